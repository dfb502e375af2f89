"""Forked processes that find a block's splices (``splice.plan``) while the writer's threads compress.

Planning is Python, line by line, 10-15 ns a byte of ``.ptx``, and in the compress threads it holds the interpreter
lock while the compressions and the reads wait: on 16 cores, 0.40 s of a 1.08 s ``pack --splice-ptx``
(``bench/splice_pack_probe.py``). The writer's block buffers are shared anonymous maps made before the fork, so a
planner reads a block where the writer filled it and sends back only its splices. A planner that dies leaves its
blocks to be planned in the writer; every planner is killed with the writer (``PR_SET_PDEATHSIG``), and reaped
when the pack ends.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import queue
import signal
import threading
from collections.abc import Sequence

from ..forking import die_with, receive_message, send_message
from . import splice


class Planners:
    """``count`` forked planners over ``buffers`` (every buffer a block with pairs can be in)."""

    def __init__(self, buffers: Sequence[mmap.mmap], count: int):
        self._index = {id(buffer): n for n, buffer in enumerate(buffers)}
        self._free: queue.SimpleQueue[tuple[int, int, int]] = queue.SimpleQueue()
        self._children: list[tuple[int, int, int]] = []  # (pid, commands fd, results fd)
        self._alive = 0
        self._lock = threading.Lock()
        parent = os.getpid()
        for _ in range(count):
            child = _fork(buffers, parent, [fd for _, *fds in self._children for fd in fds])
            if child is not None:
                self._children.append(child)
                self._free.put(child)
                self._alive += 1

    def plan(self, buffer: mmap.mmap, pairs: Sequence[tuple[int, int, int, int]]) -> tuple[splice.Splice, ...] | None:
        """The splices of the block in ``buffer``, as ``splice.plan`` finds them, its pairs shared among the planners
        that are free (the first blocks would otherwise wait for one planner each); None where none could (the
        caller plans the block itself)."""
        index = self._index.get(id(buffer))
        if index is None:
            return None
        while True:
            try:
                children = [self._free.get(timeout=0.05)]
                break
            except queue.Empty:
                with self._lock:
                    if not self._alive:
                        return None
        with contextlib.suppress(queue.Empty):
            while len(children) < len(pairs):
                children.append(self._free.get_nowait())
        share = -(-len(pairs) // len(children))
        asked = []  # the planners asked, in the order of their shares; None where the asking failed
        for n, child in enumerate(children):
            try:
                send_message(child[1], (index, list(pairs[n * share:(n + 1) * share])))
                asked.append(child)
            except OSError:
                asked.append(None)
        found: list | None = []
        for child in asked:  # every answer is read, so that no pipe is left with one unread
            reply = None
            if child is not None:
                with contextlib.suppress(OSError):
                    reply = receive_message(child[2])
            if reply is None:  # it died: its blocks are planned here from now on
                with self._lock:
                    self._alive -= 1
                found = None
                continue
            self._free.put(child)
            if found is not None:
                found += reply
        if found is None:
            return None
        return tuple(splice.Splice(*s[:5], tuple(map(tuple, s[5]))) for s in found)

    def close(self) -> None:
        """End the planners: their commands end, and each is reaped (killed first if it still runs)."""
        for pid, commands, results in self._children:
            for fd in (commands, results):
                with contextlib.suppress(OSError):
                    os.close(fd)
            with contextlib.suppress(ChildProcessError):
                done, _ = os.waitpid(pid, os.WNOHANG)
                if not done:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
        self._children.clear()

    def __enter__(self) -> Planners:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fork(buffers: Sequence[mmap.mmap], parent: int, others: list[int]) -> tuple[int, int, int] | None:
    """A planner serving ``buffers``; ``others``: the earlier planners' pipe ends, which it must not hold open."""
    pipes: list[int] = []
    try:
        pipes.extend(os.pipe())
        pipes.extend(os.pipe())
        pid = os.fork()
    except OSError:  # out of file descriptors or processes: fewer planners
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
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the writer decides, and its end ends this process
        die_with(parent)
        while (message := receive_message(commands_r)) is not None:
            index, pairs = message
            send_message(results_w, [tuple(s) for s in splice.plan_block(memoryview(buffers[index]), pairs)])
        code = 0
    finally:  # never back into the writer's code, nor its exit handlers
        os._exit(code)


__all__ = ["Planners"]
