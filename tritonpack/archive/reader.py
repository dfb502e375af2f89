"""Reading a ``.tpack`` archive: the index alone for listing, blocks on demand for extraction.

Opening reads the header, the trailer and the index, nothing of the data region. ``iter_blobs`` decodes only
the blocks that hold the wanted contents, several at a time, and verifies every sha256 before yielding.
"""
from __future__ import annotations

import hashlib
import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

import zstandard

from ..errors import ArchiveError, IntegrityError
from ..model import ArchiveInfo, Entry
from .format import HEADER_SIZE, IN_FLIGHT, TRAILER_SIZE, parse_header, parse_trailer
from .index import CODEC_ZSTD, CODEC_ZSTD_SPLICE, BlobTable, Block, Index, decode_index
from .limits import check_block_expansion, check_expansion, check_ratio
from .source import ByteSource, LocalFile
from .splice import BlockContent

if TYPE_CHECKING:
    from mmap import mmap


def _check_frame(data: bytes | memoryview, size: int, what: str, path: str) -> None:
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError:
        raise ArchiveError(f"{what} is not a zstd frame", path) from None
    if params.content_size == zstandard.CONTENTSIZE_UNKNOWN:
        raise ArchiveError(f"{what} is a zstd frame without a content size", path)
    if params.content_size != size:
        raise ArchiveError(f"{what} declares {params.content_size} bytes, the index says {size}", path)


def _decompress(data: bytes, size: int, what: str, path: str) -> bytes:
    _check_frame(data, size, what, path)
    try:
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise ArchiveError(f"{what} is corrupt ({e})", path) from None
    if len(out) != size:
        raise ArchiveError(f"{what} holds {len(out)} bytes, the index says {size}", path)
    return out


def _frame_length(data: bytes) -> int:
    """Bytes of the zstd frame at the start of ``data``, from its block headers (RFC 8878 §3.1.1); ValueError
    where they run past its end."""
    descriptor = data[4]
    at = zstandard.frame_header_size(data)
    while True:
        if at + 3 > len(data):
            raise ValueError("a block header past the end")
        header = int.from_bytes(data[at:at + 3], "little")
        kind = header >> 1 & 3
        if kind == 3:
            raise ValueError("a block of the reserved type")
        at += 3 + (1 if kind == 1 else header >> 3)  # an RLE block holds one byte
        if header & 1:  # the last block
            break
    at += 4 if descriptor & 4 else 0  # the content checksum
    if at > len(data):
        raise ValueError("a block past the end")
    return at


def _decompress_into(data: bytes, size: int, buffer: mmap | bytearray, what: str, path: str) -> memoryview:
    """``_decompress`` into ``buffer`` (writable, at least ``size`` bytes), which a worker keeps for its next
    block: one block's memory a worker, touched once. A new bytes object a block took fresh pages each time, and a
    worker's heap, fragmented by what it allocated between blocks, grew to two blocks (84 MB where one is 33)."""
    _check_frame(data, size, what, path)
    try:
        if _frame_length(data) != len(data):
            raise ArchiveError(f"{what} is corrupt (bytes after its frame)", path)
    except (ValueError, IndexError, zstandard.ZstdError) as e:
        raise ArchiveError(f"{what} is corrupt ({e})", path) from None
    view = memoryview(buffer)[:size]
    got = 0
    try:
        reader = zstandard.ZstdDecompressor().stream_reader(data)
        while got < size:
            n = reader.readinto(view[got:])
            if not n:
                break
            got += n
        more = reader.readinto(bytearray(1)) if got == size else 0
    except zstandard.ZstdError as e:
        raise ArchiveError(f"{what} is corrupt ({e})", path) from None
    if got != size or more:
        raise ArchiveError(f"{what} holds {'more than ' if more else ''}{got} bytes, the index says {size}", path)
    return view


INDEX_CHUNK = 1 << 18  # compressed bytes of the index read at a time
FRAME_HEADER_MAX = 18  # bytes of a zstd frame header at most (RFC 8878 §3.1.1.1)


def _chunks(read_at: Callable[[int, int], bytes | memoryview], offset: int,
            length: int) -> Iterator[bytes | memoryview]:
    """The ``length`` bytes at ``offset``, ``INDEX_CHUNK`` at a time, until a short read (a truncated archive: the
    digest, or the frame, then says so)."""
    end = offset + length
    while offset < end:
        chunk = read_at(offset, min(INDEX_CHUNK, end - offset))
        if chunk:
            yield chunk
        if len(chunk) < min(INDEX_CHUNK, end - offset):
            return
        offset += len(chunk)


def _held(data: bytes) -> Callable[[int, int], memoryview]:
    view = memoryview(data)
    return lambda offset, length: view[offset:offset + length]


class IndexStream:
    """The index's zstd frame, decompressed as msgpack reads it (``read``), never whole, and the byte at which a
    value starts (``stream[at]``: ``decode_index`` looks there for its arrays). The whole decompressed index, held
    while it decoded, was 18 MB of the 56 MB that decoding the index of 163,830 files peaked at (0.11 KB a file).
    A local archive's compressed index is read twice instead of held: once for its digest, once as it decodes."""

    def __init__(self, chunks: Iterator[bytes | memoryview], size: int, path: str):
        self._chunks = chunks
        self._size, self.path = size, path
        self._decompressor = zstandard.ZstdDecompressor().decompressobj()
        self._window = b""  # the decompressed bytes [_start, _end): the last output, handed out or looked at
        self._start = self._end = 0
        self._given = 0  # bytes handed to ``read``
        self._first = True

    def __len__(self) -> int:
        return self._size

    def _more(self) -> bytes:
        """The next decompressed bytes, b"" at the end of the frame."""
        while not self._decompressor.eof:
            chunk = next(self._chunks, None)
            if chunk is None:
                raise ArchiveError("index is corrupt (its frame does not end)", self.path)
            if self._first:  # the frame's header whole, whatever the chunks
                while len(chunk) < FRAME_HEADER_MAX and (more := next(self._chunks, None)) is not None:
                    chunk = bytes(chunk) + more  # a memoryview (a remote archive's chunk) has no +
                _check_frame(chunk, self._size, "index", self.path)
                self._first = False
            try:
                out = self._decompressor.decompress(chunk)
            except zstandard.ZstdError as e:
                raise ArchiveError(f"index is corrupt ({e})", self.path) from None
            if self._end + len(out) > self._size:
                raise ArchiveError(f"index holds more than {self._size} bytes, the index says {self._size}",
                                   self.path)
            if out:
                return out
        return b""

    def _advance(self) -> bool:
        out = self._more()
        self._window, self._start = out, self._end
        self._end += len(out)
        return bool(out)

    def read(self, n: int) -> bytes:
        if self._given == self._end and not self._advance():
            return b""
        at = self._given - self._start
        piece = self._window[at:at + n]
        self._given += len(piece)
        return piece

    def __getitem__(self, at: int) -> int:
        """The byte at ``at``, in what ``read`` handed out last or just after it; -1 past the end, or where it was
        dropped already (the value is then read as a whole)."""
        if at == self._end and self._given == self._end:
            self._advance()
        return self._window[at - self._start] if self._start <= at < self._end else -1

    def finish(self) -> None:
        """After the decode has read ``size`` bytes: check that the frame ends there, with nothing after it."""
        if self._end == self._size and self._more():
            raise ArchiveError(f"index holds more than {self._size} bytes, the index says {self._size}", self.path)
        if not self._decompressor.eof:
            raise ArchiveError("index is corrupt (its frame does not end)", self.path)
        if any(self._chunks) or self._decompressor.unused_data:
            raise ArchiveError("index is corrupt (bytes after its frame)", self.path)


class ArchiveReader:
    """An open ``.tpack`` archive. Use as a context manager, or call ``close()``."""

    def __init__(self, source: str | os.PathLike | ByteSource,
                 on_blocks: Callable[[ArchiveReader, list[Block]], None] | None = None,
                 on_blobs: Callable[[BlobTable], None] | None = None) -> None:
        """``source``: a path, or any ``ByteSource`` (size and positional reads). ``on_blocks``: called with the
        checked block table as soon as it is read, before the rest of the index is decoded and checked (unpack
        forks its workers there, to decode blocks meanwhile); not called where the table cannot be read ahead.
        ``on_blobs``: called with the checked blob table, before the entries are decoded (the workers verify the
        blobs of the blocks they decoded meanwhile), where ``on_blocks`` was.
        Until the constructor returns, only ``read_block``, ``local`` and ``index_size`` may be used."""
        self._source = LocalFile(source) if isinstance(source, (str, os.PathLike)) else source
        self.path = self._source.name
        self._on_blocks = on_blocks
        self._on_blobs = on_blobs
        self.index_size = 0  # bytes of the decompressed index, from the trailer
        try:
            self._index = self._read_index()
        except BaseException:
            self._source.close()
            raise

    def _read_index(self) -> Index:
        source = self._source
        size = source.size()
        version = parse_header(source.read_at(0, HEADER_SIZE), self.path)
        if size < HEADER_SIZE + TRAILER_SIZE:
            raise ArchiveError("truncated archive (no trailer)", self.path)
        trailer = parse_trailer(source.read_at(size - TRAILER_SIZE, TRAILER_SIZE), size, self.path)
        check_ratio(trailer.index_size, trailer.index_length, "index", self.path)
        self.index_size = trailer.index_size
        offset, length = trailer.index_offset, trailer.index_length
        read_at: Callable[[int, int], bytes | memoryview]
        if self.local:  # read twice, a chunk at a time: once for the digest, once as the index decodes
            digest = hashlib.sha256()
            for chunk in _chunks(source.read_at, offset, length):
                digest.update(chunk)
            read_at = source.read_at
        else:  # a remote archive's index is fetched once, and held while it decodes
            compressed = source.read_at(offset, length)
            digest = hashlib.sha256(compressed)
            offset, read_at = 0, _held(compressed)
            del compressed
        if digest.digest() != trailer.index_sha256:
            raise IntegrityError("index digest mismatch (archive corrupt or truncated)", self.path)
        stream = IndexStream(_chunks(read_at, offset, length), trailer.index_size, self.path)

        def on_head(blocks: list[Block]) -> None:
            try:
                self._check_region(blocks, trailer.index_offset)
                check_block_expansion(blocks, self.path)
            except ArchiveError:  # the checks after the decode say so
                return
            self._on_blocks(self, blocks)  # type: ignore[misc]  # on_head is passed only where it is set

        index = decode_index(stream, self.path, version, on_head=None if self._on_blocks is None else on_head,
                             on_blobs=self._on_blobs)
        stream.finish()
        self._check_region(index.blocks, trailer.index_offset)
        check_expansion(index, self.path)
        self.digest = digest.hexdigest()
        return index

    def _check_region(self, blocks: Sequence[Block], index_offset: int) -> None:
        for n, block in enumerate(blocks):
            if block.offset < HEADER_SIZE or block.offset + block.length > index_offset:
                raise ArchiveError(f"index: blocks[{n}] lies outside the data region", self.path)

    # -- the index --
    @property
    def info(self) -> ArchiveInfo:
        return self._index.info

    @property
    def entries(self) -> tuple[Entry, ...]:
        return self._index.entries

    @property
    def index(self) -> Index:
        return self._index

    def blob_of(self, entry_number: int, file_number: int) -> int:
        return self._index.file_blobs.blob(entry_number, file_number)

    def entry_blobs(self, entry_number: int) -> Sequence[int]:
        """The blob of each of an entry's files."""
        return self._index.file_blobs[entry_number]

    # -- the data --
    def read_block(self, number: int, block: Block, into: mmap | bytearray | None = None) -> BlockContent:
        """Block ``number`` (as ``block`` describes it), read and decompressed (into ``into``, if given: a
        writable buffer of at least ``block.stored`` bytes, overwritten); its blobs are not verified, and its
        spliced texts are derived as they are read."""
        if block.codec not in (CODEC_ZSTD, CODEC_ZSTD_SPLICE):
            raise ArchiveError(f"block {number} uses unknown codec {block.codec!r}", self.path)
        data = self._source.read_at(block.offset, block.length)
        if len(data) != block.length:
            raise ArchiveError(f"truncated archive (block {number})", self.path)
        what = f"block {number}"
        stored = _decompress(data, block.stored, what, self.path) if into is None else \
            _decompress_into(data, block.stored, into, what, self.path)
        return BlockContent(stored, block.splices)

    @property
    def local(self) -> bool:
        """Whether the archive is a local file: positional reads that a forked process can share."""
        return isinstance(self._source, LocalFile)

    def blocks_of(self, wanted: Iterable[int]) -> dict[int, list[int]]:
        """The blocks that hold the ``wanted`` blobs, in archive order, each with its wanted blobs in order."""
        by_block: dict[int, list[int]] = {}
        block_of = self._index.blobs.blocks  # no BlobRef made a blob
        for blob in sorted(set(wanted)):
            by_block.setdefault(block_of[blob], []).append(blob)
        return dict(sorted(by_block.items()))

    def iter_blobs(self, wanted: Iterable[int], threads: int | None = None) -> Iterator[tuple[int, memoryview | bytes]]:
        """Yield ``(blob number, content)`` for each wanted blob, block by block, each verified.

        Worker threads read, decode and verify several blocks at once; at most ``IN_FLIGHT`` decoded bytes are
        held, whatever the archive's size or the number of cores.
        """
        from ..forking import cores  # not on the path of list and check, which never decode a block

        by_block = self.blocks_of(wanted)
        order = list(by_block)
        workers = min(threads or cores(), len(order))
        if workers <= 1:  # nothing to overlap: decode inline, no thread pool to start
            for number in order:
                yield from self.decode_block(number, by_block[number])
            return
        from concurrent.futures import ThreadPoolExecutor

        sizes = {n: self._index.blocks[n].size for n in order}
        pending: deque = deque()
        queue = deque(order)
        with ThreadPoolExecutor(max_workers=workers) as pool:
            try:
                while queue or pending:
                    while queue and (not pending or (len(pending) < workers * 2 and sum(
                            sizes[n] for n, _ in pending) + sizes[queue[0]] <= IN_FLIGHT)):
                        number = queue.popleft()
                        pending.append((number, pool.submit(self.decode_block, number, by_block[number])))
                    _, future = pending.popleft()
                    yield from future.result()
            except BaseException:  # a Ctrl-C, a failure: no block read after it, nor waited for (a URL's reads)
                for _, future in pending:
                    future.cancel()
                getattr(self._source, "abort", lambda: None)()
                raise

    def decode_block(self, number: int, blobs: list[int]) -> list[tuple[int, memoryview | bytes]]:
        """Read and decode block ``number``; return its ``blobs`` (all in it), each verified."""
        data = self.read_block(number, self._index.blocks[number])
        table = self._index.blobs
        first, end = min(blobs, default=0), max(blobs, default=-1) + 1
        digests: Iterator[bytes]
        if end - first <= 2 * len(blobs):  # a writer's: one read of a large index's spilled digests
            run = table.digest_run(first, end)
            digests = (run[32 * (blob - first):32 * (blob - first) + 32] for blob in blobs)
        else:
            digests = map(table.digest, blobs)
        return [(blob, self.verified(data, number, blob, table.offsets[blob], table.sizes[blob], digest))
                for blob, digest in zip(blobs, digests, strict=True)]

    def verified(self, data: BlockContent, number: int, blob: int, offset: int, size: int,
                 sha256: bytes) -> bytes | memoryview:
        """Blob ``blob`` of block ``number`` (decoded: ``data``), checked against its recorded sha256. Also for a
        forked worker, which is told the blob's place and digest instead of holding the index."""
        try:
            content = data.range(offset, size)
        except ValueError as e:
            raise ArchiveError(f"block {number}: a spliced text does not derive ({e})", self.path) from None
        if hashlib.sha256(content).digest() != sha256:
            raise IntegrityError(f"sha256 mismatch in blob {blob} (block {number})", self.path)
        return content

    def close(self) -> None:
        self._source.close()

    def __enter__(self) -> ArchiveReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
