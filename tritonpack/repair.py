"""Checking and repairing a cache root in place: ``verify`` asks Triton's own cache manager whether each group
resolves; ``relocate`` rewrites manifests that point into another root (a cache copied with cp -r, rsync or
docker COPY) so that they point into the group's own directory."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from .cachedest import atomic_write, manifest_bytes, names_these_files, read_manifest
from .cacheroot import LocalEntry, not_a_root, scan_cache
from .model import GROUP, manifest_name, names_of

OK = "ok"
STALE = "stale"  # resolves, but through another root's files
BROKEN = "broken"  # does not resolve: Triton recompiles
INCOMPLETE = "incomplete"
UNREADABLE = "unreadable"


@dataclass(frozen=True)
class GroupState:
    path: str  # key/manifest, relative to the root
    state: str
    detail: str = ""


@dataclass
class VerifyReport:
    cache_dir: str
    groups: list[GroupState] = field(default_factory=list)
    resolved_by: str = "triton"  # or "emulated" when Triton is not importable
    other_skipped: int = 0
    ignored: list[tuple[str, str]] = field(default_factory=list)  # (path, reason) of what holds no group Triton reads

    @property
    def problems(self) -> list[GroupState]:
        return [g for g in self.groups if g.state != OK]

    def summary(self) -> str:
        ok = len(self.groups) - len(self.problems)
        how = "Triton's cache manager" if self.resolved_by == "triton" else "the rule of Triton 3.8+ (no Triton here)"
        n = len(self.problems)
        verdict = "all resolve" if not n else f"{n} need{'s' if n == 1 else ''} attention"
        return f"verified {len(self.groups)} groups under {self.cache_dir} with {how}: {ok} ok, {verdict}"

    def notes(self) -> list[str]:
        from .report import plural, shown

        lines = _alike_lines((g.state, g.detail, g.path) for g in self.problems)
        alike: dict[str, list[str]] = {}
        for path, reason in self.ignored:
            alike.setdefault(reason, []).append(path)
        return lines + [f"ignored: {plural(len(paths), 'item')}: {reason}: {shown(paths)}"
                        for reason, paths in alike.items()]

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": not self.problems,
                "ignored": [{"path": path, "reason": reason} for path, reason in self.ignored]}


@dataclass
class RelocateReport:
    cache_dir: str
    fixed: list[str] = field(default_factory=list)
    already_ok: int = 0
    not_fixed: list[tuple[str, str]] = field(default_factory=list)  # (path, reason)
    trimmed: list[str] = field(default_factory=list)  # of those fixed, the manifests that listed files that are gone

    def summary(self) -> str:
        return (f"relocated {len(self.fixed)} manifests under {self.cache_dir}; {self.already_ok} already pointed "
                f"into their own directory; {len(self.not_fixed)} could not be fixed")

    def notes(self) -> list[str]:
        from .report import plural, shown

        lines = _alike_lines(("not fixed", reason, path) for path, reason in self.not_fixed)
        if self.trimmed:
            lists = "it lists" if len(self.trimmed) == 1 else "they list"
            lines.append(f"{plural(len(self.trimmed), 'manifest')} of those relocated listed files that are gone (IR "
                         f"files removed to slim the root?): now {lists} what is left, the kernel's metadata and "
                         f"binary among it: {shown(self.trimmed)}")
        return lines

    def to_dict(self) -> dict:
        return asdict(self)


def _alike_lines(problems) -> list[str]:
    """One line per kind of problem (``(label, detail, group path)``), with a few of its groups: a copied root of
    20,000 groups is one line, not 20,000 (``--json`` lists every group)."""
    from .report import plural, shown

    alike: dict[tuple[str, str], list[str]] = {}
    for label, detail, path in problems:
        alike.setdefault((label, detail), []).append(path)
    return [f"{label}: {plural(len(paths), 'group')}: {detail}: {shown(paths)}"
            for (label, detail), paths in alike.items()]


_GROUP_SKIPS = {"incomplete group": INCOMPLETE, "unreadable manifest": UNREADABLE,
                "unreadable kernel metadata": INCOMPLETE, "manifest names": UNREADABLE,
                "unreadable: ": UNREADABLE}  # a key directory that cannot be listed: its groups cannot be verified


def _group_problem(reason: str) -> str | None:
    return next((state for prefix, state in _GROUP_SKIPS.items() if reason.startswith(prefix)), None)


def _resolver():
    """Triton's own ``get_group`` if Triton is importable, else the strict rule of Triton 3.8+."""
    try:
        from triton.runtime.cache import FileCacheManager
    except Exception:
        FileCacheManager = None

    def resolves(root: str, entry: LocalEntry) -> bool | str:
        """Whether the group resolves, or the error Triton's cache manager raises reading its manifest (a child
        path that is no string: Triton's compile fails the same way)."""
        if FileCacheManager is not None:
            # Triton's own get_group, at this root: its __init__ would take the root from the process (the
            # environment, or 3.4+'s knobs, which a host program may have set), and setting it there would change
            # it for every thread of that program. Every version 3.0-3.9 keeps the key directory in cache_dir.
            manager = FileCacheManager.__new__(FileCacheManager)
            manager.key, manager.lock_path, manager.cache_dir = entry.key, None, os.path.join(root, entry.key)
            try:
                group = manager.get_group(f"{entry.name}.json")
            except Exception as e:
                return f"{type(e).__name__}: {e}"
            return group is not None and f"{entry.name}.json" in group
        import json

        with open(os.path.join(root, entry.key, manifest_name(entry.name)), "rb") as f:
            children = json.load(f)["child_paths"]
        if not all(isinstance(p, str) for p in children.values()):
            return "a child path that is no string"
        return all(os.path.exists(p) for p in children.values())

    return resolves, ("triton" if FileCacheManager is not None else "emulated")


def _scanned(cache_dir: str):
    """The root's scan; an error where it holds things but no Triton cache entry (the directory above a cache
    root, or another directory): a health check that finds nothing there must not pass."""
    root = os.path.abspath(cache_dir)
    scan = scan_cache(root)
    if not scan.entries and scan.skipped and not any(_group_problem(s.reason) for s in scan.skipped):
        raise not_a_root(root, scan.skipped)
    return root, scan


def _points_elsewhere(root: str, entry: LocalEntry) -> str | None:
    """Where a group's manifest points when not at its own files: ``"relative"`` where it names them by relative
    paths (a relative ``TRITON_CACHE_DIR``), which Triton finds from one working directory only, ``"elsewhere"``
    where into another root; None for its own files, also named another way (the root behind a symbolic link,
    ``~/.triton -> /cache``), which Triton reads as they are. The manifest is read once."""
    if not entry.foreign_manifest:
        return None
    key_dir = os.path.join(root, entry.key)
    manifest = read_manifest(os.path.join(key_dir, manifest_name(entry.name)))
    if names_these_files(key_dir, manifest, [*names_of(entry.files), *entry.missing]):  # what it lists, gone too
        return None
    children = manifest.get("child_paths") if isinstance(manifest, dict) else None
    relative = isinstance(children, dict) and any(isinstance(p, str) and not os.path.isabs(p)
                                                  for p in children.values())
    return "relative" if relative else "elsewhere"


def _skipped_state(skipped) -> tuple[str, str] | None:
    """The state of what the scan skipped, where it is a group's (or breaks Triton): None for what Triton ignores."""
    from .cacheroot import KEY_PATTERN

    problem = _group_problem(skipped.reason)
    if problem is not None:
        return problem, skipped.reason
    if skipped.reason == "stray file at the root" and KEY_PATTERN.fullmatch(skipped.path):
        return BROKEN, ("a file where a key directory goes: Triton fails (FileExistsError) when it compiles that "
                        "key; remove it")
    return None


def verify(cache_dir: str) -> VerifyReport:
    root, scan = _scanned(cache_dir)
    resolves, how = _resolver()
    report = VerifyReport(root, resolved_by=how)
    for entry in (e for e in scan.entries if e.kind == GROUP):
        path = f"{entry.key}/{manifest_name(entry.name)}"
        ok = resolves(root, entry)
        if isinstance(ok, str):
            report.groups.append(GroupState(path, BROKEN, f"Triton's cache manager fails on its manifest ({ok}), and "
                                                          "so does Triton's compile (tritonpack relocate fixes it)"))
        elif entry.missing and not ok:
            report.groups.append(GroupState(path, BROKEN, _gone(entry)))
        elif (pointing := _points_elsewhere(root, entry)) is not None:
            if pointing == "relative":
                state, detail = BROKEN, ("names its files by relative paths, which Triton finds from one working "
                                         "directory only (tritonpack relocate fixes it)")
            elif ok:
                state, detail = STALE, "points into another root; Triton reads that root's files"
            else:
                state, detail = BROKEN, ("points into another root that is gone; Triton recompiles (tritonpack "
                                         "relocate fixes it)")
            report.groups.append(GroupState(path, state, detail))
        elif not ok:
            report.groups.append(GroupState(path, BROKEN, "does not resolve through Triton's cache manager"))
        else:
            report.groups.append(GroupState(path, OK))
    for skipped in scan.skipped:
        problem = _skipped_state(skipped)
        if problem is None:
            report.other_skipped += 1
            report.ignored.append((skipped.path, skipped.reason))
        else:
            report.groups.append(GroupState(skipped.path, *problem))
    return report


def _gone(entry: LocalEntry) -> str:
    kinds = ", ".join(sorted({"." + name.rpartition(".")[2] for name in entry.missing}))
    return (f"lists files that are gone ({kinds}: removed to slim the root?), and Triton 3.8+ recompiles a group that "
            "lacks any; its metadata and binary are here (tritonpack relocate lists what is left, and Triton hits it)")


def relocate(cache_dir: str) -> RelocateReport:
    root, scan = _scanned(cache_dir)
    report = RelocateReport(root)
    for entry in (e for e in scan.entries if e.kind == GROUP):
        if not entry.missing and _points_elsewhere(root, entry) is None:
            report.already_ok += 1
            continue
        path = f"{entry.key}/{manifest_name(entry.name)}"
        try:
            atomic_write(os.path.join(root, entry.key), manifest_name(entry.name), manifest_bytes(root, entry))
        except OSError as e:  # this group stays as it was: the others are still fixed, and it is reported
            report.not_fixed.append((path, f"cannot rewrite manifest: {e.strerror}"))
            continue
        report.fixed.append(path)
        if entry.missing:
            report.trimmed.append(path)
    for skipped in scan.skipped:
        if _group_problem(skipped.reason):
            report.not_fixed.append((skipped.path, skipped.reason))
    return report
