"""Reader policy against decompression bombs: limits on top of the format's own (spec §7, "Reader policy").

The format caps a block at 256 MiB and the index at 512 MiB decompressed; a hostile archive can still declare a
256 MiB block in a few bytes, reuse one blob for a million files, or pack a 500-million-element msgpack array in
an index. The reference reader therefore refuses, before it decompresses or writes anything:

- an index that would expand more than ``MAX_RATIO`` times (sizes up to ``RATIO_FLOOR`` always pass): every blob
  and every group brings random bytes to it (a sha256, a cache key), so a real index expands about 2x. Blocks get
  no such guard: near-duplicate files legitimately compress past any fixed ratio (a block of ten copies of the real
  cache, each file a few bytes apart, expanded 1,192x), and a block is bounded anyway: 256 MiB by the format, and
  all of them by the expansion limit below;
- an archive whose entries add up to more than ``max_unpack_bytes()`` (64 GiB unless the environment variable
  ``TRITONPACK_MAX_UNPACK_BYTES`` says otherwise), or whose blocks do;
- an index that spends more than ``MAX_INDEX_VALUES`` (2^24, or ``TRITONPACK_MAX_INDEX_VALUES``) while it is
  decoded: an array costs one plus its length, a map four plus twice its length. A real index costs about 110 per
  kernel; the worst hostile shapes tried (arrays of 16 million tiny strings) peak at about 1.2 GB of memory before
  they are refused.

Free disk space is checked by the unpacker against what it will actually write (``staging.check_space``).
"""
from __future__ import annotations

import os

from ..errors import ArchiveError, ReaderLimitError

MAX_RATIO = 1000
RATIO_FLOOR = 1 << 20
DEFAULT_MAX_UNPACK_BYTES = 64 << 30
MAX_INDEX_VALUES = 1 << 24  # about 150,000 kernels of 7 files (about 110 each, without dedupe)
ENV_MAX_UNPACK_BYTES = "TRITONPACK_MAX_UNPACK_BYTES"
ENV_MAX_INDEX_VALUES = "TRITONPACK_MAX_INDEX_VALUES"


def max_unpack_bytes() -> int:
    value = os.environ.get(ENV_MAX_UNPACK_BYTES, "").strip()
    if value.isdigit():
        return int(value)
    return DEFAULT_MAX_UNPACK_BYTES


def check_ratio(size: int, length: int, what: str, path: str) -> None:
    """Refuse a frame of ``length`` bytes that declares ``size`` decompressed bytes beyond the ratio guard."""
    if size > RATIO_FLOOR and size > MAX_RATIO * length:
        raise ArchiveError(f"{what} declares {size} bytes from {length} compressed (more than {MAX_RATIO}x: "
                           "a decompression bomb?)", path)


def check_expansion(index, path: str) -> None:
    """Refuse an archive whose blocks or entries expand beyond the guards (see the module docstring)."""
    check_block_expansion(index.blocks, path)
    limit = max_unpack_bytes()
    files = sum(e.size for e in index.entries)
    if files > limit:
        raise ReaderLimitError(f"entries expand to {files} bytes, more than the limit of {limit} "
                           f"(set {ENV_MAX_UNPACK_BYTES} to raise it)", path)


def check_block_expansion(blocks, path: str) -> None:
    """Refuse blocks that expand beyond the expansion limit, all of them together."""
    limit = max_unpack_bytes()
    total = sum(block.size for block in blocks)
    if total > limit:
        raise ReaderLimitError(f"blocks expand to {total} bytes, more than the limit of {limit} "
                           f"(set {ENV_MAX_UNPACK_BYTES} to raise it)", path)


class IndexTooLarge(Exception):
    """Raised inside msgpack decoding when the value budget is spent."""


def max_index_values() -> int:
    value = os.environ.get(ENV_MAX_INDEX_VALUES, "").strip()
    return int(value) if value.isdigit() else MAX_INDEX_VALUES


class IndexBudget:
    """What decoding an index may spend (``limit``, default ``max_index_values()``): an array costs one plus its
    length, a map four plus twice its length (a dict slot weighs about four list slots); no single array or map
    may declare more elements than the limit or than there are bytes (so a lying length allocates nothing).
    ``unpack_options()`` are keyword arguments for msgpack that spend as values are built; a decoder that reads an
    array's header itself spends for it with ``spend``."""

    def __init__(self, raw_size: int, limit: int | None = None):
        self.limit = max_index_values() if limit is None else limit
        self.left = self.limit
        self.most = min(self.limit, raw_size)  # elements one array or map may declare
        self.counted = 5 * raw_size > self.limit  # else each value takes a byte at least: this input cannot spend more

    def spend(self, cost: int) -> None:
        self.left -= cost
        if self.left < 0:
            raise IndexTooLarge(self.limit)

    def _list(self, container):
        self.spend(1 + len(container))
        return container

    def _map(self, container):
        self.spend(4 + 2 * len(container))
        return container

    def unpack_options(self) -> dict:
        options: dict[str, object] = {"max_array_len": self.most, "max_map_len": self.most}
        if self.counted:
            options.update(object_hook=self._map, list_hook=self._list)
        return options


__all__ = ["MAX_RATIO", "RATIO_FLOOR", "MAX_INDEX_VALUES", "max_unpack_bytes", "max_index_values", "check_ratio",
           "check_expansion", "IndexBudget", "IndexTooLarge"]
