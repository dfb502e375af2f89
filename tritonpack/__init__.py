"""tritonpack: portable Triton kernel caches."""
from __future__ import annotations

__version__ = "1.0.0"

from .api import check, environment, open, pack, relocate, unpack, verify
from .archive.reader import ArchiveReader
from .ensuring import EnsureResult, ensure
from .errors import (
    ArchiveError,
    CacheError,
    ConflictError,
    IncompatibleError,
    IntegrityError,
    RecordError,
    TpackError,
    UnsupportedFormatError,
    UsageError,
)
from .merging import MergeResult, merge
from .model import ArchiveInfo, Entry, KernelInfo, StoredFile
from .recording import RecordResult, record
from .report import PackResult, UnpackResult

__all__ = [
    "__version__", "pack", "unpack", "open", "check", "verify", "relocate", "environment", "record", "merge",
    "ensure", "RecordResult", "MergeResult", "EnsureResult",
    "ArchiveReader", "ArchiveInfo", "Entry", "KernelInfo", "StoredFile",
    "PackResult", "UnpackResult", "TpackError", "UsageError", "ArchiveError", "UnsupportedFormatError",
    "IntegrityError", "CacheError", "IncompatibleError", "RecordError", "ConflictError",
]
