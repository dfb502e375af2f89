"""The archive index: the msgpack document that describes everything in a ``.tpack`` file.

``IndexEncoding`` and ``decode_index`` are inverse, without side effects. ``decode_index`` treats its input as hostile:
every field is type-checked, every name and reference validated, and the first problem raises ``ArchiveError``.
Unknown map keys are ignored (forward compatibility within format major version 1).
"""
from __future__ import annotations

import contextlib
import gc
import io
import os
import re
from array import array
from bisect import bisect_right
from collections.abc import Callable, Iterable, Iterator
from itertools import accumulate, repeat
from typing import Any, BinaryIO, Literal, NamedTuple, cast, overload

import msgpack

from ..errors import ArchiveError, ReaderLimitError
from ..model import (
    AUTOTUNE,
    FILE,
    GROUP,
    KINDS,
    ArchiveInfo,
    AutotuneInfo,
    Entry,
    KernelInfo,
    LazyFiles,
    PythonInfo,
    StoredFile,
    StubInfo,
    TritonInfo,
    disowned,
    manifest_name,
    names_of,
)
from .format import MAX_BLOCK_SIZE, MAX_NAME_BYTES
from .limits import ENV_MAX_INDEX_VALUES, IndexBudget, IndexTooLarge
from .splice import Splice

CODEC_ZSTD = "zstd"
CODEC_ZSTD_SPLICE = "zstd-splice"  # format 1.1: a zstd frame of the content without its splices (spec §5.1)
MAX_META_DEPTH = 32  # reader policy: autotune values are printed and turned into JSON, which recurse
KEY_RE = re.compile(r"[A-Za-z0-9_\-=]{16,128}")
_READ_SIZE = 1 << 16  # bytes msgpack reads at a time from an index
_SPILL_BLOBS, _SPILL_ENTRIES = 8192, 2048  # elements packed between two writes of an encoding to its spill
_CHUNK = 1 << 20  # bytes of a spilled index read at a time
# Digests held, beyond which they go to a temp file, a MiB at a time; a reader hands them over 64 KiB at a time
HELD_DIGESTS, _DIGESTS_A_WRITE = 1 << 15, 1 << 16


class Block(NamedTuple):
    """One independently decodable zstd frame in the data region."""

    offset: int
    length: int  # compressed bytes
    size: int  # uncompressed bytes: the content, with its splices
    codec: str = CODEC_ZSTD
    splices: tuple[Splice, ...] = ()  # codec zstd-splice: texts derived at decode time, by increasing offset

    @property
    def stored(self) -> int:
        """Bytes the frame decodes to: the content without its splices."""
        return self.size - sum(s.length for s in self.splices)


class BlobRef(NamedTuple):
    """Where a distinct file content lives: a byte range of one block's decompressed data."""

    block: int
    offset: int
    size: int
    sha256: bytes


class BlobTable:
    """The blobs, in arrays and one run of digests; an item is a ``BlobRef``, made as it is read. A ``BlobRef``, its
    offset's int and its digest's bytes a blob took 0.15 KB more, for the hundreds of thousands of blobs of a large
    cache. The digests are bytes, or a temp file's where there are many (a reader's ``FileSpan``, a writer's
    ``SpilledRun``)."""

    __slots__ = ("blocks", "digests", "offsets", "sizes")

    def __init__(self) -> None:
        # 4 bytes each: a block's offsets and sizes stay within its 256 MiB (where "L" and "Q" took 8 on Linux)
        self.blocks = array("I")
        self.offsets = array("I")
        self.sizes = array("I")
        self.digests: bytes | FileSpan | SpilledRun = b""  # 32 bytes a blob

    def digest(self, n: int) -> bytes:
        return self.digests[32 * n:32 * n + 32]

    def __len__(self) -> int:
        return len(self.blocks)

    def __getitem__(self, n: int) -> BlobRef:
        if n < 0:
            n += len(self.blocks)
        return BlobRef(self.blocks[n], self.offsets[n], self.sizes[n], self.digest(n))  # an IndexError past the end

    def digest_run(self, first: int, end: int) -> bytes:
        """The digests of blobs ``first`` to ``end`` (excluded), one after the other: one read of a temp file's."""
        return bytes(self.digests[32 * first:32 * end])

    def __iter__(self) -> Iterator[BlobRef]:
        return map(_new_tuple, repeat(BlobRef), zip(self.blocks, self.offsets, self.sizes, self._each_digest(),
                                                    strict=True))

    def _each_digest(self) -> Iterator[bytes]:
        step = 1 << 12  # blobs a read: a writer's grows a bytearray, a reader's may be a temp file's
        for first in range(0, len(self.digests) // 32, step):
            run = self.digest_run(first, first + step)
            yield from (run[k:k + 32] for k in range(0, len(run), 32))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BlobTable):
            return NotImplemented
        return (self.blocks, self.offsets, self.sizes, self.digest_run(0, len(self))) == \
            (other.blocks, other.offsets, other.sizes, other.digest_run(0, len(other)))


class FileBlobs:
    """By entry number, the blob of each of its files (an array of them): one array for all the entries, where a
    tuple an entry and an int a file took 36 bytes a file more."""

    __slots__ = ("blobs", "starts")

    def __init__(self) -> None:
        self.blobs = array("I")
        self.starts = array("I", [0])  # entry n's blobs are blobs[starts[n]:starts[n + 1]]

    @classmethod
    def unset(cls, counts: Iterable[int]) -> FileBlobs:
        """Room for entries of ``counts`` files each, every blob 0 until set (a writer's, as it reads the files)."""
        table = cls()
        table.starts = array("I", accumulate(counts, initial=0))
        table.blobs = array("I", [0]) * table.starts[-1]
        return table

    def append(self, numbers: Iterable[int]) -> None:
        self.blobs.extend(numbers)
        self.starts.append(len(self.blobs))

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __getitem__(self, n: int) -> array:
        starts = self.starts
        if n < 0:
            n += len(starts) - 1
        if n < 0:
            raise IndexError("no such entry")
        return self.blobs[starts[n]:starts[n + 1]]  # an IndexError past the end

    def __iter__(self) -> Iterator[array]:
        return map(self.__getitem__, range(len(self)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, FileBlobs):
            return NotImplemented
        return (self.blobs, self.starts) == (other.blobs, other.starts)

    def blob(self, n: int, j: int) -> int:
        """The blob of entry ``n``'s file ``j``."""
        n = range(len(self))[n]  # an IndexError past the end, and negative numbers as a sequence has them
        start = self.starts[n]
        if not 0 <= j < self.starts[n + 1] - start:
            raise IndexError("no such file")
        return self.blobs[start + j]


class StoredFiles(LazyFiles):
    """An entry's files as the index records them, each a ``StoredFile`` made as it is read from the blob table:
    a ``StoredFile`` and its size's int a file took 0.1 KB. Making a file costs 0.4 us: loops over many files
    take ``names``, ``sizes`` or ``total_size`` (``Entry.file_names``, ``file_sizes``, ``size``)."""

    __slots__ = ("_blobs", "_number", "_table", "names")

    def __init__(self, names: tuple[str, ...], file_blobs: FileBlobs, number: int, table: BlobTable) -> None:
        self.names = names
        self._blobs = file_blobs
        self._number = number  # the entry's, in ``file_blobs``
        self._table = table

    @property
    def sizes(self) -> array:
        return array("Q", map(self._table.sizes.__getitem__, self._blobs[self._number]))

    @property
    def blobs(self) -> array:
        """The blob of each file, made as it is read (an unpack's plan holds entries, not these)."""
        return self._blobs[self._number]

    @property
    def total_size(self) -> int:
        return sum(map(self._table.sizes.__getitem__, self._blobs[self._number]))

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return tuple(self)[i]
        name = self.names[i]  # an IndexError past the end
        blob = self._blobs.blob(self._number, i if i >= 0 else i + len(self.names))
        return _new_tuple(StoredFile, (name, self._table.sizes[blob], self._table.digest(blob)))

    def __iter__(self) -> Iterator[StoredFile]:
        blobs, table = self._blobs[self._number], self._table
        return map(_new_tuple, repeat(StoredFile), zip(self.names, map(table.sizes.__getitem__, blobs),
                                                       map(table.digest, blobs), strict=True))


class Index(NamedTuple):
    info: ArchiveInfo
    blocks: tuple[Block, ...]
    blobs: BlobTable
    entries: tuple[Entry, ...]
    file_blobs: FileBlobs  # by entry number, the blob of each of its files
    unknown_entries: int = 0  # entries of kinds this reader does not know, ignored


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def _entry_meta(entry: Entry) -> dict:
    if entry.kernel is not None:
        k = entry.kernel
        return _drop_none({
            "backend": k.backend, "arch": k.arch, "warp_size": k.warp_size, "num_warps": k.num_warps,
            "num_stages": k.num_stages, "num_ctas": k.num_ctas, "shared": k.shared,
            "triton_version": k.triton_version, "hash": k.hash, "env": dict(sorted(k.env.items())),
        })
    if entry.autotune is not None:
        a = entry.autotune
        meta = {"function": a.function, "tuning_key": a.tuning_key, "configs": a.configs,
                "best_config": a.best_config, "best_timing": a.best_timing}
        if a.triton_version is not None:
            meta["triton_version"] = a.triton_version
        elif disowned(entry):
            meta["triton_unknown"] = True
        return meta
    if entry.stub is not None:
        s = entry.stub
        return _drop_none({"role": s.role, "ext_suffix": s.ext_suffix, "platform": s.platform,
                           "tag_from": s.tag_from, "triton_version": s.triton_version,
                           "triton_unknown": True if disowned(entry) else None})
    return {}


class IndexEncoding:
    """The index's msgpack bytes, made once and never held: the ``head`` (the keys before the block table) here,
    and the ``blobs`` and ``entries`` after it written to ``spill``, a temp file, as they are packed. A writer
    packs (and checks) them while its last blocks still compress, and adds the table, whose offsets and lengths
    only then exist. The bytes are those of one ``msgpack.packb`` of the whole map, whose keys keep the insertion
    order fixed here. ``blobs``: ``(block, offset, size, sha256)`` of each blob, in order (``BlobRef`` or plain
    tuples); ``entries``: entries as ``Entry`` has them, but whose files need only a ``name`` (a writer's
    sources); ``file_blobs``: by entry, the blob of each of its files (as ``Index.file_blobs``). Held in one
    buffer, they took 0.1 KB a file and twice that while the buffer grew (32 MiB for 163,830 files), at the
    peak of a pack."""

    def __init__(self, info: ArchiveInfo, blobs, entries, file_blobs, spill):
        head = {
            "format": "tpack",
            "version": list(info.format_version),
            "producer": _drop_none({"tritonpack": info.tritonpack, "created": info.created}),
            "python": None if info.python is None else _drop_none(info.python._asdict()),
            "triton": None if info.triton is None else {
                "version": info.triton.version,
                "key_sha256": info.triton.key_sha256,
                "backend_hashes": dict(sorted(info.triton.backend_hashes.items())),
            },
        }
        packer = msgpack.Packer(use_bin_type=True, autoreset=False)  # each pack adds to one buffer
        packer.pack_map_header(len(head) + 3)
        for k, v in head.items():
            packer.pack(k)
            packer.pack(v)
        packer.pack("blocks")
        self.head = packer.bytes()
        packer.reset()
        start = spill.tell()
        # The arrays element by element, as one packb of them would write them, the buffer emptied into the spill
        # every so many elements: a document of all the entries at once took as much memory again as the index.
        packer.pack("blobs")
        packer.pack_array_header(len(blobs))
        for n, (block, offset, size, sha256) in enumerate(blobs, 1):
            packer.pack([block, offset, size, sha256])
            if not n % _SPILL_BLOBS:
                spill.write(packer.bytes())
                packer.reset()
        packer.pack("entries")
        packer.pack_array_header(len(entries))
        for i, e in enumerate(entries):
            packer.pack({"kind": e.kind, "key": e.key, "name": e.name,
                         "files": [[name, blob] for name, blob in zip(names_of(e.files), file_blobs[i], strict=True)],
                         "meta": _entry_meta(e)})
            if not (i + 1) % _SPILL_ENTRIES:
                spill.write(packer.bytes())
                packer.reset()
        spill.write(packer.bytes())
        spill.flush()
        self._tail = FileSpan(spill, start, spill.tell() - start)

    def parts(self, table: bytes) -> list:
        """The index with this block table (``block_table``'s bytes), as consecutive parts: for ``check_index``,
        which reads them without joining them."""
        return [self.head, table, self._tail]

    def size(self, table: bytes) -> int:
        return len(self.head) + len(table) + len(self._tail)

    def chunks(self, table: bytes) -> Iterator[bytes]:
        """The index with this block table, a MiB at a time."""
        yield self.head
        yield table
        tail = self._tail
        for at in range(0, len(tail), _CHUNK):
            yield tail[at:at + _CHUNK]


class FileSpan:
    """``length`` bytes of an open file from ``start``, read as a bytes object is (an item, a slice) with
    ``pread``: what was spilled to a temp file (an index being written, a large index's digests), read where it
    was held. The file stays open while the span is used."""

    def __init__(self, file: BinaryIO, start: int, length: int):
        self._file, self._fd, self._start, self._length = file, file.fileno(), start, length

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, at):
        if isinstance(at, slice):
            first, end, _ = at.indices(self._length)
            return os.pread(self._fd, max(0, end - first), self._start + first) if end > first else b""
        if not 0 <= at < self._length:
            raise IndexError("past the end of the span")
        return os.pread(self._fd, 1, self._start + at)[0]


def block_table(blocks) -> bytes:
    """The index's ``blocks`` array as msgpack: encoded apart from the rest, which a writer encodes before the
    blocks' offsets are known (``IndexEncoding``)."""
    table = []
    for b in blocks:
        fields = {"codec": b.codec, "offset": b.offset, "length": b.length, "size": b.size}
        if b.splices:
            fields["splices"] = [[s.at, s.source, s.source_size, s.length, s.blanks, [list(r) for r in s.replacements]]
                                 for s in b.splices]
        table.append(fields)
    return msgpack.packb(table, use_bin_type=True)


# ---- decoding (hostile input) ----

class _Fields:
    """Typed access to a msgpack map; every failure names the field."""

    def __init__(self, data: Any, where: str, path: str):
        if not isinstance(data, dict):
            raise ArchiveError(f"index: {where} is not a map", path)
        self.data, self.where, self.path = data, where, path

    def get(self, name: str, types, required: bool = True):
        if name not in self.data or self.data[name] is None:
            if required:
                raise ArchiveError(f"index: {self.where}.{name} is missing", self.path)
            return None
        value = self.data[name]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in _as_tuple(types)):
            raise ArchiveError(f"index: {self.where}.{name} has the wrong type", self.path)
        return value

    @overload
    def uint(self, name: str, required: Literal[True] = True, limit: int = 2**63) -> int: ...
    @overload
    def uint(self, name: str, required: bool, limit: int = 2**63) -> int | None: ...

    def uint(self, name: str, required: bool = True, limit: int = 2**63) -> int | None:
        value = self.get(name, int, required)
        if value is not None and not 0 <= value < limit:
            raise ArchiveError(f"index: {self.where}.{name} out of range", self.path)
        return value


def _is_uint(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


def _as_tuple(types) -> tuple:
    return types if isinstance(types, tuple) else (types,)


_UNSAFE = re.compile(r"[/\\\x00]")
# Builds a named tuple from checked values, every field given in order, without its Python-level __new__: three
# times as fast, and the index decode makes one per blob and per file, and two per kernel.
_new_tuple = tuple.__new__


def valid_file_name(name: Any) -> bool:
    """A single path component that is safe on every filesystem we write to."""
    if not isinstance(name, str) or not name or name in (".", "..") or _UNSAFE.search(name):
        return False
    if len(name) * 4 > MAX_NAME_BYTES and len(name.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        return False
    return not name.startswith("tmp.")


def _decode_info(doc: _Fields, version: tuple[int, int], path: str) -> ArchiveInfo:
    producer = _Fields(doc.get("producer", dict), "producer", path)
    python = None
    if doc.data.get("python") is not None:
        p = _Fields(doc.get("python", dict), "python", path)
        python = PythonInfo(
            implementation=p.get("implementation", str), version=p.get("version", str),
            cache_tag=p.get("cache_tag", str, False), ext_suffix=p.get("ext_suffix", str, False),
            platform=p.get("platform", str),
        )
    triton = None
    if doc.data.get("triton") is not None:
        t = _Fields(doc.get("triton", dict), "triton", path)
        hashes = t.get("backend_hashes", dict, False) or {}
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in hashes.items()):
            raise ArchiveError("index: triton.backend_hashes has the wrong type", path)
        triton = TritonInfo(version=t.get("version", str), key_sha256=t.get("key_sha256", str, False),
                            backend_hashes=dict(hashes))
    return ArchiveInfo(
        tritonpack=producer.get("tritonpack", str),
        format_version=version,
        created=producer.uint("created", required=False),
        python=python,
        triton=triton,
    )


def _depth(value: Any) -> int:
    """Nesting depth of a msgpack value, stopping early once past the limit."""
    depth, level = 0, [value]
    while level and depth <= MAX_META_DEPTH:
        level = [v for x in level if isinstance(x, (list, dict)) for v in (x.values() if isinstance(x, dict) else x)]
        depth += 1
    return depth if not level else MAX_META_DEPTH + 1


_KERNEL_UINTS = ("warp_size", "num_warps", "num_stages", "num_ctas", "shared")
_NO_ENV = ("env",)  # in a decode's shared objects: the key of the empty env, the first item of the others'
_KERNEL_STRS = ("backend", "triton_version", "hash")


def _kernel_fast(m: dict, shared: dict) -> KernelInfo | None:
    """A group's metadata in the well-formed case, checked without helpers (thousands per index); ``None`` sends
    the caller to ``_decode_meta``, which names the first problem. Its backend, arch, Triton version, numbers
    and env are kept once (``shared``): msgpack makes an object of each for every entry (an empty env's dict and
    a shared memory size's int took 90 bytes a group)."""
    env = m.get("env")
    if env is None:
        env = shared.setdefault(_NO_ENV, {})
    elif type(env) is not dict or not all(type(k) is str and type(v) is str for k, v in env.items()):
        return None
    else:
        env = shared.setdefault((_NO_ENV, *env.items()), env)
    arch = m.get("arch")
    if arch is not None and type(arch) is not int and type(arch) is not str:
        return None
    for name in _KERNEL_UINTS:
        value = m.get(name)
        if value is not None and (type(value) is not int or not 0 <= value < 2**63):
            return None
    for name in _KERNEL_STRS:
        value = m.get(name)
        if value is not None and type(value) is not str:
            return None
    backend, version, size = m.get("backend"), m.get("triton_version"), m.get("shared")
    return _new_tuple(KernelInfo, (
        backend if backend is None else shared.setdefault(backend, backend),
        arch if type(arch) is not str else shared.setdefault(arch, arch), m.get("warp_size"), m.get("num_warps"),
        m.get("num_stages"), m.get("num_ctas"), size if size is None else shared.setdefault(size, size),
        version if version is None else shared.setdefault(version, version), m.get("hash"), env))


def _decode_meta(kind: str, meta: _Fields) -> tuple[KernelInfo | None, AutotuneInfo | None, StubInfo | None]:
    """An entry's ``(kernel, autotune, stub)``, one of them set by its kind; the first problem raises."""
    if kind == GROUP:
        env = meta.get("env", dict, False) or {}
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
            raise ArchiveError(f"index: {meta.where}.env has the wrong type", meta.path)
        arch = meta.get("arch", (int, str), False)
        return KernelInfo(
            backend=meta.get("backend", str, False), arch=arch, warp_size=meta.uint("warp_size", False),
            num_warps=meta.uint("num_warps", False), num_stages=meta.uint("num_stages", False),
            num_ctas=meta.uint("num_ctas", False), shared=meta.uint("shared", False),
            triton_version=meta.get("triton_version", str, False), hash=meta.get("hash", str, False),
            env=env), None, None
    if kind == AUTOTUNE:
        for name in ("tuning_key", "best_config"):
            if _depth(meta.data.get(name)) > MAX_META_DEPTH:
                raise ArchiveError(f"index: {meta.where}.{name} is nested too deeply", meta.path)
        timing = meta.get("best_timing", list, False) or []
        if not all(isinstance(t, (int, float)) and not isinstance(t, bool) for t in timing):
            raise ArchiveError(f"index: {meta.where}.best_timing has the wrong type", meta.path)
        return None, AutotuneInfo(
            function=meta.get("function", str), tuning_key=meta.get("tuning_key", list, False) or [],
            configs=meta.uint("configs", False) or 0, best_config=meta.get("best_config", dict, False) or {},
            best_timing=[float(t) for t in timing], triton_version=meta.get("triton_version", str, False),
            triton_unknown=meta.get("triton_unknown", bool, False) or False), None
    return None, None, StubInfo(
        role=meta.get("role", str), ext_suffix=meta.get("ext_suffix", str, False),
        platform=meta.get("platform", str, False), tag_from=meta.get("tag_from", str, False),
        triton_version=meta.get("triton_version", str, False),
        triton_unknown=meta.get("triton_unknown", bool, False) or False)


def decode_blocks(raw_blocks: list, path: str) -> list[Block]:
    """The index's block table, checked: each block's fields, and blocks in order without overlap."""
    blocks: list[Block] = []
    end = None
    for n, raw_block in enumerate(raw_blocks):
        b = _Fields(raw_block, f"blocks[{n}]", path)
        block = Block(offset=b.uint("offset"), length=b.uint("length"), size=b.uint("size", limit=MAX_BLOCK_SIZE + 1),
                      codec=b.get("codec", str))
        if block.codec == CODEC_ZSTD_SPLICE:
            block = block._replace(splices=_decode_splices(b.get("splices", list), block.size, f"blocks[{n}]", path))
        if end is not None and block.offset < end:
            raise ArchiveError(f"index: blocks[{n}] overlaps the previous block", path)
        end = block.offset + block.length
        blocks.append(block)
    return blocks


# Reader policy (spec §7): the sources of a block's splices, each read once to derive a text, add up to at most this
# many times the block's size (a writer's add up to at most its size: each .ptx serves one cubin).
MAX_SPLICE_SOURCES = 4


def _decode_splices(raw: list, size: int, where: str, path: str) -> tuple[Splice, ...]:
    """A block's splices, checked: each in the content after the previous one, its source before it and in no
    splice, all of them within the block's size."""
    splices: list[Splice] = []
    ends: list[int] = []
    sources = 0
    if not raw:
        raise ArchiveError(f"index: {where}.splices is empty", path)
    for k, item in enumerate(raw):
        if type(item) is not list or len(item) != 6 or not all(_is_uint(v) for v in item[:4]) or \
                type(item[4]) is not bytes or type(item[5]) is not list:
            raise ArchiveError(f"index: {where}.splices[{k}] is malformed", path)
        at, source, source_size, length, blanks, raw_replacements = item
        replacements: list[tuple[int, bytes]] = []
        for r in raw_replacements:
            if type(r) is not list or len(r) != 2 or not _is_uint(r[0]) or type(r[1]) is not bytes or \
                    (replacements and r[0] <= replacements[-1][0]):
                raise ArchiveError(f"index: {where}.splices[{k}] has a malformed replacement", path)
            replacements.append((r[0], r[1]))
        first = bisect_right(ends, source)  # the splices that end before the source: the next must start after it
        if length == 0 or at < (ends[-1] if ends else 0) or at + length > size or source + source_size > at or \
                (first < len(splices) and splices[first].at < source + source_size):
            raise ArchiveError(f"index: {where}.splices[{k}] lies outside its place", path)
        sources += source_size
        if sources > MAX_SPLICE_SOURCES * size:
            raise ArchiveError(f"index: {where}.splices derive from more than {MAX_SPLICE_SOURCES}x the block's "
                               "bytes (reader limit)", path)
        splices.append(Splice(at, source, source_size, length, blanks, tuple(replacements)))
        ends.append(at + length)
    return tuple(splices)


class _Parts:
    """Consecutive byte strings read as one index, never joined."""

    def __init__(self, parts: list[bytes]):
        self._parts = parts
        self._starts = [0, *accumulate(map(len, parts))]
        self._position = 0  # of ``read``

    def __len__(self) -> int:
        return self._starts[-1]

    def __getitem__(self, at: int) -> int:
        k = bisect_right(self._starts, at) - 1
        return self._parts[k][at - self._starts[k]]

    def read(self, size: int) -> bytes:
        end = min(len(self), self._position + size)
        pieces = []
        while self._position < end:
            k = bisect_right(self._starts, self._position) - 1
            start = self._position - self._starts[k]
            piece = self._parts[k][start:start + end - self._position]
            pieces.append(piece)
            self._position += len(piece)
        return b"".join(pieces)


class _BadMap(Exception):
    """Raised inside msgpack decoding: a map whose keys are not distinct strings."""


def _checked_maps(spend: Callable[[dict], dict] | None) -> Callable[[list], dict]:
    """msgpack's ``object_pairs_hook`` for an index: each map's keys checked as it is built, because the spec
    (§4) allows only str keys, none twice, at every level (a bin key or a repeated one would mean what each
    parser makes of it), then spent for with ``spend`` (the budget's, where it counts). It cost 0.3 us a map, 10%
    of decoding the real cache's index."""

    def checked(pairs: list) -> dict:
        fields = dict(pairs)
        if len(fields) != len(pairs):
            seen: set = set()
            twice = next(key for key, _ in pairs if key in seen or seen.add(key))  # type: ignore[func-returns-value]  # add's None: the key is new
            raise _BadMap(f"a map holds the key {twice!r:.60} twice")
        for key in fields:
            if type(key) is not str:
                raise _BadMap(f"a map key is not a string ({type(key).__name__})")
        return fields if spend is None else spend(fields)

    return checked


def _unpacker(raw, object_hook: Callable[[dict], dict] | None = None, **options) -> msgpack.Unpacker:
    """An unpacker that reads through a view of ``raw``: one fed ``raw`` copies the whole index into its buffer.
    Every map goes through ``_checked_maps``, then ``object_hook``. ``strict_map_key`` keeps keys other than str
    and bin out of the dicts (an int key's hash is chosen by the input)."""
    source = io.BytesIO(raw) if isinstance(raw, (bytes, bytearray, memoryview)) else raw
    return msgpack.Unpacker(source, read_size=_READ_SIZE, max_buffer_size=max(len(raw), _READ_SIZE),
                            raw=False, strict_map_key=True, object_pairs_hook=_checked_maps(object_hook), **options)


@contextlib.contextmanager
def _collector_paused():
    """The cyclic collector paused: a large index makes tens of thousands of objects, none of them in a cycle,
    and a full collection over them was 15% of a `list`."""
    collecting = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if collecting:
            gc.enable()


def decode_index(raw, path: str, version: tuple[int, int],
                 on_head: Callable[[list[Block]], None] | None = None,
                 on_blobs: Callable[[BlobTable], None] | None = None) -> Index:
    """Decode and check an index: its bytes, or a file-like object that also gives the byte at a position it has
    just read (``reader.IndexStream``). Where the index is in a writer's order, ``on_head`` is called with the
    checked block table before the blobs are decoded, and ``on_blobs`` with the checked blob table before the
    entries."""
    with _collector_paused():
        return _decode_index(raw, path, version, on_head=on_head, on_blobs=on_blobs)


def check_index(parts: list[bytes], path: str, version: tuple[int, int]) -> None:
    """Every check of ``decode_index`` on the index made of ``parts``, without joining them and without keeping
    the blobs and entries it decodes: a writer checks its own index so, at the end of a pack, where a decoded copy
    beside the writer's own model took 0.4 KB more a file, and the joined index and the blobs 0.25 KB more."""
    with _collector_paused():
        try:
            _decode_index(_Parts(parts), path, version, keep=False)
        except _OutOfOrder:  # the entries' keys are not in order: checked again, each against all the others
            _decode_index(_Parts(parts), path, version, keep=False, in_order=False)


# The keys a writer puts before ``blobs`` and ``entries`` (``IndexEncoding``). Where an index has them first, its
# two long arrays are read element by element as msgpack decodes them and checked as they come; otherwise as part
# of one document. The checks, and their order, are the same either way.
_HEAD_KEYS = frozenset({"format", "version", "producer", "python", "triton", "blocks"})
_ARRAY_HEADS = frozenset({*range(0x90, 0xA0), 0xDC, 0xDD})  # msgpack's type bytes of an array
_MAP_HEADS = frozenset({*range(0x80, 0x90), 0xDE, 0xDF})  # and of a map


def _decode_index(raw, path: str, version: tuple[int, int], keep: bool = True,
                  on_head: Callable[[list[Block]], None] | None = None,
                  on_blobs: Callable[[BlobTable], None] | None = None, in_order: bool = True) -> Index:
    """Its arrays of blobs and entries are read one element at a time: a whole msgpack document beside the objects
    made from it took twice the memory of the index alone (57 MB against 29 for 55,000 files), the peak of every
    ``list`` and of an unpack's parent."""
    budget = IndexBudget(len(raw))
    unpacker = _unpacker(raw, use_list=True, **budget.unpack_options())
    if not raw or raw[0] not in _MAP_HEADS:  # not a map: the document's own check says so
        data = _unpacked(unpacker.unpack, path)
        _check_end(unpacker, len(raw), path)
        return _decode_document(data, path, version, keep, in_order)
    fields: dict[str, Any] = {}
    head: tuple[ArchiveInfo, list[Block]] | None = None
    blobs: BlobTable | range | None = None
    decoded: tuple[list[Entry], FileBlobs, int] | None = None
    count = _unpacked(unpacker.read_map_header, path)
    _spend_header(budget, count, 4 + 2 * count, path)  # as msgpack's ``object_hook`` would have for the map
    for _ in range(count):
        key = _unpacked(unpacker.unpack, path)
        if type(key) is not str:  # as ``_checked_maps`` refuses a key within a value
            raise ArchiveError(f"index: a map key is not a string ({type(key).__name__})", path)
        if key in fields:
            raise ArchiveError(f"index: key {key!r} appears twice", path)
        at = unpacker.tell()
        array = at < len(raw) and raw[at] in _ARRAY_HEADS
        if key == "blobs" and array and fields.keys() >= _HEAD_KEYS:
            head = _decode_head(_Fields(fields, "index", path), version, path)
            if on_head is not None and keep:
                on_head(head[1])
            blobs = _decode_blobs(_elements(unpacker, budget, path), [b.size for b in head[1]], path, keep)
            fields[key] = None
            if on_blobs is not None and keep:
                on_blobs(cast(BlobTable, blobs))  # kept: a table
        elif key == "entries" and array and blobs is not None:
            decoded = _decode_entries(_elements(unpacker, budget, path), blobs, path, keep, in_order)
            fields[key] = None
        else:
            fields[key] = _unpacked(unpacker.unpack, path)
    _check_end(unpacker, len(raw), path)
    if head is None or blobs is None:  # not in a writer's order: as one document
        return _decode_document(fields, path, version, keep, in_order)
    if decoded is None:
        decoded = _decode_entries(_Fields(fields, "index", path).get("entries", list), blobs, path, keep, in_order)
    info, blocks = head
    entries, file_blobs, unknown = decoded
    return Index(info, tuple(blocks), cast(BlobTable, blobs) if keep else BlobTable(), tuple(entries),
                 file_blobs, unknown)


def _unpacked(read, path: str):
    """``read()`` of msgpack, its errors (several unrelated types on bad input) and the budget's as ``ArchiveError``."""
    try:
        return read()
    except ArchiveError:  # from an ``IndexStream`` that msgpack reads
        raise
    except _BadMap as e:
        raise ArchiveError(f"index: {e}", path) from None
    except IndexTooLarge as e:
        raise _past_value_limit(e.args[0], path) from None
    except Exception as e:
        raise ArchiveError(f"index is not valid msgpack ({type(e).__name__})", path) from None


def _past_value_limit(limit: int, path: str) -> ReaderLimitError:
    return ReaderLimitError(f"index holds more than {limit} values, the reader's limit (set {ENV_MAX_INDEX_VALUES} "
                            "to raise it)", path)


def _spend_header(budget: IndexBudget, count: int, cost: int, path: str) -> None:
    """A map's or array's length, read by hand: refused past the length msgpack's own limit allows, and spent for
    as its hooks would have. A length past the limit is past the values it allows (an array costs one more than
    its length); one past the index's bytes, under the limit, cannot be (each element takes a byte at least)."""
    if count > budget.limit:
        raise _past_value_limit(budget.limit, path)
    if count > budget.most:
        raise ArchiveError("index is not valid msgpack (ValueError)", path)
    if budget.counted:
        _unpacked(lambda: budget.spend(cost), path)


def _check_end(unpacker: msgpack.Unpacker, size: int, path: str) -> None:
    if unpacker.tell() != size:
        raise ArchiveError("index is not valid msgpack (ExtraData)", path)


def _elements(unpacker: msgpack.Unpacker, budget: IndexBudget, path: str):
    """The elements of the array at the unpacker's position, one at a time, the array spent for as msgpack's
    ``list_hook`` would have."""
    count = _unpacked(unpacker.read_array_header, path)
    _spend_header(budget, count, 1 + count, path)
    unpack = unpacker.unpack
    for _ in range(count):
        yield _unpacked(unpack, path)


def _decode_document(data: Any, path: str, version: tuple[int, int], keep: bool, in_order: bool = True) -> Index:
    """An index read as one msgpack document (keys in another order than a writer's)."""
    doc = _Fields(data, "index", path)
    info, blocks = _decode_head(doc, version, path)
    blobs = _decode_blobs(doc.get("blobs", list), [b.size for b in blocks], path, keep)
    entries, file_blobs, unknown = _decode_entries(doc.get("entries", list), blobs, path, keep, in_order)
    return Index(info, tuple(blocks), cast(BlobTable, blobs) if keep else BlobTable(), tuple(entries),
                 file_blobs, unknown)


def _decode_head(doc: _Fields, version: tuple[int, int], path: str) -> tuple[ArchiveInfo, list[Block]]:
    if doc.get("format", str) != "tpack":
        raise ArchiveError("index: not a tpack index", path)
    declared = doc.get("version", list)
    if not (len(declared) == 2 and all(_is_uint(v) for v in declared)):
        raise ArchiveError("index: version has the wrong type", path)
    if declared[0] != version[0]:
        raise ArchiveError(f"index: version {declared[0]}.{declared[1]} does not match the header's "
                           f"{version[0]}.x", path)
    return _decode_info(doc, version, path), decode_blocks(doc.get("blocks", list), path)


def _decode_blobs(raw_blobs, block_sizes: list[int], path: str, keep: bool = True) -> BlobTable | range:
    """The blobs, checked; unless ``keep``, only how many there are (``range``: what the entries' checks need).
    Past ``HELD_DIGESTS`` of them, their digests go to a temp file as they come (``SpilledRun``): held, they took
    32 bytes a blob, and as much again while the buffer that grew was copied."""
    blobs = BlobTable()
    run = SpilledRun(32 * HELD_DIGESTS)
    # A buffer grown a digest at a time, handed to the run every few thousand: a list of them, joined at the end,
    # held 73 bytes a blob more (the bytes object and its slot) and made the peak of reading 154,830 blobs 39 MB.
    digests = bytearray()
    add_block, add_offset, add_size, add_digest = \
        blobs.blocks.append, blobs.offsets.append, blobs.sizes.append, digests.extend
    n = -1
    for n, raw_blob in enumerate(raw_blobs):  # tens of thousands: plain checks, no helpers
        if type(raw_blob) is not list or len(raw_blob) != 4:
            raise ArchiveError(f"index: blobs[{n}] is malformed", path)
        block, offset, size, digest = raw_blob
        if type(block) is not int or type(offset) is not int or type(size) is not int or \
                block < 0 or offset < 0 or size < 0:
            raise ArchiveError(f"index: blobs[{n}] is malformed", path)
        if type(digest) is not bytes or len(digest) != 32:
            raise ArchiveError(f"index: blobs[{n}] has no valid sha256", path)
        if block >= len(block_sizes) or offset + size > block_sizes[block]:
            raise ArchiveError(f"index: blobs[{n}] points outside its block", path)
        if keep:
            add_block(block)
            add_offset(offset)
            add_size(size)
            add_digest(digest)
            if len(digests) >= _DIGESTS_A_WRITE:
                run.append(digests)
                del digests[:]
    run.append(digests)
    del digests
    blobs.digests = run.finished()
    return blobs if keep else range(n + 1)


class _Spill:
    """Bytes appended to a temp file: all of an ``append`` or none of it."""

    def __init__(self, file: BinaryIO):
        self.file, self.size = file, 0

    @staticmethod
    def made() -> _Spill | None:
        """A new one; None where no temp file can be made (a missing or read-only temp directory)."""
        import tempfile  # 3 ms of imports that the reading of a small index, its usual case, does not pay

        try:
            return _Spill(tempfile.TemporaryFile(buffering=0))
        except OSError:
            return None

    def append(self, data: bytearray) -> bool:
        """False where the file could not take it all (a full temp directory): it then holds what it held."""
        view = memoryview(data)
        try:
            while view:
                view = view[self.file.write(view):]
        except OSError:
            os.ftruncate(self.file.fileno(), self.size)
            return False
        finally:
            view.release()
        self.size += len(data)
        return True


class SpilledRun:
    """Bytes appended at the end and read as bytes are (slices), written to a temp file ``held`` at a time as they
    come (``_Spill``). Blob digests, 32 bytes a blob: a writer's as it reads, a reader's as it decodes. Held where
    no temp file can be made or written."""

    def __init__(self, held: int):
        self._held = held
        self._spill: _Spill | None = None
        self._spilling = True  # until a temp file cannot be made or written
        self._tail = bytearray()

    def __len__(self) -> int:
        return (self._spill.size if self._spill is not None else 0) + len(self._tail)

    def append(self, data: bytes | bytearray) -> None:
        tail = self._tail
        tail += data
        if self._spilling and len(tail) >= self._held:
            self._spill = self._spill or _Spill.made()
            self._write_tail()

    def finished(self) -> bytes | FileSpan:
        """All of it, done growing: a temp file's (the last bytes written too), or bytes where it is held."""
        if self._spill is not None and self._write_tail():
            return FileSpan(self._spill.file, 0, self._spill.size)
        return bytes(self._tail)

    def _write_tail(self) -> bool:
        """Move the held bytes to the temp file; where it takes none (none made, or full), hold from now on what it
        had taken too, and close it."""
        spill = self._spill
        if spill is not None and spill.append(self._tail):
            del self._tail[:]
            return True
        if spill is not None:
            self._tail[0:0] = os.pread(spill.file.fileno(), spill.size, 0)
            spill.file.close()
        self._spill, self._spilling = None, False
        return False

    def __getitem__(self, at: slice) -> bytes:
        first, end, _ = at.indices(len(self))
        split = self._spill.size if self._spill is not None else 0
        head = os.pread(self._spill.file.fileno(), min(end, split) - first, first) if first < min(end, split) else b""  # type: ignore[union-attr]  # split > 0: spilled
        return head + bytes(self._tail[max(first, split) - split:end - split]) if end > split else head


def _decode_entries(raw_entries, blobs: BlobTable | range, path: str, keep: bool = True,
                    in_order: bool = True) -> tuple[list[Entry], FileBlobs, int]:
    """The entries, checked (none kept unless ``keep``), their blobs, and the number of unknown kinds skipped.

    Two entries must never be one, nor write one file. In a writer's order, a key's entries side by side, each is
    checked against the others of its key only, and what the checks hold is let go at the next key: checked
    against all the entries before, they held 0.42 KB an entry (10 MB for 163,830 files, traced).
    Past an entry out of order, each is checked against all the others: those kept so far, or (``_OutOfOrder``:
    none kept) those of the index decoded again with ``in_order`` False."""
    entries: list[Entry] = []
    file_blobs = FileBlobs()
    seen: set[tuple[str, str, str]] = set()
    # key -> file names written there: two entries must never write one file
    claimed: dict[str, tuple[str, ...] | set[str]] = {}
    current = None  # the key of the entries before, in order
    # Names already validated, each kept once: the configurations of one kernel share their file names, and so
    # many entries share one str instead of a copy each.
    good_names: dict[str, str] = {}
    # And group names already validated, with their manifest's name, each kept once: a kernel's configurations
    # share its name (the real cache's 780 groups have 23 names)
    group_names: dict[str, str] = {}
    # Each entry's tuple of file names, kept once: the configurations of one kernel list the same names
    name_tuples: dict[tuple[str, ...], tuple[str, ...]] = {}
    shared: dict = {}  # the kinds, and the kernels' backends, archs, versions, numbers and envs, each kept once
    unknown = 0
    kind: Any  # checked to be str where they are used (``type(...) is str`` below, which mypy does not follow)
    key: Any
    name: Any
    meta: tuple[KernelInfo | None, AutotuneInfo | None, StubInfo | None]
    table = cast(BlobTable, blobs)  # where ``keep``, the only place it is used as one
    for n, raw_entry in enumerate(raw_entries):
        if type(raw_entry) is dict:  # the usual case, without per-field helpers
            kind, key, name = raw_entry.get("kind"), raw_entry.get("key"), raw_entry.get("name")
            raw_files, raw_meta = raw_entry.get("files"), raw_entry.get("meta")
        if type(raw_entry) is not dict or type(kind) is not str or (kind in KINDS and not (
                type(key) is str and type(name) is str and type(raw_files) is list)):
            e = _Fields(raw_entry, f"entries[{n}]", path)  # names the first problem
            kind = e.get("kind", str)
            if kind in KINDS:
                key, name, raw_files = e.get("key", str), e.get("name", str), e.get("files", list)
        if kind not in KINDS:
            unknown += 1
            continue
        if not KEY_RE.fullmatch(key):
            raise ArchiveError(f"index: entries[{n}] has an invalid cache key {key!r}", path)
        known = group_names.get(name) if kind == GROUP else None
        if known is not None:
            name = known
        else:
            if not valid_file_name(name) or (kind == GROUP and not valid_file_name(manifest_name(name))):
                raise ArchiveError(f"index: entries[{n}] has an invalid name {name!r}", path)
            if kind == GROUP:
                group_names[name] = name
        if key != current and in_order:
            if current is not None and key < current:
                if not keep:
                    raise _OutOfOrder
                in_order = False
                seen, claimed = _checked_so_far(entries)
            else:
                seen.clear()
                claimed.clear()
            current = key
        if (key, kind, name) in seen:
            raise ArchiveError(f"index: duplicate entry {key}/{name}", path)
        seen.add((key, kind, name))
        file_names: list[str] = []
        numbers: list[int] = []
        names: set[str] = set()
        if not raw_files:
            raise ArchiveError(f"index: entries[{n}] has no files", path)
        for j, raw_file in enumerate(raw_files):
            if type(raw_file) is not list or len(raw_file) != 2:
                raise ArchiveError(f"index: entries[{n}].files[{j}] is malformed", path)
            fname, blob = raw_file
            known = good_names.get(fname) if type(fname) is str else None
            if known is not None:
                fname = known
            else:
                if not valid_file_name(fname) or fname.startswith("__grp__"):
                    raise ArchiveError(f"index: entries[{n}] has an invalid file name {fname!r}", path)
                good_names[fname] = fname
            if fname in names:
                raise ArchiveError(f"index: entries[{n}] lists {fname} twice", path)
            if type(blob) is not int or not 0 <= blob < len(blobs):
                raise ArchiveError(f"index: entries[{n}].files[{j}] points to no blob", path)
            names.add(fname)
            if keep:
                file_names.append(fname)
                numbers.append(blob)
        if kind != GROUP and (len(names) != 1 or name not in names):
            raise ArchiveError(f"index: entries[{n}] must hold exactly the file {name}", path)
        if kind == GROUP:
            if f"{name}.json" not in names:
                raise ArchiveError(f"index: entries[{n}] has no kernel metadata {name}.json", path)
            names.add(manifest_name(name))
        taken = claimed.get(key)
        if taken is None:  # a tuple: a set an entry took 0.7 KB while the index decodes (15 MB for 23,000 groups)
            claimed[key] = tuple(names)
        elif not names.isdisjoint(taken):
            raise ArchiveError(f"index: {key}/{min(names.intersection(taken))} is claimed by two entries", path)
        elif type(taken) is tuple:  # a key's second entry (an autotune result beside a group): a set from here
            claimed[key] = names.union(taken)
        else:
            taken |= names  # type: ignore[operator]  # a set: tuples are replaced just above
        kernel = _kernel_fast(raw_meta, shared) if kind == GROUP and type(raw_meta) is dict else None
        if kernel is not None:
            meta = (kernel, None, None)
        else:
            if raw_meta is not None and type(raw_meta) is not dict:
                raise ArchiveError(f"index: entries[{n}].meta has the wrong type", path)
            meta = _decode_meta(kind, _Fields(raw_meta or {}, f"entries[{n}].meta", path))
        if keep:
            file_blobs.append(numbers)
            names_kept = tuple(file_names)
            files = StoredFiles(name_tuples.setdefault(names_kept, names_kept), file_blobs, len(file_blobs) - 1, table)
            entries.append(_new_tuple(Entry, (shared.setdefault(kind, kind), key, name, files, *meta)))
    return entries, file_blobs, unknown


class _OutOfOrder(Exception):
    """An entry whose key comes before the key of the one before it, where the entries were not kept."""


def _checked_so_far(entries: list[Entry]) -> tuple[set[tuple[str, str, str]], dict[str, tuple[str, ...] | set[str]]]:
    """What ``_decode_entries`` checks each entry against, for all of ``entries``: the entries, and the file
    names claimed in each key."""
    seen: set[tuple[str, str, str]] = set()
    claimed: dict[str, set[str]] = {}
    for e in entries:
        seen.add((e.key, e.kind, e.name))
        names = claimed.setdefault(e.key, set())
        names.update(e.file_names)
        if e.kind == GROUP:
            names.add(manifest_name(e.name))
    return seen, cast("dict[str, tuple[str, ...] | set[str]]", claimed)  # the sets as the caller's values


__all__ = ["Block", "BlobRef", "BlobTable", "FileBlobs", "StoredFiles", "Index", "IndexEncoding", "FileSpan",
           "SpilledRun", "HELD_DIGESTS", "decode_index", "check_index", "decode_blocks", "block_table",
           "valid_file_name", "CODEC_ZSTD", "CODEC_ZSTD_SPLICE", "FILE"]
