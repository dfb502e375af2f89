"""The fixed-size parts of a ``.tpack`` file (see spec/tpack-v1.md): header, trailer, limits."""
from __future__ import annotations

import struct
from typing import NamedTuple

from ..errors import ArchiveError, UnsupportedFormatError

MAGIC = b"\x89TPACK\r\n"
TRAILER_MAGIC = b"TPACKEND"
FORMAT_MAJOR = 1
# The newest this tritonpack reads and writes: 1.1 added blocks of codec zstd-splice (§5.1), 1.2 the Triton version
# of autotune results and files (§4.6), 1.3 their mark that no Triton can be named
FORMAT_MINOR = 3
ENTRY_VERSIONS = (1, 2)  # the version a writer declares where an autotune result or a file names its Triton
UNKNOWN_VERSIONS = (1, 3)  # where one says that its Triton cannot be named

HEADER = struct.Struct("<8sHHI")  # magic, major, minor, flags
TRAILER = struct.Struct("<QQQ32s8s")  # index offset, index length, index size, sha256(index bytes), magic
HEADER_SIZE = HEADER.size  # 16
TRAILER_SIZE = TRAILER.size  # 64

IN_FLIGHT = 128 * 1024 * 1024  # uncompressed bytes a reader or writer holds at once, whatever the core count
DEFAULT_LEVEL = 8  # zstd level of data blocks unless asked otherwise (bench/perf.py: 0.57-0.59x of tar|zstd-19)

# Reader limits: a hostile archive must not make a reader allocate without bound.
MAX_INDEX_SIZE = 512 * 1024 * 1024
MAX_BLOCK_SIZE = 256 * 1024 * 1024
MAX_NAME_BYTES = 255


class Trailer(NamedTuple):
    index_offset: int
    index_length: int
    index_size: int
    index_sha256: bytes


def format_version(splice_ptx: bool = False) -> tuple[int, int]:
    """The version a writer declares: 1.1 only where it splices cubins (§5.1), so that other archives stay 1.0."""
    return (FORMAT_MAJOR, 1 if splice_ptx else 0)


def pack_header(minor: int) -> bytes:
    return HEADER.pack(MAGIC, FORMAT_MAJOR, minor, 0)


def parse_header(data: bytes, path: str) -> tuple[int, int]:
    if len(data) < HEADER_SIZE:
        raise ArchiveError("not a tpack archive (file too short)", path)
    magic, major, minor, flags = HEADER.unpack(data[:HEADER_SIZE])
    if magic != MAGIC:
        raise ArchiveError("not a tpack archive (bad magic)", path)
    if major != FORMAT_MAJOR:
        raise UnsupportedFormatError(
            f"format version {major}.{minor} is not supported (this tritonpack reads {FORMAT_MAJOR}.x)", path)
    if flags != 0:
        raise ArchiveError(f"unknown header flags 0x{flags:08x}", path)
    return major, minor


def pack_trailer(trailer: Trailer) -> bytes:
    return TRAILER.pack(trailer.index_offset, trailer.index_length, trailer.index_size, trailer.index_sha256,
                        TRAILER_MAGIC)


def parse_trailer(data: bytes, file_size: int, path: str) -> Trailer:
    if len(data) != TRAILER_SIZE:
        raise ArchiveError("truncated archive (no trailer)", path)
    offset, length, size, digest, magic = TRAILER.unpack(data)
    if magic != TRAILER_MAGIC:
        raise ArchiveError("truncated or corrupt archive (bad trailer magic)", path)
    if offset < HEADER_SIZE or length == 0 or offset + length != file_size - TRAILER_SIZE:
        raise ArchiveError("corrupt archive (index location out of range)", path)
    if size == 0 or size > MAX_INDEX_SIZE or length > MAX_INDEX_SIZE:
        raise ArchiveError(f"corrupt archive (index size {size} out of range)", path)
    return Trailer(offset, length, size, digest)
