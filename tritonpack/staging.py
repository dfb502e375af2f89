"""Writing an unpack in two phases, so that a bad archive, a full disk or a kill never costs the user anything.

1. **Stage.** Every file to write, and every manifest, is written to a temp file in its key directory (names and
   clean-up in ``tempfiles``), decoding each needed block once and verifying every blob. Nothing visible changes:
   a corrupt block, ``ENOSPC``/``EDQUOT`` or any other failure here removes the temp files and leaves the root as
   it was (key directories this run created are removed again if they are empty).
2. **Commit**, entry by entry. Each entry is compared with the root again (``place``), because another unpack or a
   Triton compile may have completed it since the plan: what is now present is left alone, a differing entry that
   appeared meanwhile is kept (reported as a conflict), and only a manifest that this comparison saw is unlinked
   (replace, repair) before the entry's files are renamed in; the manifest is renamed in last. A manifest that was
   absent is never hidden, so a concurrent writer's complete group stays visible throughout.

Commit needs no free space (renames only), so a full disk is met in phase 1. Before phase 1, the free space and
inodes of the target filesystem are checked against what the plan will write.
"""
from __future__ import annotations

import contextlib
import os
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from .cachedest import CONFLICT, RELINK, REPLACE, WRITE, Placement, Written, manifest_bytes, place, write_fd
from .errors import CacheError
from .model import GROUP, manifest_name
from .report import human_bytes
from .tempfiles import RunLock, clean_stale

WRITERS = 4
MAX_PENDING_WRITES = 256


@dataclass
class _Staged:
    files: dict[int, str] = field(default_factory=dict)  # file index -> temp path
    manifest: str | None = None


def _existing_ancestor(path: str) -> str:
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def check_space(root: str, placements: Sequence[Placement]) -> None:
    """Refuse, before writing anything, what the target filesystem cannot hold (bytes, then inodes)."""
    try:
        st = os.statvfs(_existing_ancestor(root))
    except (OSError, AttributeError):  # no statvfs: the writes themselves will tell
        return
    unit = st.f_frsize or st.f_bsize or 4096
    need = files = 0
    for p in placements:
        sizes = [p.entry.files[i].size for i in p.files]
        if p.writes_manifest:
            sizes.append(len(manifest_bytes(root, p.entry)))
        need += sum(-(-size // unit) * unit for size in sizes)
        files += len(sizes)
    keys = {p.entry.key for p in placements}
    available = st.f_bavail * unit
    if need > available:
        raise CacheError(f"not enough free space: unpacking needs {human_bytes(need)}, "
                         f"{human_bytes(available)} available", root)
    if st.f_files and files + len(keys) + 2 > st.f_favail:
        raise CacheError(f"not enough free inodes: unpacking creates {files + len(keys)} files and directories, "
                         f"{st.f_favail} available", root)


def _write_all(fd: int, data: bytes | memoryview) -> None:
    """Named here so that fault-injection tests can make exactly this step fail."""
    write_fd(fd, data)


class _Writer:
    def __init__(self, root: str):
        self.root = root
        self.lock = RunLock(root)
        self.temps: set[str] = set()
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

    def stage(self, directory: str, data: bytes | memoryview) -> str:
        try:
            try:
                fd, path = self.lock.create(directory)
            except FileNotFoundError:  # a failing concurrent unpack removed the empty directory: make it again
                os.makedirs(directory, exist_ok=True)
                fd, path = self.lock.create(directory)
            self.temps.add(path)
            _write_all(fd, data)
        except OSError as e:  # name the directory: the temp file is gone by the time the error is shown
            raise OSError(e.errno, e.strerror, directory) from e
        return path

    def move(self, temp: str, final: str) -> None:
        os.replace(temp, final)
        self.temps.discard(temp)

    def discard(self, temp: str | None) -> None:
        if temp is not None and temp in self.temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp)
            self.temps.discard(temp)

    def abandon(self) -> None:
        """After a failure: remove every temp file left, then the directories this run made, if still empty."""
        for temp in list(self.temps):
            self.discard(temp)
        self.lock.release()
        for directory in reversed(self.created_dirs):
            with contextlib.suppress(OSError):
                os.rmdir(directory)


def _commit(w: _Writer, root: str, p: Placement, staged: _Staged) -> tuple[Placement, int, int]:
    """Make one staged entry visible; return its final placement, files and bytes written."""
    key_dir = os.path.join(root, p.entry.key)
    now = place(root, p.entry, p.blobs, overwrite=p.action == REPLACE)
    usable = now.action in (WRITE, REPLACE, RELINK) and set(now.files) <= set(staged.files)
    if not usable:
        if now.action in (WRITE, REPLACE):  # a file that was in place changed meanwhile: leave it to a re-run
            now = Placement(now.entry, now.blobs, CONFLICT)
        for temp in staged.files.values():
            w.discard(temp)
        w.discard(staged.manifest)
        return now, 0, 0
    if p.entry.kind == GROUP and now.files and now.manifest_seen:
        # Hide the group from Triton while its files change; it comes back, complete, with the new manifest.
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(key_dir, manifest_name(p.entry.name)))
    files = size = 0
    for i, temp in staged.files.items():
        if i in now.files:
            w.move(temp, os.path.join(key_dir, p.entry.files[i].name))
            files += 1
            size += p.entry.files[i].size
        else:
            w.discard(temp)
    if now.writes_manifest and staged.manifest is not None:
        w.move(staged.manifest, os.path.join(key_dir, manifest_name(p.entry.name)))
    else:
        w.discard(staged.manifest)
    return now, files, size


def write_staged(
    reader,
    root: str,
    placements: Sequence[Placement],
    on_file: Callable[[int], None] | None = None,
) -> Written:
    """Stage everything the placements need, then commit entry by entry. ``OSError`` propagates (the caller maps
    it to ``CacheError``); whatever fails, no temp file of this run is left behind."""
    clean_stale(root, sorted({p.entry.key for p in placements}))
    active = [n for n, p in enumerate(placements) if p.action in (WRITE, REPLACE, RELINK)]
    if not active:
        return Written(0, 0, tuple(placements))
    check_space(root, [placements[n] for n in active])
    w = _Writer(root)
    try:
        staged: dict[int, _Staged] = {n: _Staged() for n in active}
        targets: dict[int, list[tuple[int, int]]] = {}
        for n in active:
            p = placements[n]
            w.ensure_dir(os.path.join(root, p.entry.key))
            for i in p.files:
                targets.setdefault(p.blobs[i], []).append((n, i))
        w.lock.acquire()
        # Creating files is the cost of an unpack: a few writer threads overlap it with decoding and hashing.
        with ThreadPoolExecutor(max_workers=WRITERS) as pool:
            pending: deque[tuple[Future, int, int, int]] = deque()

            def settle(limit: int) -> None:
                while len(pending) > limit or (pending and pending[0][0].done()):
                    future, n, i, size = pending.popleft()
                    staged[n].files[i] = future.result()
                    if on_file:
                        on_file(size)

            for blob, content in reader.iter_blobs(targets):
                for n, i in targets[blob]:
                    directory = os.path.join(root, placements[n].entry.key)
                    pending.append((pool.submit(w.stage, directory, content), n, i, len(content)))
                settle(MAX_PENDING_WRITES)
            settle(0)
            manifests = {n: pool.submit(w.stage, os.path.join(root, placements[n].entry.key),
                                        manifest_bytes(root, placements[n].entry))
                         for n in active if placements[n].writes_manifest}
            for n, future in manifests.items():
                staged[n].manifest = future.result()
        final = list(placements)
        files = size = 0
        for n in active:
            final[n], f, s = _commit(w, root, placements[n], staged[n])
            files += f
            size += s
        return Written(files, size, tuple(final))
    except BaseException:
        w.abandon()
        raise
    finally:
        w.lock.release()


__all__ = ["write_staged", "check_space"]
