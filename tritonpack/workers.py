"""Forked worker processes that stage an unpack (see ``staging``), for the command.

Python's per-file steps then run on several cores instead of taking turns on one interpreter lock, and the first
blocks decode while the parent plans. ``Launcher`` forks the workers as soon as the archive's block table is read
(``ArchiveReader(on_blocks=...)``), each with a first block (the largest first), which it decompresses at once
while the parent decodes the rest of the index, checks it, and compares the archive with the root; as soon as the
blob table is decoded (``on_blobs``), each verifies that block's blobs, until its plan comes.
``StagingWorkers.stage`` then sends each worker the plan of its item (each blob's place and sha256 in the block,
and where its files go; or a share of the manifests), and further items with their plans, costliest first, to
whichever worker reports back (before the parent records what it reported); a block decompressed ahead that the
plan does not need is dropped. Workers verify every blob, write temp files only (``staging.StageWriter``) and
report each one; the parent commits and cleans up:

- a worker that fails removes its unreported temp files and sends its error; the others finish their item;
- a worker that dies is named by its signal, and the parent sweeps this run's temp names;
- a parent that is interrupted, or fails before staging, kills its workers (and sweeps what they may have made);
- a killed parent takes its workers with it (``PR_SET_PDEATHSIG``): none goes on writing for a dead run.

Forking needs a local archive and what ``forking.fork_safe`` asks, which is why only the command asks for workers
(``api.unpack(processes=True)``).
"""
from __future__ import annotations

import contextlib
import mmap
import os
import select
import signal
from array import array
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from .archive.format import IN_FLIGHT
from .archive.index import BlobTable, Block
from .archive.splice import BlockContent
from .cachedest import manifest_json
from .errors import ArchiveError, CacheError
from .forking import (
    as_child,
    cores,
    die_with,
    fork_safe,
    private_map,
    receive_message,
    send_message,
    uninterrupted,
)
from .staging import MANIFEST, StageWriter, Targets

if TYPE_CHECKING:
    from .model import Entry

MANIFESTS = -1  # an item that writes a share of the manifests, a share a worker or more (blocks: from 0)
# Manifests in one share at most: where one worker took every manifest of 23,000 groups, their plan and its message
# held about 24 MB in the worker at once. More shares are added after the fork, as items past the worker's list.
MANIFESTS_A_SHARE = 2_000
FILE_COST = 20_000  # what a file costs a worker, in bytes of block: to send out the costliest items first
HELD_ASSEMBLED = 4 << 20  # a spliced block's cubins and the manifests are new bytes each: written by the 4 MiB
# Messages to a worker: decompress this block now; verify these blobs of it; stage this item so; end
_HINT, _VERIFY, _PLAN, _STOP = 0, 1, 2, 3
# Blobs a _VERIFY message lists at most: it must fit the pipe (64 KiB) while the worker still decompresses, or the
# parent would wait on it instead of decoding the index (48 bytes a blob: offset, size, sha256)
VERIFY_AHEAD = 1_200

# What a worker is told to write: for a block, [(blob, offset, size, sha256, [(directory, name or None, entry,
# file), ...]), ...]; for the manifests, [(directory, name or None, entry, path prefix, file names), ...]. A name
# None is a temp name.
Plan = list
Record = Callable[[int, int, int, str | None], None]  # entry, file (or staging.MANIFEST), size, temp path or None


# What the processes of an unpack may hold together (summed PSS): the performance goal's 256 MB, less a margin. The
# parent holds the index and the plan: about 20 MB and at most 3 times the index's msgpack bytes since 0dcdf11-ff48b31
# (1.5 times at 1,060,970 files on the 16-core H200 host, 203 MB for a 119 MB index; 2 times at 163,830 files on the
# 2-core VM, 60 MB for 18.4 MB; 4.5 times from 6b91496, ten times before); a worker its map of the largest block and
# about 15 MB of its own (42-52 MB a worker for 32 MiB blocks there; one worker alone beside the parent, 57-75 MB:
# the pages it shares are counted between two processes).
MEMORY = 240 << 20
PARENT_BASE, PARENT_PER_INDEX_BYTE, WORKER_BASE = 24 << 20, 3, 16 << 20


def worker_count(reader, blocks: list[Block]) -> int:
    """How many workers to fork (none: stage in threads): one a block, a core, and a block's share of
    ``IN_FLIGHT``, and as many as fit in ``MEMORY`` beside the parent, whose share grows with the index (but one
    at least: a worker holds one block, where threads would hold up to ``IN_FLIGHT``). None where a fork is not
    safe, or where one worker would do (one core, one block)."""
    if not blocks or not reader.local or not fork_safe():
        return 0
    biggest = max(block.size for block in blocks)
    count = min(cores(), len(blocks), max(1, IN_FLIGHT // max(biggest, 1)))
    if count < 2:
        return 0
    parent = PARENT_BASE + PARENT_PER_INDEX_BYTE * reader.index_size
    return max(1, min(count, (MEMORY - parent) // (WORKER_BASE + biggest)))


class Launcher:
    """``ArchiveReader``'s ``on_blocks`` for an unpack into ``root``: forks the workers there, if any; a context
    manager that kills whatever still runs when it ends (a bad index, nothing to write, an error)."""

    def __init__(self, root: str):
        self.root = root
        self.workers: StagingWorkers | None = None

    def __call__(self, reader, blocks: list[Block]) -> None:
        count = worker_count(reader, blocks)
        if count:
            with uninterrupted():  # every worker forked is known to __exit__ before a Ctrl-C lands
                workers = StagingWorkers(reader, self.root, blocks, count)
                self.workers = workers if workers.children else None

    def on_blobs(self, blobs: BlobTable) -> None:
        """``ArchiveReader``'s ``on_blobs``: the workers verify blobs of the blocks they decompress meanwhile."""
        if self.workers is not None:
            self.workers.verify_ahead(blobs)

    def __enter__(self) -> Launcher:
        return self

    def __exit__(self, *exc) -> None:
        if self.workers is not None:
            self.workers.close()


def _stage_item(w: StageWriter, reader, number: int, block: Block | None, data: BlockContent | None,
                plan: Plan, buffer: mmap.mmap, checked: frozenset[int] | set[int] = frozenset()
                ) -> list[tuple[int, int, int, str | None]]:
    """Stage one item as planned: the files of block ``number`` (``data``: the block decompressed ahead, if it
    was; else it is decompressed into ``buffer``), each blob verified first; or, with no block, a share of the
    manifests. Every file is written before it returns: nothing may hold a view of ``buffer`` past it. ``checked``:
    blobs of ``data`` verified already, while the plan was made."""
    jobs: list[tuple[str, str | None, bytes | memoryview]] = []
    owners: list[tuple[int, int, int]] = []
    staged: list[tuple[int, int, int, str | None]] = []
    held = 0  # bytes made here (manifests, spliced cubins), not views of the block: written every few MB
    content: bytes | memoryview

    def write() -> None:
        """Report each file staged (a manifest too): its path where it has a temp name; None where it has its
        own name in a staging directory (the parent knows where, and need not hold a path a file)."""
        paths = w.stage_batch(jobs)
        staged.extend((n, i, size, path if job[1] is None else None)
                      for (n, i, size), path, job in zip(owners, paths, jobs, strict=True))
        jobs.clear()
        owners.clear()

    def made(size: int) -> None:
        nonlocal held
        held += size
        if held > HELD_ASSEMBLED:
            write()
            held = 0

    if block is None:
        for directory, name, n, prefix, names in plan:
            content = manifest_json(prefix, names)
            jobs.append((directory, name, content))
            owners.append((n, MANIFEST, 0))
            made(len(content))
    else:
        decoded = data if data is not None else reader.read_block(number, block, buffer)
        for blob, offset, size, digest, where in plan:
            content = decoded.range(offset, size) if blob in checked else \
                reader.verified(decoded, number, blob, offset, size, digest)
            for directory, name, n, i in where:
                jobs.append((directory, name, content))
                owners.append((n, i, size))
            if not isinstance(content, memoryview):
                made(size)
    write()
    return staged


def _verify_ahead(reader, number: int, data: BlockContent, blobs: tuple, checked: set[int], commands: int) -> None:
    """Verify the listed blobs of block ``number`` (decoded: ``data``), adding each that matches its digest to
    ``checked``, until a message waits (the plan: staging goes first). A blob that does not match is left out: if
    the plan needs it, its check fails then, as it would have."""
    first, offsets, sizes, digests = blobs
    offsets, sizes = array("I", offsets), array("I", sizes)  # as ``BlobTable`` has them
    for k, (offset, size) in enumerate(zip(offsets, sizes, strict=True)):
        if k % 16 == 0 and select.select([commands], [], [], 0)[0]:
            return
        with contextlib.suppress(ArchiveError):
            reader.verified(data, number, first + k, offset, size, digests[32 * k:32 * k + 32])
            checked.add(first + k)


def _work(reader, items: list[int], blocks: list[Block], root: str, part: int, parts: int, commands: int,
          results: int) -> int:
    """A worker: decompress the block it is hinted, then stage each item as the parent plans it and report the
    temp files made, until told to stop. On failure its own unreported temp files go, and the error to the
    parent."""
    w = StageWriter(root)
    # Every block is decompressed into this one map, sized for the largest: its pages are touched once, as the
    # first blocks fill them, and hold no more than the largest block whatever the number of blocks.
    buffer = private_map(max(1, max(block.stored for block in blocks)))
    # (item, its block, the blobs of it verified) decompressed before the plan came
    ahead: tuple[int, BlockContent, set[int]] | None = None
    try:
        while True:
            message = receive_message(commands)
            if message is None or message[0] == _STOP:
                return 0
            if message[0] == _HINT:
                number = message[1]
                try:
                    ahead = (number, reader.read_block(items[number], blocks[items[number]], buffer), set())
                except Exception:  # not fatal yet: the plan may not need this block, and if it does, it fails then
                    ahead = None
                continue
            if message[0] == _VERIFY:
                if ahead is not None and ahead[0] == message[1]:
                    _verify_ahead(reader, items[ahead[0]], ahead[1], message[2:], ahead[2], commands)
                continue
            _, number, pid, token, plan = message
            if w.lock.token is None:  # the run's temp names, under its lock (which the parent holds)
                w.lock.pid, w.lock.token = pid, token
                w.lock.share_names(part, parts)
            data, checked = ahead[1:] if ahead is not None and ahead[0] == number else (None, frozenset())
            ahead = None
            item = items[number] if number < len(items) else MANIFESTS  # a share added after the fork
            staged = _stage_item(w, reader, item, None if item == MANIFESTS else blocks[item], data, plan, buffer,
                                 checked)
            del data, checked
            send_message(results, (True, staged))
            w.temps.clear()  # the parent's now
    except BaseException as e:
        for temp in list(w.temps):
            w.discard(temp)
        import pickle

        try:
            error = pickle.dumps(e)
        except Exception:
            error = pickle.dumps(CacheError(f"an unpack worker failed: {e!r}", root))
        with contextlib.suppress(OSError):
            send_message(results, (False, error))
        return 1


class StagingWorkers:
    """Workers forked for one unpack (by a ``Launcher``, which closes them when it ends)."""

    def __init__(self, reader, root: str, blocks: list[Block], count: int):
        self.reader = reader
        self.blocks = blocks
        # Blocks largest first, the first ``count`` decompressed at once; the manifests, planned later, after them
        # in ``count`` shares: small items that even out the workers' last rounds.
        self.items = [*sorted(range(len(blocks)), key=lambda n: blocks[n].size, reverse=True), *[MANIFESTS] * count]
        self.children: dict[int, tuple[int, int, int]] = {}  # results pipe -> (pid, commands pipe, hinted item)
        parent = os.getpid()
        for part in range(count):
            pipes: list[int] = []
            try:
                pipes.extend(os.pipe())
                pipes.extend(os.pipe())
                pid = os.fork()
            except OSError:  # out of processes (a pids limit) or of file descriptors: go on with the workers there are
                for fd in pipes:
                    os.close(fd)
                break
            commands_r, commands_w, results_r, results_w = pipes
            if pid == 0:  # the worker: never returns into the caller
                code = 1
                try:
                    as_child()  # the parent decides, and cleans up
                    die_with(parent)
                    for fd in (commands_w, results_r, *(f for r, (_, c, _) in self.children.items() for f in (r, c))):
                        os.close(fd)
                    code = _work(reader, self.items, blocks, root, part, count, commands_r, results_w)
                finally:
                    os._exit(code)
            os.close(commands_r)
            os.close(results_w)
            send_message(commands_w, (_HINT, part))
            self.children[results_r] = (pid, commands_w, part)

    def verify_ahead(self, blobs: BlobTable) -> None:
        """Send each worker the places and digests of the first ``VERIFY_AHEAD`` blobs of the block it was hinted,
        to verify while this process decodes the entries and plans (the workers would wait for the plan). Blobs
        lie in block order in a writer's table; in another order, only those found so are listed."""
        for _, commands, number in self.children.values():
            block = self.items[number]
            if self.blocks[block].splices:  # its cubins' texts would be derived twice
                continue
            first = bisect_left(blobs.blocks, block)
            end = min(bisect_right(blobs.blocks, block, first), first + VERIFY_AHEAD)
            if first >= end or any(blobs.blocks[n] != block for n in (first, end - 1)):
                continue
            message = (_VERIFY, number, first, blobs.offsets[first:end].tobytes(), blobs.sizes[first:end].tobytes(),
                       blobs.digests[32 * first:32 * end])
            with contextlib.suppress(BrokenPipeError):
                send_message(commands, message)

    def stage(self, w: StageWriter, targets: Targets,
              manifests: Sequence[tuple[str, str | None, int, Entry, Sequence[str]]],
              record: Record) -> None:
        """Stage every planned file (``targets``, whose destinations are worked out a block at a time, as its plan
        goes out) and manifest (directory, name, entry number, entry, names listed) through the workers; ``record``
        each temp file as it is reported. Raises the first error, after the other workers have finished their item
        (their files recorded, for the caller to clean up)."""
        # Where temp names may be left by a worker that dies: key directories (staging directories go whole).
        swept = targets.temp_name_directories() | {directory for directory, name, *_ in manifests if name is None}
        table = self.reader.index.blobs
        offsets, sizes, digest = table.offsets, table.sizes, table.digest
        missing = -(-len(manifests) // MANIFESTS_A_SHARE) - self.items.count(MANIFESTS)
        self.items += [MANIFESTS] * max(0, missing)
        shares = [number for number, item in enumerate(self.items) if item == MANIFESTS]
        cuts = [len(manifests) * k // len(shares) for k in range(len(shares) + 1)]
        manifests_of = {number: manifests[cuts[k]:cuts[k + 1]] for k, number in enumerate(shares)}

        def plan_of(number: int) -> Plan:
            if self.items[number] == MANIFESTS:
                return [(directory, name, n, os.path.join(w.root, entry.key, ""), listed)
                        for directory, name, n, entry, listed in manifests_of[number]]
            return [(blob, offsets[blob], sizes[blob], digest(blob), made)
                    for blob, made in targets.runs(*targets.blocks[self.items[number]])]

        # The items to stage, by cost. A block with nothing to write (all in place, or not taken) is dropped; a
        # manifest costs what a file does (26-40 us each, measured on 2 cores).
        costs: dict[int, int] = {}
        for number, item in enumerate(self.items):
            if item == MANIFESTS:
                if manifests_of[number]:
                    costs[number] = FILE_COST * len(manifests_of[number])
            elif item in targets.blocks:
                start, end = targets.blocks[item]
                costs[number] = self.blocks[item].size + FILE_COST * (end - start)
        hinted = {child[2] for child in self.children.values()}
        queue = deque(sorted((n for n in costs if n not in hinted), key=costs.__getitem__, reverse=True))
        error: BaseException | None = None

        def follow(commands: int, number: int | None) -> None:
            """Send a worker its item's plan, or tell it to end."""
            if number is None:
                number = queue.popleft() if queue and error is None else None
            message = (_STOP,) if number is None else (_PLAN, number, w.lock.pid, w.lock.token, plan_of(number))
            with contextlib.suppress(BrokenPipeError):  # it died: the end of its results pipe tells
                send_message(commands, message)

        try:
            for _, commands, number in self.children.values():
                follow(commands, number if number in costs else None)
            while self.children:
                ready, _, _ = select.select(list(self.children), [], [])
                for fd in ready:
                    pid, commands, _ = self.children[fd]
                    message = receive_message(fd)
                    if message is None:  # the worker has ended
                        del self.children[fd]
                        os.close(fd)
                        os.close(commands)
                        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
                        if code and error is None:
                            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
                            error = CacheError(f"an unpack worker process {how}", w.root)
                        continue
                    ok, data = message
                    if not ok:
                        import pickle

                        error = error or pickle.loads(data)
                        continue
                    follow(commands, None)  # its next item first: the bookkeeping waits, not the worker
                    for n, i, size, temp in data:
                        if temp is not None:
                            w.temps.add(temp)
                        record(n, i, size, temp)
            if error is not None:
                raise error
        except BaseException:
            self.close()
            # A worker that was killed, or died, may have left temp files it never reported: they carry this
            # run's token. (Those in staging directories go with the directories.)
            w.sweep(swept)
            raise

    def close(self) -> None:
        """Kill and reap the workers still running (none after a complete ``stage``)."""
        for pid, _, _ in self.children.values():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for fd, (pid, commands, _) in self.children.items():
            os.waitpid(pid, 0)
            os.close(fd)
            os.close(commands)
        self.children.clear()
