"""Writing a ``.tpack`` archive from entries whose files are on disk.

Files are laid out by file type and target (similar bytes side by side compress far better), packed into
independent zstd blocks (decodable in parallel and one at a time), and identical contents are stored once.
Each file is read exactly once; memory is bounded by a few blocks whatever the cache size.
"""
from __future__ import annotations

import contextlib
import hashlib
import mmap
import tempfile
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from typing import NamedTuple, Protocol

import msgpack
import zstandard

from ..archivedest import archive_file
from ..errors import ArchiveError, CacheError, ReaderLimitError, UsageError
from ..forking import cores, fork_safe, private_map
from ..model import (
    GROUP,
    ArchiveInfo,
    Described,
    KernelInfo,
    disowned,
    index_order,
    named_version,
    names_of,
    sizes_of,
    total_size,
)
from . import splice
from .format import (
    DEFAULT_LEVEL,
    ENTRY_VERSIONS,
    HEADER_SIZE,
    MAX_BLOCK_SIZE,
    TRAILER_SIZE,
    UNKNOWN_VERSIONS,
    Trailer,
    pack_header,
    pack_trailer,
)
from .helpers import BlockHelpers, fill
from .index import (
    CODEC_ZSTD,
    CODEC_ZSTD_SPLICE,
    HELD_DIGESTS,
    BlobTable,
    Block,
    FileBlobs,
    IndexEncoding,
    SpilledRun,
    block_table,
    check_index,
    decode_blocks,
)
from .limits import ENV_MAX_INDEX_VALUES, ENV_MAX_UNPACK_BYTES, max_index_values, max_unpack_bytes

BLOCK_SIZE = 32 * 1024 * 1024  # a window that spans many alike files, small enough to decode in parallel
MAX_WINDOW_LOG = 25  # 32 MiB: zstd decoders accept up to 2^27 by default
# The index is compressed after the last block, with every other core idle: level 6 takes a third of level 12's
# time for 0.7-2.3% more index bytes (most of an index is sha256 digests), 0.03-0.24% of the bench's archives.
INDEX_LEVEL = 6
DEFAULT_SEARCH_LOG = 3  # see compress_block
# Block bytes a pack holds: five blocks, four of them compressing where there are cores for them. Each block
# compressing costs its buffer and a 6 MB zstd context (hash and chain tables at level 8): peak RSS of a real
# pack is 173 MB with two compressing and a read ahead, 219-221 MB with four (bench/results/perf-*torch*.json).
HELD = 5 * BLOCK_SIZE
MOST_HELPERS = 4  # forked helpers of a pack (helpers.py), where there are twice as many cores
# The pack also holds what it knows of each file until its index is written (the scan's share of its group, its
# digest, blob and dedupe slot, then the index's bytes): about 0.2 KB a file since d89babf, which took the layout's
# tuples and the dedupe's dict out (1 KB before). Up to ``FILES_HELD`` files fit beside five blocks (219-224 MB of
# summed PSS on the 16-core host for 6,241 and 9,600 files); each block's worth of files more, counted at
# ``FILE_HELD`` bytes a file (with a margin: the host's PSS moves by 20 MB between calls), takes a buffer's place.
# At 1 KB a file, 54,610 files had three buffers and 163,830 two; at 384 bytes, four and three: pack 0.85 and 0.76
# of the time on 16 cores, 196 and 194-197 MB instead of 158 and 160 (bench/results/pack-buffers-file-held-*.json),
# but 180,000 files, the last with three buffers, took 231 MB, where the index is encoded and checked beside them
# (memory-scale-h200host-305dfdb.json). At 512 bytes: four buffers to 75,000 files, three to 141,000, and at the
# last files of each, 202 MB (71,000 files) and 187 MB (136,500; memory-scale-h200host-file-held-512.json).
FILES_HELD, FILE_HELD = 10_000, 512
FEWEST_BUFFERS = 2


def held_buffers(files: int, block_size: int = BLOCK_SIZE) -> int:
    """Block buffers a pack of ``files`` files holds: five, less one for each block's worth of per-file memory
    past ``FILES_HELD`` files, two at least (one filled while one compresses)."""
    beyond = max(0, files - FILES_HELD) * FILE_HELD
    return max(FEWEST_BUFFERS, HELD // block_size - (beyond + block_size - 1) // block_size)


class SourceFile(Protocol):
    """A file to archive: a file of a cache root, or a stored file of another archive (merge)."""

    @property
    def name(self) -> str: ...
    @property
    def size(self) -> int:  # what the scan saw; a file that no longer has this size is an error, never half-stored
        ...

    def read_into(self, view: memoryview) -> None:
        """Fill ``view`` (``size`` bytes) with the contents."""


class SourceEntry(Described, Protocol):
    """An entry to archive (read only: an entry may be a named tuple)."""

    @property
    def name(self) -> str: ...
    @property
    def files(self) -> Sequence[SourceFile]: ...


class WriteResult(NamedTuple):
    files: int
    blobs: int
    bytes_in: int
    bytes_out: int
    cubins: int = 0  # distinct cubins paired with their group's .ptx
    spliced: int = 0  # of those, the ones stored without their PTX text (spec §5.1)


# Types whose bytes cost zstd the most time go first, so that the blocks compressing last (alone, at the end of a
# pack) are quick ones: on a real cache, cubin costs 22 ns a byte at level 8, ptx 13, llir 6, the others less.
SLOW_FIRST = ("cubin", "hsaco", "ptx", "amdgcn", "llir")
_PAIRS = "\0ptx"  # no file's extension: a .ptx paired with its cubin, ranked with the cubins
# Machine code and its assembly, ordered by the kernel's launch configuration first (see _layout_order).
BY_CONFIG = frozenset({"cubin", "hsaco", "ptx", "amdgcn", _PAIRS})
_NO_CONFIG = (0, 0, 0)


def _type_rank(ext: str) -> tuple[int, str]:
    if ext == _PAIRS:
        return 0, "ptx"
    return (SLOW_FIRST.index(ext) if ext in SLOW_FIRST else len(SLOW_FIRST)), ext


# A unit as one int (``_layout_order``): its entry's number, its file's, and a paired cubin's (else _NO_PAIR).
_FILE_BITS = 20
_NO_PAIR = (1 << _FILE_BITS) - 1
_MOST_ENTRIES = 1 << (64 - 2 * _FILE_BITS)
_UNIT_BITS = 64
_UNIT_MASK = (1 << _UNIT_BITS) - 1


def _unit(i: int, j: int, cubin: int = _NO_PAIR) -> int:
    return (i << _FILE_BITS | j) << _FILE_BITS | cubin


def _unit_numbers(unit: int) -> tuple[int, int, int]:
    """A unit's entry number, file number and paired cubin's number (else ``_NO_PAIR``)."""
    return unit >> 2 * _FILE_BITS, unit >> _FILE_BITS & _NO_PAIR, unit & _NO_PAIR


def _unit_files(entries: Sequence[SourceEntry], unit: int) -> tuple[tuple[int, int, SourceFile], ...]:
    """A unit's ``(entry number, file number, file)``: one file, or a ``.ptx`` and its cubin."""
    i, j, cubin = _unit_numbers(unit)
    files = entries[i].files
    return ((i, j, files[j]),) if cubin == _NO_PAIR else ((i, j, files[j]), (i, cubin, files[cubin]))


def _layout_order(entries: Sequence[SourceEntry], block_size: int = 0) -> array:
    """Units in the order that puts alike bytes together: by type (slow ones first), then size, then target. A
    unit is one file or, where ``block_size`` is given (cubins to splice), a group's ``.ptx`` and ``.cubin`` that
    fit one block together: they go in one block, the ``.ptx`` first, so that the cubin's PTX text can be spliced
    from it; the pair is ranked as a cubin and ordered by its ``.ptx``. Each unit is an int (``_unit_files``
    reads it), and its files are made as its block is planned: tuples and a file object a unit took 0.25 KB a
    file for the whole of a pack's writing (100 MB at 374,460 files).

    Files of one type with about the same size are mostly the same kernel template at the same configuration
    (other shapes, other constants, other targets): side by side, zstd's match finder sees them within its reach.
    On a real max-autotune cache this ordering is 14% smaller than ordering by name. Size before target keeps a
    kernel's files for several targets near each other: multi-target archives of the bench's synthetic caches
    came out 5.2% and 5.8% smaller than with target before size (archives of one target are the same bytes).
    Machine code and assembly (``BY_CONFIG``) go by ``num_warps``, ``num_stages`` and ``shared`` before size: a
    launch configuration shapes the code (its warps' indexing, its pipeline's stages, its tiles, which the shared
    memory counts) more than the kernel's size tells: 3.3% smaller archives of the synthetic cache and 1.0% of the
    real one (0.7% and 0.3% of that from ``shared``; the IRs ordered so too: larger).

    Sorted type by type, on keys of a file's own fields, the units made as the keys are: this runs before the
    first block is read, on the path of every pack (16-18 ms for 8,400 files on 2 cores, where one sort of all the
    files on their types too, and the units made after it, took 37). A key is one int: the ranks of the file's
    configuration, target and name, its size, and its unit in the low 64 bits (its entry's number orders as its
    key would: ``entries`` come sorted by key). A tuple of the fields took 0.2 KB a file while the layout was
    made, and the heap kept its size after (27 MB at 187,230 files, which later records only filled)."""
    too_many = f"more than {_MOST_ENTRIES} entries or {_NO_PAIR - 1} files in one cannot be archived"
    if len(entries) > _MOST_ENTRIES:
        raise UsageError(too_many)
    all_names: set[str]
    all_names, all_targets, all_configs = set(), {""}, {_NO_CONFIG}  # an entry is read once a pass (packed ones
    previous = None  # are made again each time: none is held)
    for entry in entries:
        order = index_order(entry)
        if previous is not None and order < previous:
            raise ArchiveError(f"entry {entry.key}/{entry.name} is out of the index's order (a writer bug)")
        previous = order
        file_names = names_of(entry.files)
        if len(file_names) >= _NO_PAIR:
            raise UsageError(too_many)
        all_names.update(file_names)
        if entry.kernel:
            all_targets.add(entry.kernel.target)
            all_configs.add(_config(entry.kernel))
    names, targets, configs = _ranks(all_names), _ranks(all_targets), _ranks(all_configs)
    del all_names, all_targets, all_configs
    # A key's fields, from the low bits: unit, name, target, size (64 bits: any file's), configuration
    target_shift = _UNIT_BITS + len(names).bit_length()
    size_shift = target_shift + len(targets).bit_length()
    config_shift = size_shift + 64
    plain = configs[_NO_CONFIG] << config_shift
    of_type: dict[str, list[int]] = {}  # extension (or _PAIRS) -> the sort keys of its files
    for i, entry in enumerate(entries):
        kernel, file_names, sizes = entry.kernel, names_of(entry.files), sizes_of(entry.files)
        target = targets[kernel.target if kernel else ""] << target_shift
        config = configs[_config(kernel)] << config_shift
        paired = _ptx_pairs(file_names, sizes, block_size) if kernel is not None else {}
        cubins = set(paired.values())
        for j, name in enumerate(file_names):
            cubin = paired.get(j)
            if cubin is not None:
                of_type.setdefault(_PAIRS, []).append(
                    config | sizes[j] << size_shift | target | names[name] << _UNIT_BITS | _unit(i, j, cubin))
                continue
            if j in cubins:  # it goes with its .ptx
                continue
            if name.endswith(".autotune.json"):
                ext = "autotune.json"
            else:
                _, dot, ext = name.rpartition(".")
                if not dot:
                    ext = ""
            keys = of_type.get(ext)
            if keys is None:
                keys = of_type[ext] = []
            keys.append((config if ext in BY_CONFIG else plain) | sizes[j] << size_shift | target
                        | names[name] << _UNIT_BITS | _unit(i, j))
    units = array("Q")
    for ext in sorted(of_type, key=_type_rank):
        keys = of_type.pop(ext)  # each type's keys go once its units are taken
        keys.sort()
        units.extend(k & _UNIT_MASK for k in keys)
    return units


def _config(kernel: KernelInfo | None) -> tuple[int, int, int]:
    return (kernel.num_warps or 0, kernel.num_stages or 0, kernel.shared or 0) if kernel else _NO_CONFIG


def _ranks(values: set) -> dict:
    """Each value's place in sorted order."""
    return {value: n for n, value in enumerate(sorted(values))}


def _ptx_pairs(names: Sequence[str], sizes: Sequence[int], block_size: int) -> dict[int, int]:
    """A group's ``<stem>.ptx`` file number -> its ``<stem>.cubin``'s, for the pairs that fit a block."""
    if not block_size:
        return {}
    numbers = {name: j for j, name in enumerate(names)}
    pairs = {}
    for name, j in numbers.items():
        if name.endswith(".cubin"):
            ptx = numbers.get(name[:-len("cubin")] + "ptx")
            if ptx is not None and sizes[ptx] + sizes[j] <= block_size:
                pairs[ptx] = j
    return pairs


class _Blobs(BlobTable):
    """The blobs written so far, by number, as the index's table has them, and the dedupe of contents: an open
    addressing table of blob numbers by digest. A named tuple a blob took 0.13 KB; a dict of digests, their bytes
    and an int a blob, 0.14 KB more (24.6 MB of a pack's 39 MB growth while it read 187,230 files). The digests
    past the first ``HELD_DIGESTS`` go to a temp file, as a reader's do (32 bytes a blob held: 34 MB at 1,060,970
    files); beside each blob four bytes of its digest's hash, so that a lookup reads a digest only where they
    match (a duplicate file, 2% of a real cache's, or one in four billion). These take 24 bytes a blob."""

    __slots__ = ("_slots", "_tags")

    def __init__(self, files: int):
        super().__init__()
        self.digests: SpilledRun = SpilledRun(32 * HELD_DIGESTS)  # grown a blob at a time
        self._tags = array("I")  # by blob: the high 32 bits of its digest's hash
        # A blob number + 1 a slot (0: free); at least twice as many slots as files: never more than half full
        self._slots = array("I", [0]) * (1 << max(3, (2 * files).bit_length()))

    def find(self, digest: bytes) -> int:
        """The number of the blob with this sha256, or, where there is none, a negative number for ``add``."""
        slots, tags = self._slots, self._tags
        mask = len(slots) - 1
        key = hash(digest)
        slot, tag = key & mask, (key >> 32) & 0xFFFFFFFF
        while True:
            blob = slots[slot] - 1
            if blob < 0:
                return ~slot
            if tags[blob] == tag and self.digests[32 * blob:32 * blob + 32] == digest:
                return blob
            slot = (slot + 1) & mask

    def add(self, missing: int, block: int, offset: int, size: int, digest: bytes) -> int:
        """A new blob, where ``find`` returned ``missing`` for its digest (no blob added since)."""
        blob = len(self.blocks)
        self._slots[~missing] = blob + 1
        self.blocks.append(block)
        self.offsets.append(offset)
        self.sizes.append(size)
        self.digests.append(digest)
        self._tags.append((hash(digest) >> 32) & 0xFFFFFFFF)
        return blob

    def forget_contents(self) -> None:
        """Every file is read: no content is looked up again."""
        self._slots, self._tags = array("I"), array("I")


def compress_block(data: bytes | memoryview, level: int) -> bytes:
    """One independent frame whose window spans the whole block. No long-distance matching: with alike files
    side by side the regular match finder does better (it made real caches 10% larger). At the default level,
    the lazy2 match finder searches 2^3 candidates instead of 2^4: alike files sit close together, and on a real
    cache this takes 15% less time for 2% more bytes (better than level 7 on both)."""
    window_log = max(17, min(MAX_WINDOW_LOG, (max(len(data), 1) - 1).bit_length()))
    tuning = {"search_log": DEFAULT_SEARCH_LOG} if level == DEFAULT_LEVEL else {}
    params = zstandard.ZstdCompressionParameters.from_level(
        level, source_size=len(data), window_log=window_log, write_content_size=True, **tuning)
    return zstandard.ZstdCompressor(compression_params=params).compress(data)


def splice_and_compress(content: memoryview, level: int, pairs: Sequence[tuple[int, int, int, int]],
                        helpers: BlockHelpers | None = None, buffer: mmap.mmap | None = None
                        ) -> tuple[bytes, tuple[splice.Splice, ...]]:
    """The block's frame, and its splices: each cubin of ``pairs`` (``(cubin offset, size, ptx offset, size)`` in
    the content) whose PTX text derives from its ``.ptx`` is stored without it, planned by forked helpers where
    there are some (``buffer`` holds the block), else here. The texts are cut out of the block buffer in place (its
    digests are taken): no second copy of the block."""
    splices = helpers.plan(buffer, pairs) if helpers is not None and pairs else None
    if splices is None:
        splices = splice.plan_block(content, pairs)
    if not splices:
        return compress_block(content, level), ()
    end = splices[0].at
    for s, following in zip(splices, [*splices[1:], None], strict=True):
        start, stop = s.at + s.length, following.at if following else len(content)
        content[end:end + stop - start] = content[start:stop]  # a memmove
        end += stop - start
    return compress_block(content[:end], level), splices


def write_archive(
    path: str,
    entries: Sequence[SourceEntry],
    info: ArchiveInfo,
    level: int = DEFAULT_LEVEL,
    block_size: int = BLOCK_SIZE,
    threads: int | None = None,
    on_file: Callable[[int], None] | None = None,
    splice_ptx: bool = False,
    helpers: BlockHelpers | None = None,
) -> WriteResult:
    """Write the archive where ``archivedest.destination`` says: to a temp file beside ``path``, moved in place
    (never a half-written archive), or straight into a device or FIFO.

    ``splice_ptx``: store each cubin without the PTX text it embeds, spliced back from its ``.ptx`` when it is
    unpacked (spec §5.1; ``info.format_version`` must then be 1.1): 12-15% smaller archives of CUDA caches, for
    2.4-5 ns of unpack CPU a byte of ``.ptx`` (2-core VM). ``helpers``: forked processes (``forked_helpers``)
    that read the files, by their ``path`` (files of a cache root), and plan the splices. ``entries``: a list or
    tuple in any order; any other sequence in the index's order (``model.index_order``), as a scan's are."""
    if splice_ptx and info.format_version < (1, 1):
        raise UsageError("spliced cubins need format 1.1")
    try:
        with archive_file(path) as (out, scratch):
            return _write(out, path, scratch, entries, info, level, block_size, threads or cores(), on_file,
                          splice_ptx, helpers)
    except OSError as e:
        raise CacheError(f"cannot write the archive: {e.strerror}", path) from e


_NARROW = "write part of it (--arch, --kernel; pack --since), or raise that limit here and where it is read"


def _check_written(parts: list, path: str, version: tuple[int, int]) -> None:
    """Never write what a reader would reject. An index past a reader's limit is an honest cache too large for one
    archive at that limit, so the error says how to write less."""
    try:
        check_index(parts, path, version)
    except ReaderLimitError:
        raise ReaderLimitError(f"the index would hold more than {max_index_values()} values, more than a reader "
                               f"accepts ({ENV_MAX_INDEX_VALUES}): {_NARROW}", path) from None


def forked_helpers(threads: int | None = None) -> BlockHelpers | None:
    """Helpers for a pack of a cache root, with its block buffers, where there are four cores or more and a fork
    is safe (``forking.fork_safe``); None elsewhere. Made before the scan: the helpers fork small."""
    threads = threads or cores()
    if threads < 4 or not fork_safe():
        return None
    return BlockHelpers(min(MOST_HELPERS, threads // 2), HELD // BLOCK_SIZE, BLOCK_SIZE)


def block_buffer(size: int) -> mmap.mmap:
    """A block buffer of this process alone (``forking.private_map``; helpers need shared ones): a map, not a
    bytearray, which zero-fills its bytes in the writer's thread (20 ms for a block on the path to its first read,
    where the map's pages are faulted in by the reader threads)."""
    return private_map(size)


def release(buffer: mmap.mmap, shared: bool) -> None:
    """Free a buffer's pages now, as its block is written after the last read, while other blocks still compress:
    not all at the pack's end, on the path to its exit (22 ms for the helpers' five maps on the host). A helpers'
    map is shared memory, which only MADV_REMOVE frees (for every process that maps it)."""
    advice = getattr(mmap, "MADV_REMOVE" if shared else "MADV_DONTNEED", None)
    if advice is not None:
        with contextlib.suppress(OSError):
            buffer.madvise(advice)


def _fill(files: Sequence[tuple[int, int, SourceFile, int]], view: memoryview) -> list[bytes]:
    """Runs in a reader thread: each file straight into its place in the block; their sha256s."""
    return fill(((source.read_into, source.size, offset) for _, _, source, offset in files), view)


def _plan(entries: Sequence[SourceEntry], units: Iterable[int], block_size: int):
    """Consecutive runs of units (``_layout_order``) that fill one block each, by their listed sizes (duplicates
    included), each run as its files with their offsets in the block."""
    run: list[tuple[tuple[int, int, SourceFile], ...]] = []
    size = 0
    for code in units:
        unit = _unit_files(entries, code)
        unit_size = 0
        for _, _, source in unit:
            if source.size > MAX_BLOCK_SIZE:
                where = getattr(source, "path", source.name)
                raise UsageError(f"file larger than {MAX_BLOCK_SIZE} bytes cannot be archived", where)
            unit_size += source.size
        if run and size + unit_size > block_size:
            yield _laid_out(run), size
            run, size = [], 0
        run.append(unit)
        size += unit_size
    if run:
        yield _laid_out(run), size


def _consumed(items: array):
    """The items of a reversed array in their first order, each dropped from it as it is taken."""
    while items:
        yield items.pop()


def _laid_out(run) -> list[tuple[int, int, SourceFile, int]]:
    """A run's files in block order, with their offsets: consecutive pairs lay all their ``.ptx`` files, then
    all their cubins in the same order (alike bytes together, and each .ptx before its cubin)."""
    order, pairs = [], []
    for unit in [*run, ()]:
        if len(unit) == 2:
            pairs.append(unit)
            continue
        order += [ptx for ptx, _ in pairs] + [cubin for _, cubin in pairs] + list(unit)
        pairs = []
    laid, offset = [], 0
    for i, j, source in order:
        laid.append((i, j, source, offset))
        offset += source.size
    return laid


def _batches(run: list, target: int = 1 << 20, most: int = 256):
    """Reads grouped into tasks of about a MiB: one task a file would cost more in the pool than the read."""
    batch, size = [], 0
    for item in run:
        batch.append(item)
        size += item[2].size
        if size >= target or len(batch) >= most:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _write(out, path, scratch, entries, info, level, block_size, threads, on_file, splice_ptx,
           helpers) -> WriteResult:
    if isinstance(entries, (list, tuple)):  # objects, sorted at no cost; a large scan's packed ones come sorted
        entries = sorted(entries, key=index_order)
    units = _layout_order(entries, block_size if splice_ptx else 0)
    partner = {(i, cubin): ptx for i, ptx, cubin in map(_unit_numbers, units)  # (entry, cubin) -> its .ptx
               if cubin != _NO_PAIR}
    if splice_ptx and not partner:  # no cubin beside its .ptx (HIP, binary-only): no 1.1 feature can be used
        info = info._replace(format_version=(1, 0))
    blocks: list[Block] = []
    counts, total = [], 0  # a large scan's entries are made again each time they are read: one pass
    versioned = unknown = False  # an autotune result or a file names its Triton (1.2), or says it cannot (1.3)
    for e in entries:
        counts.append(len(e.files))
        total += total_size(e.files)
        versioned = versioned or (e.kind != GROUP and named_version(e) is not None)
        unknown = unknown or disowned(e)
    declared = UNKNOWN_VERSIONS if unknown else ENTRY_VERSIONS if versioned else info.format_version
    if info.format_version < declared:
        info = info._replace(format_version=declared)
    out.write(pack_header(info.format_version[1]))
    offset = HEADER_SIZE
    if total > max_unpack_bytes():
        raise ReaderLimitError(f"the files add up to {total} bytes, more than a reader unpacks ({max_unpack_bytes()}, "
                               f"{ENV_MAX_UNPACK_BYTES}): {_NARROW}", path)
    file_blobs = FileBlobs.unset(counts)  # all set below
    first, file_blob = file_blobs.starts, file_blobs.blobs  # entry i's file j has file_blob[first[i] + j]
    files = len(file_blob)
    blobs = _Blobs(files)
    pending: deque[list] = deque()  # [future, size, buffer] of each block submitted, in order, until written
    free: list[mmap.mmap] = []  # block buffers to reuse: no fresh pages to fault in for every block
    bytes_in = 0
    # Block buffers held at once, HELD bytes whatever the core count: the one being filled and deduplicated, those
    # compressing, and one read ahead where too few cores leave a buffer spare. Where there are cores for them, a
    # fourth compression does more than a read ahead: a block compresses in 0.05-0.7 s, and reads in 0.03 s. Where
    # helpers read (15-40 ms a block, out of the interpreter lock), all five compress, and the next block is read
    # as one ends: pack 0.92 and 0.96 of the time with four (host, synthetic and real cache), for one more 5.5 MB
    # zstd context. A read ahead takes a buffer of its own: only where the compressions and the block being filled
    # leave one spare (with helpers on 4 cores, four compress and the fifth buffer is filled: no sixth buffer).
    buffers = held_buffers(files, block_size)
    slots = buffers if helpers is not None else buffers - 1
    most_compressing = max(1, min(threads, slots))
    read_ahead = most_compressing + 1 < buffers

    shared = {id(buffer) for buffer in helpers.buffers} if helpers is not None else set()
    last_read = False  # every block has been read: a buffer whose block is written is not needed again

    def buffer_for(size: int) -> mmap.mmap:
        return free.pop() if free and size <= block_size else block_buffer(max(size, block_size))

    def recycle(buffer: mmap.mmap | None) -> None:
        if buffer is None or len(buffer) != block_size:  # a larger one held a single big file: let it go
            return
        if last_read:
            release(buffer, id(buffer) in shared)
        else:
            free.append(buffer)

    def settle(limit: int) -> None:
        """Write finished blocks in order; return once at most ``limit`` compressions run, and with ``limit`` 0
        only once every block is written.

        A block that finishes before an earlier, slower one frees its buffer at once (cubin blocks take three
        times as long as llir ones), so a core never waits on the order of the file; its output waits in memory,
        at most a block's worth of it. The first block is looked at again before any return: it may finish
        between two looks (it once did, under load, and settle(0) returned with it unwritten)."""
        nonlocal offset
        while pending:
            if pending[0][0].done():
                future, size, buffer = pending.popleft()
                data, splices = future.result()
                out.write(data)
                blocks.append(Block(offset=offset, length=len(data), size=size,
                                    codec=CODEC_ZSTD_SPLICE if splices else CODEC_ZSTD, splices=splices))
                offset += len(data)
                recycle(buffer)
                continue
            running, waiting = [], 0
            for item in pending:
                if not item[0].done():
                    running.append(item[0])
                    continue
                waiting += len(item[0].result()[0])
                recycle(item[2])
                item[2] = None
            if limit == 0 or waiting > block_size:
                wait([pending[0][0]])
            elif len(running) > limit:
                wait(running, return_when=FIRST_COMPLETED)
            else:
                return

    units.reverse()  # taken from the end as blocks are planned
    plan = _plan(entries, _consumed(units), block_size)
    if helpers is not None and helpers.block_size == block_size:
        free.extend(helpers.buffers[:buffers])  # the others are never touched: no memory of theirs is used
    # Separate pools: reads must not queue behind compressions, or the next block waits for its files. Reads of
    # cached files are CPU work (copy, hash): more reader threads than cores only contend (2 cores: 2 readers fill
    # a block in 0.037 s, 4 in 0.05 s); four keep a disk busy where there are cores for them. With helpers, each
    # reader thread waits on one, out of the interpreter lock that the writer's own Python holds.
    reading = helpers.count if helpers is not None and helpers.count else min(4, threads)
    with ThreadPoolExecutor(max_workers=most_compressing) as compressors, \
            ThreadPoolExecutor(max_workers=reading, thread_name_prefix="read") as readers:

        def read(buffer: mmap.mmap, view: memoryview, batch) -> list[bytes]:
            digests = None if helpers is None else helpers.read(
                buffer, [(source.path, source.size, offset) for _, _, source, offset in batch])
            return digests if digests is not None else _fill(batch, view)

        def start_reading():
            nonlocal last_read
            step = next(plan, None)
            if step is None:
                last_read = True
                for buffer in free:
                    release(buffer, id(buffer) in shared)
                free.clear()
                return None
            run, size = step
            buffer = buffer_for(size)
            view = memoryview(buffer)
            return buffer, [(batch, readers.submit(read, buffer, view, batch)) for batch in _batches(run)]

        current = start_reading()
        while current is not None:
            buffer, reads = current
            view = memoryview(buffer)
            following = start_reading() if read_ahead else None
            cursor = 0  # dedupe: later contents move up over the duplicates, in place
            first_blob = len(blobs)
            number = len(blocks) + len(pending)
            pairs = []  # (cubin offset, size, .ptx offset, size) of the new cubins whose .ptx is in this block
            for batch, future in reads:
                for (i, j, source, place), digest in zip(batch, future.result(), strict=True):
                    size = source.size
                    bytes_in += size
                    blob = blobs.find(digest)
                    if blob < 0:
                        blob = blobs.add(blob, number, cursor, size, digest)
                        if cursor != place:
                            view[cursor:cursor + size] = view[place:place + size]  # a memmove
                        ptx = partner.get((i, j))
                        ptx_blob = file_blob[first[i] + ptx] if ptx is not None else None
                        if ptx_blob is not None and blobs.blocks[ptx_blob] == number:
                            pairs.append((cursor, size, blobs.offsets[ptx_blob], blobs.sizes[ptx_blob]))
                        cursor += size
                    file_blob[first[i] + j] = blob
                    if on_file:
                        on_file(size)
            if len(blobs) > first_blob:  # even if all are empty files: their blobs point into this block
                pending.append([compressors.submit(splice_and_compress, view[:cursor], level, pairs, helpers,
                                                   buffer), cursor, buffer])
            else:
                recycle(buffer)
            settle(min(most_compressing, buffers - 1))
            current = following if read_ahead else start_reading()
        # Every file is read: helpers that plan no splices have nothing left to do, and their memory goes before
        # the index is encoded (on 16 cores, 12-20 MB each for a cache of 187,230 files, at the pack's peak).
        if helpers is not None and not splice_ptx:
            helpers.close()
        blobs.forget_contents()
        # The index, but for its block table, is encoded and checked while the last blocks compress; but where the
        # files' records have taken the buffers down to their fewest, after, with the real table: its check peaked
        # beside the buffers and the last blocks' output (2-core VM, 374,460 files: 332 MB, then 312-314 MB once
        # the index waited, the writing's own peak). Its bytes go to a temp file beside the archive (in the temp
        # directory for a device or a FIFO) as they are packed, and from it through the compressor to the archive:
        # never held.
        with tempfile.TemporaryFile(dir=scratch) as spill:
            if buffers <= FEWEST_BUFFERS:
                settle(0)
                encoding = IndexEncoding(info, blobs, entries, file_blobs, spill)
                table = block_table(blocks)
                _check_written(encoding.parts(table), path, info.format_version)
            else:
                encoding = IndexEncoding(info, blobs, entries, file_blobs, spill)
                sizes = [b.size for b in blocks] + [item[1] for item in pending]
                stand_in = [Block(offset=HEADER_SIZE + n, length=1, size=size) for n, size in enumerate(sizes)]
                # Never write what a reader would reject. The real table differs from the stand-in only in offsets
                # and lengths, which this function sets, in order, from the blocks it writes.
                _check_written(encoding.parts(block_table(stand_in)), path, info.format_version)
                settle(0)
                if [b.size for b in blocks] != sizes:  # the table the stand-in stood for, or no archive
                    raise ArchiveError("the blocks written are not the blocks the index describes (a writer bug)",
                                       path)
                table = block_table(blocks)
                if any(b.splices for b in blocks):  # found as blocks compressed, after the stand-in's check
                    decode_blocks(msgpack.unpackb(table), path)
            index_size = encoding.size(table)
            compressor = zstandard.ZstdCompressor(level=INDEX_LEVEL, write_content_size=True).compressobj(
                size=index_size)
            digest, index_length = hashlib.sha256(), 0

            def write(data: bytes) -> None:
                nonlocal index_length
                out.write(data)
                digest.update(data)
                index_length += len(data)

            for chunk in encoding.chunks(table):
                write(compressor.compress(chunk))
            write(compressor.flush())
    out.write(pack_trailer(Trailer(offset, index_length, index_size, digest.digest())))
    out.flush()
    return WriteResult(files, len(blobs), bytes_in,
                       offset + index_length + TRAILER_SIZE, len({file_blob[first[i] + j] for i, j in partner}),
                       sum(len(b.splices) for b in blocks))


__all__ = ["write_archive", "forked_helpers", "WriteResult", "BLOCK_SIZE", "DEFAULT_LEVEL"]
