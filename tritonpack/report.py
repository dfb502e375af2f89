"""Result objects of pack and unpack, with the one-line summaries the CLI prints."""
from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from .cachedest import Placement
    from .cacheroot import Skipped
    from .compat import CheckReport


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} GB"


def plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n} {word if n == 1 else (many or word + 's')}"


def none_used(entries: int, reasons: Sequence[tuple[str, int]]) -> str:
    """The refusal of an archive none of whose entries would be used here: the first reason, and how many more
    ``check`` lists."""
    first = reasons[0][0] if reasons else "no entry is usable"
    more = f"; and {plural(len(reasons) - 1, 'other reason')}, as check lists them" if len(reasons) > 1 else ""
    return f"none of the {entries} entries would be used here ({first}{more})"


def foreign_manifests_line(n: int) -> str:
    return (f"{plural(n, 'manifest')} pointed outside {'its' if n == 1 else 'their'} own directory (a copied cache): "
            "the files were read from the group's own directory")


class Thinned(NamedTuple):
    """A group packed without files its manifest lists that are gone (IR files removed to slim the root, or left
    out by a copy)."""

    path: str  # key/manifest, relative to the root
    missing: tuple[str, ...]


def thinned_line(thinned: Sequence[Thinned]) -> str:
    """Said whenever a group was packed with less than its manifest lists: never a silent loss."""
    kinds = ", ".join(sorted({"." + name.rpartition(".")[2] for t in thinned for name in t.missing}))
    lists = "its manifest lists" if len(thinned) == 1 else "their manifests list"
    return (f"{plural(len(thinned), 'kernel')} packed without files {lists} that are gone "
            f"({plural(sum(len(t.missing) for t in thinned), 'file')}: {kinds}; {shown([t.path for t in thinned])}): "
            "Triton loads a kernel from its metadata and binary, so the archive lists what is left, as --binary-only "
            "does, and Triton hits it")


def count_words(kinds: dict[str, int]) -> str:
    labels = {"group": "kernel", "autotune": "autotune result", "file": "file"}
    parts = [f"{n} {labels[k]}{'' if n == 1 else 's'}" for k, n in kinds.items() if n]
    return ", ".join(parts) or "nothing"


def skipped_lines(skipped: list[Skipped], examples: int = 3) -> list[str]:
    """One line per reason, with a few example paths: counted and explained, never silent."""
    by_reason: dict[str, list[str]] = {}
    for s in skipped:
        by_reason.setdefault(s.reason, []).append(s.path)
    lines = []
    for reason, paths in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(paths[:examples]) + (", ..." if len(paths) > examples else "")
        lines.append(f"skipped {len(paths)}: {reason} ({shown})")
    return lines


class PackResult(NamedTuple):
    archive: str
    cache_dir: str
    entries: dict[str, int]  # kind -> count
    files: int
    unique_blobs: int
    bytes_in: int
    bytes_out: int
    seconds: float
    skipped: list[Skipped]
    not_since: int  # entries left out by ``since``: no file changed since then
    not_selected: int  # and then by the selection (targets, kernel names)
    foreign_manifests: int
    triton_version: str | None
    cubins: int | None = None  # with --splice-ptx: cubins beside their group's .ptx (None: not counted)
    spliced: int | None = None  # of those, stored without the PTX text they embed (spec §5.1)
    triton_note: str | None = None  # why the archive records less than the local Triton's fingerprint
    thinned: Sequence[Thinned] = ()

    @property
    def written_archive(self) -> str:
        """The archive this command wrote: where it is standard output, the summary goes to standard error."""
        return self.archive

    @property
    def ratio(self) -> float:
        return self.bytes_in / self.bytes_out if self.bytes_out else 0.0

    def summary(self) -> str:
        count = plural(sum(self.entries.values()), "entry", "entries")
        return (f"packed {count} ({count_words(self.entries)}) from {self.cache_dir}: "
                f"{self.files} files, {human_bytes(self.bytes_in)} -> {human_bytes(self.bytes_out)} "
                f"({self.ratio:.1f}x) in {self.seconds:.2f} s -> {self.archive}")

    def notes(self) -> list[str]:
        lines = skipped_lines(self.skipped)
        lines += left_out_lines(self.not_selected, self.not_since)
        if self.foreign_manifests:
            lines.append(foreign_manifests_line(self.foreign_manifests))
        if self.thinned:
            lines.append(thinned_line(self.thinned))
        if self.triton_note:
            lines.append(self.triton_note)
        if self.cubins == 0:
            lines.append("--splice-ptx: no cubin beside its group's .ptx, so nothing was spliced (a 1.0 archive)")
        elif self.cubins is not None and self.spliced is not None and self.spliced < self.cubins:
            lines.append(f"{self.cubins - self.spliced} of {self.cubins} cubins stored whole: their embedded PTX text "
                         "is not their .ptx line for line, their .ptx is stored in another block (the same as another "
                         "group's), or they embed none (compiled without -lineinfo)")
        return lines

    def to_dict(self) -> dict:
        d = self._asdict()
        d["skipped"] = [{"path": s.path, "reason": s.reason} for s in self.skipped]
        d["thinned"] = [{"path": t.path, "missing": list(t.missing)} for t in self.thinned]
        d["ratio"] = round(self.ratio, 3)
        return d


class UnpackResult(NamedTuple):
    archive: str
    cache_dir: str
    entries: int
    written: int
    present: int
    relinked: int
    replaced: int
    conflicts: list[str]
    files_written: int
    bytes_written: int
    seconds: float
    kinds: dict[str, int]
    unknown_entries: int
    not_used: list[tuple[str, int]]  # (reason, entries) left out by the preflight
    not_used_entries: int
    forced: int  # entries that the preflight says will not be used, written (replaced, relinked) by --force
    forced_present: int  # entries that the preflight says will not be used, found already present with --force
    unchecked: list[str]
    linked: list[str]  # kept: the key directory is a symbolic link (never written through)
    key_not_directory: list[str]  # kept: a file (anything but a directory) where the key directory goes
    file_is_directory: list[str]  # kept: a directory where one of the entry's files goes (never removed)
    not_selected: int = 0  # entries of the archive that the selection (targets, kernel names) left out
    root_only: str = ""  # written as root with a umask that keeps other users out (``cachedest.root_only``)
    not_writable: Sequence[str] = ()  # kept: its key directory needs writing, and this process may not write it
    digest: str = ""  # the archive digest (the index's sha256) of what was read

    def summary(self) -> str:
        parts = [f"{self.written} written", f"{self.present} already present"]
        if self.relinked:
            parts.append(f"{self.relinked} relinked")
        if self.replaced:
            parts.append(f"{self.replaced} replaced")
        for kept, why in ((self.conflicts, "differ"), (self.linked, "key directory is a symbolic link"),
                          (self.key_not_directory, "key directory is not a directory"),
                          (self.file_is_directory, "a file is a directory"),
                          (self.not_writable, "key directory not writable")):
            if kept:
                parts.append(f"{len(kept)} kept ({why})")
        if self.not_used_entries:
            parts.append(f"{self.not_used_entries} not used here (skipped)")
        count = plural(self.entries, "entry", "entries")
        in_place = self.written + self.present + self.relinked + self.replaced
        taken = count if in_place == self.entries else f"{in_place} of {count}"  # the rest kept or not used
        return (f"unpacked {taken} ({count_words(self.kinds)}) into {self.cache_dir}: "
                f"{', '.join(parts)}; {plural(self.files_written, 'file')}, {human_bytes(self.bytes_written)} "
                f"in {self.seconds:.2f} s")

    def notes(self) -> list[str]:
        lines = kept_lines(self.conflicts, self.linked, self.key_not_directory, self.file_is_directory,
                           self.not_writable)
        lines += left_out_lines(self.not_selected)
        lines += [f"skipped {entries(n)} that will not be used here: {reason}" for reason, n in self.not_used]
        if self.forced:
            lines.append(f"--force: wrote {entries(self.forced)} that the preflight says will not be used here")
        if self.forced_present:
            lines.append(f"--force: {entries(self.forced_present)} that the preflight says will not be used here "
                         f"{'was' if self.forced_present == 1 else 'were'} already present")
        lines += [f"not checked: {note}" for note in self.unchecked]
        if self.unknown_entries:
            lines.append(f"skipped {self.unknown_entries} entries of a kind this tritonpack does not know "
                         "(archive written by a newer version)")
        return lines + root_only_lines(self.root_only)

    def to_dict(self) -> dict:
        return {**self._asdict(), "not_used": reasons_to_dicts(self.not_used)}


def reasons_to_dicts(reasons: list[tuple[str, int]]) -> list[dict]:
    """Why entries were not used, in JSON as ``check --json`` gives it: one object a reason."""
    return [{"reason": reason, "entries": n} for reason, n in reasons]


def root_only_lines(root_only: str) -> list[str]:
    return [f"written as root with {root_only}: a Triton running as another user can read none of it (umask 022 "
            "before unpacking lets every user read it)"] if root_only else []


def unpack_result(archive: str, cache_dir: str, placements: Sequence[Placement], report: CheckReport, force: bool,
                  files: int, size: int, seconds: float, unknown_entries: int, not_selected: int = 0,
                  root_only: str = "", digest: str = "") -> UnpackResult:
    """What an unpack did, from the final placement of each entry the preflight's ``report`` checked (with
    ``force`` every entry it checked is placed, in its order: ``forced`` counts only those written)."""
    from .cachedest import (
        CONFLICT,
        FILE_IS_DIRECTORY,
        KEY_NOT_DIRECTORY,
        LINKED,
        NOT_WRITABLE,
        PRESENT,
        RELINK,
        REPLACE,
        WRITE,
    )

    actions = Counter(p.action for p in placements)

    def named(action: str) -> list[str]:
        return [f"{p.entry.key}/{p.entry.name}" for p in placements if p.action == action] if actions[action] else []

    forced: Counter[str] = Counter()
    if force and report.unusable_count:
        usable = report.verdicts.usable
        forced.update(p.action for k, p in enumerate(placements) if not usable(k))
    return UnpackResult(
        archive=archive,
        cache_dir=cache_dir,
        entries=len(report.verdicts),
        written=actions[WRITE],
        present=actions[PRESENT],
        relinked=actions[RELINK],
        replaced=actions[REPLACE],
        conflicts=named(CONFLICT),
        files_written=files,
        bytes_written=size,
        seconds=seconds,
        kinds=kind_counts(e.kind for e in report.verdicts.entries),
        unknown_entries=unknown_entries,
        not_used=[] if force else report.reasons(),
        not_used_entries=0 if force else report.unusable_count,
        forced=forced[WRITE] + forced[REPLACE] + forced[RELINK],
        forced_present=forced[PRESENT],
        unchecked=report.unchecked,
        linked=named(LINKED),
        key_not_directory=named(KEY_NOT_DIRECTORY),
        file_is_directory=named(FILE_IS_DIRECTORY),
        not_selected=not_selected,
        root_only=root_only,
        not_writable=named(NOT_WRITABLE),
        digest=digest,
    )


def kept_lines(conflicts: list[str], linked: list[str], key_not_directory: list[str],
               file_is_directory: list[str], not_writable: Sequence[str] = ()) -> list[str]:
    """One line per reason an unpack kept what the root holds, with a few of the entries."""
    reasons = (
        (conflicts, "existing {} whose content differs from the archive (--overwrite replaces them)"),
        (linked, "{} whose key directory is a symbolic link (never written through, not even with --overwrite; "
                 "remove the link to unpack them)"),
        (key_not_directory, "{} whose key directory is taken by a file, or anything else but a directory "
                            "(--overwrite replaces it)"),
        (file_is_directory, "{} with a directory where one of its files goes (never removed, not even with "
                            "--overwrite)"),
        (not_writable, "{} whose key directory needs writing and is not writable by this user (another user's, "
                       "in a shared root: that user, or root, can unpack them)"),
    )
    return [f"kept {len(kept)} {why.format('entry' if len(kept) == 1 else 'entries')}: {shown(list(kept))}"
            for kept, why in reasons if kept]


def left_out_lines(not_selected: int, not_since: int = 0) -> list[str]:
    """What pack's ``--since`` and pack's or unpack's selection left out, said alike by both."""
    lines = [f"left out {entries(not_since)} with no file changed since --since"] if not_since else []
    if not_selected:
        lines.append(f"left out {entries(not_selected)} that --arch or --kernel does not select")
    return lines


def entries(n: int) -> str:
    return plural(n, "entry", "entries")


def shown(names: list[str], examples: int = 3) -> str:
    """A few of the entries a note is about, then "..." for the rest."""
    return ", ".join(names[:examples]) + (", ..." if len(names) > examples else "")


def kind_counts(kinds) -> dict[str, int]:
    counts = Counter(kinds)
    return {k: counts.get(k, 0) for k in ("group", "autotune", "file")}
