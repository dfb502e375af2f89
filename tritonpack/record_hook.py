"""The cache manager ``tritonpack record`` installs through Triton's ``TRITON_CACHE_MANAGER`` hook.

Self-contained on purpose (standard library and Triton only): ``record`` copies this file to a directory of its own
on ``PYTHONPATH`` as ``tritonpack_record_hook``, so that any Python the recorded command starts can import it, with
or without tritonpack installed. It serves exactly what Triton's own manager would serve and appends one JSON line
per group hit, group write, file hit and file write to each log named in ``TRITONPACK_RECORD_LOG``
(``os.pathsep``-separated, so that nested recordings each see everything). One ``O_APPEND`` write per line keeps
lines whole when many processes log at once. Logging never breaks the recorded program: a failed write is dropped.
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import sysconfig

from triton.runtime.cache import FileCacheManager

LOG_ENV = "TRITONPACK_RECORD_LOG"
CHAIN_ENV = "TRITONPACK_RECORD_CHAIN"  # the user's own TRITON_CACHE_MANAGER, which this one extends
_announced: set[str] = set()  # what this process has said about itself: "process", "key"
if hasattr(os, "register_at_fork"):  # a forked child (multiprocessing's fork) is a process to say again
    os.register_at_fork(after_in_child=_announced.clear)


def _log(record: dict) -> None:
    line = (json.dumps(record, separators=(",", ":")) + "\n").encode("utf-8", "surrogateescape")
    for path in filter(None, os.environ.get(LOG_ENV, "").split(os.pathsep)):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        except OSError:
            continue
        try:
            os.write(fd, line)
        except OSError:
            pass
        finally:
            os.close(fd)


def _triton_key_sha256() -> str | None:
    """The digest of ``triton_key()`` when Triton has computed it already (it has, before any compile or
    autotune lookup); never computed here, since that hashes libtriton (about a second)."""
    import hashlib

    try:
        from triton.runtime.cache import triton_key  # 3.5+
    except ImportError:
        from triton.compiler.compiler import triton_key  # 3.0-3.4
    if triton_key.cache_info().currsize == 0:
        return None
    return hashlib.sha256(triton_key().encode("utf-8")).hexdigest()


def _announce() -> None:
    """Say once per process which Python and Triton it runs, and the Triton build key as soon as it is known."""
    import triton

    if "process" not in _announced:
        _announced.add("process")
        _log({"op": "process", "pid": os.getpid(), "python": sys.executable,
              "implementation": sys.implementation.name, "version": f"{sys.version_info[0]}.{sys.version_info[1]}",
              "cache_tag": sys.implementation.cache_tag, "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
              "platform": sysconfig.get_platform(), "triton_version": triton.__version__,
              "triton_dir": os.path.dirname(os.path.realpath(triton.__file__))})
    if "key" not in _announced:
        try:
            key = _triton_key_sha256()
        except Exception:  # an unusual build: the key is simply not recorded
            key = None
        if key is not None:
            _announced.add("key")
            _log({"op": "key", "pid": os.getpid(), "key_sha256": key})


def _event(manager, op: str, what: str, name: str) -> None:
    try:
        _announce()
        _log({"op": op, "what": what, "dir": manager._tritonpack_dir, "name": name, "pid": os.getpid()})
    except Exception:  # never break the recorded program
        pass


def _chained() -> type:
    spec = os.environ.get(CHAIN_ENV, "")
    if not spec:
        return FileCacheManager
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _tracking_class() -> type:
    base = _chained()
    if not issubclass(base, FileCacheManager):  # not on disk in Triton's layout: served as is, nothing recorded
        _log({"op": "unsupported", "pid": os.getpid(), "manager": os.environ.get(CHAIN_ENV, "")})
        return base

    class TrackingCacheManager(base):  # type: ignore[valid-type,misc]  # the base is chosen at run time
        """Triton's file cache manager (or the user's subclass of it) that logs what it serves and writes.

        Managers made for kernel dumps and overrides (``dump=True``, ``override=True``) are not the cache.
        """

        def __init__(self, key, *args, **kwargs):
            super().__init__(key, *args, **kwargs)
            tracked = not (kwargs.get("override") or kwargs.get("dump") or any(args[:2]))
            cache_dir = getattr(self, "cache_dir", None) if tracked else None
            self._tritonpack_dir = os.path.abspath(cache_dir) if isinstance(cache_dir, str) else None

        def get_group(self, filename):
            group = super().get_group(filename)
            if self._tritonpack_dir and group and filename in group and filename.endswith(".json"):
                _event(self, "hit", "group", filename[: -len(".json")])
            return group

        def put_group(self, filename, group):
            result = super().put_group(filename, group)
            if self._tritonpack_dir and filename.endswith(".json"):
                _event(self, "write", "group", filename[: -len(".json")])
            return result

        def get_file(self, filename):
            path = super().get_file(filename)
            if self._tritonpack_dir and path is not None:
                _event(self, "hit", "file", filename)
            return path

        def put(self, data, filename, *args, **kwargs):
            path = super().put(data, filename, *args, **kwargs)
            if self._tritonpack_dir and not filename.startswith("__grp__"):
                _event(self, "write", "file", filename)
            return path

    return TrackingCacheManager


TrackingCacheManager = _tracking_class()
