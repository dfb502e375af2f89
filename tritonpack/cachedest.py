"""Materialising archive entries under a cache root so that Triton finds them.

Every file is written to a temp file in its key directory and moved in with ``os.replace``; a group's
``__grp__`` manifest, which Triton treats as the commit marker, is written only after all of its files are in
place, with absolute paths under the target root. An existing group whose content differs is never replaced
unless asked to be.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import stat
from collections.abc import Callable, Sequence
from typing import NamedTuple

from .archive.reader import ArchiveReader
from .errors import CacheError
from .model import GROUP, Entry, manifest_name, names_of

WRITE = "write"  # absent (or invisible leftovers): written
PRESENT = "present"  # identical already: nothing to do
RELINK = "relink"  # identical files, manifest points elsewhere: manifest rewritten
CONFLICT = "conflict"  # different content present: kept
REPLACE = "replace"  # different content present and overwrite asked: replaced


class Placement(NamedTuple):
    """What unpacking will do with one entry, and which of its files must be written."""

    entry: Entry  # as selected: a binary-only unpack holds fewer files than the archive's entry
    blobs: Sequence[int] | None  # the archive's blob for each of entry.files; None: they know theirs (``blobs_of``)
    action: str
    files: tuple[int, ...] = ()  # indices into entry.files to write
    manifest_seen: bool = False  # a group's manifest existed when this was planned (only then may it be hidden)

    @property
    def size(self) -> int:
        """Bytes of the files it writes."""
        if len(self.files) == len(self.entry.files):
            return self.entry.size
        sizes = self.entry.file_sizes
        return sum(sizes[i] for i in self.files)

    @property
    def writes_manifest(self) -> bool:
        return self.entry.kind == GROUP and self.action in (WRITE, REPLACE, RELINK)


def blobs_of(p: Placement) -> Sequence[int]:
    """The archive's blob for each of the placement's ``entry.files``."""
    return p.blobs if p.blobs is not None else p.entry.files.blobs


def manifest_bytes(root: str, entry: Entry) -> bytes:
    """Exactly what Triton's ``put_group`` writes: ``json.dumps`` of the child paths, in manifest order."""
    return manifest_json(os.path.join(root, entry.key, ""), names_of(entry.files))


def manifest_json(prefix: str, names: Sequence[str]) -> bytes:
    """A manifest's bytes from its files' names and the path before them (``os.path.join(key_dir, "")``)."""
    return json.dumps({"child_paths": {name: prefix + name for name in names}}).encode("utf-8")


_JSON_PLAIN = re.compile(r'[ !#-\[\]-~]*')  # printable ASCII but " and \: json.dumps writes these as they are


def manifest_size(root: str, entry: Entry) -> int:
    """``len(manifest_bytes(root, entry))``, counted without building it where every path is plain ASCII (the
    usual case): the free-space check needs the sizes before the workers build the bytes."""
    prefix = os.path.join(root, entry.key, "")
    names = "".join(entry.file_names)  # one match for all: the pattern holds for each part iff for all
    if not _JSON_PLAIN.fullmatch(prefix + names):
        return len(manifest_bytes(root, entry))
    # {"child_paths": {"<name>": "<prefix><name>", ...}}
    count = len(entry.files)
    return 19 + 2 * len(names) + count * (len(prefix) + 6) + 2 * max(count - 1, 0)


def _same_file(path: str, size: int, sha256: bytes) -> bool | None:
    """True if identical, False if different, None if absent."""
    try:
        if os.path.getsize(path) != size:
            return False
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        return digest.digest() == sha256
    except FileNotFoundError:
        return None
    except (IsADirectoryError, NotADirectoryError):
        return False


def _read_manifest(path: str):
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}


def holds_nothing(root: str) -> bool:
    """Whether the root is absent or empty, as at a pod's start: then no key directory needs a look. Each look at
    one that is not there is a failing system call and a Python exception: 10 us on 2 cores, a few a key."""
    try:
        with os.scandir(root) as names:
            return next(names, None) is None
    except FileNotFoundError:
        return True
    except OSError:  # the looks key by key then meet it and say what it is
        return False


@functools.cache
def every_file(count: int) -> tuple[int, ...]:
    """The file numbers of an entry taken whole: one tuple for all the entries of that many files, not one each."""
    return tuple(range(count))


def place(root: str, entry: Entry, blobs: Sequence[int] | None, overwrite: bool, fresh: bool = False) -> Placement:
    """Compare one entry with what the root holds and decide what to do. ``fresh``: the root held nothing when
    the plan began (``holds_nothing``); the commit compares again (``staging``), so an entry written meanwhile by
    another writer is still found. Raises ``CacheError`` where the entry's files are to be written but a rename
    cannot put them in place (a directory where a file goes, a key path that is not a directory): before anything
    of the entry changes."""
    if fresh:
        return Placement(entry, blobs, WRITE, every_file(len(entry.files)))
    key_dir = os.path.join(root, entry.key)
    try:
        mode = os.lstat(key_dir).st_mode
    except FileNotFoundError:  # the common case of a fresh root: one look instead of one a file
        return Placement(entry, blobs, WRITE, every_file(len(entry.files)))
    if stat.S_ISLNK(mode):  # never write through a link out of the root, even with overwrite
        return Placement(entry, blobs, CONFLICT)
    if not stat.S_ISDIR(mode):  # every file differs, and a manifest cannot be read (spec §8.1)
        if overwrite:
            raise CacheError(f"not a directory, where the archive's {entry.name} goes", key_dir)
        return Placement(entry, blobs, CONFLICT)
    states = [_same_file(os.path.join(key_dir, f.name), f.size, f.sha256) for f in entry.files]
    placement = _decided(root, entry, blobs, states, overwrite)
    for i in placement.files:
        if states[i] is False and _is_directory(path := os.path.join(key_dir, entry.files[i].name)):
            raise CacheError("a directory, where the archive has a file (a rename cannot replace it)", path)
    return placement


def _is_directory(path: str) -> bool:
    """Whether ``path`` is a directory itself (a link to one is replaced by a rename like any file)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _decided(root: str, entry: Entry, blobs: Sequence[int] | None, states: list[bool | None],
             overwrite: bool) -> Placement:
    """The placement of an entry whose key directory exists, from the state of each of its files (``_same_file``)
    and its manifest (spec §8.1's tables)."""
    differs = any(s is False for s in states)
    todo = tuple(i for i, s in enumerate(states) if s is not True)
    if entry.kind != GROUP:
        if not todo:
            return Placement(entry, blobs, PRESENT)
        if differs:
            return Placement(entry, blobs, REPLACE if overwrite else CONFLICT, todo if overwrite else ())
        return Placement(entry, blobs, WRITE, todo)
    manifest = _read_manifest(os.path.join(root, entry.key, manifest_name(entry.name)))
    if manifest is None:  # files without a manifest are invisible to Triton: leftovers, safe to complete
        return Placement(entry, blobs, WRITE, todo)
    if differs:
        return Placement(entry, blobs, REPLACE if overwrite else CONFLICT, todo if overwrite else (), True)
    if todo:  # a manifest whose files are missing is a broken group: repair it
        return Placement(entry, blobs, WRITE, todo, True)
    expected = json.loads(manifest_bytes(root, entry))
    if manifest == expected:
        return Placement(entry, blobs, PRESENT, (), True)
    return Placement(entry, blobs, RELINK, (), True)


def write_fd(fd: int, data: bytes | memoryview) -> None:
    """Write all of ``data`` to ``fd`` and close it. One write in the usual case: unpack's writer threads call
    this for every file and take turns on the interpreter lock, so each step here is paid many times over."""
    try:
        written = os.write(fd, data)
        if written < len(data):  # a short write (a signal, a full disk): finish it, or get the error
            view = memoryview(data)[written:]
            while view:
                view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def atomic_write(directory: str, name: str, data: bytes | memoryview) -> None:
    """Write through a temp file and ``os.replace``: readers see the old file or the whole new one."""
    tmp = os.path.join(directory, f"tmp.tpack.{os.getpid()}.{os.urandom(6).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        write_fd(fd, data)
        os.replace(tmp, os.path.join(directory, name))
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


class Written(NamedTuple):
    files: int
    bytes: int
    placements: tuple[Placement, ...] = ()  # what was done in the end (see staging: entries are re-checked)


def materialize(
    reader: ArchiveReader,
    root: str,
    placements: Sequence[Placement],
    on_file: Callable[[int], None] | None = None,
    workers=None,
) -> Written:
    """Write the planned files, then the manifests, staged so that a failure changes nothing visible (see
    ``staging``), with forked ``workers`` if given (``workers.Launcher``). Raises ``CacheError`` on any filesystem
    failure, ``ArchiveError`` on a bad block."""
    from .staging import write_staged

    root = os.path.abspath(root)
    try:
        return write_staged(reader, root, placements, on_file, workers)
    except OSError as e:
        raise CacheError(f"cannot write: {e.strerror}", _where(e.filename, root)) from e


def _where(path: str | None, root: str) -> str:
    """What an error names: the directory where one of this run's temp files or its lock could not be made,
    not that internal name."""
    from .tempfiles import is_ours

    if not path:
        return root
    return os.path.dirname(path) if is_ours(os.path.basename(path)) else path
