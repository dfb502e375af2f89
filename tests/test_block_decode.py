"""A block decompressed into a worker's buffer is checked as one decompressed into new bytes: the same frames are
taken, the same refused (a frame is exactly the block's bytes and declares exactly its size)."""
from __future__ import annotations

import mmap
import os

import pytest
import zstandard

from tritonpack.archive.reader import _decompress, _decompress_into
from tritonpack.errors import ArchiveError


def frame(data: bytes, **options) -> bytes:
    return zstandard.ZstdCompressor(write_content_size=True, **options).compress(data)


TEXT = b"".join(b"line %d of a kernel's text\n" % (i % 977) for i in range(60_000))
GOOD = {
    "compressed blocks": (frame(TEXT, level=8), TEXT),
    "with a checksum": (frame(TEXT, level=3, write_checksum=True), TEXT),
    "raw blocks": (frame(raw := os.urandom(300_000)), raw),
    "rle blocks": (frame(b"\0" * 1_000_000), b"\0" * 1_000_000),
    "empty": (frame(b""), b""),
}
SKIPPABLE = b"\x50\x2a\x4d\x18" + (4).to_bytes(4, "little") + b"abcd"
BAD = {
    "trailing zeros": (GOOD["compressed blocks"][0] + b"\0\0\0\0", len(TEXT)),
    "a second frame": (GOOD["compressed blocks"][0] + frame(b"x"), len(TEXT)),
    "a skippable frame after": (GOOD["compressed blocks"][0] + SKIPPABLE, len(TEXT)),
    "truncated": (GOOD["compressed blocks"][0][:-7], len(TEXT)),
    "checksum cut": (GOOD["with a checksum"][0][:-2], len(TEXT)),
    "declares less": (GOOD["compressed blocks"][0], len(TEXT) - 1),
    "no content size": (zstandard.ZstdCompressor(write_content_size=False).compress(TEXT), len(TEXT)),
    "not zstd": (b"\0" * 64, 64),
}


@pytest.mark.parametrize("name", sorted(GOOD))
def test_a_good_frame_decodes_into_the_buffer_as_into_new_bytes(name):
    data, content = GOOD[name]
    buffer = mmap.mmap(-1, max(1, len(content) + 100))
    buffer[:] = b"\xff" * len(buffer)  # a block decoded before: overwritten
    assert bytes(_decompress_into(data, len(content), buffer, "block 0", "a.tpack")) == content
    assert _decompress(data, len(content), "block 0", "a.tpack") == content


@pytest.mark.parametrize("name", sorted(BAD))
def test_a_bad_frame_is_refused_into_the_buffer_as_into_new_bytes(name):
    data, size = BAD[name]
    buffer = mmap.mmap(-1, size + 100)
    with pytest.raises(ArchiveError):
        _decompress_into(data, size, buffer, "block 0", "a.tpack")
    with pytest.raises(ArchiveError):
        _decompress(data, size, "block 0", "a.tpack")


def test_a_flipped_byte_anywhere_gives_the_same_outcome_both_ways():
    """Corrupt frames that zstd decodes without an error (a literal changed) are caught by each blob's sha256; what
    matters here is that both ways agree: refused both, or the same bytes."""
    data, content = GOOD["with a checksum"][0], TEXT
    for at in range(0, len(data), max(1, len(data) // 200)):
        bad = data[:at] + bytes([data[at] ^ 0x5A]) + data[at + 1:]
        assert _outcome(_decompress_into, bad, mmap.mmap(-1, len(content))) == _outcome(_decompress, bad), at


def _outcome(decode, data: bytes, *buffer) -> bytes | None:
    try:
        return bytes(decode(data, len(TEXT), *buffer, "block 0", "a.tpack"))
    except ArchiveError:
        return None


def test_an_index_frame_whose_header_is_cut_across_memoryview_chunks_reads_whole():
    """A remote archive's index arrives as memoryviews; a first one shorter than a frame header is joined to the
    next before the header is checked."""
    import zstandard

    from tritonpack.archive.reader import IndexStream

    data = b"an index of some bytes " * 100
    frame = zstandard.ZstdCompressor().compress(data)
    view = memoryview(frame)
    stream = IndexStream(iter([view[:3], view[3:7], view[7:]]), len(data), "remote.tpack")
    out = b"".join(iter(lambda: stream.read(100), b""))
    stream.finish()
    assert out == data
