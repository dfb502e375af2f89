"""A cubin's embedded PTX text, spliced back from the group's ``.ptx`` instead of stored twice (format 1.1).

ptxas embeds the PTX it compiled in a cubin's ``.nv_debug_ptx_txt`` section (Triton compiles with ``-lineinfo``):
the ``.ptx`` file line for line, each line without its indent and comments, ``.loc``/``.file`` directives and
debug-section data blanked, lines joined by NUL. That is 52-58% of a cubin's bytes on the bench's caches, and
stored beside the ``.ptx`` it costs about as much again as the ``.ptx``. A block of codec ``zstd-splice`` holds such
cubins without that text and says how to derive it from the ``.ptx`` in the same block (spec §5.1): the lines of
the ``.ptx``, each without one leading tab, some of them blanked or replaced, joined by NUL. The pack side finds
what to blank by comparing the two texts, so no rule of ptxas is built in: a text that does not derive line for
line is simply stored.
"""
from __future__ import annotations

import re
import struct
import sys
from array import array
from bisect import bisect_right
from collections.abc import Sequence
from itertools import accumulate, compress, count
from operator import ne, not_, sub
from typing import NamedTuple

SECTION = b".nv_debug_ptx_txt"
_ELF_HEAD = struct.Struct("<4sBB")  # magic, class (2: 64-bit), data (1: little-endian)
_SECTION_HEADER = struct.Struct("<IIQQQQ")  # name, type, flags, addr, offset, size (of the 64-byte header)
_NOBITS = 8
_WIDTHS = {1: "B", 2: "H", 4: "I"}
_LINE_BREAK = re.compile(rb"\n\t?")  # a line's end, and the next line's one leading tab if it has one
# Reader policy against hostile splices (spec §7): a source of more lines than this is refused before it is split
# (a list of lines costs 8 bytes a line and more; a real .ptx has tens of thousands of lines at most).
MAX_SPLICE_LINES = 1 << 22


class Splice(NamedTuple):
    """Text inserted at ``at`` of a block's content, derived from the content range ``[source, source +
    source_size)`` (which lies before ``at`` and outside every splice). ``blanks``: a width byte (1, 2 or 4) then,
    little-endian, the number of the first line to blank and the gaps to each next one (lines numbered from 0);
    ``replacements``: ``(line, text)`` by increasing line number."""

    at: int
    source: int
    source_size: int
    length: int
    blanks: bytes
    replacements: tuple[tuple[int, bytes], ...] = ()


def embedded_ptx(cubin) -> tuple[int, int] | None:
    """``(offset, size)`` of the non-empty ``.nv_debug_ptx_txt`` section of a 64-bit little-endian ELF file, or
    None (no such section, or not such a file)."""
    try:
        magic, elf_class, data = _ELF_HEAD.unpack_from(cubin, 0)
        if magic != b"\x7fELF" or elf_class != 2 or data != 1:
            return None
        (table,) = struct.unpack_from("<Q", cubin, 0x28)
        entry_size, entries, names_index = struct.unpack_from("<HHH", cubin, 0x3A)
        if entry_size < _SECTION_HEADER.size or names_index >= entries:
            return None
        headers = [_SECTION_HEADER.unpack_from(cubin, table + n * entry_size) for n in range(entries)]
        _, _, _, _, names_at, names_size = headers[names_index]
        if names_at + names_size > len(cubin):
            return None
        names = bytes(cubin[names_at:names_at + names_size])
        for name, kind, _, _, offset, size in headers:
            if names[name:name + len(SECTION) + 1] == SECTION + b"\0" and kind != _NOBITS:
                return (offset, size) if size and offset + size <= len(cubin) else None
    except struct.error:  # a header or table past the end: not a cubin we can read
        return None
    return None


def ptx_lines(ptx) -> list[bytes]:
    """The ``.ptx``'s lines (split at every LF), each without one leading tab. One regular expression split, which
    runs for every cubin an unpack writes: 3.3 ns a byte on 2 cores, where a replace and a split took 4.6."""
    lines = _LINE_BREAK.split(ptx)
    if lines[0][:1] == b"\t":
        lines[0] = lines[0][1:]
    return lines


def plan(block, cubin: int, cubin_size: int, ptx: int, ptx_size: int) -> Splice | None:
    """The splice that restores the PTX text of the cubin at ``block[cubin:cubin + cubin_size]`` from the
    ``.ptx`` at ``block[ptx:ptx + ptx_size]``, or None where the text does not derive line for line (or nearly
    nothing of it would)."""
    found = embedded_ptx(block[cubin:cubin + cubin_size])
    if found is None:
        return None
    offset, size = found
    want = bytes(block[cubin + offset:cubin + offset + size]).split(b"\0")
    lines = ptx_lines(block[ptx:ptx + ptx_size])
    if len(lines) != len(want):
        return None
    differ = list(compress(count(), map(ne, lines, want)))
    empty = list(map(not_, map(want.__getitem__, differ)))  # C-level loops: this runs for every cubin packed
    blanks = list(compress(differ, empty))
    replacements = tuple((n, want[n]) for n in compress(differ, map(not_, empty)))
    if sum(len(text) for _, text in replacements) * 4 > size:
        return None
    return Splice(cubin + offset, ptx, ptx_size, size, encode_gaps(blanks), replacements)


def plan_block(block, pairs: Sequence[tuple[int, int, int, int]]) -> tuple[Splice, ...]:
    """The splices of a block's ``pairs`` (``(cubin offset, size, ptx offset, size)``), where they derive."""
    return tuple(found for found in (plan(block, *pair) for pair in pairs) if found is not None)


def encode_gaps(lines: Sequence[int]) -> bytes:
    gaps = list(map(sub, lines, [0, *lines]))  # the first: the first line's number
    most = max(gaps, default=0)
    width = 1 if most < 1 << 8 else 2 if most < 1 << 16 else 4
    packed = array(_WIDTHS[width], gaps)
    if packed.itemsize != width:  # a platform whose C types differ: write them one by one
        return bytes([width]) + b"".join(gap.to_bytes(width, "little") for gap in gaps)
    if sys.byteorder == "big":
        packed.byteswap()
    return bytes([width]) + packed.tobytes()


def decode_gaps(blanks: bytes) -> array | None:
    """The gaps, or None if ``blanks`` is malformed (a bad width or length, a gap of 0 after the first)."""
    width = blanks[0] if blanks else 0
    if width not in _WIDTHS or (len(blanks) - 1) % width:
        return None
    gaps = array(_WIDTHS[width])
    if gaps.itemsize != width:  # a platform whose C types differ: read them one by one
        gaps = array("L", [int.from_bytes(blanks[i:i + width], "little") for i in range(1, len(blanks), width)])
    else:
        gaps.frombytes(blanks[1:])
        if sys.byteorder == "big":
            gaps.byteswap()
    return gaps if len(gaps) < 2 or min(gaps[1:]) >= 1 else None


def derive(ptx: bytes, splice: Splice) -> bytes:
    """The text ``splice`` inserts, from the ``.ptx`` bytes; ValueError where the splice does not fit them."""
    count = ptx.count(b"\n") + 1
    if count > splice.length + 1:  # every line but the last adds a NUL to the text
        raise ValueError(f"the .ptx has {count} lines, more than a text of {splice.length} bytes can hold")
    if count > MAX_SPLICE_LINES:
        raise ValueError(f"the .ptx has {count} lines (reader limit {MAX_SPLICE_LINES})")
    lines = ptx_lines(ptx)
    gaps = decode_gaps(splice.blanks)
    if gaps is None:
        raise ValueError("malformed blank lines")
    if sum(gaps) >= len(lines):
        raise ValueError("a blank line past the end of the .ptx")
    for number in accumulate(gaps):
        lines[number] = b""
    for number, text in splice.replacements:
        if number >= len(lines):
            raise ValueError("a replaced line past the end of the .ptx")
        lines[number] = text
    text = b"\0".join(lines)
    if len(text) != splice.length:
        raise ValueError(f"derives {len(text)} bytes, not {splice.length}")
    return text


class BlockContent:
    """A decoded block's content by byte range: the stored bytes, and the spliced texts derived where a range
    covers them (one at a time: a block's blobs are read in order, each cubin once)."""

    def __init__(self, stored: bytes | memoryview, splices: Sequence[Splice] = ()):
        self._stored = memoryview(stored)
        self._splices = splices
        self._ends = [s.at + s.length for s in splices]
        self._before = [0, *accumulate(s.length for s in splices)]  # bytes inserted before splice k
        self._text: tuple[int, bytes] | None = None

    def range(self, offset: int, size: int) -> bytes | memoryview:
        """Bytes ``[offset, offset + size)`` of the content (a view where no splice is in the range)."""
        splices = self._splices
        if not splices:
            return self._stored[offset:offset + size]
        k = bisect_right(self._ends, offset)
        end = offset + size
        if k == len(splices) or splices[k].at >= end:  # between splices: one stored range
            start = offset - self._before[k]
            return self._stored[start:start + size]
        parts: list[bytes | memoryview] = []
        position = offset
        while position < end:
            if k < len(splices) and splices[k].at <= position:
                at = splices[k].at
                text = self.text(k)
                stop = min(end, at + splices[k].length)
                parts.append(text[position - at:stop - at])
                k += 1
            else:
                stop = min(end, splices[k].at) if k < len(splices) else end
                start = position - self._before[k]
                parts.append(self._stored[start:start + stop - position])
            position = stop
        return b"".join(parts)

    def text(self, k: int) -> bytes:
        if self._text is None or self._text[0] != k:
            splice = self._splices[k]
            before = self._before[bisect_right(self._ends, splice.source)]
            source = bytes(self._stored[splice.source - before:splice.source - before + splice.source_size])
            self._text = (k, derive(source, splice))
        return self._text[1]


__all__ = ["Splice", "BlockContent", "SECTION", "embedded_ptx", "plan", "plan_block", "derive", "decode_gaps",
           "encode_gaps"]
