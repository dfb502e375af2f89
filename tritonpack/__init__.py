"""tritonpack: portable Triton kernel caches."""
from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "1.0.0"

from .api import check, environment, open, pack, relocate, unpack, verify
from .archive.reader import ArchiveReader
from .errors import (
    ArchiveError,
    CacheError,
    ConflictError,
    IncompatibleError,
    IntegrityError,
    RecordError,
    RemoteError,
    TpackError,
    UnsupportedFormatError,
    UsageError,
)
from .model import ArchiveInfo, Entry, KernelInfo, StoredFile
from .report import PackResult, UnpackResult

if TYPE_CHECKING:
    from .ensuring import EnsureResult, ensure
    from .merging import MergeResult, merge
    from .oci import pull, push
    from .recording import RecordResult, record
    from .redis_cache import unpack_to_redis

# Loaded on first use: code that calls only unpack() or open() does not pay for the rest.
_LAZY = {"ensure": "ensuring", "EnsureResult": "ensuring", "record": "recording", "RecordResult": "recording",
         "merge": "merging", "MergeResult": "merging", "push": "oci", "pull": "oci",
         "unpack_to_redis": "redis_cache"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "__version__", "pack", "unpack", "open", "check", "verify", "relocate", "environment", "record", "merge",
    "ensure", "RecordResult", "MergeResult", "EnsureResult",
    "ArchiveReader", "ArchiveInfo", "Entry", "KernelInfo", "StoredFile",
    "PackResult", "UnpackResult", "TpackError", "UsageError", "ArchiveError", "UnsupportedFormatError",
    "IntegrityError", "CacheError", "IncompatibleError", "RecordError", "ConflictError", "RemoteError",
    "push", "pull", "unpack_to_redis",
]
