"""``merge``: the union of several archives in one, each distinct entry once.

Entries are identified by ``(key, kind, name)``. The same entry with the same files (names, order and sha256) in
several inputs is stored once; with different files it is a conflict, an error unless ``prefer`` says which input
wins. The output goes through the ordinary writer, so it is deterministic and obeys the reader's rules.

Producer maps: the ``python`` map describes the host that packed an archive, the ``triton`` map the Triton that
compiled its cache, and the preflight trusts ``triton.key_sha256`` and ``triton.backend_hashes`` for the entries of
that Triton version. A merged archive
therefore keeps only what every contributing input agrees on: one Triton version (else no ``triton`` map, and the
preflight falls back to each kernel's own recorded version), one build key (else none), and per target the
backend hash all inputs that have it agree on. The merging host's own Triton is never claimed: it compiled nothing.
Autotune results and files name no version of their own: each input attributes them to the Triton of its kernels
(spec §4.2), and where the merged archive would attribute them to none or to another (inputs of several Tritons),
the merge writes that input's version in their ``meta`` (format 1.2), so that none is left unchecked for it. One
that its input attributes to none (packed from a cache of several Tritons), where the merged archive would attribute
it to one, says that its Triton is unknown (format 1.3), so that it is not passed as that one's.
"""
from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from . import __version__
from .archive.format import DEFAULT_LEVEL, format_version
from .archive.reader import ArchiveReader
from .archivesource import ArchiveEntry, BlobStore, archive_entry
from .compat import attributed, compiler_of, could_write
from .errors import ConflictError, UsageError
from .model import GROUP, ArchiveInfo, Entry, TritonInfo, manifest_name, naming_triton
from .remote import file_url_path, open_source, scheme_of, shown
from .report import count_words, human_bytes, kind_counts, left_out_lines, plural
from .report import entries as count_entries
from .selection import EVERYTHING, Offered, Selection
from .streams import STDIN, STDIN_NAME, stream_identity

PREFER = ("first", "last")


@dataclass(frozen=True)
class MergeInput:
    archive: str
    digest: str
    entries: int
    contributed: int  # entries of the output taken from this input
    triton_version: str | None
    triton_key_sha256: str | None
    python: str | None  # cache tag and platform


@dataclass
class MergeResult:
    archive: str
    inputs: list[MergeInput]
    entries: dict[str, int]  # kind -> count
    identical: int  # entries found in more than one input with the same files, stored once
    # "key/name (kind): ...": of those, autotune results and files the inputs attribute to different Tritons
    identical_other_triton: list[str]
    conflicts: list[str]  # "key/name (kind)": resolved by prefer
    # "key/name (group): ...": of the identical, groups one input holds fewer files of (thinned, binary-only)
    fuller_kept: list[str]
    versions_written: int  # autotune results and files whose Triton version the output names (format 1.2)
    unknown_written: int  # those it says it cannot name one of, where it would attribute them to one (format 1.3)
    prefer: str | None
    files: int
    unique_blobs: int
    bytes_in: int
    bytes_out: int
    seconds: float
    blocks_needed: int
    blocks_decoded: int
    peak_blocks: int  # decoded blocks held at once, at most
    unknown_entries: int  # entries of kinds this tritonpack does not know: not carried over
    producer: str  # what the output's producer maps say, in words
    not_selected: int = 0  # distinct entries of the inputs that the selection (targets, kernel names) left out

    @property
    def written_archive(self) -> str:
        """The archive this command wrote: where it is standard output, the summary goes to standard error."""
        return self.archive

    def summary(self) -> str:
        count = plural(sum(self.entries.values()), "entry", "entries")
        parts = [f"{plural(self.identical, 'duplicate')} stored once"] if self.identical else []
        if self.conflicts:
            parts.append(f"{plural(len(self.conflicts), 'conflict')} resolved (--prefer {self.prefer})")
        ratio = self.bytes_in / self.bytes_out if self.bytes_out else 0.0
        return (f"merged {plural(len(self.inputs), 'archive')} into {count} ({count_words(self.entries)}): "
                f"{''.join(part + '; ' for part in parts)}{self.files} files, {human_bytes(self.bytes_in)} -> "
                f"{human_bytes(self.bytes_out)} ({ratio:.1f}x) in {self.seconds:.2f} s -> {self.archive}")

    def notes(self) -> list[str]:
        lines = [f"conflict resolved (--prefer {self.prefer}): {c}" for c in self.conflicts[:10]]
        if len(self.conflicts) > 10:
            lines.append(f"... and {len(self.conflicts) - 10} more conflicts")
        lines += [f"a kernel with fewer files in one input (thinned, binary-only), the fuller copy kept: {c}"
                  for c in self.fuller_kept[:10]]
        if len(self.fuller_kept) > 10:
            lines.append(f"... and {len(self.fuller_kept) - 10} more kept from the input with more files")
        lines += [f"the same bytes from different Tritons, stored once: {c}" for c in self.identical_other_triton[:10]]
        if len(self.identical_other_triton) > 10:
            lines.append(f"... and {len(self.identical_other_triton) - 10} more stored once from different Tritons")
        if self.versions_written:
            lines.append(f"{count_entries(self.versions_written)} (autotune results, launcher stubs) name the Triton "
                         "that produced them (format 1.2): the merged archive's kernels would attribute them to none "
                         "or to another")
        if self.unknown_written:
            lines.append(f"{count_entries(self.unknown_written)} (autotune results, launcher stubs) say that their "
                         "Triton is unknown (format 1.3): their inputs name none, and the merged archive's kernels "
                         "would attribute them to one; the preflight reports them unchecked")
        if self.unknown_entries:
            lines.append(f"dropped {self.unknown_entries} entries of a kind this tritonpack does not know")
        lines += left_out_lines(self.not_selected)
        if len({(i.triton_version, i.triton_key_sha256) for i in self.inputs if i.contributed}) > 1:
            lines.append(f"inputs were packed by different Tritons: {self.producer}")
        return lines

    def to_dict(self) -> dict:
        return asdict(self)


def _content(entry: Entry) -> tuple:
    return tuple((f.name, f.sha256) for f in entry.files)


def _fuller(first: Entry, other: Entry) -> Entry | None:
    """Of two copies of one group whose files agree where both have them, the one holding all of the other's (a
    whole group beside a thinned or binary-only copy of it: the same kernel, which no ``--prefer`` need settle);
    None where each lacks a file of the other, or a file differs."""
    if first.kind != GROUP:
        return None
    mine, theirs = dict(_content(first)), dict(_content(other))
    if any(mine[name] != theirs[name] for name in mine.keys() & theirs.keys()):
        return None
    if mine.keys() >= theirs.keys():
        return first
    return other if theirs.keys() >= mine.keys() else None


def merged_info(parts: Sequence[tuple[ArchiveInfo, set[str]]], created: int | None) -> ArchiveInfo:
    """Producer maps that claim only what all contributing inputs agree on (see the module docstring).

    ``parts``: each contributing input's info with the targets (``cuda:90``) of the entries it contributes. A
    target's backend hash is kept only if every input contributing kernels of that target recorded the same one.
    """
    infos = [info for info, _ in parts]
    pythons = {i.python for i in infos}
    python = pythons.pop() if len(pythons) == 1 else None
    triton = None
    tritons = [i.triton for i in infos]
    versions = {t.version if t else None for t in tritons}
    if len(versions) == 1 and None not in versions:
        known = [(t, targets) for t, (_, targets) in zip(tritons, parts, strict=True) if t is not None]
        keys = {t.key_sha256 for t, _ in known}
        hashes: dict[str, str] = {}
        for target in sorted({target for _, targets in parts for target in targets}):
            values = {t.backend_hashes.get(target) for t, targets in known if target in targets}
            value = values.pop() if len(values) == 1 else None
            if value is not None:
                hashes[target] = value
        triton = TritonInfo(known[0][0].version, keys.pop() if len(keys) == 1 else None, hashes)
    return ArchiveInfo(tritonpack=__version__, format_version=format_version(), created=created,
                       python=python, triton=triton)


def _producer_words(info: ArchiveInfo) -> str:
    if info.triton is None:
        return ("no compiling Triton recorded (the inputs disagree, or record none); the preflight checks each "
                "kernel's own version")
    key = info.triton.key_sha256
    build = f", build {key[:12]}" if key else ", build key unknown (inputs differ, or record none)"
    return f"Triton {info.triton.version}{build}, backend hashes for {len(info.triton.backend_hashes)} target(s)"


def _named(entry: Entry, version: str | None, output: TritonInfo | None) -> tuple[str | None, bool]:
    """What an autotune result or a file says of its Triton in the merged archive: the version its input attributes
    to it, where the merged archive would attribute it to none or to another (spec §4.6); that it is unknown, where
    its input attributes it to none (a cache of several Tritons) and the merged archive would to one that could
    have written it (1.3); else nothing, the archive's record saying it. As ``(version, unknown)``."""
    if version is None:
        return None, output is not None and could_write(entry, output.version)
    return (version if output is None or version != output.version else None), False


def _tritons(first: tuple[str | None, str], second: tuple[str | None, str]) -> str:
    """`` (Triton 3.6.0 in a.tpack, 3.9.0 in b.tpack)``, where two inputs attribute one entry to different Tritons
    (``(version, input)`` each); empty where they agree."""
    (one, one_input), (other, other_input) = first, second
    return f" (Triton {one or 'unknown'} in {one_input}, {other or 'unknown'} in {other_input})" if one != other else ""


def _conflict_error(clashes: list[tuple[int, str]], names: Sequence[str]) -> ConflictError:
    """All the entries that differ under one key, in one line: a fleet's merge learns at once how many there are,
    and why they usually are (the key hashes a kernel's source text, not the path of its file, nor where Triton
    is installed, which its files name)."""
    source, first = clashes[0]
    more = f", and {plural(len(clashes) - 1, 'more entry differs', 'more entries differ')}" if len(clashes) > 1 else ""
    return ConflictError(f"{first}{more} (the same cache key, other files: usually a kernel compiled from a source "
                         "file at another path, or by a Triton installed elsewhere; --prefer first|last chooses one)",
                         names[source])


def _check_paths(chosen: dict[tuple[str, str, str], tuple[int, int, Entry]], names: Sequence[str]) -> None:
    """Two different entries must never claim one file; the reader would refuse the output."""
    owner: dict[tuple[str, str], tuple[str, str]] = {}
    for source, _, e in chosen.values():
        for name in [f.name for f in e.files] + ([manifest_name(e.name)] if e.kind == GROUP else []):
            if (e.key, name) in owner:
                other_source, other = owner[(e.key, name)]
                raise ConflictError(f"{e.key}/{name} is claimed by {other} ({other_source}) and by {e.kind} "
                                    f"{e.name} ({names[source]})")
            owner[(e.key, name)] = (names[source], f"{e.kind} {e.name}")


def _stream_of(name: str) -> tuple[int, int] | None:
    """The stream an input names (``-``, a pipe, a FIFO, ``/dev/stdin`` on a pipe, their ``file://`` URLs)."""
    scheme = scheme_of(name)
    if scheme not in ("", "file"):
        return None
    return stream_identity(file_url_path(name) if scheme == "file" else name)


def _refuse_a_stream_named_twice(names: Sequence[str]) -> None:
    """A stream gives its bytes once: named again, it would read empty (an error that blames the archive) or, a
    FIFO, wait for another writer. Refused before anything is read, naming the input that repeats one. A regular
    file named twice is read twice and its entries stored once, as ``-`` is when standard input is that file, but
    ``-`` itself is one input at most."""
    first: dict[object, int] = {}
    for number, name in enumerate(names):
        for stream in ([STDIN] if name == STDIN else []) + [_stream_of(name)]:
            if stream is None:
                continue
            if stream not in first:
                first[stream] = number
                continue
            earlier = names[first[stream]]
            what = (f"named twice (inputs {first[stream] + 1} and {number + 1})" if earlier == name else
                    f"the same stream as input {first[stream] + 1} ({earlier})")
            why = ("standard input gives one archive, so - can be one input at most" if stream == STDIN else
                   "a stream (a pipe, a FIFO) gives its bytes once, so it can be one input at most")
            raise UsageError(f"{what}: {why}", STDIN_NAME if name == STDIN else name)


def merge(
    inputs: Sequence[str | os.PathLike],
    output: str | os.PathLike,
    *,
    prefer: str | None = None,
    level: int = DEFAULT_LEVEL,
    selection: Selection = EVERYTHING,
    max_blocks: int = 0,
) -> MergeResult:
    """Write the union of ``inputs`` to ``output``. ``prefer`` (``"first"``/``"last"``) settles conflicts;
    without it a conflict raises ``ConflictError`` naming the key. ``selection`` takes part of each input (targets,
    kernels, binary-only). ``max_blocks`` caps decoded blocks in memory."""
    from .api import source_date_epoch
    from .archive.writer import write_archive

    if isinstance(inputs, (str, os.PathLike)):  # would be read as one archive a character
        raise UsageError("merge takes a list of archives, not one path", os.fspath(inputs))
    if not inputs:
        raise UsageError("nothing to merge: name at least one archive")
    if prefer is not None and prefer not in PREFER:
        raise UsageError(f"--prefer must be first or last, not {prefer!r}")
    if not 1 <= level <= 22:
        raise UsageError(f"compression level must be 1-22, not {level}")
    selection = selection.checked()
    created = source_date_epoch()
    start = time.perf_counter()
    names = [os.fspath(p) for p in inputs]
    _refuse_a_stream_named_twice(names)
    with contextlib.ExitStack() as stack:
        readers = [stack.enter_context(ArchiveReader(open_source(p))) for p in names]
        unowned = [attributed(r.entries, r.info) for r in readers]  # each input's Triton of its autotune results

        def version(source: int, entry: Entry) -> str | None:
            """The Triton that produced an autotune result or a file, as its input says it (spec §4.2)."""
            if entry.kind == GROUP:
                return None
            compiler = compiler_of(entry, readers[source].info, unowned[source])
            return compiler.version if compiler is not None else None

        chosen: dict[tuple[str, str, str], tuple[int, int, Entry]] = {}
        identical = 0
        identical_other_triton: list[str] = []
        conflicts: list[str] = []
        fuller_kept: list[str] = []
        clashes: list[tuple[int, str]] = []  # (input, what differs from whose): unsettled, without prefer
        left_out: set[tuple[str, str, str]] = set()
        offer = Offered()
        for source, reader in enumerate(readers):
            for number, entry in enumerate(reader.entries):
                offer.add(entry)
                if not selection.wants(entry):
                    left_out.add(entry.ident)
                    continue
                if selection.binary_only:
                    kept = tuple(entry.files[i] for i in selection.file_indices(entry))
                    entry = entry._replace(files=kept)
                ident = entry.ident
                if ident not in chosen:
                    chosen[ident] = (source, number, entry)
                    continue
                first_source, _, first = chosen[ident]
                where = f"{entry.key}/{entry.name} ({entry.kind})"
                earlier = (version(first_source, first), names[first_source])
                this = (version(source, entry), names[source])
                if _content(first) == _content(entry):
                    identical += 1
                    if earlier[0] != this[0]:
                        identical_other_triton.append(f"{where}{_tritons(earlier, this)}: kept as {earlier[1]}'s")
                    continue
                fuller = _fuller(first, entry)
                if fuller is not None:
                    identical += 1
                    fuller_from, thinner_from = (first_source, source) if fuller is first else (source, first_source)
                    fuller_kept.append(f"{where}: kept from {names[fuller_from]}, whose copy has files "
                                       f"{names[thinner_from]}'s lacks")
                    if fuller is entry:
                        chosen[ident] = (source, number, entry)
                    continue
                if prefer is None:
                    clashes.append((source, f"{where} differs from {earlier[1]}'s{_tritons(earlier, this)}"))
                    continue
                winner, loser = (earlier, this) if prefer == "first" else (this, earlier)
                conflicts.append(f"{where}: kept from {winner[1]}{_tritons(winner, loser)}")
                if prefer == "last":
                    chosen[ident] = (source, number, entry)
        if clashes:
            raise _conflict_error(clashes, names)
        _check_paths(chosen, names)
        picked = sorted(chosen.values(), key=lambda c: c[2].ident)
        if selection.chooses_kernels and not any(e.kind == GROUP for _, _, e in picked):
            raise UsageError(f"nothing to merge: no kernel of the inputs matches --arch or --kernel "
                             f"({offer.words(selection)})")
        keep = {(s, n): selection.file_indices(readers[s].entries[n]) for s, n, _ in picked}
        store = BlobStore(readers, ((s, readers[s].blob_of(n, j)) for s, n, _ in picked for j in keep[(s, n)]),
                          max_blocks=max_blocks)
        contributing = sorted({s for s, _, _ in picked})
        info = merged_info([(readers[n].info, {e.kernel.hash_key for s, _, e in picked
                                                if s == n and e.kernel and e.kernel.backend})
                            for n in contributing], created)
        theirs = attributed([e for _, _, e in picked], info)  # what the output would attribute to them
        named = {(s, n): _named(e, version(s, e), theirs) for s, n, e in picked if e.kind != GROUP}
        sources: list[ArchiveEntry] = [
            archive_entry(readers[s], s, n, naming_triton(readers[s].entries[n], *named[(s, n)])
                          if (s, n) in named else readers[s].entries[n], store, keep[(s, n)])
            for s, n, _ in picked]
        written = write_archive(os.fspath(output), sources, info, level=level)
        contributed = [sum(1 for s, _, _ in picked if s == n) for n in range(len(readers))]
        return MergeResult(
            archive=os.fspath(output),
            inputs=[MergeInput(
                archive=shown(names[n]), digest=r.digest, entries=len(r.entries), contributed=contributed[n],
                triton_version=r.info.triton.version if r.info.triton else None,
                triton_key_sha256=r.info.triton.key_sha256 if r.info.triton else None,
                python=f"{r.info.python.cache_tag} {r.info.python.platform}" if r.info.python else None,
            ) for n, r in enumerate(readers)],
            entries=kind_counts(e.kind for _, _, e in picked),
            identical=identical,
            identical_other_triton=identical_other_triton,
            conflicts=conflicts,
            fuller_kept=fuller_kept,
            versions_written=sum(v is not None for v, _ in named.values()),
            unknown_written=sum(unknown for _, unknown in named.values()),
            prefer=prefer,
            files=written.files,
            unique_blobs=written.blobs,
            bytes_in=written.bytes_in,
            bytes_out=written.bytes_out,
            seconds=time.perf_counter() - start,
            blocks_needed=store.blocks_needed,
            blocks_decoded=store.decoded,
            peak_blocks=store.peak_blocks,
            unknown_entries=sum(r.index.unknown_entries for r in readers),
            producer=_producer_words(info),
            not_selected=len(left_out - chosen.keys()),
        )
