"""Stored files of open archives as sources for the archive writer (``merge``): name, size and ``read_into``.

The writer reads files in its own layout order, which jumps between blocks and between archives. A shared
``BlobStore`` decodes a block when one of its blobs is first read and keeps that block's wanted blobs until each
has been read as often as the plan says (reference counts), then drops them. Archives written by tritonpack are
laid out in the order the writer reads, so each archive has about one live block at a time and every block is
decoded once. A cap on live blocks bounds memory whatever the input layout; a block evicted early by the cap is
decoded again if needed, and counted in ``redecoded``. Reads are serialised by a lock: the writer calls them from
its worker threads.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .archive.reader import ArchiveReader
from .errors import ArchiveError
from .model import AutotuneInfo, Entry, KernelInfo, StubInfo


class BlobStore:
    """Decoded blobs of several archives, each block decoded once while any of its planned reads is pending."""

    def __init__(self, readers: Sequence[ArchiveReader], reads: Iterable[tuple[int, int]], max_blocks: int = 0):
        """``reads``: every ``(archive number, blob number)`` the writer will read, once per read.
        ``max_blocks``: live decoded blocks at most (0: twice the number of archives, at least 4)."""
        self._readers = readers
        self._pending: dict[tuple[int, int], int] = {}  # (archive, blob) -> reads to come
        self._block_blobs: dict[tuple[int, int], set[int]] = {}  # (archive, block) -> blobs still wanted
        for source, blob in reads:
            self._pending[(source, blob)] = self._pending.get((source, blob), 0) + 1
            self._block_blobs.setdefault((source, self._block_of(source, blob)), set()).add(blob)
        self._live: OrderedDict[tuple[int, int], dict[int, bytes | memoryview]] = OrderedDict()
        self._decoded_once: set[tuple[int, int]] = set()
        self.max_blocks = max_blocks or max(4, 2 * len(readers))
        self.decoded = 0  # block decodes in all
        self.redecoded = 0  # of which repeats, forced by the cap
        self.peak_blocks = 0
        self._lock = threading.Lock()  # the writer reads its sources from several threads

    def _block_of(self, source: int, blob: int) -> int:
        return self._readers[source].index.blobs[blob].block

    @property
    def blocks_needed(self) -> int:
        return len(self._block_blobs)

    def read(self, source: int, blob: int) -> bytes | memoryview:
        with self._lock:
            return self._read(source, blob)

    def _read(self, source: int, blob: int) -> bytes | memoryview:
        block = (source, self._block_of(source, blob))
        if (source, blob) not in self._pending:
            raise ArchiveError(f"blob {blob} was not planned for reading", self._readers[source].path)
        blobs = self._live.get(block)
        if blobs is None:
            blobs = self._decode(block)
        else:
            self._live.move_to_end(block)
        content = blobs[blob]
        self._pending[(source, blob)] -= 1
        if not self._pending[(source, blob)]:
            del self._pending[(source, blob)]
            del blobs[blob]
            self._block_blobs[block].discard(blob)
            if not blobs:
                del self._live[block]
        return content

    def _decode(self, block: tuple[int, int]) -> dict[int, bytes | memoryview]:
        source, _ = block
        wanted = self._block_blobs[block]
        blobs = dict(self._readers[source].iter_blobs(wanted, threads=1))  # one block; every sha256 verified
        self.decoded += 1
        if block in self._decoded_once:
            self.redecoded += 1
        self._decoded_once.add(block)
        self._live[block] = blobs
        while len(self._live) > self.max_blocks:
            self._live.popitem(last=False)
        self.peak_blocks = max(self.peak_blocks, len(self._live))
        return blobs


@dataclass(frozen=True)
class ArchiveFile:
    """One stored file of an open archive; ``read`` goes through the shared ``BlobStore``."""

    name: str
    size: int
    store: BlobStore
    source: int
    blob: int
    path: str  # archive: key/name, for error messages

    def read(self) -> bytes | memoryview:
        return self.store.read(self.source, self.blob)

    def read_into(self, view: memoryview) -> None:
        data = self.read()
        if len(data) != len(view):  # the reader verified size and digest: only a bug gets here
            raise ArchiveError(f"stored file is {len(data)} bytes, not {len(view)}", self.path)
        view[:] = data


@dataclass(frozen=True)
class ArchiveEntry:
    """An entry of an open archive, as a source entry of the writer."""

    kind: str
    key: str
    name: str
    files: tuple[ArchiveFile, ...]
    kernel: KernelInfo | None = None
    autotune: AutotuneInfo | None = None
    stub: StubInfo | None = None


def archive_entry(reader: ArchiveReader, source: int, number: int, entry: Entry, store: BlobStore,
                  keep: Sequence[int] | None = None) -> ArchiveEntry:
    """``keep``: indices of the files to take (binary-only); all by default."""
    keep = range(len(entry.files)) if keep is None else keep
    blobs = reader.entry_blobs(number)
    files = tuple(ArchiveFile(entry.files[j].name, entry.files[j].size, store, source, blobs[j],
                              f"{reader.path}:{entry.key}/{entry.files[j].name}") for j in keep)
    return ArchiveEntry(entry.kind, entry.key, entry.name, files, entry.kernel, entry.autotune, entry.stub)
