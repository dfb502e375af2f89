"""tritonpack: portable Triton kernel caches."""
from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "1.0.0"

from .errors import (
    ArchiveError,
    CacheError,
    ConflictError,
    IncompatibleError,
    IntegrityError,
    NotFoundError,
    ReaderLimitError,
    RecordError,
    RemoteError,
    SpaceError,
    Terminated,
    TpackError,
    UnsupportedFormatError,
    UsageError,
)

if TYPE_CHECKING:
    from .api import check, environment, open, pack, relocate, unpack, verify
    from .archive.reader import ArchiveReader
    from .compat import CheckReport, Environment, Mismatch, Verdict
    from .ensuring import EnsureResult, ensure
    from .merging import MergeResult, merge
    from .model import ArchiveInfo, AutotuneInfo, Entry, KernelInfo, PythonInfo, StoredFile, StubInfo, TritonInfo
    from .oci import PullResult, PushResult, pull, push
    from .recording import RecordResult, record
    from .redis_cache import unpack_to_redis
    from .repair import RelocateReport, VerifyReport
    from .report import PackResult, UnpackResult
    from .selection import Selection

# Loaded on first use: `tritonpack list` or code that calls only unpack() does not pay for the rest.
_LAZY = {
    **dict.fromkeys(("check", "environment", "open", "pack", "relocate", "unpack", "verify"), "api"),
    "ArchiveReader": "archive.reader",
    **dict.fromkeys(("ArchiveInfo", "AutotuneInfo", "Entry", "KernelInfo", "PythonInfo", "StoredFile", "StubInfo",
                     "TritonInfo"), "model"),
    **dict.fromkeys(("CheckReport", "Environment", "Mismatch", "Verdict"), "compat"),
    "VerifyReport": "repair", "RelocateReport": "repair",
    **dict.fromkeys(("PackResult", "UnpackResult"), "report"),
    "ensure": "ensuring", "EnsureResult": "ensuring", "record": "recording", "RecordResult": "recording",
    "merge": "merging", "MergeResult": "merging", "push": "oci", "pull": "oci", "PushResult": "oci",
    "PullResult": "oci",
    "unpack_to_redis": "redis_cache",
    "Selection": "selection",
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "__version__", "pack", "unpack", "open", "check", "verify", "relocate", "environment", "record", "merge",
    "ensure", "RecordResult", "MergeResult", "EnsureResult",
    "ArchiveReader", "ArchiveInfo", "PythonInfo", "TritonInfo", "Entry", "KernelInfo", "AutotuneInfo", "StubInfo",
    "StoredFile", "PackResult", "UnpackResult", "CheckReport", "Environment", "Verdict", "Mismatch", "VerifyReport",
    "RelocateReport", "PushResult", "PullResult",
    "TpackError", "UsageError", "ArchiveError", "UnsupportedFormatError", "IntegrityError", "ReaderLimitError",
    "CacheError", "IncompatibleError", "RecordError", "ConflictError", "RemoteError", "Terminated",
    "NotFoundError", "SpaceError",
    "push", "pull", "unpack_to_redis", "Selection",
]
