"""A large scan's entries held as packed records, each made again as it is read.

The objects of a scanned group (its entry, kernel info, key and hash strings, files table and sizes) took 0.68 KB,
100 bytes a file: 106 MB for a root of 1,060,970 files, held through the whole of its pack. A record takes 165
bytes (25 a file): the group's key, hash and sizes, its other fields as numbers into a table of the values they
share (names, file-name tuples, backends, versions, envs). Reading one back costs 1.5 us on the 2-core VM, which a
scan pays only past ``cacheroot.PACKED_KEYS`` key directories. Entries that are not plain groups, a group whose
manifest lists files that are gone, and a group a record cannot hold (an int past 64 bits in its metadata), are
kept as they are.
"""
from __future__ import annotations

from array import array
from bisect import bisect_right
from collections.abc import Iterable, Iterator, Sequence

import msgpack

from .cacheroot import LocalEntry, LocalFiles
from .model import GROUP, KernelInfo


class _Run:
    """Records packed by one process (a forked reader of the scan, or the scan itself), with their own table."""

    __slots__ = ("kept", "numbers", "records", "root", "starts", "values")

    def __init__(self, root: str, records: bytes | bytearray = b"", starts: array | None = None,
                 values: list | None = None, kept: dict | None = None) -> None:
        self.root = root
        self.records = bytearray(records)
        self.starts = starts if starts is not None else array("Q", [0])  # record n: starts[n] to starts[n + 1]
        self.values = values if values is not None else []
        # value -> its place in ``values``, for records still to come; an env by the frozenset of its items, which
        # no other value equals (a tuple of file names, say)
        self.numbers: dict = {}
        self.kept = kept if kept is not None else {}  # entry number -> an entry held as it is

    def __len__(self) -> int:
        return len(self.starts) - 1

    def __reduce__(self):  # a forked reader sends its run to the parent
        return _Run, (self.root, bytes(self.records), self.starts, self.values, self.kept)

    def _number(self, value, stored=None) -> int:
        """``value``'s place in the table, added where new (``stored`` is kept for it, where not the value)."""
        n = self.numbers.get(value)
        if n is None:
            n = self.numbers[value] = len(self.values)
            self.values.append(value if stored is None else stored)
        return n

    def append(self, entry) -> None:
        files, kernel = entry.files, entry.kernel
        if (entry.kind != GROUP or kernel is None or entry.autotune is not None or entry.stub is not None
                or entry.missing or getattr(files, "root", None) != self.root or files.key != entry.key):
            self._keep(entry)
            return
        number = self._number
        try:
            record = msgpack.packb([
                entry.key, number(entry.name), number(files.names), list(files.sizes), number(kernel.backend),
                number(kernel.arch), kernel.warp_size, kernel.num_warps, kernel.num_stages, kernel.num_ctas,
                kernel.shared, number(kernel.triton_version), kernel.hash,
                number(frozenset(kernel.env.items()), kernel.env), entry.foreign_manifest])
        except (OverflowError, TypeError, ValueError):  # a value msgpack cannot hold
            self._keep(entry)
            return
        self.records += record
        self.starts.append(len(self.records))

    def _keep(self, entry) -> None:
        self.kept[len(self)] = entry
        self.starts.append(len(self.records))

    def entry(self, n: int):
        kept = self.kept.get(n)
        if kept is not None:
            return kept
        (key, name, names, sizes, backend, arch, warp_size, num_warps, num_stages, num_ctas, shared, version, digest,
         env, foreign) = msgpack.unpackb(self.records[self.starts[n]:self.starts[n + 1]], use_list=False)
        values = self.values
        kernel = KernelInfo(values[backend], values[arch], warp_size, num_warps, num_stages, num_ctas, shared,
                            values[version], digest, values[env])
        return LocalEntry(GROUP, key, values[name], LocalFiles(self.root, key, values[names], sizes), kernel, None,
                          None, foreign)


class PackedEntries(Sequence[LocalEntry]):
    """Entries of a scan of ``root`` as packed records (see the module), a sequence of ``LocalEntry`` in the order
    they were added. ``extend`` with another's takes its records as they are: a forked reader's come whole."""

    def __init__(self, root: str, runs: Iterable[_Run] = ()) -> None:
        self.root = root
        self._runs: list[_Run] = []
        self._firsts: list[int] = []  # the number of each run's first entry
        self._count = 0
        self._open: _Run | None = None  # the run that ``append`` adds to: never one taken from another sequence
        for run in runs:
            self._take(run)

    def __len__(self) -> int:
        return self._count

    def __getitem__(self, i: int) -> LocalEntry:  # type: ignore[override]  # one at a time: a slice raises TypeError
        if not isinstance(i, int):
            raise TypeError("packed entries are read one at a time")
        if i < 0:
            i += self._count
        if not 0 <= i < self._count:
            raise IndexError("entry number out of range")
        run = bisect_right(self._firsts, i) - 1
        return self._runs[run].entry(i - self._firsts[run])

    def __iter__(self) -> Iterator[LocalEntry]:
        for run in self._runs:
            yield from map(run.entry, range(len(run)))

    def __reduce__(self):
        return PackedEntries, (self.root, self._runs)

    def append(self, entry: LocalEntry) -> None:
        if self._open is None:
            self._open = _Run(self.root)
            self._firsts.append(self._count)
            self._runs.append(self._open)
        self._open.append(entry)
        self._count += 1

    def extend(self, entries: Iterable[LocalEntry]) -> None:
        if isinstance(entries, PackedEntries) and entries.root == self.root:
            for run in list(entries._runs):
                self._take(run)
        else:
            for entry in entries:
                self.append(entry)

    def __iadd__(self, entries: Iterable[LocalEntry]) -> PackedEntries:
        self.extend(entries)
        return self

    def _take(self, run: _Run) -> None:
        if len(run):
            self._firsts.append(self._count)
            self._runs.append(run)
            self._count += len(run)
            self._open = None


__all__ = ["PackedEntries"]
