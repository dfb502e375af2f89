"""Writing an unpack in two phases, so that a bad archive, a full disk or a kill never costs the user anything.

1. **Stage.** Every file to write, and every manifest, is written to a temp file (names and clean-up in
   ``tempfiles``), decoding each needed block once and verifying every blob. A key directory the root lacks (the
   usual case: a fresh root) is staged whole in a temp directory at the root, its files under their final names;
   into a key directory that exists, files are staged under temp names. Nothing visible changes: a corrupt block,
   ``ENOSPC``/``EDQUOT`` or any other failure here removes the temp files and directories and leaves the root as
   it was (key directories this run created are removed again if they are empty).
2. **Commit.** A staged key directory is renamed into place: one step makes all of its entries visible, and the
   rename fails rather than merge if the key directory appeared meanwhile with content. Then, and for existing
   key directories, it goes entry by entry: each entry is compared with the root again (``place``), because
   another unpack or a Triton compile may have completed it since the plan: what is now present is left alone, a
   differing entry that appeared meanwhile is kept (reported as a conflict), and only the manifest of a group to
   replace, which this comparison saw, is hidden before the entry's files are renamed in: replaced by one that
   lists no file (never unlinked: Triton 3.0-3.7 open it after seeing it exists), which every Triton misses. The
   manifest is renamed in last. A manifest that was absent is never hidden, so a concurrent writer's complete
   group stays visible throughout, and neither is that of a group that only gains files it lacked.

Staging runs in this process's threads, or, for the command, in forked worker processes (``workers``), which
report each temp file they make: commit and clean-up stay here.

Commit needs no free space (renames only), so a full disk is met in phase 1. Before phase 1, the free space and
inodes of the target filesystem are checked against what the plan will write.

Concurrent unpacks of one archive into one root (every rank of a job) each stage what they found missing, so for
a moment they need that space as many times over. Each stages and commits under a shared ``flock`` on the root
directory; one that runs short of space (the precheck, or ``ENOSPC``/``EDQUOT`` while staging) cleans up, takes
the lock exclusively, which waits for the others to commit or clean up, compares the archive with the root again
and stages once more only what is still missing, then alone: a disk that holds one copy is enough.
"""
from __future__ import annotations

import contextlib
import errno
import os
import stat
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from itertools import accumulate, groupby, pairwise
from typing import TYPE_CHECKING, NamedTuple

from .cachedest import (
    CONFLICT,
    RELINK,
    REPLACE,
    WRITE,
    Placement,
    Written,
    blobs_of,
    holds_nothing,
    manifest_bytes,
    manifest_size,
    place,
    write_fd,
)
from .errors import SpaceError
from .model import GROUP, HIDDEN_MANIFEST, Entry, manifest_name
from .report import human_bytes
from .tempfiles import NAMES_A_RUN, PREFIX, RunLock, clean_stale, remove_stage_dir, run_name

try:
    import fcntl
except ImportError:  # not POSIX: no lock on the root
    fcntl = None  # type: ignore[assignment]  # every use checks for None first

if TYPE_CHECKING:
    from collections.abc import Iterable
    from concurrent.futures import Future
    from typing import Literal

    from .workers import StagingWorkers

WRITERS = 4
# Staging directories named under one run token: theirs are made by the first file staged in each, not created
# exclusively when named, so their names must not repeat. Past these, a run takes another token, with its own lock
# (a root of more than 65,536 new keys: 560,000 files of a real cache's kind). Writing such keys in place, under
# temp names, held a path a file (0.5 KB a file past 560,000 files, at the unpack's peak).
STAGE_DIRS_A_TOKEN = NAMES_A_RUN
BATCH_FILES, BATCH_BYTES = 64, 1 << 20
MAX_PENDING_BATCHES = 16
MANIFEST = -1  # in a batch's owners, where a file number would be: the entry's manifest

# directory, name or None (a temp name), entry number, entry, the names it lists (``Placement.manifest_names``)
_Manifest = tuple[str, "str | None", int, Entry, Sequence[str]]
_Record = Callable[[int, int, int, str | None], None]  # entry, file (or MANIFEST), size, temp path or None


class _Staged(NamedTuple):
    """One entry's files staged (``Staged.of``): by file index, then the manifest (``MANIFEST``, the last), its
    temp path, None where it has its own name in ``directory`` (its staging directory), False if not staged."""

    directory: str | None
    files: list[str | Literal[False] | None]

    def staged(self) -> list[tuple[int, str | None]]:
        """(file index, temp path or None) of each file staged, the manifest left out."""
        return [(i, temp) for i, temp in enumerate(self.files[:MANIFEST]) if temp is not False]

    def temp(self, i: int) -> str | None:
        """File ``i``'s temp path (``MANIFEST``: the manifest's), if it has one."""
        temp = self.files[i]
        return temp if isinstance(temp, str) else None

    def path(self, i: int, name: str) -> str:
        temp = self.files[i]
        return temp if isinstance(temp, str) else f"{self.directory}{os.sep}{name}"


class Staged:
    """What the entries have staged, filled in as workers report: a byte a file and a manifest, and the temp path
    of each file with a temp name (in a key directory). In a staging directory a file has its own name: its path
    is not kept (120 bytes a file, for the hundreds of thousands of files of a large cache). An object and a list
    an entry took 0.18 KB."""

    def __init__(self, placements: Sequence[Placement], where: Destinations):
        """``where``: by placement, where each entry to stage writes (``write_staged``)."""
        self._where = where
        self._starts = array("I", accumulate((len(p.entry.files) + 1 if at != NOT_STAGED else 0
                                              for p, at in zip(placements, where.numbers, strict=True)), initial=0))
        self._done = bytearray(self._starts[-1])
        self._temps: dict[int, str] = {}

    def record(self, n: int, i: int, temp: str | None) -> None:
        """File ``i`` (or ``MANIFEST``) of entry ``n`` is staged, at ``temp`` where that is a temp name."""
        slot = self._starts[n] + i if i >= 0 else self._starts[n + 1] + i
        self._done[slot] = 1
        if temp is not None and self._where.numbers[n] == KEY_DIRECTORY:
            self._temps[slot] = temp

    def of(self, n: int) -> _Staged:
        start, end = self._starts[n], self._starts[n + 1]
        temps, done = self._temps, self._done
        at = self._where[n]  # a staging directory, where the files have their own names (None: not staged)
        return _Staged(at[0] if at is not None and at[1] is not None else None,
                       [temps.get(slot) if done[slot] else False for slot in range(start, end)])


def _existing_ancestor(path: str) -> str:
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def check_space(root: str, placements: Sequence[Placement], manifests: Sequence[int]) -> None:
    """Refuse, before writing anything, what the target filesystem cannot hold (bytes, then inodes): the
    placements' files and the manifests they write (their sizes)."""
    try:
        st = os.statvfs(_existing_ancestor(root))
    except (OSError, AttributeError):  # no statvfs: the writes themselves will tell
        return
    unit = st.f_frsize or st.f_bsize or 4096
    need = files = 0  # summed as they come: a list of the sizes took 36 bytes a file at the parent's peak
    for p in placements:
        sizes = p.entry.file_sizes
        need += sum(-(-sizes[i] // unit) for i in p.files) * unit
        files += len(p.files)
    need += sum(-(-size // unit) for size in manifests) * unit
    files += len(manifests)
    keys = {p.entry.key for p in placements}
    available = st.f_bavail * unit
    if need > available:
        raise SpaceError(f"not enough free space: unpacking needs {human_bytes(need)}, "
                         f"{human_bytes(available)} available", root)
    if st.f_files and files + len(keys) + 2 > st.f_favail:
        raise SpaceError(f"not enough free inodes: unpacking creates {files + len(keys)} files and directories, "
                         f"{st.f_favail} available", root)


def stage_path(prefixes: Sequence[str], number: int) -> str:
    """Staging directory ``number``'s path, from its token's prefix (``StageWriter.stage_prefixes``)."""
    return run_name(prefixes[number // STAGE_DIRS_A_TOKEN], number)


KEY_DIRECTORY, NOT_STAGED = -1, -2  # in ``Destinations.numbers``, where a staging directory's number would be


class Destinations(Sequence):
    """Where each entry to stage writes, by placement, made as it is read: ``(directory, names)``, its staging
    directory with its files' names (they have their own names there) or its key directory with None (temp names);
    None for an entry not staged. Held as a number an entry (``numbers``): its staging directory's, else
    ``KEY_DIRECTORY`` or ``NOT_STAGED``. A tuple an entry, and a staging directory's path and a dict slot a key,
    took 0.3 KB a key (7 MB of an unpack's parent for 23,400 groups)."""

    __slots__ = ("_key_prefix", "_placements", "_stage_prefixes", "numbers")

    def __init__(self, root: str, placements: Sequence[Placement], numbers: array, stage_prefixes: list[str]):
        """``stage_prefixes``: a staging directory's path but for its number (``StageWriter.stage_prefixes``)."""
        self._key_prefix = os.path.join(root, "")
        self._placements = placements
        self._stage_prefixes = stage_prefixes
        self.numbers = numbers

    def __len__(self) -> int:
        return len(self.numbers)

    def __getitem__(self, n: int) -> tuple[str, Sequence[str] | None] | None:  # type: ignore[override]  # no slices
        at = self.numbers[n]
        if at >= 0:
            return stage_path(self._stage_prefixes, at), self._placements[n].entry.file_names
        if at == KEY_DIRECTORY:
            return self._key_prefix + self._placements[n].entry.key, None
        return None


class Targets:
    """Every file an unpack stages, as (blob, entry, file) in three arrays sorted by block and blob, the order in
    which blocks are read: 12 bytes a file. A dict of a list of tuples a blob, worked out up front, took 0.18 KB a
    file (29 MB of the parent's 139 for 164,000 files); the destinations are worked out a block at a time, as its
    plan goes out. The files are placed by a counting sort on their blob's place in block order: sorting one int
    a file (its block, blob, entry and file in its bits) held a list of those ints, 44 bytes a file at the peak of
    the parent (12 MB of its 61 for 163,830 files)."""

    def __init__(self, placements: Sequence[Placement], active: Sequence[int], blob_blocks: Sequence[int],
                 where: Callable[[int], tuple[str, Sequence[str] | None]]):
        """``blob_blocks``: the block of each blob; ``where``: an entry's directory, and its files' names where
        they have their own names there (None: temp names)."""
        self._where = where
        # The blobs in block order, and each blob's place in it: their own order, where a writer numbered them
        order: range | array[int]
        rank: range | array[int]
        if all(a <= b for a, b in pairwise(blob_blocks)):
            order = rank = range(len(blob_blocks))
        else:
            order = array("I", sorted(range(len(blob_blocks)), key=blob_blocks.__getitem__))
            rank = array("I", bytes(4 * len(order)))
            for place, blob in enumerate(order):
                rank[blob] = place
        starts = array("I", bytes(4 * (len(order) + 1)))  # first, the files of each blob; then where they go
        active = sorted(active)
        for n in active:
            p = placements[n]
            blobs = blobs_of(p)
            for i in p.files:
                starts[rank[blobs[i]] + 1] += 1
        for k in range(1, len(starts)):
            starts[k] += starts[k - 1]
        at = starts[:-1]  # the next free place of each blob's files
        self.blobs, self.entries, self.files = (array("I", bytes(4 * starts[-1])) for _ in range(3))
        for n in active:  # same blob: by entry, then file
            p = placements[n]
            blobs = blobs_of(p)
            for i in p.files:
                blob = blobs[i]
                k = rank[blob]
                j = at[k]
                at[k] = j + 1
                self.blobs[j], self.entries[j], self.files[j] = blob, n, i
        self.blocks: dict[int, tuple[int, int]] = {}  # block -> (start, end) of its files here, in block order
        for k, blob in enumerate(order):
            if starts[k] < starts[k + 1]:
                block = blob_blocks[blob]
                first = self.blocks.get(block, (starts[k], 0))[0]
                self.blocks[block] = (first, starts[k + 1])

    def __len__(self) -> int:
        return len(self.blobs)

    def runs(self, start: int = 0, end: int | None = None):
        """``(blob, [(directory, name or None for a temp name, entry, file), ...])`` for each blob of files
        ``start:end``, in order."""
        blobs, entries, files, where = self.blobs, self.entries, self.files, self._where
        end = len(blobs) if end is None else end
        at = start
        while at < end:
            blob = blobs[at]
            made = []
            while at < end and blobs[at] == blob:
                n, i = entries[at], files[at]
                directory, names = where(n)
                made.append((directory, names[i] if names is not None else None, n, i))
                at += 1
            yield blob, made

    def distinct_blobs(self) -> list[int]:
        """The blobs to read, each once, in order."""
        blobs = self.blobs
        return [blob for at, blob in enumerate(blobs) if not at or blobs[at - 1] != blob]

    def temp_name_directories(self) -> set[str]:
        """The key directories where files are staged under temp names."""
        return {directory for directory, names in map(self._where, set(self.entries)) if names is None}


class ManifestJobs(Sequence):
    """The manifests to stage, each ``(directory, name or None for a temp name, entry number, entry, names listed)``
    made as it is read: a tuple and a name held for each took 0.16 KB an entry."""

    __slots__ = ("_numbers", "_placements", "_where")

    def __init__(self, numbers: Sequence[int], placements: Sequence[Placement], where: Destinations):
        self._numbers = numbers  # the entries, by placement
        self._placements = placements
        self._where = where

    def __len__(self) -> int:
        return len(self._numbers)

    def __getitem__(self, k):
        if isinstance(k, slice):
            return ManifestJobs(self._numbers[k], self._placements, self._where)
        n = self._numbers[k]
        directory, names = self._where[n]  # type: ignore[misc]  # an entry with a manifest to stage is staged
        p = self._placements[n]
        return directory, manifest_name(p.entry.name) if names is not None else None, n, p.entry, p.manifest_names


_NEW_FILE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)


# Each new file's write and close, under a name of this module so that fault-injection tests can make exactly this
# step fail; the function itself, not a wrapper: one call a file (see ``StageWriter.stage_batch``).
_write_all = write_fd


class StageWriter:
    """The temp files and staging directories of one unpack under one root, named with its run lock, and what
    it takes to clean them up (in this process, or in a forked worker)."""

    def __init__(self, root: str):
        self.root = root
        self.lock = RunLock(root)
        self.temps: set[str] = set()
        self.stage_dirs = 0  # staging directories named, by number (``stage_dir``, ``stage_path``)
        self._stage_locks = [self.lock]  # and one more lock, of another token, for each STAGE_DIRS_A_TOKEN more
        self._stage_prefixes: list[str] = []  # a token's staging directories' path but for their number
        self.created_dirs: list[str] = []

    def ensure_dir(self, path: str) -> None:
        missing = []
        probe = path
        while not os.path.isdir(probe):
            missing.append(probe)
            parent = os.path.dirname(probe)
            if parent == probe:
                break
            probe = parent
        os.makedirs(path, exist_ok=True)
        self.created_dirs.extend(reversed(missing))

    def stage_dir(self) -> int:
        """The number of a new staging directory at the root (``stage_path``), for a key directory the root lacks.
        Made by the first file staged in it (``stage_batch``), in a worker where there are some: a mkdir a key is
        a serial cost here. Its name is this run's own: its token's lock file was created exclusively, and no
        temp file is made at the root."""
        if self.stage_dirs % STAGE_DIRS_A_TOKEN == 0:
            if self.stage_dirs:
                self._stage_locks.append(RunLock(self.root))
            self._stage_prefixes.append(os.path.join(self.root, self._stage_locks[-1].prefix()))  # acquires it
        self.stage_dirs += 1
        return self.stage_dirs - 1

    def stage_prefixes(self) -> list[str]:
        """A staging directory's path but for its number: ``stage_prefixes()[n // STAGE_DIRS_A_TOKEN]``, then
        ``n % STAGE_DIRS_A_TOKEN`` in four hex digits."""
        return self._stage_prefixes

    def stage_path(self, number: int) -> str:
        return stage_path(self._stage_prefixes, number)

    def release(self) -> None:
        """Release the run's locks (the staging directories' too)."""
        for lock in self._stage_locks:
            lock.release()

    def stage_batch(self, jobs: Sequence[tuple[str, str | None, bytes | memoryview]]) -> list[str]:
        """Write each job's ``data`` to a new file: ``name`` in a staging directory, else a temp name in a key
        directory. Few Python steps a file, on purpose: the writer threads take turns on the interpreter lock, and
        on 2 cores this loop (before: a helper call, ``os.path.join`` and a write loop a file), with each blob's
        destinations worked out ahead in ``write_staged``, took the unpack of a 9,600-file cache from 1.17 s to
        0.99 s, and its CPU from 1.61 s to 1.34 s."""
        paths = []
        directory = ""
        try:
            for directory, name, data in jobs:
                if name is None:
                    try:
                        fd, path = self.lock.create(directory)
                    except FileNotFoundError:  # a failing concurrent unpack removed the empty directory: again
                        os.makedirs(directory, exist_ok=True)
                        fd, path = self.lock.create(directory)
                else:
                    path = f"{directory}{os.sep}{name}"
                    try:
                        fd = os.open(path, _NEW_FILE, 0o666)
                    except FileNotFoundError:  # the first file of its staging directory
                        with contextlib.suppress(FileExistsError):  # made meanwhile by another writer of this run
                            os.mkdir(directory)
                        fd = os.open(path, _NEW_FILE, 0o666)
                if name is None:  # a staging directory goes whole, with every file in it (``abandon``)
                    self.temps.add(path)
                _write_all(fd, data)
                paths.append(path)
        except OSError as e:  # name the directory: the temp file is gone by the time the error is shown
            raise OSError(e.errno, e.strerror, directory) from e
        return paths

    def rename_in(self, stage_dir: str, key_dir: str) -> bool:
        """Move a staged key directory into place (its files have their own names there: none is a temp file of
        ``temps``); False if the key directory appeared meanwhile with content."""
        try:
            os.rename(stage_dir, key_dir)  # replaces an empty directory, never a non-empty one
        except OSError as e:
            if e.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                return False
            raise
        return True

    def move(self, temp: str, final: str) -> None:
        os.replace(temp, final)
        self.temps.discard(temp)

    def hide(self, key_dir: str, manifest: str) -> None:
        """Replace a group's manifest with ``HIDDEN_MANIFEST``, through a temp file of this run (its lock keeps other
        unpacks' clean-up off it). Never unlinked: Triton 3.0-3.7 open a manifest once they see that it exists, and
        raised FileNotFoundError from the compile where it went in between."""
        fd, temp = self.lock.create(key_dir)
        self.temps.add(temp)
        _write_all(fd, HIDDEN_MANIFEST)
        self.move(temp, os.path.join(key_dir, manifest))

    def discard(self, temp: str | None) -> None:
        if temp is not None and temp in self.temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            self.temps.discard(temp)

    def sweep(self, directories: set[str]) -> None:
        """Remove this run's temp files from ``directories``, reported or not (after killing workers)."""
        mine = f"{PREFIX}{self.lock.pid}.{self.lock.token}"
        for directory in directories:
            with contextlib.suppress(OSError):
                for name in os.listdir(directory):
                    if name.startswith(mine) and not name.endswith(".lock"):
                        self.temps.add(os.path.join(directory, name))
        for temp in list(self.temps):
            self.discard(temp)

    def abandon(self) -> None:
        """After a failure: remove every temp file left, then the directories this run made, if still empty."""
        for temp in list(self.temps):
            self.discard(temp)
        for number in range(self.stage_dirs):  # those renamed into place, or removed after their commit, are gone
            remove_stage_dir(self.stage_path(number))
        self.release()
        for directory in reversed(self.created_dirs):
            with contextlib.suppress(OSError):
                os.rmdir(directory)


def _is_directory(path: str) -> bool:
    """Whether a directory, not a link to one, is there."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def _remove_file(path: str) -> None:
    """Remove a regular file, if one is there."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISREG(os.lstat(path).st_mode):
            os.unlink(path)


def _unblock(key_dir: str) -> None:
    """With overwrite: remove what stands where a key directory goes, unless a directory or a link is there (then
    the staged directory's rename fails, and its entries are compared again, one by one)."""
    with contextlib.suppress(FileNotFoundError):
        mode = os.lstat(key_dir).st_mode
        if not (stat.S_ISDIR(mode) or stat.S_ISLNK(mode)):
            os.unlink(key_dir)


def _commit(w: StageWriter, root: str, p: Placement, staged: _Staged) -> tuple[Placement, int, int]:
    """Make one staged entry visible; return its final placement, files and bytes written."""
    key_dir = os.path.join(root, p.entry.key)
    now = place(root, p.entry, p.blobs, overwrite=p.action == REPLACE)
    files = staged.staged()
    usable = now.action in (WRITE, REPLACE, RELINK) and set(now.files) <= {i for i, _ in files} and \
        (not now.writes_manifest or now.manifest_names == p.manifest_names)  # as the staged manifest lists
    if not usable:
        if now.action in (WRITE, REPLACE, RELINK):  # changed meanwhile: leave it to a re-run
            now = Placement(now.entry, now.blobs, CONFLICT)
        for _, temp in files:
            w.discard(temp)
        w.discard(staged.temp(MANIFEST))
        return now, 0, 0
    if p.entry.kind == GROUP and now.files and now.manifest_seen and now.action == REPLACE:
        # Hide the group from Triton while files it lists change; it comes back, complete, with the new manifest.
        # A group that only gains absent files (thinned, binary-only) stays visible: Triton hits it meanwhile.
        w.hide(key_dir, manifest_name(p.entry.name))
    written = size = 0
    names, sizes = p.entry.file_names, p.entry.file_sizes
    for i, temp in files:
        if i in now.files:
            w.move(staged.path(i, names[i]), os.path.join(key_dir, names[i]))
            written += 1
            size += sizes[i]
        else:
            w.discard(temp)  # in a staging directory (None), it goes with the directory
    manifest = manifest_name(p.entry.name)
    if now.writes_manifest and staged.files[MANIFEST] is not False:
        w.move(staged.path(MANIFEST, manifest), os.path.join(key_dir, manifest))
        if now.action == REPLACE:  # the old group's other files: the group is now the archive's alone
            for name in now.others:
                _remove_file(os.path.join(key_dir, name))
    else:
        w.discard(staged.temp(MANIFEST))
    return now, written, size


def _stage_in_threads(w: StageWriter, reader, manifest_jobs: Sequence[_Manifest], targets: Targets,
                      record: _Record) -> None:
    """Creating files is the cost of an unpack: writer threads overlap it with decoding and hashing. Files go to
    them in batches; one task a file costs more in thread hand-offs than the write itself."""
    from concurrent.futures import ThreadPoolExecutor  # 9 ms of imports (logging too) that forked staging skips

    with ThreadPoolExecutor(max_workers=WRITERS) as pool:
        pending: deque[tuple[Future, list[tuple[int, int, int]]]] = deque()
        batch: list[tuple[str, str | None, bytes | memoryview]] = []
        owners: list[tuple[int, int, int]] = []
        batched = 0

        def settle(limit: int) -> None:
            while len(pending) > limit or (pending and pending[0][0].done()):
                future, done = pending.popleft()
                for (n, i, size), temp in zip(done, future.result(), strict=True):
                    record(n, i, size, temp)

        def submit() -> None:
            nonlocal batch, owners, batched
            if batch:
                pending.append((pool.submit(w.stage_batch, batch), owners))
                batch, owners, batched = [], [], 0
                settle(MAX_PENDING_BATCHES)

        # Manifests first: they need no block, so the writers make them while the first block decodes.
        for directory, name, n, entry, listed in manifest_jobs:
            batch.append((directory, name, manifest_bytes(w.root, entry, listed)))
            owners.append((n, MANIFEST, 0))
            if len(batch) >= BATCH_FILES:
                submit()
        submit()
        for (blob, content), (planned, made) in zip(reader.iter_blobs(targets.distinct_blobs()), targets.runs(),
                                                    strict=True):
            assert blob == planned  # both in block order, then blob order
            length = len(content)
            for directory, name, n, i in made:
                batch.append((directory, name, content))
                owners.append((n, i, length))
                batched += length
            if batched >= BATCH_BYTES or len(batch) >= BATCH_FILES:
                submit()
        submit()
        settle(0)


ACTIVE = (WRITE, REPLACE, RELINK)  # the actions that write


def _short_of_space(error: BaseException) -> bool:
    """Whether an unpack failed for want of space or inodes: its precheck, or a write."""
    return isinstance(error, SpaceError) or \
        (isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT))


def _lock_root(root: str, exclusive: bool) -> int | None:
    """A ``flock`` on the root directory itself (no file of its own: nothing for Triton, pack or verify to meet),
    shared, or exclusive (see the module's docstring); its descriptor, None where the filesystem has none. Taken
    once this run's lock file is in the root: no other run can then remove the directory (only empty ones are)."""
    if fcntl is None:
        return None
    try:
        fd = os.open(root, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
    except OSError:  # no flock here: unpacks run side by side, as before
        os.close(fd)
        return None
    return fd


def write_staged(
    reader,
    root: str,
    placements: Sequence[Placement],
    on_file: Callable[[int], None] | None = None,
    workers: StagingWorkers | None = None,
    overwrite: bool = False,
) -> Written:
    """Stage everything the placements need, then commit entry by entry. ``OSError`` propagates (the caller maps
    it to ``CacheError``); whatever fails, no temp file of this run is left behind. ``workers``: forked worker
    processes (a ``workers.Launcher``'s) to stage with, instead of this process's threads. Short of space, it
    compares the archive with the root again, alone, and stages what is still missing (the module's docstring):
    ``overwrite`` is asked again of the entries found changed."""
    try:
        return _write_staged(reader, root, placements, on_file, workers)
    except (OSError, SpaceError) as e:
        if not _short_of_space(e):
            raise
    # The workers are gone (a failed stage ends them): this process's threads stage what is left
    return _write_staged(reader, root, placements, on_file, None, overwrite)


def _write_staged(reader, root: str, placements: Sequence[Placement], on_file: Callable[[int], None] | None,
                  workers: StagingWorkers | None, again: bool | None = None) -> Written:
    """``write_staged``, once: under a shared lock on the root, or, ``again`` (the ``overwrite`` asked) not None,
    under an exclusive one, the placements that write decided again first."""
    fresh = again is None and holds_nothing(root)  # then nothing to clean up, and no key directory there yet
    if not fresh:
        clean_stale(root, sorted({p.entry.key for p in placements}))
    if not any(p.action in ACTIVE for p in placements):
        return Written(0, 0, tuple(placements))
    w = StageWriter(root)
    held = None
    try:
        w.ensure_dir(root)  # recorded if this run makes it: removed again if the run fails
        w.lock.acquire()
        held = _lock_root(root, exclusive=again is not None)
        if again is not None:
            placements = [place(root, p.entry, p.blobs, again) if p.action in ACTIVE else p for p in placements]
        # Entry numbers in arrays (an int and a list slot an entry took 36 bytes)
        active = array("I", (n for n, p in enumerate(placements) if p.action in ACTIVE))
        if not active:
            w.abandon()
            return Written(0, 0, tuple(placements))
        manifests = array("I", (n for n in active if placements[n].writes_manifest))
        check_space(root, [placements[n] for n in active],
                    [manifest_size(root, placements[n].entry, placements[n].manifest_names) for n in manifests])

        # The entries of a key side by side (an index in a writer's order has them so): its directory is staged and
        # committed as one. A dict of a list a key took 0.13 KB an entry.
        def key_of(n: int) -> str:
            return placements[n].entry.key

        active = array("I", sorted(active, key=key_of))
        of_key: Iterable[int]
        numbers = array("i", [NOT_STAGED]) * len(placements)  # by placement: where it writes (``Destinations``)
        for key, of_key in groupby(active, key_of):
            key_dir = os.path.join(root, key)
            if not fresh and _is_directory(key_dir):
                w.ensure_dir(key_dir)
                at = KEY_DIRECTORY
            else:  # absent, or in the way (a link is never written through; a file, only replaced if asked)
                at = w.stage_dir()
            for n in of_key:
                numbers[n] = at
        where = Destinations(root, placements, numbers, w.stage_prefixes())
        staged = Staged(placements, where)

        # active entries are staged: ``where`` is never None for them
        targets = Targets(placements, active, reader.index.blobs.blocks, where.__getitem__)  # type: ignore[arg-type]

        manifest_jobs = ManifestJobs(manifests, placements, where)

        def record(n: int, i: int, size: int, temp: str | None) -> None:
            staged.record(n, i, temp)
            if on_file and i != MANIFEST:
                on_file(size)

        if workers is not None:
            workers.stage(w, targets, manifest_jobs, record)
        else:
            _stage_in_threads(w, reader, manifest_jobs, targets, record)
        final = list(placements)
        files = size = 0
        for key, of_key in groupby(active, key_of):
            of_key = list(of_key)
            key_dir = os.path.join(root, key)
            at = numbers[of_key[0]]
            if at >= 0 and any(placements[n].action == REPLACE for n in of_key):
                _unblock(key_dir)
            if at >= 0 and w.rename_in(w.stage_path(at), key_dir):
                for n in of_key:
                    p = placements[n]
                    files += len(p.files)
                    size += p.size
                continue
            for n in of_key:  # an existing key directory, or one that appeared meanwhile: entry by entry
                final[n], f, s = _commit(w, root, placements[n], staged.of(n))
                files += f
                size += s
            if at >= 0:
                remove_stage_dir(w.stage_path(at))
        return Written(files, size, tuple(final))
    except BaseException:
        w.abandon()
        raise
    finally:
        w.release()
        if held is not None:
            os.close(held)  # releases the root's lock


__all__ = ["write_staged", "check_space"]
