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

from .archive.index import valid_file_name
from .archive.reader import ArchiveReader
from .errors import CacheError
from .model import GROUP, MANIFEST_PREFIX, Entry, hidden, manifest_name, names_of

WRITE = "write"  # absent (or invisible leftovers): written
PRESENT = "present"  # identical already: nothing to do
RELINK = "relink"  # identical files, manifest points elsewhere: manifest rewritten
CONFLICT = "conflict"  # different content present: kept
REPLACE = "replace"  # different content present and overwrite asked: replaced
LINKED = "linked"  # the key directory is a symbolic link: kept, never written through (overwrite or not)
KEY_NOT_DIRECTORY = "key-not-directory"  # a file (anything but a directory) where the key directory goes: kept
# (overwrite asked: REPLACE, and staging removes it)
FILE_IS_DIRECTORY = "file-is-directory"  # a directory where one of its files goes: kept (no rename replaces it)
# the key directory needs writing, and this process may not write it though it may write the root (another user's,
# in a shared root): kept, so that the rest is written
NOT_WRITABLE = "not-writable"


class Placement(NamedTuple):
    """What unpacking will do with one entry, and which of its files must be written."""

    entry: Entry  # as selected: a binary-only unpack holds fewer files than the archive's entry
    blobs: Sequence[int] | None  # the archive's blob for each of entry.files; None: they know theirs (``blobs_of``)
    action: str
    files: tuple[int, ...] = ()  # indices into entry.files to write
    manifest_seen: bool = False  # a group's manifest existed when this was planned (only then may it be hidden)
    # Files beyond the entry's that the group's manifest lists (``place``): still listed by the manifest written, or,
    # where the group is replaced, removed after it (the group then holds the archive's files alone)
    others: tuple[str, ...] = ()

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

    @property
    def manifest_names(self) -> Sequence[str]:
        """The names the manifest it writes lists: the entry's files, then ``others`` unless it replaces the group."""
        names = self.entry.file_names
        return (*names, *self.others) if self.others and self.action != REPLACE else names


def blobs_of(p: Placement) -> Sequence[int]:
    """The archive's blob for each of the placement's ``entry.files``."""
    return p.blobs if p.blobs is not None else p.entry.files.blobs  # type: ignore[attr-defined]  # an archive's: StoredFiles


def manifest_bytes(root: str, entry: Entry, names: Sequence[str] | None = None) -> bytes:
    """Exactly what Triton's ``put_group`` writes: ``json.dumps`` of the child paths, in manifest order (``names``:
    the files it lists, the entry's by default)."""
    return manifest_json(os.path.join(root, entry.key, ""), names_of(entry.files) if names is None else names)


def manifest_json(prefix: str, names: Sequence[str]) -> bytes:
    """A manifest's bytes from its files' names and the path before them (``os.path.join(key_dir, "")``)."""
    return json.dumps({"child_paths": {name: prefix + name for name in names}}).encode("utf-8")


_JSON_PLAIN = re.compile(r'[ !#-\[\]-~]*')  # printable ASCII but " and \: json.dumps writes these as they are


def manifest_size(root: str, entry: Entry, listed: Sequence[str] | None = None) -> int:
    """``len(manifest_bytes(root, entry, listed))``, counted without building it where every path is plain ASCII
    (the usual case): the free-space check needs the sizes before the workers build the bytes."""
    listed = entry.file_names if listed is None else listed
    prefix = os.path.join(root, entry.key, "")
    names = "".join(listed)  # one match for all: the pattern holds for each part iff for all
    if not _JSON_PLAIN.fullmatch(prefix + names):
        return len(manifest_bytes(root, entry, listed))
    # {"child_paths": {"<name>": "<prefix><name>", ...}}
    count = len(listed)
    return 19 + 2 * len(names) + count * (len(prefix) + 6) + 2 * max(count - 1, 0)


DIRECTORY = "directory"  # in ``_same_file``'s answers, beside True, False and None: a directory where a file goes


def _directory_itself(path: str, mode: int) -> bool:
    """Whether ``path``, whose followed mode is ``mode``, is a directory and not a link to one: no rename replaces
    a directory, and a link to one is replaced like any link."""
    return stat.S_ISDIR(mode) and stat.S_ISDIR(os.lstat(path).st_mode)


def _same_file(path: str, size: int, sha256: bytes) -> bool | str | None:
    """True if identical, False if different, None if absent, ``DIRECTORY`` if a directory (not a link to one)
    stands there, which no rename replaces. Only a regular file is read: a FIFO would block the unpack."""
    try:
        st = os.stat(path)
        if not stat.S_ISREG(st.st_mode):
            return DIRECTORY if _directory_itself(path, st.st_mode) else False
        if st.st_size != size:
            return False
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                digest.update(chunk)
        return digest.digest() == sha256
    except FileNotFoundError:
        return None
    except NotADirectoryError:
        return False


def read_manifest(path: str):
    """The parsed manifest; None if absent, ``DIRECTORY`` if a directory stands there, ``{}`` if it is anything
    else but JSON in a regular file (opened without blocking: a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        return None
    except OSError:
        return {}
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # a link to a directory is replaced like any link
            return DIRECTORY if _directory_itself(path, mode) else {}
        with open(fd, "rb", closefd=False) as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return {}
    finally:
        os.close(fd)


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


def _others(key_dir: str, manifest, names: Sequence[str]) -> tuple[tuple[str, ...], bool]:
    """The files beyond ``names`` that an existing manifest lists and that are regular files of the key directory,
    in its order: the manifest an unpack writes keeps listing them, so that it never makes a group smaller (a
    binary-only unpack over a whole group, an archive packed binary-only), unless the group is replaced. And whether
    it lists others, which are not there (or have names no group could hold): a broken group, whose manifest then
    stops listing them."""
    children = manifest.get("child_paths") if isinstance(manifest, dict) else None
    if not isinstance(children, dict):
        return (), False
    taken = set(names)
    kept = []
    gone = False
    for name in children:
        if name in taken:
            continue
        try:
            if valid_file_name(name) and not name.startswith(MANIFEST_PREFIX) and \
                    stat.S_ISREG(os.lstat(os.path.join(key_dir, name)).st_mode):
                kept.append(name)
                continue
        except FileNotFoundError:
            pass
        gone = True
    return tuple(kept), gone


def names_these_files(key_dir: str, manifest, names: Sequence[str]) -> bool:
    """Whether a parsed manifest lists exactly ``names``, each by an absolute path to the file of that name in
    ``key_dir`` itself, reached another way: the root (or a directory above it) behind a symbolic link or a bind
    mount, where Triton reads these very files (spec §8.1). The same directory, by device and inode: no directory
    has a hard link, so a hard-linked copy of a root is another one, whose removal would break the group."""
    children = manifest.get("child_paths") if isinstance(manifest, dict) and len(manifest) == 1 else None
    if not isinstance(children, dict) or children.keys() != set(names):
        return False
    same: dict[str, bool] = {}  # a manifest's paths share one directory
    try:
        own = os.stat(key_dir)
        for name, path in children.items():
            if not isinstance(path, str) or not os.path.isabs(path) or os.path.basename(path) != name:
                return False
            directory = os.path.dirname(path)
            if directory not in same:
                st = os.stat(directory)
                same[directory] = (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)
            if not same[directory]:
                return False
    except (OSError, ValueError):  # gone, unreadable, or a NUL in a path
        return False
    return True


def place(root: str, entry: Entry, blobs: Sequence[int] | None, overwrite: bool, fresh: bool = False) -> Placement:
    """Compare one entry with what the root holds and decide what to do. ``fresh``: the root held nothing when
    the plan began (``holds_nothing``); the commit compares again (``staging``), so an entry written meanwhile by
    another writer is still found. What a rename cannot replace keeps the entry as it is, named for why: a linked
    key directory, a file in its place (replaced only with ``overwrite``), a directory where a file goes (spec
    §8.1); so does a key directory to write that this process may not write, in a root it may (another user's)."""
    placement = _placement(root, entry, blobs, overwrite, fresh)
    if placement.action in (WRITE, REPLACE, RELINK) and not fresh:
        key_dir = os.path.join(root, entry.key)
        if os.path.isdir(key_dir) and not os.access(key_dir, os.W_OK | os.X_OK) and \
                os.access(root, os.W_OK | os.X_OK):  # a root it may not write fails the unpack, as before
            return Placement(entry, blobs, NOT_WRITABLE)
    return placement


def _placement(root: str, entry: Entry, blobs: Sequence[int] | None, overwrite: bool, fresh: bool) -> Placement:
    if fresh:
        return Placement(entry, blobs, WRITE, every_file(len(entry.files)))
    key_dir = os.path.join(root, entry.key)
    try:
        mode = os.lstat(key_dir).st_mode
    except FileNotFoundError:  # the common case of a fresh root: one stat instead of one per file
        return Placement(entry, blobs, WRITE, every_file(len(entry.files)))
    if stat.S_ISLNK(mode):  # never write through a link out of the root, even with overwrite
        return Placement(entry, blobs, LINKED)
    if not stat.S_ISDIR(mode):  # a file where the key directory goes: staging removes it only if asked to
        if overwrite:
            return Placement(entry, blobs, REPLACE, every_file(len(entry.files)))
        return Placement(entry, blobs, KEY_NOT_DIRECTORY)
    states = [_same_file(os.path.join(key_dir, f.name), f.size, f.sha256) for f in entry.files]
    if DIRECTORY in states:
        return Placement(entry, blobs, FILE_IS_DIRECTORY)
    differs = any(s is False for s in states)
    todo = tuple(i for i, s in enumerate(states) if s is not True)
    if entry.kind != GROUP:
        if not todo:
            return Placement(entry, blobs, PRESENT)
        if differs:
            return Placement(entry, blobs, REPLACE if overwrite else CONFLICT, todo if overwrite else ())
        return Placement(entry, blobs, WRITE, todo)
    manifest = read_manifest(os.path.join(key_dir, manifest_name(entry.name)))
    if manifest == DIRECTORY:
        return Placement(entry, blobs, FILE_IS_DIRECTORY)
    if manifest is None or hidden(manifest):  # files no manifest names are invisible to Triton: safe to complete
        return Placement(entry, blobs, WRITE, todo)
    if differs and not overwrite:
        return Placement(entry, blobs, CONFLICT, (), True)
    others, gone = _others(key_dir, manifest, entry.file_names)
    if differs:
        return Placement(entry, blobs, REPLACE, todo, True, others)
    if todo or gone:  # a manifest whose files are missing is a broken group: repair it
        return Placement(entry, blobs, WRITE, todo, True, others)
    listed = (*entry.file_names, *others)
    if manifest == json.loads(manifest_bytes(root, entry, listed)) or names_these_files(key_dir, manifest, listed):
        return Placement(entry, blobs, PRESENT, (), True)
    return Placement(entry, blobs, RELINK, (), True, others)


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


def root_only(files_written: int) -> str:
    """The umask and modes that keep what root just wrote from every other user ("" where it wrote nothing, or is
    not root, or others may read): an image is built as root and its service often runs as another user, whose
    Triton then can read none of the kernels (and, where it misses, cannot write there either)."""
    from .archivedest import current_umask

    if not files_written or os.geteuid() != 0:
        return ""
    mask = current_umask()
    if not mask & 0o005:  # others may read the files and enter the directories
        return ""
    return f"umask {mask:03o}: files {0o666 & ~mask:04o}, directories {0o777 & ~mask:04o}"


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
    overwrite: bool = False,
) -> Written:
    """Write the planned files, then the manifests, staged so that a failure changes nothing visible (see
    ``staging``), with forked ``workers`` if given (``workers.Launcher``); ``overwrite``: as the plan was made
    (the root is compared again if space runs short). Raises ``CacheError`` on any filesystem failure,
    ``ArchiveError`` on a bad block."""
    from .staging import write_staged

    root = os.path.abspath(root)
    try:
        return write_staged(reader, root, placements, on_file, workers, overwrite)
    except OSError as e:
        raise CacheError(f"cannot write: {e.strerror}", _where(e.filename, root)) from e


def _where(path: str | None, root: str) -> str:
    """What an error names: the directory where one of this run's temp files or its lock could not be made,
    not that internal name."""
    from .tempfiles import is_ours

    if not path:
        return root
    return os.path.dirname(path) if is_ours(os.path.basename(path)) else path
