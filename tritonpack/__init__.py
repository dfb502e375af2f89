"""tritonpack: portable Triton kernel caches."""
from __future__ import annotations

__version__ = "1.0.0"

from .api import open, pack, unpack  # noqa: E402,A004
from .archive.reader import ArchiveReader  # noqa: E402
from .errors import (  # noqa: E402
    ArchiveError,
    CacheError,
    IncompatibleError,
    IntegrityError,
    TpackError,
    UnsupportedFormatError,
    UsageError,
)
from .model import ArchiveInfo, Entry, KernelInfo, StoredFile  # noqa: E402
from .report import PackResult, UnpackResult  # noqa: E402

__all__ = [
    "__version__", "pack", "unpack", "open", "ArchiveReader", "ArchiveInfo", "Entry", "KernelInfo", "StoredFile",
    "PackResult", "UnpackResult", "TpackError", "UsageError", "ArchiveError", "UnsupportedFormatError",
    "IntegrityError", "CacheError", "IncompatibleError",
]
