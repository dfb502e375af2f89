"""Forked processes for the command: when a fork is safe, and a map over parts of a job.

A fork copies whatever locks other threads hold; so only the CLI, which is its own process, asks for forks
(``processes=True`` in the API), and only where ``fork_safe`` says so: one thread, counted by the kernel, since
``threading`` cannot see a host program's native threads (torch's, CUDA's, a C extension's).
"""
from __future__ import annotations

import contextlib
import marshal
import mmap
import os
import pickle
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import BinaryIO, TypeVar

Part = TypeVar("Part")
Result = TypeVar("Result")


def fork_safe() -> bool:
    """Linux, no other thread, and SIGCHLD left to its default: a process that ignores it (inherited through exec
    from whoever started it) has its children reaped by the kernel, and a host program's handler may reap them
    itself (``waitpid(-1)``); either way this process could not wait for its children, nor tell one that finished
    from one that was killed. A handler Python does not know of (None) is taken as one."""
    return (sys.platform.startswith("linux") and threading.active_count() == 1 and _one_thread()
            and signal.getsignal(signal.SIGCHLD) == signal.SIG_DFL)


def _one_thread() -> bool:
    """Whether the kernel counts one thread here, given a few ms: a Python thread just joined is still counted
    until its last instructions have run."""
    for _ in range(5):
        if _threads() == 1:
            return True
        time.sleep(0.001)
    return False


def _threads() -> int:
    """This process's threads, native ones included, as the kernel counts them (1 where it cannot be read)."""
    try:
        with open("/proc/self/status", "rb") as f:
            status = f.read()
    except OSError:
        return 1
    start = status.find(b"\nThreads:")
    return int(status[start + 9:status.index(b"\n", start + 1)]) if start >= 0 else 1


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Ctrl-C and SIGTERM held back in this thread while something that must be cleaned up (a forked child and
    its pipes, a lock file) is made and recorded where the cleanup finds it: delivered as soon as the block ends,
    never in between, where a host program that goes on after a KeyboardInterrupt would be left with it."""
    try:
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, (signal.SIGINT, signal.SIGTERM))
    except AttributeError:  # not on this platform
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def as_child() -> None:
    """In a forked child (forked inside ``uninterrupted``): Ctrl-C ignored, since the parent decides and kills it
    if it must; SIGTERM delivered again."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with contextlib.suppress(AttributeError):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, (signal.SIGINT, signal.SIGTERM))


def cores() -> int:
    """The CPUs this process may run on: its affinity (a container's cpuset, ``taskset``), not the machine's
    count, so that a pack or an unpack limited to 2 CPUs of a large host runs as on 2 cores."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity to ask for (macOS)
        return os.cpu_count() or 1


def die_with(parent: int) -> None:
    """Have the kernel kill this forked process when its parent dies (Linux ``PR_SET_PDEATHSIG``)."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl: the child still ends at its next word with the parent
        pass
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def forked_map(function: Callable[[Part], Result], parts: Sequence[Part]) -> list[Result]:
    """``[function(part) for part in parts]``: the first part in this process while forked children do the
    others, each writing its result, pickled, to a temp file of its own and exiting. A part whose child could not
    be forked, failed or died is done here instead, so the results are the same whatever happens to the children,
    only later. An interrupted or failing parent kills the children it forked.

    A child that sent its result down a pipe held it, and its pickle, until this process had read the children
    before it: a scan of 561,690 files on 16 cores peaked at 193 MB (summed PSS), 127 MB since. Written to a
    file, a result waits in the page cache, and is read back a piece at a time."""
    if not parts:
        return []
    parent = os.getpid()
    children: list[tuple[int, BinaryIO] | None] = []  # (pid, result file) of each part after the first
    try:
        for part in parts[1:]:
            with uninterrupted():
                children.append(_fork(function, part, parent))
        results = [function(parts[0])]
        for n in range(1, len(parts)):
            child, children[n - 1] = children[n - 1], None
            result = _collect(child) if child is not None else None
            results.append(function(parts[n]) if result is None else result[0])
        return results
    finally:
        for child in children:
            if child is not None:
                with contextlib.suppress(OSError):
                    os.kill(child[0], signal.SIGKILL)
                _collect(child)


def _fork(function: Callable, part, parent: int) -> tuple[int, BinaryIO] | None:
    import tempfile  # 3 ms of imports that an unpack, which forks no map, would pay at its start

    try:
        spill = tempfile.TemporaryFile()  # noqa: SIM115 (closed by _collect, once the child is reaped)
    except OSError:  # out of file descriptors, or no temp directory to write: this part is done here
        return None
    try:
        pid = os.fork()
    except OSError:  # out of processes (a pids limit)
        spill.close()
        return None
    if pid:
        return pid, spill
    code = 1
    try:
        as_child()
        die_with(parent)
        pickle.dump((function(part),), spill, protocol=pickle.HIGHEST_PROTOCOL)
        spill.flush()
        code = 0
    finally:  # never back into the parent's code, nor its exit handlers
        os._exit(code)


def _collect(child: tuple[int, BinaryIO]) -> tuple | None:
    """The child's result (in a 1-tuple), or None if it failed; either way the child is reaped and its file
    closed."""
    pid, spill = child
    try:
        _, status = os.waitpid(pid, 0)
        if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
            return None
        spill.seek(0)
        return pickle.load(spill)
    except Exception:  # not what a child that exits 0 writes (a full disk): its part is done here all the same
        return None
    finally:
        spill.close()


def send_message(fd: int, message) -> None:
    """One marshalled message, its length first, to a pipe between forked processes of this run."""
    payload = marshal.dumps(message)
    view = memoryview(len(payload).to_bytes(4, "little") + payload)
    while view:
        view = view[os.write(fd, view):]


def receive_message(fd: int):
    """One message, or None at the end of the pipe."""
    head = _read_exactly(fd, 4)
    payload = None if head is None else _read_exactly(fd, int.from_bytes(head, "little"))
    return None if payload is None else marshal.loads(payload)


def _read_exactly(fd: int, size: int) -> bytes | None:
    parts, left = [], size
    while left:
        part = os.read(fd, left)
        if not part:
            return None
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def private_map(size: int) -> mmap.mmap:
    """Anonymous memory of this process alone, its pages untouched until written: a private map, where
    ``mmap.mmap(-1, size)`` would be a shared one, which costs more to fault in and to free (five 32 MiB maps
    filled in 107 ms against 129 on the 16-core host; ``bench/block_buffer_probe.py``)."""
    if hasattr(mmap, "MAP_PRIVATE"):
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mmap.mmap(-1, size)


__all__ = ["private_map", "fork_safe", "cores", "die_with", "forked_map", "send_message", "receive_message"]
