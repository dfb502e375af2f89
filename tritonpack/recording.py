"""``record``: run a command with a tracking cache manager and pack exactly the entries it used.

Triton resolves its cache manager from ``TRITON_CACHE_MANAGER`` ("module:Class") in every version: 3.0-3.3 read it at
each ``get_cache_manager`` call, 3.4+ through ``knobs.cache.manager_class``, which also demands a ``CacheManager``
subclass. The tracking manager (``record_hook.py``) is copied to a private directory put first on ``PYTHONPATH``,
so that every Python the command starts, however deep and whichever environment it runs in, imports it. It logs
what it serves and writes, with the cache directory it was given (whatever set it: ``TRITON_CACHE_DIR`` in the
command, Inductor's ``$TORCHINDUCTOR_CACHE_DIR/triton/0``), so the entries are taken from the roots that were
really used, and only the key directories that were used are read.

A user's own ``TRITON_CACHE_MANAGER`` is kept, not refused: the tracking manager subclasses it when it is a
``FileCacheManager`` (same on-disk layout, so what it serves can be packed); any other manager is used as is and
reported, since its entries are not files in Triton's layout.
"""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from .archive.format import DEFAULT_LEVEL, format_version
from .cacheroot import LocalEntry, Skipped, scan_keys
from .errors import CacheError, RecordError, Terminated, UsageError
from .model import FILE, GROUP, ArchiveInfo, PythonInfo, TritonInfo, hash_key, index_order, manifest_name
from .report import Thinned, count_words, foreign_manifests_line, human_bytes, kind_counts, plural, thinned_line

HOOK_MODULE = "tritonpack_record_hook"  # the name record_hook.py gets in the command's PYTHONPATH
HOOK_CLASS = "TrackingCacheManager"
LOG_ENV = "TRITONPACK_RECORD_LOG"  # the same names as in record_hook.py
CHAIN_ENV = "TRITONPACK_RECORD_CHAIN"
MANAGER_ENV = "TRITON_CACHE_MANAGER"
HOOK_SPEC = f"{HOOK_MODULE}:{HOOK_CLASS}"


@dataclass(frozen=True)
class Use:
    """One entry the run used, named as Triton's cache manager saw it."""

    root: str
    key: str
    what: str  # "group" (get_group / put_group) or "file" (get_file / put)
    name: str  # the kernel name of a group, the file name of a file


@dataclass
class RecordLog:
    """What the tracking managers of every process logged, parsed."""

    uses: dict[Use, list[int]] = field(default_factory=dict)  # -> [hits, writes]
    processes: dict[int, dict] = field(default_factory=dict)  # pid -> its "process" line (and "key_sha256")
    unsupported: list[str] = field(default_factory=list)  # TRITON_CACHE_MANAGER values not in Triton's layout
    bad_lines: int = 0


def hook_environment(environ: Mapping[str, str], hook_dir: str, log_path: str) -> dict[str, str]:
    """The command's environment: the tracking manager installed, the user's own manager chained behind it.

    Inside another ``record`` the outer manager is kept and this run's log is added to its list of logs.
    """
    env = dict(environ)
    user = env.get(MANAGER_ENV, "").strip()
    logs = [log_path]
    if user == HOOK_SPEC:
        logs += [p for p in env.get(LOG_ENV, "").split(os.pathsep) if p]
    elif user:
        env[CHAIN_ENV] = user
    else:
        env.pop(CHAIN_ENV, None)
    env[MANAGER_ENV] = HOOK_SPEC
    env[LOG_ENV] = os.pathsep.join(logs)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [hook_dir, env.get("PYTHONPATH", "")]))
    return env


def _hook_directory(work: str) -> str:
    """Where the tracking manager's module goes for the command's PYTHONPATH: kept beside the fingerprints, one
    directory a version of it, so that a process the command leaves running, which imports it at its first
    compile, still finds it once record has ended and removed ``work`` (it failed there with ModuleNotFoundError;
    its uses, logged to ``work``, are then lost, its compiles not). ``work`` itself where there is no home to keep
    it in, or it cannot be written."""
    import hashlib

    from .cachedest import atomic_write
    from .fingerprint import cache_home

    with open(os.path.join(os.path.dirname(__file__), "record_hook.py"), "rb") as f:
        source = f.read()
    home = cache_home()
    if home is not None:
        directory = os.path.join(home, f"record-hook-{hashlib.sha256(source).hexdigest()[:16]}")
        module = os.path.join(directory, f"{HOOK_MODULE}.py")
        try:
            with open(module, "rb") as f:
                if f.read() == source:
                    return directory
        except OSError:
            pass
        with contextlib.suppress(OSError):
            os.makedirs(directory, exist_ok=True)
            atomic_write(directory, f"{HOOK_MODULE}.py", source)
            return directory
    with open(os.path.join(work, f"{HOOK_MODULE}.py"), "wb") as f:
        f.write(source)
    return work


def parse_log(lines: Iterable[str]) -> RecordLog:
    """Fold the event lines into uses and process descriptions; a torn or foreign line is counted, not fatal."""
    log = RecordLog()
    for line in lines:
        try:
            record = json.loads(line)
            op = record["op"]
            if op in ("hit", "write"):
                directory = record["dir"]
                use = Use(os.path.dirname(directory), os.path.basename(directory), record["what"], record["name"])
                counts = log.uses.setdefault(use, [0, 0])
                counts[op == "write"] += 1
            elif op == "process":
                log.processes.setdefault(int(record["pid"]), {}).update(record)
            elif op == "key":
                log.processes.setdefault(int(record["pid"]), {})["key_sha256"] = record["key_sha256"]
            elif op == "unsupported" and record["manager"] not in log.unsupported:
                log.unsupported.append(record["manager"])
        except (ValueError, KeyError, TypeError):
            log.bad_lines += 1
    return log


@dataclass(frozen=True)
class RecordedEntry:
    """An entry packed by ``record``, with how the run used it."""

    root: str
    key: str
    kind: str
    name: str
    hits: int  # served from the cache
    writes: int  # compiled or written during the run


@dataclass
class Selection:
    entries: list[LocalEntry] = field(default_factory=list)
    recorded: list[RecordedEntry] = field(default_factory=list)
    not_packed: list[Skipped] = field(default_factory=list)  # paths are absolute: several roots


def _reason(scan_skipped: list[Skipped], key: str, name: str) -> str:
    """Why a used entry is not in the scan: the scanner's own reason for that file or key, if it gave one."""
    for s in scan_skipped:
        if s.path in (key, f"{key}/{name}", f"{key}/{manifest_name(name)}"):
            return s.reason
    for s in scan_skipped:
        if s.path.startswith(f"{key}/"):
            return s.reason
    return "no longer in the cache"


def select(log: RecordLog) -> Selection:
    """The entries of the used roots that the run used, and what it used that cannot be packed, with reasons."""
    selection = Selection()
    by_root: dict[str, list[Use]] = {}
    for use in log.uses:
        by_root.setdefault(use.root, []).append(use)
    chosen: dict[tuple[str, str, str], LocalEntry] = {}
    differing: set[tuple[str, tuple[str, str, str]]] = set()  # (root, entry) said once, not once a file used
    for root in sorted(by_root):
        uses = sorted(by_root[root], key=lambda u: (u.key, u.what != GROUP, u.name))
        scan = scan_keys(root, {u.key for u in uses})
        groups = {(e.key, e.name): e for e in scan.entries if e.kind == GROUP}
        loose = {(e.key, e.name): e for e in scan.entries if e.kind != GROUP}
        group_of = {(e.key, f.name): e for e in scan.entries if e.kind == GROUP for f in e.files}
        unpacked: dict[tuple[str, str], list[str]] = {}  # (key, reason) -> names
        for use in uses:
            hits, writes = log.uses[use]
            if use.what == GROUP:
                entry = groups.get((use.key, use.name))
            else:  # a loose file, or a file of a group (packed with its group)
                entry = loose.get((use.key, use.name)) or group_of.get((use.key, use.name))
            if entry is None:
                unpacked.setdefault((use.key, _reason(scan.skipped, use.key, use.name)), []).append(use.name)
                continue
            ident = index_order(entry)
            if ident in chosen:
                if chosen[ident] is not entry and (root, ident) not in differing and \
                        not _same_content(chosen[ident], entry):
                    differing.add((root, ident))
                    selection.not_packed.append(Skipped(
                        os.path.join(root, entry.key, entry.name),
                        "also used from another root with different content; packed once, from the first root"))
                continue
            chosen[ident] = entry
            selection.entries.append(entry)
            selection.recorded.append(RecordedEntry(root, entry.key, entry.kind, entry.name, hits, writes))
        for (key, reason), names in sorted(unpacked.items()):
            more = f" and {len(names) - 1} more" if len(names) > 1 else ""
            selection.not_packed.append(Skipped(os.path.join(root, key, names[0]) + more, reason))
    return selection


def _untracked(log: RecordLog, default_root: str | None, began: int) -> list[str]:
    """Key directories of the roots the run used (and Triton's default one) that changed while it ran and that no
    tracked process used: a kernel compiled where the recording could not see it (an own cache manager, an
    environment without the recording's), which would otherwise be left out without a word."""
    from .cacheroot import KEY_PATTERN

    used = {(u.root, u.key) for u in log.uses}
    found = []
    for root in sorted({u.root for u in log.uses} | ({default_root} if default_root else set())):
        with contextlib.suppress(OSError), os.scandir(root) as items:
            for item in items:
                with contextlib.suppress(OSError):
                    if (root, item.name) not in used and KEY_PATTERN.fullmatch(item.name) and \
                            item.is_dir(follow_symlinks=False) and item.stat().st_mtime_ns >= began:
                        found.append(os.path.join(root, item.name))
    return sorted(found)


def _same_content(a: LocalEntry, b: LocalEntry) -> bool:
    return [(f.name, f.size) for f in a.files] == [(f.name, f.size) for f in b.files] and all(
        x.read() == y.read() for x, y in zip(a.files, b.files, strict=True))


def _local_triton_dir() -> str | None:
    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        return None
    return os.path.dirname(os.path.realpath(spec.origin)) if spec and spec.origin else None


def _one(values: Iterable):
    distinct = set(values)
    return distinct.pop() if len(distinct) == 1 else None


def archive_info(entries: Sequence[LocalEntry], processes: Mapping[int, dict], created: int | None,
                 version: str) -> tuple[ArchiveInfo, list[str]]:
    """The producer maps, describing the Python and Triton the command ran, not this process, and never
    claiming more than is known: a Triton other than the one importable here is recorded with its version and
    build key (when the run computed it) but no backend hashes; several different ones, as unknown."""
    from .fingerprint import local_triton
    from .toolchain import checked_hashes

    notes: list[str] = []
    procs = list(processes.values())
    python_ids = {(p.get("implementation"), p.get("version"), p.get("cache_tag"), p.get("ext_suffix"),
                   p.get("platform")) for p in procs}
    python = None
    if len(python_ids) == 1:
        impl, ver, tag, suffix, plat = python_ids.pop()
        if impl and ver and plat:
            python = PythonInfo(impl, ver, tag, suffix, plat)
    elif len(python_ids) > 1:
        notes.append("the command ran several Pythons: the archive records none as the producer")
    tritons = {(p.get("triton_dir"), p.get("triton_version")) for p in procs}
    triton = None
    if len(tritons) == 1:
        directory, triton_version = tritons.pop()
        targets = {(e.kernel.backend, e.kernel.arch, e.kernel.warp_size) for e in entries
                   if e.kernel and e.kernel.backend and e.kernel.arch is not None and e.kernel.warp_size}
        here = local_triton(targets) if directory and directory == _local_triton_dir() else None
        if here is not None and here.version == triton_version:
            wanted = {hash_key(*target) for target in targets}
            triton, elsewhere = checked_hashes(TritonInfo(here.version, here.key_sha256, {
                t: h for t, h in sorted(here.backend_hashes.items()) if t in wanted}), entries)
            if elsewhere:
                notes.append(elsewhere)
        elif triton_version:
            triton = TritonInfo(triton_version, _one(k for p in procs if (k := p.get("key_sha256"))), {})
            notes.append(f"the command's Triton ({directory}) is not the one importable here: the archive records "
                         "its version and build key but no backend hashes, so the preflight cannot check ptxas")
    elif len(tritons) > 1:
        notes.append("the command ran several Triton installations: the archive records no packing Triton; the "
                     "preflight checks each kernel's own Triton version")
    info = ArchiveInfo(tritonpack=version, format_version=format_version(), created=created,
                       python=python, triton=triton)
    return info, notes


def retag_stubs(entries: Sequence[LocalEntry], python: PythonInfo | None) -> list[LocalEntry]:
    """Launcher stubs are tagged with the Python that built them (the command's), not with this process's."""
    if python is None:
        return list(entries)
    out = []
    for e in entries:
        if e.kind == FILE and e.stub is not None and e.stub.role == "launcher":
            suffix = python.ext_suffix if e.stub.tag_from == "packer" else e.stub.ext_suffix
            e = e._replace(stub=e.stub._replace(ext_suffix=suffix, platform=python.platform))
        out.append(e)
    return out


@dataclass
class RecordResult:
    archive: str
    command: list[str]
    returncode: int
    roots: list[str]
    entries: dict[str, int]  # kind -> count
    recorded: list[RecordedEntry]
    not_packed: list[Skipped]
    files: int
    unique_blobs: int
    bytes_in: int
    bytes_out: int
    seconds: float  # the whole recording, command included
    pack_seconds: float
    processes: int  # processes that used Triton's cache
    unsupported_managers: list[str] = field(default_factory=list)
    foreign_manifests: int = 0
    producer_notes: list[str] = field(default_factory=list)
    triton_version: str | None = None
    untracked: list[str] = field(default_factory=list)  # ROOT/KEY written during the run that no use names
    thinned: list[Thinned] = field(default_factory=list)  # groups packed without files that are gone

    @property
    def written_archive(self) -> str:
        """The archive this command wrote: where it is standard output, the summary goes to standard error."""
        return self.archive

    @property
    def compiled(self) -> int:
        return sum(1 for r in self.recorded if r.writes)

    def summary(self) -> str:
        count = plural(sum(self.entries.values()), "entry", "entries")
        roots = ", ".join(self.roots) or "no root"
        return (f"recorded {count} ({count_words(self.entries)}) used by `{shlex.join(self.command)}` from {roots}: "
                f"{len(self.recorded) - self.compiled} served from the cache, {self.compiled} written by the run; "
                f"{self.files} files, {human_bytes(self.bytes_in)} -> {human_bytes(self.bytes_out)} "
                f"in {self.pack_seconds:.2f} s -> {self.archive}")

    def notes(self) -> list[str]:
        lines = []
        if self.returncode != 0:
            lines.append(f"the command {_status(self.returncode)}; packed what it used anyway (--allow-failure)")
        if self.untracked:
            lines.append(f"not packed, {len(self.untracked)}: key directories written while the command ran by no "
                         "process the recording tracked (one with its own TRITON_CACHE_MANAGER or "
                         "triton.knobs.cache.manager_class, one started without the recording's environment, or "
                         f"another program using the root): {', '.join(self.untracked[:3])}"
                         f"{', ...' if len(self.untracked) > 3 else ''}")
        by_reason: dict[str, list[str]] = {}
        for s in self.not_packed:
            by_reason.setdefault(s.reason, []).append(s.path)
        for reason, paths in sorted(by_reason.items(), key=lambda kv: -len(kv[1])):
            shown = ", ".join(paths[:3]) + (", ..." if len(paths) > 3 else "")
            lines.append(f"used but not packed, {len(paths)}: {reason} ({shown})")
        lines += [f"{MANAGER_ENV}={m} keeps kernels outside Triton's file layout: what it served was not recorded"
                  for m in self.unsupported_managers]
        if self.foreign_manifests:
            lines.append(foreign_manifests_line(self.foreign_manifests))
        if self.thinned:
            lines.append(thinned_line(self.thinned))
        return lines + self.producer_notes

    def to_dict(self) -> dict:
        d = asdict(self)
        d["not_packed"] = [s._asdict() for s in self.not_packed]  # named tuples: asdict keeps them as tuples
        d["thinned"] = [{"path": t.path, "missing": list(t.missing)} for t in self.thinned]
        return d


def _run(command: Sequence[str], env: Mapping[str, str], stdout: int | None) -> int:
    try:
        proc = subprocess.Popen(list(command), env=dict(env), stdout=stdout)
    except FileNotFoundError:
        raise UsageError("command not found", command[0]) from None
    except OSError as e:
        raise UsageError(f"cannot run: {e.strerror}", command[0]) from None
    with _forwarding_signals(proc) as received:
        try:
            returncode = proc.wait()
        except KeyboardInterrupt:  # the command was interrupted too: let it finish its own way
            proc.wait()
            raise
    if received:  # stopped as a whole (``timeout``, a pod's end): the command was told, and nothing is packed
        raise Terminated(received[0])
    return returncode


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants now (Linux's ``/proc``; ``pid`` alone elsewhere): a shell script's command
    runs in a grandchild, which a signal to the shell alone leaves running."""
    children: dict[int, list[int]] = {}
    with contextlib.suppress(OSError):
        for name in os.listdir("/proc"):
            if name.isdigit():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    with open(f"/proc/{name}/stat", "rb") as f:
                        parent = int(f.read().rpartition(b")")[2].split()[1])
                    children.setdefault(parent, []).append(int(name))
    tree, todo = [], [pid]
    while todo:
        tree.append(todo.pop())
        todo += children.get(tree[-1], [])
    return tree


def _from_a_terminal() -> bool:
    """Whether this process's group is a terminal's foreground group, which a Ctrl-C there interrupts whole, the
    command with it: a SIGINT then is not passed on again (an interrupted cleanup would be interrupted twice)."""
    for fd in (0, 1, 2):
        with contextlib.suppress(OSError):
            if os.isatty(fd) and os.tcgetpgrp(fd) == os.getpgrp():
                return True
    return False


@contextlib.contextmanager
def _forwarding_signals(proc: subprocess.Popen):
    """A SIGTERM or SIGHUP to tritonpack while the command runs goes to the command and every process under it
    (a shell script's), which would otherwise go on alone; a SIGINT too, where it was not a terminal's Ctrl-C that
    reached them already (``kill -INT``, a container's stop signal). Where ``archivedest.handling_signals`` says;
    yields the SIGTERMs and SIGHUPs received."""
    from .archivedest import handling_signals

    received: list[int] = []

    def tell(signum: int) -> None:
        for pid in _process_tree(proc.pid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signum)

    def forward(signum: int, frame) -> None:
        received.append(signum)
        tell(signum)

    def interrupted(signum: int, frame) -> None:
        if not _from_a_terminal():
            tell(signum)
        raise KeyboardInterrupt

    with handling_signals({signal.SIGTERM: forward, signal.SIGHUP: forward, signal.SIGINT: interrupted}):
        yield received


def _default_root() -> str | None:
    """The root the command's Tritons use unless it sets another (``TRITON_CACHE_DIR``, else Triton's default),
    absolute; None for an empty ``TRITON_CACHE_DIR``, which the command itself must replace to compile."""
    from .triton_env import default_cache_dir

    try:
        return os.path.abspath(default_cache_dir())
    except UsageError:
        return None


def _status(returncode: int) -> str:
    return f"was killed by signal {-returncode}" if returncode < 0 else f"exited with status {returncode}"


def record(
    command: Sequence[str],
    output: str | os.PathLike = "kernels.tpack",
    *,
    level: int = DEFAULT_LEVEL,
    allow_failure: bool = False,
    stdout: int | None = None,
) -> RecordResult:
    """Run ``command`` with a tracking cache manager, then pack exactly the cache entries it used.

    ``stdout``: a file descriptor for the command's standard output (default: inherited). Raises
    ``RecordError`` when the command fails (unless ``allow_failure``) or used no Triton cache entry.
    """
    from . import __version__
    from .api import refuse_output_inside, source_date_epoch
    from .archive.writer import write_archive
    from .archivedest import destination

    if isinstance(command, str):  # would be run as one program a character
        raise UsageError("record takes the command as a list of words, e.g. shlex.split(line)", command)
    command = list(command)
    if not command:
        raise UsageError("no command to record (tritonpack record -o OUT.tpack -- CMD [ARGS...])")
    if not 1 <= level <= 22:
        raise UsageError(f"compression level must be 1-22, not {level}")
    target = destination(os.fspath(output))  # a directory is refused before the command runs, too
    default_root = _default_root()
    if default_root is not None:  # as pack refuses to write into its source, before the command runs
        refuse_output_inside(default_root, output, f"Triton's cache root {default_root}, which the command uses "
                                                   "unless it sets another")
    directory = os.path.dirname(target.path)
    if not (target.in_place or (os.path.isdir(directory) and os.access(directory, os.W_OK | os.X_OK))):
        raise CacheError("cannot write the archive there (checked before running the command)", os.fspath(output))
    created = source_date_epoch()
    start = time.perf_counter()
    began = time.time_ns() - 50_000_000  # filesystems stamp from a coarser clock, up to a tick behind
    with tempfile.TemporaryDirectory(prefix="tritonpack-record-") as work:
        log_path = os.path.join(work, "events.jsonl")
        returncode = _run(command, hook_environment(os.environ, _hook_directory(work), log_path), stdout)
        lines: list[str] = []
        with contextlib.suppress(FileNotFoundError), open(log_path, encoding="utf-8", errors="replace") as f:
            lines = f.readlines()
    log = parse_log(lines)
    if returncode != 0 and not allow_failure:
        raise RecordError(f"the command {_status(returncode)}; nothing was packed (--allow-failure packs what it "
                          "used anyway)", command[0])
    for root in sorted({use.root for use in log.uses}):  # roots the command chose itself, known only now
        refuse_output_inside(root, output, f"{root}, a cache root the command used (nothing was packed)")
    pack_start = time.perf_counter()
    selection = select(log)
    if not selection.entries:
        why = (f"; {MANAGER_ENV}={log.unsupported[0]} keeps kernels outside Triton's file layout" if log.unsupported
               else "" if log.uses else
               f" (did it run Triton? A program that sets triton.knobs.cache.manager_class or {MANAGER_ENV} itself "
               "bypasses the recording)")
        detail = f"; {selection.not_packed[0].path}: {selection.not_packed[0].reason}" if selection.not_packed else ""
        raise RecordError(f"the command used no Triton cache entry that can be packed{why}{detail}", command[0])
    info, producer_notes = archive_info(selection.entries, log.processes, created, __version__)
    entries = retag_stubs(selection.entries, info.python)
    written = write_archive(os.fspath(output), entries, info, level=level)
    now = time.perf_counter()
    return RecordResult(
        archive=os.fspath(output),
        command=command,
        returncode=returncode,
        roots=sorted({r.root for r in selection.recorded}),
        entries=kind_counts(e.kind for e in entries),
        recorded=selection.recorded,
        not_packed=selection.not_packed,
        files=written.files,
        unique_blobs=written.blobs,
        bytes_in=written.bytes_in,
        bytes_out=written.bytes_out,
        seconds=now - start,
        pack_seconds=now - pack_start,
        processes=len(log.processes),
        unsupported_managers=log.unsupported,
        foreign_manifests=sum(1 for e in entries if e.foreign_manifest),
        producer_notes=producer_notes + ([f"{log.bad_lines} unreadable line(s) in the event log were ignored"]
                                         if log.bad_lines else []),
        triton_version=info.triton.version if info.triton else None,
        untracked=_untracked(log, default_root, began),
        thinned=[Thinned(f"{e.key}/{manifest_name(e.name)}", e.missing) for e in entries if e.missing],
    )
