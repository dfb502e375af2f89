from __future__ import annotations

import asyncio
import base64
import contextlib
import gc
import hashlib
import os
import signal
import sys
import threading
import warnings
from pathlib import Path

import pytest

from tritonpack.archive.writer import BLOCK_SIZE
from tritonpack.fingerprint import installed_version
from tritonpack.triton_env import releases_keyed_as

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION is unset")


def snapshot(root) -> dict[str, tuple[int, int, str]]:
    """Every file under ``root``: size, mtime and sha256, to prove that nothing was written."""
    result = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = os.path.join(dirpath, name)
            st = os.stat(path)
            with open(path, "rb") as f:
                digest = hashlib.sha256(f.read()).hexdigest()
            result[os.path.relpath(path, root)] = (st.st_size, st.st_mtime_ns, digest)
    return result


def cache_key(seed: str) -> str:
    """A valid cache key, the sha256 of ``seed``, in the encoding of the installed Triton's release (hex in 3.0-3.1,
    urlsafe base64 in 3.2, base32 since 3.3; base32 without Triton): the preflight refuses an entry whose key this
    Triton never looks up, so an archive made by hand must name its keys so to get past it."""
    digest = hashlib.sha256(seed.encode()).digest()
    releases = releases_keyed_as(installed_version())
    if releases == "3.0-3.1":
        return digest.hex()
    if releases == "3.2":
        return base64.urlsafe_b64encode(digest).decode().rstrip("=")
    return base64.b32encode(digest).decode().rstrip("=")


def no_child_left() -> bool:
    """Whether every process this one forked has been reaped."""
    try:
        os.waitpid(-1, os.WNOHANG)
    except ChildProcessError:
        return True
    return False


@contextlib.contextmanager
def fifo_reader(path: Path):
    """A FIFO at ``path`` and a thread that reads it to its end; yields the list that gets its bytes. The FIFO is
    opened here, its reading end and a writing end held until the block ends: the reader sees its end only then,
    whatever the command did with the FIFO (a command that replaced it once left a reader waiting forever)."""
    os.mkfifo(path)
    reading = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    os.set_blocking(reading, True)
    held = os.open(path, os.O_WRONLY)
    received: list[bytes] = []

    def read() -> None:
        with open(reading, "rb") as f:
            received.append(f.read())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        yield received
    finally:
        os.close(held)
        reader.join()


def without_root_powers() -> list[str]:
    """A command prefix under which file permissions apply: none for a user, ``setpriv`` dropping root's
    capability to read and write anything (skipped where it cannot)."""
    import shutil
    import subprocess

    if os.geteuid() != 0:
        return []
    prefix = ["setpriv", "--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search"]
    if not shutil.which("setpriv") or subprocess.run([*prefix, "true"], capture_output=True).returncode:
        pytest.skip("root, and setpriv cannot drop its capability to read any file here")
    return prefix


@pytest.fixture()
def interruptible():
    """Ctrl-C and SIGHUP as a terminal's process has them. CI may start the tests with both ignored (a background
    job, nohup): Python then never makes a SIGINT a KeyboardInterrupt, and children inherit what is ignored, so a
    test that sends them would see nothing happen."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGHUP)}
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    yield
    for signum, handler in saved.items():
        signal.signal(signum, handler)


@pytest.fixture()
def counted_forks(monkeypatch) -> list[int]:
    """The pids of the forks this process makes (``os.fork`` counted)."""
    made: list[int] = []
    real = os.fork

    def counted():
        pid = real()
        if pid:
            made.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", counted)
    return made


@pytest.fixture(scope="module", autouse=True)
def _no_fsspec_thread_after_the_module():
    """fsspec runs its event loop in a thread it keeps for the process's life, with asyncio's executor threads
    (DNS) beside it: after a module that read URLs, every later test would run in a multi-threaded process, where
    the CLI forks no worker (``forking.fork_safe``), so that a test of forking passed or failed by the order of the
    modules, and Python 3.12+ warned at each fork the tests force. Stopped after each module, with the
    filesystems made on that loop (fsspec makes a new loop when next asked)."""
    yield
    asyn = sys.modules.get("fsspec.asyn")
    if asyn is None or asyn.loop[0] is None:
        return
    from fsspec.registry import _registry

    for cls in list(_registry.values()):
        cls.clear_instance_cache()
    gc.collect()  # the filesystems' finalizers close their sessions on the loop while it still runs
    loop, thread = asyn.loop[0], asyn.iothread[0]
    asyncio.run_coroutine_threadsafe(loop.shutdown_default_executor(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    loop.close()
    asyn.reset_lock()


@pytest.fixture(scope="session", autouse=True)
def _no_proxy_of_the_machine():
    """Tests reach their servers on 127.0.0.1 directly, whatever proxy the machine names (URL reads take the
    environment's proxies); a test of proxies sets its own."""
    names = [n for n in os.environ if n.lower() in ("http_proxy", "https_proxy", "all_proxy", "no_proxy")]
    kept = {n: os.environ.pop(n) for n in names}
    yield
    os.environ.update(kept)


@pytest.fixture(scope="session", autouse=True)
def _private_fingerprint_cache(tmp_path_factory):
    """Tests never read or write the user's ~/.cache/tritonpack."""
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


@pytest.fixture(scope="session")
def compiled_root(tmp_path_factory) -> Path:
    """A real Triton cache root compiled once per session; tests copy it, never change it."""
    pytest.importorskip("triton")
    from kernels import compile_all

    root = tmp_path_factory.mktemp("compiled") / "cache"
    compile_all(root)
    return root


# Another Python's launcher stub, larger than the writer's block target: the preflight skips it, and it lies in a
# block of its own, which a partial read of the archive never fetches
FOREIGN_STUB = "cuda_utils.cpython-38-x86_64-linux-gnu.so"
FOREIGN_STUB_BYTES = BLOCK_SIZE + (1 << 20)


def thin(root) -> dict[str, list[str]]:
    """Remove every group's IR files, as a script slimming a root to its binaries does (``find -name '*.ptx'
    -delete``): each group's manifest path, and what it lost."""
    import json

    lost = {}
    for manifest in sorted(root.glob("*/__grp__*.json")):
        names = json.loads(manifest.read_text())["child_paths"]
        gone = [n for n in names if not n.endswith((".json", ".cubin", ".hsaco"))]
        for name in gone:
            (manifest.parent / name).unlink()
        lost[f"{manifest.parent.name}/{manifest.name}"] = gone
    return lost


def full_and_thinned(compiled_root: Path, work: Path) -> tuple[Path, Path]:
    """Archives of one cache, whole and thinned to its binaries (``thin``)."""
    import shutil

    import tritonpack

    root = work / "thinned-root"
    shutil.copytree(compiled_root, root)
    full, thinned = work / "full.tpack", work / "thin.tpack"
    tritonpack.pack(root, full)
    thin(root)
    tritonpack.pack(root, thinned)
    return full, thinned


def pack_with_foreign_stub(compiled_root: Path, root: Path, archive: Path) -> Path:
    """``archive``: the compiled kernels (copied to ``root``) plus ``FOREIGN_STUB`` in a key directory of its own."""
    import shutil

    import tritonpack

    shutil.copytree(compiled_root, root)
    key = root / base64.b32encode(hashlib.sha256(b"foreign stub").digest()).decode().rstrip("=")
    key.mkdir()
    (key / FOREIGN_STUB).write_bytes(os.urandom(FOREIGN_STUB_BYTES))
    tritonpack.pack(root, archive)
    return archive


@pytest.fixture()
def gpu_cache() -> Path:
    """The real H200 cache (Triton 3.6, autotuned kernel, launcher stubs) committed in fixtures/."""
    return FIXTURES / "h200-triton36" / "cache"


@pytest.fixture()
def fast_tmp(tmp_path) -> Path:
    """A temp dir on a tmpfs when there is one, for tests that write and remove thousands of small files (disk
    metadata operations can cost milliseconds each); ``tmp_path`` otherwise."""
    import shutil
    import tempfile

    if os.access("/dev/shm", os.W_OK):
        path = Path(tempfile.mkdtemp(prefix="tritonpack-test-", dir="/dev/shm"))
        yield path
        shutil.rmtree(path, ignore_errors=True)
    else:
        yield tmp_path
