"""What the local environment is: Triton's default cache root, the Python ABI, and the local Triton's identity.

Triton is optional; every function here works without it and says so by returning ``None``.
"""
from __future__ import annotations

import functools
import hashlib
import os
import re
import sys
from collections.abc import Iterable, Mapping

from .errors import CacheError, UsageError
from .model import PythonInfo, TritonInfo, hash_key


def release_of(version: str | None) -> tuple[int, int] | None:
    """``(3, 2)`` of ``"3.2.0"`` (or of ``"3.2.0+git1234"``); None when there is no version or it does not read."""
    match = re.match(r"(\d+)\.(\d+)", version or "")
    return (int(match.group(1)), int(match.group(2))) if match else None


# One sha256 names a key directory, in the encoding of its Triton's release: hex before 3.2, urlsafe base64 in 3.2,
# base32 since 3.3 (``get_cache_manager``). A Triton never looks up a key in another encoding. By the key's length,
# which tells them apart: the preflight asks for every entry.
_KEY_ENCODINGS = {64: (re.compile(r"[0-9a-f]{64}"), "3.0-3.1"), 43: (re.compile(r"[A-Za-z0-9_-]{43}"), "3.2"),
                  52: (re.compile(r"[A-Z2-7]{52}"), "3.3+")}


def key_releases(key: str) -> str | None:
    """The Triton releases that name a key directory so (``"3.0-3.1"``, ``"3.2"``, ``"3.3+"``); None for another
    form."""
    encoding = _KEY_ENCODINGS.get(len(key))
    return encoding[1] if encoding is not None and encoding[0].fullmatch(key) else None


@functools.lru_cache(maxsize=8)
def releases_keyed_as(version: str | None) -> str | None:
    """The releases (as ``key_releases`` says them) whose keys a Triton version writes; None for no version. Asked
    for every entry, of the one local version: kept."""
    release = release_of(version)
    if release is None:
        return None
    return "3.0-3.1" if release < (3, 2) else "3.2" if release == (3, 2) else "3.3+"


_NEWEST = (1 << 16, 0)  # the rule of the newest Triton, where none is installed


def default_cache_dir(environ: Mapping[str, str] | None = None) -> str:
    """Triton's own resolution, by the rule of the installed Triton, which changed:
    ``TRITON_CACHE_DIR``, else ``$TRITON_HOME/.triton/cache``, else ``~/.triton/cache``.

    - 3.0-3.1 know no ``TRITON_HOME``.
    - 3.0-3.3 strip ``TRITON_CACHE_DIR`` and take an empty one for unset. 3.4+ cannot compile with an empty one,
      which is refused here. 3.4 strips both variables, 3.5+ take their values as they are (an empty
      ``TRITON_HOME`` is the current directory).

    Implemented from the environment rather than by importing Triton, so it costs nothing and works without
    Triton (then by the newest rule); the installed version is read only where the rules differ.
    """
    env = os.environ if environ is None else environ
    explicit, home = env.get("TRITON_CACHE_DIR"), env.get("TRITON_HOME")
    if explicit and explicit == explicit.strip():
        return explicit  # the same root in every release
    if explicit is None and home is None:
        return os.path.join(os.path.expanduser("~"), ".triton", "cache")
    from .fingerprint import installed_version

    release = release_of(installed_version()) or _NEWEST
    if explicit is not None:
        if release <= (3, 4):
            explicit = explicit.strip()
        if explicit.strip():
            return explicit
        if release >= (3, 4):
            raise UsageError("TRITON_CACHE_DIR is set but empty, which Triton 3.4+ cannot use: unset it, or name "
                             "the cache root")
    if home is None or release < (3, 2):
        home = os.path.expanduser("~")
    elif release == (3, 4):
        home = home.strip()
    return os.path.join(home, ".triton", "cache")


def cache_root(cache_dir: str | os.PathLike | None) -> str:
    """The cache root a command was given, or Triton's own when none was. An empty one is refused, never taken
    as the current directory: it is what an unset variable gives (``--cache-dir "$ROOT"``)."""
    if cache_dir is None:
        return default_cache_dir()
    root = os.fspath(cache_dir)
    if not root.strip():
        raise UsageError("the cache directory given is empty (an unset variable?); leave it out for Triton's own")
    if "\0" in root:
        raise UsageError("the cache directory's path holds a NUL character", repr(root))
    return os.path.expanduser(root)  # as a shell would, where none did: the API, or --cache-dir=~/cache


def resolved_root(cache_dir: str | os.PathLike | None) -> str:
    """The cache root, absolute; an error where it, or the first of its parents that exists, is no
    directory (an error about a key directory under it would name the wrong path)."""
    root = os.path.abspath(cache_root(cache_dir))
    there = root
    while not os.path.lexists(there) and os.path.dirname(there) != there:
        there = os.path.dirname(there)
    if os.path.exists(there) and not os.path.isdir(there):
        why = "" if there == root else f" ({there} is not a directory)"
        raise CacheError(f"cache directory is not a directory{why}", root)
    return root


def python_info() -> PythonInfo:
    import sysconfig  # pack and unpack need it, list does not

    return PythonInfo(
        implementation=sys.implementation.name,
        version=f"{sys.version_info.major}.{sys.version_info.minor}",
        cache_tag=sys.implementation.cache_tag,
        ext_suffix=sysconfig.get_config_var("EXT_SUFFIX"),
        platform=sysconfig.get_platform(),
    )


def _import_triton():
    try:
        import triton
    except Exception:  # Triton absent or broken: nothing to say about it
        return None
    return triton


def triton_version() -> str | None:
    triton = _import_triton()
    return getattr(triton, "__version__", None) if triton else None


def _triton_key_function():
    try:
        from triton.runtime.cache import triton_key  # 3.5+
    except ImportError:
        from triton.compiler.compiler import triton_key  # 3.0-3.4
    return triton_key


def _backend_hash(backend: str, arch: str | int, warp_size: int) -> str | None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler.compiler import make_backend

    try:
        return make_backend(GPUTarget(backend, arch, warp_size)).hash()
    except Exception:  # a backend whose toolchain (ptxas, ld.lld) is missing here
        return None


def triton_info(targets: Iterable[tuple[str, str | int, int]] = ()) -> TritonInfo | None:
    """The local Triton's version, a digest of ``triton_key()`` and ``backend.hash()`` for each target.

    ``targets`` are ``(backend, arch, warp_size)``; their hashes are keyed by ``model.hash_key``.
    """
    triton = _import_triton()
    if triton is None:
        return None
    try:
        key = _triton_key_function()()
        key_sha256 = hashlib.sha256(key.encode("utf-8")).hexdigest()
    except Exception:
        key_sha256 = None
    hashes = {}
    for backend, arch, warp_size in sorted(set(targets), key=str):
        value = _backend_hash(backend, arch, warp_size)
        if value is not None:
            hashes[hash_key(backend, arch, warp_size)] = value
    return TritonInfo(version=triton.__version__, key_sha256=key_sha256, backend_hashes=hashes)
