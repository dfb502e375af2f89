"""The local Triton's identity (version, ``triton_key()`` digest, backend hashes, cache-invalidating env vars),
cached on disk so that a repeat check costs milliseconds instead of importing Triton and hashing libtriton.

The cache is keyed by the identity of the installed files that ``triton_key()`` hashes (path, size, mtime of
each) and by the environment variables that can change the answer, so a reinstall or a changed variable is never
served a stale fingerprint.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping
from typing import NamedTuple

from .model import hash_key

# Names of variables that may invalidate Triton's cache or change a backend hash: all those that Triton's
# get_cache_invalidating_env_vars() knows begin with one of these.
_ENV_PREFIXES = ("TRITON_", "MLIR_", "LLVM_", "AMDGCN_", "NVPTX_", "DISABLE_", "ALLOW_", "USE_")
# Of those, the ones that say only where the cache is: an image built with ``--cache-dir`` and run with
# ``TRITON_CACHE_DIR`` set to the same root must find the build's stamp and fingerprint.
_LOCATION_VARIABLES = frozenset({"TRITON_CACHE_DIR", "TRITON_HOME"})
_VERSION_RE = re.compile(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", re.M)
FINGERPRINT_VERSION = 2  # 2: backend hashes keyed by model.hash_key (a warp size that is not the arch's own)


class LocalTriton(NamedTuple):
    version: str
    key_sha256: str | None
    backend_hashes: dict[str, str]  # "cuda:90" -> backend.hash()
    env: dict[str, str]  # invalidating variables set now, as Triton records them
    cached: bool = False  # served from the fingerprint cache


def cache_home() -> str | None:
    """Where fingerprints (and record's tracking manager) are kept; None with no home to keep them in (no
    ``HOME``, a user the password database does not know, as ``docker run --user 12345`` gives): a directory named
    ``~`` in the working directory is none."""
    base = os.environ.get("XDG_CACHE_HOME")
    if not base:
        home = os.path.expanduser("~")
        if home == "~":
            return None
        base = os.path.join(home, ".cache")
    return os.path.join(base, "tritonpack")


def _package_dir() -> str | None:
    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    return os.path.dirname(spec.origin)


def toolchain_files() -> list[str]:
    """The tools outside Triton's package whose ``--version`` is a backend hash: the ptxas that
    ``TRITON_PTXAS_PATH`` (and 3.6+'s ``TRITON_PTXAS_BLACKWELL_PATH``) name, and ROCm's ld.lld, where Triton
    3.0-3.4 look for it (``path_to_rocm_lld``). A CUDA or ROCm upgraded in place changes the hash, and no file of
    Triton's; the tools in Triton's package (its bundled ptxas and ld.lld) are Triton's files."""
    named = [os.environ.get(v) for v in ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH", "TRITON_HIP_LLD_PATH")]
    return [*(path for path in named if path), "/opt/rocm/llvm/bin/ld.lld", "/usr/bin/ld.lld"]


def _installed_identity(package: str) -> str:
    """Digest of path, size and mtime of every file ``triton_key()`` reads (and a little more), and of the tools
    whose version is a backend hash (``toolchain_files``)."""
    digest = hashlib.sha256(f"{FINGERPRINT_VERSION}\0{sys.executable}\0{package}".encode())
    for tool in toolchain_files():
        try:
            st = os.stat(tool)
            digest.update(f"{tool}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        except OSError:
            digest.update(f"{tool}\0none\0".encode())
    for sub in ("compiler", "backends", "language", "runtime", "_C"):
        top = os.path.join(package, sub)
        for dirpath, dirnames, names in os.walk(top):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")  # bytecode, and its temp files
            where = os.path.relpath(dirpath, package)  # once a directory: this runs before every unpack
            for name in sorted(names):
                if name.endswith(".pyc"):
                    continue
                try:
                    st = os.stat(os.path.join(dirpath, name))
                except OSError:
                    continue
                digest.update(f"{where}/{name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return digest.hexdigest()


def env_digest(environ: Mapping[str, str]) -> str:
    """A digest of the variables that may change Triton's cache keys or backend hashes."""
    items = sorted((k, v) for k, v in environ.items()
                   if k.startswith(_ENV_PREFIXES) and k not in _LOCATION_VARIABLES)
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()


def _read_version(package: str) -> str | None:
    try:
        with open(os.path.join(package, "__init__.py"), encoding="utf-8") as f:
            match = _VERSION_RE.search(f.read())
    except OSError:
        return None
    return match.group(1) if match else None


def installed_version() -> str | None:
    """The installed Triton's version, read from its ``__init__.py`` without importing it; None without Triton."""
    package = _package_dir()
    return _read_version(package) if package else None


def _compute(targets: Iterable[tuple[str, str | int, int]], known: dict[str, str]) -> tuple[str | None, dict, dict]:
    """The slow path: import Triton, hash it, ask it for backend hashes and the invalidating variables."""
    from .triton_env import triton_info

    info = triton_info([t for t in targets if hash_key(*t) not in known])
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars

        env = dict(get_cache_invalidating_env_vars())
    except Exception:  # very old or unusual builds
        env = {}
    return (info.key_sha256 if info else None), {**known, **(info.backend_hashes if info else {})}, env


def local_triton(targets: Iterable[tuple[str, str | int, int]] = (), use_cache: bool = True) -> LocalTriton | None:
    """The local Triton's fingerprint, or ``None`` when Triton is not installed."""
    package = _package_dir()
    if package is None:
        return None
    version = _read_version(package)
    if version is None:
        return None
    targets = set(targets)
    wanted = {hash_key(*target) for target in targets}
    home = cache_home() if use_cache else None
    path = os.path.join(home, f"fingerprint-{_installed_identity(package)[:24]}-"
                              f"{env_digest(os.environ)[:16]}.json") if home else None
    cached: dict = {}
    if path:
        with contextlib.suppress(OSError, ValueError), open(path, encoding="utf-8") as f:
            cached = json.load(f)
    same = cached.get("version") == version
    # targets whose hash this Triton cannot compute (Triton 3.0-3.4 without ROCm's ld.lld for AMD): asked once
    unhashable = set(cached.get("unhashable", ())) if same else set()
    if same and wanted <= set(cached.get("backend_hashes", {})) | unhashable:
        return LocalTriton(version, cached.get("key_sha256"), cached["backend_hashes"], cached.get("env", {}),
                           cached=True)
    key_sha256, hashes, env = _compute(targets, cached.get("backend_hashes", {}) if same else {})
    result = LocalTriton(version, key_sha256 or cached.get("key_sha256"), hashes, env)
    if path:
        _store(path, {"version": version, "key_sha256": result.key_sha256, "backend_hashes": hashes, "env": env,
                      "unhashable": sorted((unhashable | wanted) - set(hashes))})
    return result


KEPT_FINGERPRINTS = 32  # a Triton reinstalled, a toolkit upgraded, another set of TRITON_* variables: one each


def _store(path: str, doc: dict) -> None:
    """Best effort: a read-only home only costs speed. Each installation and environment has a fingerprint of its
    own; where more than ``KEPT_FINGERPRINTS`` are kept, the oldest go (one that is still used is made again)."""
    import tempfile

    with contextlib.suppress(OSError):
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=".fingerprint-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                json.dump(doc, f, sort_keys=True)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
        _prune(os.path.dirname(path), keep=path)


def _prune(directory: str, keep: str) -> None:
    kept = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.name.startswith("fingerprint-") and entry.name.endswith(".json") and entry.path != keep:
                with contextlib.suppress(OSError):
                    kept.append((entry.stat().st_mtime_ns, entry.path))
    for _, old in sorted(kept)[:max(0, len(kept) - (KEPT_FINGERPRINTS - 1))]:
        with contextlib.suppress(OSError):
            os.unlink(old)
