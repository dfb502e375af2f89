"""Temp files of an unpack, and the clean-up of those a killed unpack left behind.

Every file an unpack writes first exists as ``<root>/<key>/tmp.tpack.<pid>.<12 hex>`` (spec §8.2). The 12 hex
digits are an 8-digit run token and a 4-digit counter. While a run has temp files it holds an exclusive
``flock`` on ``<root>/tmp.tpack.<pid>.<token>.lock``; the kernel drops that lock when the process dies, however
it dies (``kill -9`` included). The next unpack therefore knows exactly which temp files are orphans:

- a temp file whose run lock exists and can be locked belongs to a dead run: removed, and then its lock;
- a temp file whose run lock is held belongs to a live unpack (in any container that shares the kernel, whatever
  its pid namespace): never touched;
- a temp file with no run lock (tritonpack 1.0.0, or a lock already cleaned): removed when its pid is not alive in
  this pid namespace or when it is more than an hour old.

A key directory that does not exist yet is staged whole as a directory ``<root>/tmp.tpack.<pid>.<12 hex>`` and
renamed into place in one step; the same rules decide when such a directory is an orphan, and then its regular
files and the directory itself are removed.

Only regular files named exactly like ours, and our staging directories, are ever removed: never Triton's
``tmp.pid_*`` directories, never anything else.
"""
from __future__ import annotations

import contextlib
import errno
import itertools
import os
import re
import stat
import threading
import time

from .forking import uninterrupted

PREFIX = "tmp.tpack."
TEMP_RE = re.compile(r"tmp\.tpack\.([0-9]{1,10})\.([0-9a-f]{8})([0-9a-f]{4})")
LOCK_RE = re.compile(r"tmp\.tpack\.([0-9]{1,10})\.([0-9a-f]{8})\.lock")
NAMES_A_RUN = 0x10000  # temp names one run token gives (its 4 hex digits of counter), before they repeat


def is_ours(name: str) -> bool:
    """A temp file's, a staging directory's or a run lock's name, as an unpack makes them."""
    return TEMP_RE.fullmatch(name) is not None or LOCK_RE.fullmatch(name) is not None


def run_name(prefix: str, number: int) -> str:
    """Name ``number`` of a run token's (``RunLock.prefix``): its four hex digits after the prefix, as ``TEMP_RE``
    reads them. Temp files and staging directories alike."""
    return f"{prefix}{number % NAMES_A_RUN:04x}"


ORPHAN_AGE = 3600.0  # seconds after which an unlocked temp file is an orphan even if its pid is alive

try:
    import fcntl
except ImportError:  # not POSIX: no run locks; the pid rule alone applies
    fcntl = None  # type: ignore[assignment]  # every use checks for None first


def _pid_alive(pid: int) -> bool:
    if not 0 < pid < 1 << 31:  # no process has it (kill takes a 32-bit pid and raised OverflowError past it)
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


class RunLock:
    """The lock that marks this process's temp files under one root as in use. Taken lazily, on first use."""

    def __init__(self, root: str):
        self.root = root
        self.pid = os.getpid()
        self.token: str | None = None
        self._fd: int | None = None
        self._counter = itertools.count()
        self._acquiring = threading.Lock()

    @property
    def path(self) -> str | None:
        return None if self.token is None else os.path.join(self.root, f"{PREFIX}{self.pid}.{self.token}.lock")

    def acquire(self) -> None:
        # writer threads stage files at once: one run, one lock; a Ctrl-C between creating the lock file and
        # recording it would leave the file, and its lock held
        with self._acquiring, uninterrupted():
            self._acquire()

    def _acquire(self) -> None:
        if self.token is not None:
            return
        os.makedirs(self.root, exist_ok=True)
        for _ in range(16):
            token = os.urandom(4).hex()
            path = os.path.join(self.root, f"{PREFIX}{self.pid}.{token}.lock")
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
            except FileExistsError:
                continue
            except FileNotFoundError:  # a failing concurrent run removed the root, empty, since it was made: again
                os.makedirs(self.root, exist_ok=True)
                continue
            if fcntl is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:  # a cleaner took it in the instant between create and lock: another token
                    os.close(fd)
                    continue
                except OSError:  # no flock on this filesystem: cleaners cannot lock it either, so they keep out
                    pass
                # A cleaner may have removed the file in that instant; then our lock guards nothing.
                try:
                    same = os.stat(path).st_ino == os.fstat(fd).st_ino
                except FileNotFoundError:
                    same = False
                if not same:
                    os.close(fd)
                    continue
            self.token, self._fd = token, fd
            return
        raise OSError(errno.EEXIST, "cannot create a run lock", self.root)

    def temp_name(self) -> str:
        """A fresh temp file name for this run (unique per directory with O_EXCL; the counter wraps harmlessly)."""
        return run_name(self.prefix(), next(self._counter))

    def prefix(self) -> str:
        """What this run's temp names start with; four hex digits of a counter follow (``NAMES_A_RUN`` names)."""
        self.acquire()
        return f"{PREFIX}{self.pid}.{self.token}"

    def share_names(self, part: int, parts: int) -> None:
        """In forked worker ``part`` of ``parts``: its own range of counters, so that workers writing into one
        directory seldom try the same name (a clash only costs another try: names are created exclusively)."""
        self._counter = itertools.count(part * (NAMES_A_RUN // parts))

    def create(self, directory: str) -> tuple[int, str]:
        """Create a new temp file in ``directory`` exclusively, mode ``0666 & ~umask``; return (fd, path)."""
        for _ in range(NAMES_A_RUN):
            path = os.path.join(directory, self.temp_name())
            try:
                return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666), path
            except FileExistsError:
                continue
        raise OSError(errno.EEXIST, "no free temp file name", directory)

    def release(self) -> None:
        """Remove the lock file (all of this run's temp files are gone by now) and drop the lock."""
        path, fd = self.path, self._fd
        if path is None or fd is None:
            return
        with contextlib.suppress(OSError):
            os.unlink(path)
        with contextlib.suppress(OSError):
            os.close(fd)
        self.token, self._fd = None, None


def _remove_file(path: str) -> bool:
    """Unlink ``path`` if it is a regular file (never a directory or anything else)."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):
            return False
        os.unlink(path)
        return True
    except OSError:
        return False


class _DeadRuns:
    """Run locks under a root whose owners are dead; held locked while their temp files are removed."""

    def __init__(self, root: str):
        self.root = root
        self.dead: dict[tuple[str, str], int] = {}  # (pid, token) -> fd holding the lock
        self.live: set[tuple[str, str]] = set()
        try:
            names = os.listdir(root)
        except OSError:
            names = []
        for name in names:
            match = LOCK_RE.fullmatch(name)
            if match is None or fcntl is None:
                continue
            path = os.path.join(root, name)
            try:
                fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:  # held by a live unpack (or no flock here: assume it is live)
                os.close(fd)
                self.live.add((match[1], match[2]))
                continue
            self.dead[match[1], match[2]] = fd

    def owner_state(self, pid: str, token: str) -> str:
        if (pid, token) in self.dead:
            return "dead"
        if (pid, token) in self.live:
            return "live"
        return "unknown"

    def finish(self) -> None:
        for (pid, token), fd in self.dead.items():
            _remove_file(os.path.join(self.root, f"{PREFIX}{pid}.{token}.lock"))
            os.close(fd)
        self.dead.clear()


def _orphan(directory: str, name: str, runs: _DeadRuns, now: float) -> bool:
    match = TEMP_RE.fullmatch(name)
    if match is None:
        return False
    pid, token, _ = match.groups()
    state = runs.owner_state(pid, token)
    if state != "unknown":
        return state == "dead"
    try:
        age = now - os.lstat(os.path.join(directory, name)).st_mtime
    except OSError:
        return False
    return age > ORPHAN_AGE or not _pid_alive(int(pid))


def clean_stale(root: str, key_dirs: list[str]) -> int:
    """Remove the temp files killed unpacks left under ``root``; return how many were removed.

    ``key_dirs`` (names under ``root``) are always looked at; when a dead run lock is found, every key directory
    of the root is, since that run may have written anywhere. Errors are ignored: clean-up is best effort.
    """
    if not os.path.isdir(root):
        return 0
    runs = _DeadRuns(root)
    now = time.time()
    removed = 0
    try:
        if runs.dead:
            with contextlib.suppress(OSError):
                key_dirs = sorted(set(key_dirs) | {n for n in os.listdir(root) if not n.startswith("tmp.")})
        for key in key_dirs:
            directory = os.path.join(root, key)
            if not _is_dir(directory):  # a key directory that is a link is never written through, nor cleaned
                continue
            try:
                names = [n for n in os.listdir(directory) if n.startswith(PREFIX)]
            except OSError:
                continue
            for name in names:
                if _orphan(directory, name, runs, now) and _remove_file(os.path.join(directory, name)):
                    removed += 1
        for name in _names(root):
            path = os.path.join(root, name)
            if _is_dir(path) and _orphan(root, name, runs, now):
                removed += remove_stage_dir(path)
    finally:
        runs.finish()
    return removed


def _names(directory: str) -> list[str]:
    try:
        return [n for n in os.listdir(directory) if n.startswith(PREFIX)]
    except OSError:
        return []


def _is_dir(path: str) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def remove_stage_dir(path: str) -> int:
    """Remove a staging directory: its regular files, then itself if that left it empty. Returns files removed."""
    try:
        names = os.listdir(path)
    except OSError:
        return 0
    removed = sum(_remove_file(os.path.join(path, n)) for n in names)
    with contextlib.suppress(OSError):
        os.rmdir(path)
    return removed


__all__ = ["RunLock", "clean_stale", "remove_stage_dir", "run_name", "is_ours", "TEMP_RE", "LOCK_RE", "PREFIX",
           "NAMES_A_RUN"]
