"""Reading a ``.tpack`` archive: the index alone for listing, blocks on demand for extraction.

Opening reads the header, the trailer and the index, nothing of the data region. ``iter_blobs`` decodes only
the blocks that hold the wanted contents, several at a time, and verifies every sha256 before yielding.
"""
from __future__ import annotations

import hashlib
import os
import stat
from collections import deque
from collections.abc import Iterable, Iterator

import zstandard

from ..errors import ArchiveError, IntegrityError, UsageError
from ..model import ArchiveInfo, Entry
from .format import HEADER_SIZE, TRAILER_SIZE, parse_header, parse_trailer
from .index import CODEC_ZSTD, Block, Index, decode_index
from .limits import check_expansion, check_ratio


def _decompress(data: bytes, size: int, what: str, path: str) -> bytes:
    try:
        params = zstandard.get_frame_parameters(data)
    except zstandard.ZstdError:
        raise ArchiveError(f"{what} is not a zstd frame", path) from None
    if params.content_size == zstandard.CONTENTSIZE_UNKNOWN:
        raise ArchiveError(f"{what} is a zstd frame without a content size", path)
    if params.content_size != size:
        raise ArchiveError(f"{what} declares {params.content_size} bytes, the index says {size}", path)
    try:
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=size, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise ArchiveError(f"{what} is corrupt ({e})", path) from None
    if len(out) != size:
        raise ArchiveError(f"{what} holds {len(out)} bytes, the index says {size}", path)
    return out


def _open_regular(path: str):
    """Open for reading; a FIFO must not block the open, and only a regular file can be read by offset."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise IsADirectoryError if stat.S_ISDIR(mode) else UsageError("not a regular file", path)
    return os.fdopen(fd, "rb")


class ArchiveReader:
    """An open ``.tpack`` archive. Use as a context manager, or call ``close()``."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        try:
            self._file = _open_regular(self.path)
        except FileNotFoundError:
            raise UsageError("no such archive", self.path) from None
        except IsADirectoryError:
            raise UsageError("is a directory, not an archive", self.path) from None
        except OSError as e:
            raise UsageError(f"cannot open: {e.strerror}", self.path) from None
        try:
            self._index = self._read_index()
        except BaseException:
            self._file.close()
            raise

    def _read_index(self) -> Index:
        f = self._file
        size = os.fstat(f.fileno()).st_size
        version = parse_header(f.read(HEADER_SIZE), self.path)
        if size < HEADER_SIZE + TRAILER_SIZE:
            raise ArchiveError("truncated archive (no trailer)", self.path)
        f.seek(size - TRAILER_SIZE)
        trailer = parse_trailer(f.read(TRAILER_SIZE), size, self.path)
        check_ratio(trailer.index_size, trailer.index_length, "index", self.path)
        f.seek(trailer.index_offset)
        compressed = f.read(trailer.index_length)
        if hashlib.sha256(compressed).digest() != trailer.index_sha256:
            raise IntegrityError("index digest mismatch (archive corrupt or truncated)", self.path)
        raw = _decompress(compressed, trailer.index_size, "index", self.path)
        index = decode_index(raw, self.path, version)
        for n, block in enumerate(index.blocks):
            if block.offset < HEADER_SIZE or block.offset + block.length > trailer.index_offset:
                raise ArchiveError(f"index: blocks[{n}] lies outside the data region", self.path)
        check_expansion(index, self.path)
        self.digest = hashlib.sha256(compressed).hexdigest()
        return index

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
        return self._index.file_blobs[(entry_number, file_number)]

    # -- the data --
    def _read_block(self, number: int, block: Block) -> bytes:
        if block.codec != CODEC_ZSTD:
            raise ArchiveError(f"block {number} uses unknown codec {block.codec!r}", self.path)
        data = os.pread(self._file.fileno(), block.length, block.offset)
        if len(data) != block.length:
            raise ArchiveError(f"truncated archive (block {number})", self.path)
        return _decompress(data, block.size, f"block {number}", self.path)

    def iter_blobs(self, wanted: Iterable[int], threads: int | None = None) -> Iterator[tuple[int, bytes]]:
        """Yield ``(blob number, content)`` for each wanted blob, block by block, each verified."""
        by_block: dict[int, list[int]] = {}
        for blob in sorted(set(wanted)):
            by_block.setdefault(self._index.blobs[blob].block, []).append(blob)
        order = sorted(by_block)
        workers = min(threads or os.cpu_count() or 1, len(order))
        if workers <= 1:  # nothing to overlap: decode inline, no thread pool to start
            for number in order:
                yield from self._blobs_of(number, self._read_block(number, self._index.blocks[number]),
                                          by_block[number])
            return
        from concurrent.futures import ThreadPoolExecutor

        pending: deque = deque()
        with ThreadPoolExecutor(max_workers=workers) as pool:
            queue = iter(order)
            for number in queue:
                pending.append((number, pool.submit(self._read_block, number, self._index.blocks[number])))
                if len(pending) >= workers * 2:
                    break
            while pending:
                number, future = pending.popleft()
                data = future.result()
                nxt = next(queue, None)
                if nxt is not None:
                    pending.append((nxt, pool.submit(self._read_block, nxt, self._index.blocks[nxt])))
                yield from self._blobs_of(number, data, by_block[number])

    def _blobs_of(self, number: int, data: bytes, blobs: list[int]) -> Iterator[tuple[int, bytes]]:
        for blob in blobs:
            ref = self._index.blobs[blob]
            content = data[ref.offset:ref.offset + ref.size]
            if hashlib.sha256(content).digest() != ref.sha256:
                raise IntegrityError(f"sha256 mismatch in blob {blob} (block {number})", self.path)
            yield blob, content

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> ArchiveReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
