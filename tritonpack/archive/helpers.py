"""Forked processes that work on the writer's block buffers: read a batch of a cache's files into a block, and
find a block's splices (``splice.plan``), while the writer's threads compress.

Both are work that holds the interpreter lock in the writer. A read costs four trips through the lock (open, read,
close, hash) a file; with four reader threads and the writer's own Python beside them, a block of 2,600 small
files (the kernels' json, ttir, ttgir) took 0.10-0.12 s to read on 16 cores, the end of a pack waiting on it;
helpers read a block in 15-40 ms (``bench/pack_timeline.py``). Planning is Python, line by line, 10-15 ns a byte of
``.ptx``: 0.40 s of a 1.08 s ``pack --splice-ptx`` in the threads (``bench/splice_pack_probe.py``).

The helpers own the block buffers: shared anonymous maps, made before the fork, so that a helper reads files
straight into the block the writer compresses, and plans a block where the writer filled it; it sends back only
digests or splices. They fork before the cache is scanned (``api.pack``), while the process is small: the helpers
keep the original of every page that the writer changes after the fork, and forked after the scan, four of them
added 33-42 MB to the pack's memory. So a read names its files by path, size and place. A helper that fails a read or
dies leaves the work to the writer, which does it itself (and meets the same error, if it was the files'): the
archive is the same bytes either way. Every helper is killed with the writer (``PR_SET_PDEATHSIG``), and reaped
when the pack ends.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import mmap
import os
import queue
import signal
import threading
from collections.abc import Callable, Iterable, Sequence
from functools import partial

from ..cacheroot import read_file_into
from ..forking import as_child, die_with, receive_message, send_message
from . import splice

_READ, _PLAN = 0, 1


def fill(reads: Iterable[tuple[Callable[[memoryview], None], int, int]], view: memoryview) -> list[bytes]:
    """Each read (a function that fills a view, a size, an offset) straight into its place in the block, then its
    sha256: the writer's reader threads and its helpers both read so (reads and hashing release the GIL)."""
    digests = []
    for read_into, size, offset in reads:
        part = view[offset:offset + size]
        read_into(part)
        digests.append(hashlib.sha256(part).digest())
    return digests


def read_files(files: Sequence[tuple[str, int, int]], view: memoryview) -> list[bytes]:
    """Each file (path, size, offset) of a cache root into its place in the block; their sha256s."""
    return fill(((partial(read_file_into, path), size, offset) for path, size, offset in files), view)


class BlockHelpers:
    """``count`` forked helpers, and ``buffers`` block buffers of ``block_size`` bytes that they share with the
    writer (every buffer a block can be in)."""

    def __init__(self, count: int, buffers: int, block_size: int):
        self.block_size = block_size
        self.buffers = [mmap.mmap(-1, block_size) for _ in range(buffers)]
        self._index = {id(buffer): n for n, buffer in enumerate(self.buffers)}
        self._free: queue.SimpleQueue[tuple[int, int, int]] = queue.SimpleQueue()
        self._children: list[tuple[int, int, int]] = []  # (pid, commands fd, results fd)
        self._alive = 0
        self._lock = threading.Lock()
        parent = os.getpid()
        for _ in range(count):  # made inside forking.uninterrupted (forked_helpers' caller): see api.pack
            child = _fork(self.buffers, parent, [fd for _, *fds in self._children for fd in fds])
            if child is not None:
                self._children.append(child)
                self._free.put(child)
                self._alive += 1

    @property
    def count(self) -> int:
        return len(self._children)

    def read(self, buffer: mmap.mmap, files: Sequence[tuple[str, int, int]]) -> list[bytes] | None:
        """The digests of ``files`` (path, size, offset), read by a helper into ``buffer``; None where none could
        (the caller reads them itself)."""
        index = self._index.get(id(buffer))
        child = None if index is None or not files else self._take()
        if child is None:
            return None
        digests = self._ask(child, (_READ, index, list(files)))
        return digests or None  # [] is a read the helper could not do

    def plan(self, buffer: mmap.mmap | None,
             pairs: Sequence[tuple[int, int, int, int]]) -> tuple[splice.Splice, ...] | None:
        """The splices of the block in ``buffer``, as ``splice.plan`` finds them, its pairs shared among the
        helpers that are free (the first blocks would otherwise wait for one helper each); None where none could
        (the caller plans the block itself)."""
        index = self._index.get(id(buffer))
        first = None if index is None else self._take()
        if first is None:
            return None
        children = [first]
        with contextlib.suppress(queue.Empty):
            while len(children) < len(pairs):
                children.append(self._free.get_nowait())
        share = -(-len(pairs) // len(children))
        replies = self._ask_all([(child, (_PLAN, index, list(pairs[n * share:(n + 1) * share])))
                                 for n, child in enumerate(children)])
        if any(reply is None for reply in replies):
            return None
        return tuple(splice.Splice(*s[:5], tuple(map(tuple, s[5])))  # type: ignore[call-arg]  # *s[:5]: the first five fields
                     for reply in replies for s in reply)

    def _take(self) -> tuple[int, int, int] | None:
        """A free helper, waiting for one; None once none is alive."""
        while True:
            try:
                return self._free.get(timeout=0.05)
            except queue.Empty:
                with self._lock:
                    if not self._alive:
                        return None

    def _ask(self, child: tuple[int, int, int], message):
        return self._ask_all([(child, message)])[0]

    def _ask_all(self, asks: list[tuple[tuple[int, int, int], object]]) -> list:
        """Each helper's reply to its message, None where it died (it is not asked again). Every answer is read,
        so that no pipe is left with one unread."""
        asked: list[tuple[int, int, int] | None] = []
        child: tuple[int, int, int] | None
        for child, message in asks:
            try:
                send_message(child[1], message)
                asked.append(child)
            except OSError:
                asked.append(None)
        replies = []
        for child in asked:
            reply = None
            if child is not None:
                with contextlib.suppress(OSError):
                    reply = receive_message(child[2])
            if reply is None:
                with self._lock:
                    self._alive -= 1
            else:
                self._free.put(child)  # type: ignore[arg-type]  # a reply: child is not None
            replies.append(reply)
        return replies

    def close(self) -> None:
        """End the helpers: killed all at once (each exit unmaps the block buffers, milliseconds apiece on a
        large pack, spent in parallel), then each reaped."""
        for pid, commands, results in self._children:
            for fd in (commands, results):
                with contextlib.suppress(OSError):
                    os.close(fd)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for pid, _, _ in self._children:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self._children.clear()

    def __enter__(self) -> BlockHelpers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fork(buffers: Sequence[mmap.mmap], parent: int, others: list[int]) -> tuple[int, int, int] | None:
    """A helper serving ``buffers``; ``others``: the earlier helpers' pipe ends, which it must not hold open."""
    pipes: list[int] = []
    try:
        pipes.extend(os.pipe())
        pipes.extend(os.pipe())
        pid = os.fork()
    except OSError:  # out of file descriptors or processes: fewer helpers
        for fd in pipes:
            os.close(fd)
        return None
    commands_r, commands_w, results_r, results_w = pipes
    if pid:
        os.close(commands_r)
        os.close(results_w)
        return pid, commands_w, results_r
    code = 1
    try:
        for fd in (commands_w, results_r, *others):
            os.close(fd)
        as_child()  # the writer decides, and its end ends this process
        die_with(parent)
        gc.disable()  # a collection would write to every object it inherited: copies of the writer's pages
        while (message := receive_message(commands_r)) is not None:
            reply: list[bytes] | list[tuple]
            if message[0] == _READ:
                _, index, files = message
                try:
                    reply = read_files(files, memoryview(buffers[index]))
                except Exception:  # the writer reads it again, and meets the error itself
                    reply = []
            else:
                _, index, pairs = message
                reply = [tuple(s) for s in splice.plan_block(memoryview(buffers[index]), pairs)]
            send_message(results_w, reply)
        code = 0
    finally:  # never back into the writer's code, nor its exit handlers
        os._exit(code)


__all__ = ["BlockHelpers", "fill", "read_files"]
