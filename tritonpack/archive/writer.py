"""Writing a ``.tpack`` archive from entries whose files are on disk.

Files are laid out by file type and target (similar bytes side by side compress far better), packed into
independent zstd blocks (decodable in parallel and one at a time), and identical contents are stored once.
Each file is read exactly once; memory is bounded by a few blocks whatever the cache size.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import zstandard

from ..errors import CacheError, UsageError
from ..model import ArchiveInfo, AutotuneInfo, Entry, KernelInfo, StoredFile, StubInfo
from .format import (
    DEFAULT_LEVEL,
    HEADER_SIZE,
    IN_FLIGHT,
    MAX_BLOCK_SIZE,
    TRAILER_SIZE,
    Trailer,
    pack_header,
    pack_trailer,
)
from .index import BlobRef, Block, decode_index, encode_index

BLOCK_SIZE = 32 * 1024 * 1024  # large enough for long-distance matches, small enough to decode in parallel
READ_AHEAD = 16 * 1024 * 1024
MAX_WINDOW_LOG = 25  # 32 MiB: zstd decoders accept up to 2^27 by default
INDEX_LEVEL = 19


class SourceFile(Protocol):
    """A file to archive: a file of a cache root, or a stored file of another archive (merge)."""

    name: str

    def read(self) -> bytes: ...


class SourceEntry(Protocol):
    kind: str
    key: str
    name: str
    files: Sequence[SourceFile]
    kernel: KernelInfo | None
    autotune: AutotuneInfo | None
    stub: StubInfo | None


@dataclass(frozen=True)
class WriteResult:
    entries: tuple[Entry, ...]
    files: int
    blobs: int
    bytes_in: int
    bytes_out: int


def _layout_key(entry: SourceEntry, name: str) -> tuple:
    """Order that puts alike bytes together: by extension, then target, then name."""
    ext = name.rsplit(".", 1)[-1] if "." in name else ""
    if name.endswith(".autotune.json"):
        ext = "autotune.json"
    target = entry.kernel.target if entry.kernel else ""
    return (ext, target, name, entry.key)


def compress_block(data: bytes, level: int) -> bytes:
    """One independent frame; long-distance matching finds the repeats between alike files of a block."""
    window_log = max(17, min(MAX_WINDOW_LOG, (max(len(data), 1) - 1).bit_length()))
    params = zstandard.ZstdCompressionParameters.from_level(
        level, source_size=len(data), window_log=window_log, enable_ldm=True, write_content_size=True)
    return zstandard.ZstdCompressor(compression_params=params).compress(data)


def write_archive(
    path: str,
    entries: Sequence[SourceEntry],
    info: ArchiveInfo,
    level: int = DEFAULT_LEVEL,
    block_size: int = BLOCK_SIZE,
    threads: int | None = None,
    on_file: Callable[[int], None] | None = None,
) -> WriteResult:
    """Write the archive to a temp file beside ``path`` and move it in place: never a half-written archive."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(prefix=".tpack-", suffix=".tmp", dir=directory)
    except OSError as e:
        raise CacheError(f"cannot create the archive: {e.strerror}", path) from e
    try:
        with os.fdopen(fd, "wb") as out:
            result = _write(out, entries, info, level, block_size, threads or os.cpu_count() or 1, on_file)
        os.chmod(tmp, 0o666 & ~current_umask())
        os.replace(tmp, path)
        return result
    except OSError as e:
        raise CacheError(f"cannot write the archive: {e.strerror}", path) from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _read(source: SourceFile) -> tuple[bytes, bytes]:
    """Runs in a worker thread: file reads and sha256 release the GIL, so files are read in parallel."""
    data = source.read()
    return data, hashlib.sha256(data).digest()


def _chunks(refs: list, entries: Sequence[SourceEntry]):
    """Consecutive runs of files of about READ_AHEAD bytes, read in parallel while earlier blocks compress."""
    chunk, size = [], 0
    for ref in refs:
        chunk.append(ref)
        size += getattr(entries[ref[1]].files[ref[2]], "size", 0) or 0
        if size >= READ_AHEAD or len(chunk) >= 4096:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _write(out, entries, info, level, block_size, threads, on_file) -> WriteResult:
    entries = sorted(entries, key=lambda e: (e.key, e.kind, e.name))
    refs = sorted(
        ((_layout_key(e, f.name), i, j) for i, e in enumerate(entries) for j, f in enumerate(e.files)),
    )
    out.write(pack_header())
    offset = HEADER_SIZE
    blocks: list[Block] = []
    blobs: list[BlobRef] = []
    by_digest: dict[bytes, int] = {}
    file_blobs: dict[tuple[int, int], int] = {}
    stored: dict[tuple[int, int], StoredFile] = {}
    pending: deque[tuple[Future, int]] = deque()
    buffer: list[bytes] = []
    buffered = 0
    bytes_in = 0

    def drain(limit: int) -> None:
        """Write finished blocks in order until at most ``limit`` uncompressed bytes are in flight (-1: all)."""
        nonlocal offset
        while pending and sum(size for _, size in pending) > limit:
            future, size = pending.popleft()
            data = future.result()
            out.write(data)
            blocks.append(Block(offset=offset, length=len(data), size=size))
            offset += len(data)

    with ThreadPoolExecutor(max_workers=threads) as pool:
        def flush() -> None:
            nonlocal buffer, buffered
            if buffer:
                data = b"".join(buffer)
                buffer, buffered = [], 0
                pending.append((pool.submit(compress_block, data, level), len(data)))
                drain(IN_FLIGHT)

        for chunk in _chunks(refs, entries):
            for (_, i, j), (data, digest) in zip(chunk, pool.map(_read, [entries[i].files[j] for _, i, j in chunk]),
                                                 strict=True):
                source = entries[i].files[j]
                if len(data) > MAX_BLOCK_SIZE:
                    where = getattr(source, "path", f"{entries[i].key}/{source.name}")
                    raise UsageError(f"file larger than {MAX_BLOCK_SIZE} bytes cannot be archived", where)
                bytes_in += len(data)
                stored[(i, j)] = StoredFile(source.name, len(data), digest)
                blob = by_digest.get(digest)
                if blob is None:
                    if buffer and buffered + len(data) > block_size:
                        flush()
                    blob = len(blobs)
                    by_digest[digest] = blob
                    blobs.append(BlobRef(block=len(blocks) + len(pending), offset=buffered, size=len(data),
                                         sha256=digest))
                    buffer.append(data)
                    buffered += len(data)
                file_blobs[(i, j)] = blob
                if on_file:
                    on_file(len(data))
        flush()
        drain(-1)

    model = tuple(
        Entry(kind=e.kind, key=e.key, name=e.name, files=tuple(stored[(i, j)] for j in range(len(e.files))),
              kernel=e.kernel, autotune=e.autotune, stub=e.stub)
        for i, e in enumerate(entries)
    )
    raw_index = encode_index(info, blocks, blobs, model, file_blobs)
    decode_index(raw_index, out.name, info.format_version)  # never write what a reader would reject
    index = zstandard.ZstdCompressor(level=INDEX_LEVEL, write_content_size=True).compress(raw_index)
    out.write(index)
    out.write(pack_trailer(Trailer(offset, len(index), len(raw_index), hashlib.sha256(index).digest())))
    out.flush()
    return WriteResult(model, len(refs), len(blobs), bytes_in, offset + len(index) + TRAILER_SIZE)


__all__ = ["write_archive", "WriteResult", "BLOCK_SIZE", "DEFAULT_LEVEL"]
