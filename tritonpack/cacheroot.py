"""Reading a Triton cache root (3.0-3.9 layouts) into entries, and reporting what is skipped and why.

A root holds one directory per cache key. A key directory with a ``__grp__<name>.json`` manifest is a compiled
kernel group; its files are taken from the key directory itself by name, never from the absolute paths the
manifest records (those may point into another root the cache was copied from).
"""
from __future__ import annotations

import json
import os
import re
import stat
import sys
from array import array
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from itertools import repeat
from typing import TYPE_CHECKING, Literal, NamedTuple

from .archive.index import MAX_META_DEPTH, valid_file_name
from .errors import CacheError
from .forking import cores, fork_safe, forked_map
from .model import (
    AUTOTUNE,
    FILE,
    GROUP,
    MANIFEST_PREFIX,
    AutotuneInfo,
    KernelInfo,
    LazyFiles,
    StubInfo,
    hidden,
    index_order,
    manifest_name,
    total_size,
)
from .selection import binary_only_names
from .triton_env import python_info

if TYPE_CHECKING:
    from .packedentries import PackedEntries

# hex (3.0-3.1), urlsafe base64 (3.2), base32 (3.3+); a little wider so that future encodings still read.
KEY_PATTERN = re.compile(r"[A-Za-z0-9_\-=]{16,128}")
AUTOTUNE_SUFFIX = ".autotune.json"
# Files only a compile writes; seen without a manifest they mean an interrupted compile.
KERNEL_SUFFIXES = (".json", ".source", ".ttir", ".ttgir", ".llir", ".ptx", ".cubin", ".amdgcn", ".hsaco", ".glir")
_ENV_NAME = re.compile(r"^[A-Z][A-Z0-9_]*$")
TOOL_DIR = ".tritonpack"  # tritonpack's own bookkeeping in a root (ensure's stamps and lock): not cache content


class LocalFile(NamedTuple):
    """A file of an entry found on disk; ``read`` is what the archive writer calls. Its directory is one str
    that the files of an entry share: a path a file, kept until the archive is written, was 120 bytes a file."""

    name: str
    directory: str
    size: int

    @property
    def path(self) -> str:
        return f"{self.directory}{os.sep}{self.name}"

    def read(self) -> bytes:
        try:
            with open(self.path, "rb") as f:
                return f.read()
        except OSError as e:
            raise CacheError(f"cannot read: {e.strerror}", self.path) from e

    def read_into(self, view: memoryview) -> None:
        """The writer's read: straight into its block, no copy. The size must still be the scanned one."""
        read_file_into(self.path, view)


def read_file_into(path: str, view: memoryview) -> None:
    """Fill ``view`` with the file at ``path``, which must be exactly as long (what the scan saw)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise CacheError(f"cannot read: {e.strerror}", path) from e
    try:
        got, past_end = 0, bytearray(1)  # a byte read into past_end means the file grew
        while got < len(view):
            n = os.readv(fd, [view[got:], past_end])
            if n == 0:
                break
            got += n
        if got != len(view):
            raise CacheError("changed while being packed (its size is not what the scan saw); pack again", path)
    except OSError as e:
        raise CacheError(f"cannot read: {e.strerror}", path) from e
    finally:
        os.close(fd)


class LocalFiles(LazyFiles):
    """A group's files, each a ``LocalFile`` made as it is read from its names and sizes: a ``LocalFile`` and its
    size's int a file took 0.1 KB, for as long as a pack runs. Its directory too is made as it is read, from the
    root and the key that every group shares or holds already (its path took 0.11 KB a group)."""

    __slots__ = ("key", "names", "root", "sizes")

    def __init__(self, root: str, key: str, names: tuple[str, ...], sizes: Sequence[int]) -> None:
        self.root = root
        self.key = key
        self.names = names
        self.sizes = sizes

    @property
    def directory(self) -> str:
        return os.path.join(self.root, self.key)

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self)[i]
        return LocalFile(self.names[i], self.directory, self.sizes[i])

    def __iter__(self) -> Iterator[LocalFile]:
        return map(LocalFile, self.names, repeat(self.directory), self.sizes)

    def __reduce__(self):  # the forked scan sends its entries to the parent
        return LocalFiles, (self.root, self.key, self.names, self.sizes)

    def subset(self, numbers: Sequence[int]) -> LocalFiles:
        """The files of these numbers, in this order."""
        return LocalFiles(self.root, self.key, tuple(self.names[n] for n in numbers),
                          array("Q", [self.sizes[n] for n in numbers]))


def files_subset(files: Sequence[LocalFile], numbers: Sequence[int]) -> Sequence[LocalFile]:
    """An entry's files of these numbers, in this order, held as its files were."""
    return files.subset(numbers) if isinstance(files, LocalFiles) else tuple(files[n] for n in numbers)


class LocalEntry(NamedTuple):
    """An entry found under a cache root, its files still on disk."""

    kind: str
    key: str
    name: str
    files: Sequence[LocalFile]  # a tuple, or a group's ``LocalFiles``
    kernel: KernelInfo | None = None
    autotune: AutotuneInfo | None = None
    stub: StubInfo | None = None
    foreign_manifest: bool = False  # the manifest pointed outside its own directory
    # files the manifest lists that are gone (IR files removed to slim the root): the entry holds the rest
    missing: tuple[str, ...] = ()

    @property
    def size(self) -> int:
        return total_size(self.files)


class Skipped(NamedTuple):
    """Something under a root that is not packed, with the reason, so nothing is dropped silently."""

    path: str  # relative to the root
    reason: str


class CacheScan:
    """What a scan of a root found, built up as it goes. Its entries come in the order an archive's index has them
    (``model.index_order``); ``packed``: held as packed records (``PackedEntries``), for a large root."""

    def __init__(self, root: str, packed: bool = False) -> None:
        self.root = root
        self.entries = _no_entries(root, packed)
        self.skipped: list[Skipped] = []
        # child names found valid so far: the kernels of one template share them, and each is checked once
        self.valid_names: set[str] = set()
        # and their tuples, each kept once (an entry's took 0.11 KB): the configurations of one kernel list the same
        self.name_tuples: dict[tuple[str, ...], tuple[str, ...]] = {}

    def keep(self, choose: Callable[[LocalEntry], LocalEntry | None]) -> None:
        """Keep, for each entry, what ``choose`` makes of it (None: nothing), held as the entries were."""
        entries = self.entries
        self.entries = _no_entries(self.root, packed=not isinstance(entries, list))
        for entry in entries:
            if (chosen := choose(entry)) is not None:
                self.entries.append(chosen)


def _no_entries(root: str, packed: bool) -> list[LocalEntry] | PackedEntries:
    """A scan's entries before the first: a list, or packed records (``PackedEntries``)."""
    from .packedentries import PackedEntries  # which reads the records back into this module's classes

    return PackedEntries(root) if packed else []


_NO_ENV: dict[str, str] = {}  # the env of most kernels, one dict for all (read, never changed): 64 bytes a group


def kernel_info(metadata: dict) -> KernelInfo:
    """The fields of Triton's kernel metadata json that identify and describe the kernel."""
    target = metadata.get("target") or {}
    if isinstance(target, list):  # some versions serialise GPUTarget as [backend, arch, warp_size]
        target = dict(zip(("backend", "arch", "warp_size"), target, strict=False))
    if not isinstance(target, dict):
        target = {}

    def integer(value):  # a uint of the index (spec §1): any other value is left out, as an unknown one
        return value if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63 else None

    def text(value):  # backend, version, arch, env: the same few values in every group, kept once (sys.intern)
        return sys.intern(value) if isinstance(value, str) else None

    arch = target.get("arch")

    env = {text(k): text(str(metadata[k])) for k in sorted(k for k in metadata if k.isupper() and _ENV_NAME.match(k))}
    env = env or _NO_ENV
    return KernelInfo(
        backend=text(target.get("backend")),
        arch=text(arch) if isinstance(arch, str) else arch if integer(arch) is not None else None,
        warp_size=integer(target.get("warp_size")),
        num_warps=integer(metadata.get("num_warps")),
        num_stages=integer(metadata.get("num_stages")),
        num_ctas=integer(metadata.get("num_ctas")),
        shared=integer(metadata.get("shared")),
        triton_version=text(metadata.get("triton_version")),
        hash=digest if isinstance(digest := metadata.get("hash"), str) else None,  # one a group: not interned
        env=env,
    )


def autotune_info(file_name: str, data: dict) -> AutotuneInfo:
    """Summary of Triton's autotune json; ``ValueError`` when it is not the shape Triton writes."""
    timings = data.get("configs_timings")
    key = data.get("key") or []
    if not isinstance(timings, list) or not isinstance(key, list):
        raise ValueError("not an autotune result")
    pairs = []
    for item in timings:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], dict)):
            raise ValueError("malformed configs_timings")
        config, timing = item
        timing = timing if isinstance(timing, list) else [timing]
        if not all(isinstance(t, (int, float)) and not isinstance(t, bool) and abs(t) < _FLOAT_END for t in timing):
            raise ValueError("non-numeric timing")
        pairs.append((config, timing))
    best_config, best_timing = min(pairs, key=lambda pair: pair[1]) if pairs else ({}, [])
    best_config = {k: v for k, v in best_config.items() if v is not None}
    if not (_index_holds(key) and _index_holds(best_config)):
        raise ValueError("values an archive's index cannot hold")
    return AutotuneInfo(
        function=file_name[: -len(AUTOTUNE_SUFFIX)],
        tuning_key=list(key),
        configs=len(timings),
        best_config=best_config,
        best_timing=[float(t) for t in best_timing],
    )


_FLOAT_END = 1 << 1024  # ints from here on have no float


def _index_holds(value) -> bool:
    """Whether an autotune value (JSON) goes into an index that readers accept (spec §1, §7): ints that msgpack
    holds (-2^63 to 2^64 - 1), nested at most ``MAX_META_DEPTH`` deep. Otherwise packing it raised OverflowError
    (a traceback) or wrote an index the self-check refused, failing the whole pack for one file."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_META_DEPTH or (type(item) is int and not -1 << 63 <= item < 1 << 64):
            return False
        if isinstance(item, (list, dict)):
            stack.extend((element, depth + 1) for element in (item.values() if isinstance(item, dict) else item))
    return True


def stub_info(file_name: str) -> StubInfo:
    """Tag a loose file; a launcher's ABI comes from its name (3.4+) or, for ``name.so``, from the packer."""
    if not file_name.endswith(".so"):
        return StubInfo(role="other")
    here = python_info()
    stem = file_name.partition(".")[0]
    suffix = file_name[len(stem):]
    if suffix != ".so":
        return StubInfo(role="launcher", ext_suffix=suffix, platform=here.platform, tag_from="filename")
    return StubInfo(role="launcher", ext_suffix=here.ext_suffix, platform=here.platform, tag_from="packer")


def _regular_files(key_dir: str, rel: str, skipped: list[Skipped], unreadable: set[str]) -> dict[str, int]:
    """Name -> size of the plain files of a key dir that can be read, in name order; the names of those that
    cannot go to ``unreadable`` (their entry is reported, not packed); everything else is reported."""
    files: dict[str, int] = {}
    with os.scandir(key_dir) as it:
        items = {item.name: item for item in it}
    for name in sorted(items):
        if name.startswith("tmp.") or ".tmp.pid_" in name:  # Triton 3.2+'s temp dir; 3.0-3.1's temp file
            skipped.append(Skipped(f"{rel}/{name}", "temporary file of an unfinished write"))
            continue
        mode = (st := items[name].stat(follow_symlinks=False)).st_mode
        if stat.S_ISREG(mode) and not _readable(items[name].path, mode):
            unreadable.add(name)
        elif stat.S_ISREG(mode):
            files[name] = st.st_size
        elif stat.S_ISLNK(mode):
            skipped.append(Skipped(f"{rel}/{name}", "symbolic link (never followed)"))
        elif stat.S_ISDIR(mode):
            skipped.append(Skipped(f"{rel}/{name}", "unexpected directory"))
        else:
            skipped.append(Skipped(f"{rel}/{name}", "not a regular file"))
    return files


_READ_BY_ALL = stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH
_EFFECTIVE = os.access in os.supports_effective_ids


def _readable(path: str, mode: int) -> bool:
    """Whether this process may read a file: asked of the kernel only where its mode does not let everyone read
    it (a cache's files are 0644: no call for them), so that one unreadable file skips its entry, reported,
    rather than failing the whole pack when the writer reads it."""
    return mode & _READ_BY_ALL == _READ_BY_ALL or os.access(path, os.R_OK, effective_ids=_EFFECTIVE)


KERNEL_BINARIES = (".cubin", ".hsaco")  # ELF64: CUDA's and ROCm's kernel objects


def whole_elf(path: str, size: int) -> bool:
    """Whether a kernel binary holds an ELF64 header and the tables it points to. One cut short (a copy killed
    mid-file, a power loss between a write and its rename) or empty is a hit for Triton, which then fails to load
    it, and never compiles it again. A file that cannot be read is another skip's to report."""
    if size < 64:
        return False
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return True
    if len(head) < 64 or head[:5] != b"\x7fELF\x02" or head[5] not in (1, 2):
        return False
    order: Literal["little", "big"] = "little" if head[5] == 1 else "big"

    def field(start: int, width: int) -> int:
        return int.from_bytes(head[start:start + width], order)

    programs = field(0x20, 8) + field(0x36, 2) * field(0x38, 2)  # e_phoff + e_phentsize * e_phnum
    sections = field(0x28, 8) + field(0x3A, 2) * field(0x3C, 2)  # e_shoff + e_shentsize * e_shnum
    return programs <= size and sections <= size


def _read_json(path: str, size: int):
    """The parsed file, or None. One read of the scanned ``size`` and a byte more: no buffered file object, which
    costs more than the read for a small json (a file that grew since the scan is read to its end)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            data = os.read(fd, size + 1)
            if len(data) > size:
                while more := os.read(fd, 1 << 16):
                    data += more
        finally:
            os.close(fd)
        return json.loads(data)
    except (OSError, ValueError):
        return None


def _inside(path, directory: str) -> bool:
    """Whether a manifest's child path names a file of ``directory`` (``os.path.abspath`` only when in doubt). A
    relative path (a relative ``TRITON_CACHE_DIR``) never does: Triton finds it from one working directory only."""
    if not isinstance(path, str) or not os.path.isabs(path):
        return False
    parent, _, name = path.rpartition(os.sep)
    if parent == directory and name not in ("", ".", ".."):
        return True
    return os.path.dirname(os.path.abspath(path)) == directory


def _scan_group(root: str, key: str, manifest: str, files: dict[str, int], unreadable: set[str],
                scan: CacheScan) -> LocalEntry | None:
    key_dir = os.path.join(root, key)
    skipped = scan.skipped
    rel = f"{key}/{manifest}"
    data = _read_json(f"{key_dir}{os.sep}{manifest}", files[manifest])
    children = data.get("child_paths") if isinstance(data, dict) else None
    if hidden(data):
        skipped.append(Skipped(rel, "incomplete group: its manifest lists no file (an unpack --overwrite stopped "
                                    "while it replaced the group; the next unpack completes it)"))
        return None
    if not isinstance(children, dict) or not children:
        skipped.append(Skipped(rel, "unreadable manifest"))
        return None
    group_name = sys.intern(manifest[len(MANIFEST_PREFIX):-len(".json")])  # one a kernel, not one a configuration
    if not group_name:
        skipped.append(Skipped(rel, "manifest names no kernel"))
        return None
    names = [sys.intern(n) for n in children]  # configurations of one kernel share them: each name kept once
    bad = [n for n in names if n not in scan.valid_names and (not valid_file_name(n) or n.startswith(MANIFEST_PREFIX))]
    if bad:
        skipped.append(Skipped(rel, f"manifest names an invalid child {bad[0]!r}"))
        return None
    scan.valid_names.update(names)
    blocked = [n for n in names if n in unreadable]
    if blocked:
        skipped.append(Skipped(f"{key}/{blocked[0]}", f"unreadable: Permission denied (its group, {group_name}, is "
                                                     "not packed)"))
        return None
    metadata_name = f"{group_name}.json"
    if metadata_name not in children:
        skipped.append(Skipped(rel, f"incomplete group: manifest does not list {metadata_name}"))
        return None
    missing = [n for n in names if n not in files]
    if missing:
        # Triton loads a kernel from its metadata and binary alone (TRITON_STORE_BINARY_ONLY writes no more): a
        # group that lost only IR files is packed with what is left, and said so; one that lost either is not
        # (a missing name that is there as something else, a link, a directory, is not gone: the group is skipped)
        needed = binary_only_names(group_name, names)
        lost = next((n for n in missing if n in needed or os.path.lexists(f"{key_dir}{os.sep}{n}")), None)
        if lost is not None or len(needed) < 2:
            name = lost or missing[0]
            what = "missing" if not os.path.lexists(f"{key_dir}{os.sep}{name}") else (
                "a symbolic link (never followed)" if os.path.islink(f"{key_dir}{os.sep}{name}") else "no file")
            skipped.append(Skipped(rel, f"incomplete group: {name} is {what}"))
            return None
        names = [n for n in names if n in files]
    metadata = _read_json(f"{key_dir}{os.sep}{metadata_name}", files[metadata_name])
    if not isinstance(metadata, dict):
        skipped.append(Skipped(f"{key}/{metadata_name}", "unreadable kernel metadata"))
        return None
    cut = next((n for n in names if n.endswith(KERNEL_BINARIES) and not whole_elf(f"{key_dir}{os.sep}{n}", files[n])),
               None)
    if cut is not None:
        skipped.append(Skipped(rel, f"incomplete group: {cut} is cut short (no whole ELF binary: Triton would take it "
                                    "for a hit, and fail to load it)"))
        return None
    own_dir = os.path.abspath(key_dir)
    foreign = any(not _inside(path, own_dir) for path in children.values())
    return LocalEntry(
        kind=GROUP,
        key=key,
        name=group_name,
        files=LocalFiles(root, key, scan.name_tuples.setdefault(kept := tuple(names), kept),
                         array("Q", [files[n] for n in names])),
        kernel=kernel_info(metadata),
        foreign_manifest=foreign,
        missing=tuple(missing),
    )


def _scan_key_dir(root: str, key: str, scan: CacheScan) -> None:
    key_dir = os.path.join(root, key)
    unreadable: set[str] = set()
    files = _regular_files(key_dir, key, scan.skipped, unreadable)
    claimed: set[str] = set()
    unread = False  # a manifest whose children cannot be known: the directory's kernel files are taken as its
    found: list[LocalEntry] = []
    taken: dict[str, str] = {}  # file -> the manifest of the group that has it
    for name in [n for n in files if n.startswith(MANIFEST_PREFIX) and n.endswith(".json")]:
        claimed.add(name)
        entry = _scan_group(root, key, name, files, unreadable, scan)
        if entry is not None:
            claimed.update(f.name for f in entry.files)
            shared = [f.name for f in entry.files if f.name in taken]
            if shared:  # one file, two groups: an unpack could not write both (spec §7), so the second is left out
                scan.skipped.append(Skipped(f"{key}/{name}", f"its group lists {shared[0]}, which the group of "
                                                              f"{taken[shared[0]]} lists too"))
            else:
                found.append(entry)
                taken.update((f.name, name) for f in entry.files)
        else:  # its children are reported with the manifest, not one by one
            data = _read_json(f"{key_dir}{os.sep}{name}", files[name])
            children = data.get("child_paths") if isinstance(data, dict) else None
            if isinstance(children, dict):
                claimed.update(n for n in children if isinstance(n, str))
                if not children:  # hidden by a replace: its kernel's files are its own, reported with it
                    stem = f"{name[len(MANIFEST_PREFIX):-len('.json')]}."
                    claimed.update(n for n in files if n.startswith(stem))
            else:
                unread = True
    for name in sorted(unreadable - claimed):  # those of a group skipped above are reported with it
        is_manifest = name.startswith(MANIFEST_PREFIX) and name.endswith(".json")
        unread |= is_manifest
        if is_manifest or not (unread and name.endswith(KERNEL_SUFFIXES)):
            scan.skipped.append(Skipped(f"{key}/{name}", "unreadable manifest" if is_manifest else
                                        "unreadable: Permission denied"))
    loose = [n for n in files if n not in claimed]
    orphans = [n for n in loose if n.endswith(KERNEL_SUFFIXES) and not n.endswith(AUTOTUNE_SUFFIX)]
    if orphans and not unread:  # else reported once, with the manifest that cannot be read
        scan.skipped.append(Skipped(f"{key}/{orphans[0]}",
                                    f"incomplete group: no manifest for {len(orphans)} kernel file(s)"))
    for name in loose:
        if name in orphans:
            continue
        path = os.path.join(key_dir, name)
        local = (LocalFile(name, key_dir, files[name]),)
        if name.endswith(AUTOTUNE_SUFFIX):
            data = _read_json(path, files[name])
            try:
                info = autotune_info(name, data if isinstance(data, dict) else {})
            except ValueError:
                scan.skipped.append(Skipped(f"{key}/{name}", "unreadable autotune result"))
                continue
            found.append(LocalEntry(AUTOTUNE, key, name, local, autotune=info))
        elif name.endswith(".so"):
            found.append(LocalEntry(FILE, key, name, local, stub=stub_info(name)))
        elif name == "lock" and files[name] == 0:
            scan.skipped.append(Skipped(f"{key}/{name}", "lock file"))
        else:
            scan.skipped.append(Skipped(f"{key}/{name}", "unrecognised file"))
    scan.entries.extend(sorted(found, key=index_order))


ITEMS_PER_PROCESS = 128  # a forked reader's least share of a root: fewer directories cost more to fork than to read
# Past this many directories in a root (about 60,000 files, whose entries' objects take 6 MB), the scan packs its
# entries (``PackedEntries``); below, a pack reads them back (1.5 us an entry, a few times each) for little memory.
PACKED_KEYS = 8192


def _an_archive(path: str) -> str:
    """What to do with a file given for a cache root, if it is an archive."""
    from .archive.format import MAGIC

    try:
        with open(path, "rb") as f:
            is_archive = f.read(len(MAGIC)) == MAGIC
    except OSError:
        return ""
    return " (an archive: tritonpack unpack writes it into a cache directory)" if is_archive else ""


def scan_cache(root: str, processes: bool = False) -> CacheScan:
    """Every entry under ``root``, in sorted order, plus what was skipped. Reads, never writes. With
    ``processes``, forked processes read a large root's directories too, a run of them each (``forking``): the
    result is the same, in the same order."""
    if not os.path.exists(root):
        raise CacheError("cache directory does not exist", root)
    if not os.path.isdir(root):
        raise CacheError(f"not a directory{_an_archive(root)}", root)
    try:
        items = sorted(os.scandir(root), key=lambda d: d.name)
    except OSError as e:
        raise CacheError(f"cannot read: {e.strerror}", root) from e
    count = min(cores(), len(items) // ITEMS_PER_PROCESS) if processes and fork_safe() else 1
    packed = len(items) > PACKED_KEYS
    if count > 1:
        runs = [items[n * len(items) // count:(n + 1) * len(items) // count] for n in range(count)]
        parts = forked_map(partial(_scan_items, root, packed=packed), runs)
    else:
        parts = [_scan_items(root, items, packed)]
    scan = CacheScan(root, packed)
    for entries, skipped in parts:
        scan.entries += entries  # type: ignore[operator]  # either takes any iterable in place (mypy checks + on a union)
        scan.skipped += skipped
    return scan


def _scan_items(root: str, items: list[os.DirEntry], packed: bool) -> tuple[Sequence[LocalEntry], list[Skipped]]:
    scan = CacheScan(root, packed)
    for item in items:
        if item.name == TOOL_DIR:
            continue
        if item.name.startswith("tmp."):
            scan.skipped.append(Skipped(item.name, "temporary file of an unfinished write"))
        elif item.is_symlink():
            scan.skipped.append(Skipped(item.name, "symbolic link (never followed)"))
        elif not item.is_dir():
            scan.skipped.append(Skipped(item.name, "stray file at the root"))
        elif not KEY_PATTERN.fullmatch(item.name):
            scan.skipped.append(Skipped(item.name, "not a cache key directory"))
        else:
            try:
                _scan_key_dir(root, item.name, scan)
            except OSError as e:
                scan.skipped.append(Skipped(item.name, f"unreadable: {e.strerror}"))
    return scan.entries, scan.skipped


def not_a_root(root: str, skipped: Sequence[Skipped] = ()) -> CacheError:
    """The error for a directory that holds no Triton cache entry: naming the cache root it probably meant (the
    directory above one, ``~/.triton``, Triton's home; an Inductor root's parents, ``/tmp/torchinductor_me``,
    whose Triton root is ``triton/0``), else what was skipped there."""
    for below in (("cache",), (".triton", "cache"), ("0",), ("triton", "0")):
        meant = os.path.join(root, *below)
        if os.path.isdir(meant):
            return CacheError(f"no Triton cache entry here; is the cache root {meant}?", root)
    if skipped:
        first = skipped[0]
        return CacheError(f"no complete Triton cache entry here: skipped {len(skipped)} ({first.path}: "
                          f"{first.reason}{', ...' if len(skipped) > 1 else ''})", root)
    return CacheError("no Triton cache entry here (a Triton cache root holds one directory per cache key)", root)


def scan_keys(root: str, keys) -> CacheScan:
    """Only the named key directories of ``root`` (what a recorded run used), not the whole root."""
    scan = CacheScan(root=root)
    for key in sorted(set(keys)):
        key_dir = os.path.join(root, key)
        if not KEY_PATTERN.fullmatch(key) or os.path.islink(key_dir) or not os.path.isdir(key_dir):
            scan.skipped.append(Skipped(key, "no longer in the cache"))
            continue
        try:
            _scan_key_dir(root, key, scan)
        except OSError as e:
            scan.skipped.append(Skipped(key, f"unreadable: {e.strerror}"))
    return scan


__all__ = ["CacheScan", "LocalEntry", "LocalFile", "LocalFiles", "Skipped", "files_subset", "scan_cache", "scan_keys",
           "not_a_root",
           "kernel_info", "manifest_name"]
