"""The Python API: ``pack``, ``unpack`` and ``open``. The CLI is a thin layer over these."""
from __future__ import annotations

import contextlib
import os
import time
from array import array
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

from . import __version__
from .archive.format import DEFAULT_LEVEL, format_version
from .archive.reader import ArchiveReader
from .errors import CacheError, IncompatibleError, UsageError
from .model import (
    GROUP,
    ArchiveInfo,
    Entry,
    TritonInfo,
    disowned,
    hash_key,
    manifest_name,
    named_version,
    naming_triton,
)
from .remote import open_source, shown
from .selection import EVERYTHING, Offered, Selection
from .triton_env import cache_root, key_releases, releases_keyed_as, resolved_root

if TYPE_CHECKING:  # each function imports what it needs when called: `tritonpack list` starts faster
    from .cacheroot import LocalEntry
    from .compat import CheckReport, Environment
    from .fingerprint import LocalTriton
    from .gpus import GpuProbe
    from .repair import RelocateReport, VerifyReport
    from .report import PackResult, UnpackResult

Progress = Callable[[int, int], None]  # (bytes done so far, bytes in all)


def source_date_epoch() -> int | None:
    """Wall-clock time only when asked for (SOURCE_DATE_EPOCH): same input, same bytes."""
    value = os.environ.get("SOURCE_DATE_EPOCH")
    if not value:
        return None
    try:
        created = int(value)
    except ValueError:
        created = -1
    if not 0 <= created < 2**63:
        raise UsageError(f"SOURCE_DATE_EPOCH must be a non-negative integer, not {value!r}")
    return created


def progress_counter(total: int, progress: Progress | None):
    if progress is None:
        return None
    done = 0

    def on_file(n: int) -> None:
        nonlocal done
        done += n
        progress(done, total)

    return on_file


def refuse_output_inside(root: str, output, what: str = "the cache it packs") -> None:
    """Pack never changes its source, nor record the roots its command uses: not even an archive (or its temp
    file) may land inside the root, nor the target of a link that ``-o`` names. ``what`` names the root. An ``-o``
    in a directory that does not exist is refused here too, before the work whose archive it could not hold."""
    from .archivedest import STDOUT, destination

    target = destination(os.fspath(output))
    if target.path == STDOUT:
        return
    where = os.path.dirname(os.path.realpath(target.path))
    if not os.path.isdir(where):
        raise CacheError(f"cannot write the archive: {where} is not a directory", os.fspath(output))
    source = os.path.realpath(root)
    if os.path.isdir(source) and os.path.commonpath([where, source]) == source:
        raise UsageError(f"the archive would be written inside {what}; choose another -o", os.fspath(output))


def _newest(entry) -> float:
    """When an entry found on disk last changed (its newest file)."""
    try:
        return max(os.stat(f.path).st_mtime for f in entry.files)
    except OSError:
        return 0.0


def _compiling_triton(compilers: Counter[str], unnamed: Counter[str | None], local: LocalTriton | None,
                      targets: set[str]) -> tuple[TritonInfo | None, str | None]:
    """The archive's ``triton`` map: the Triton that compiled the packed kernels (``compilers``: how many kernels
    name each version; ``unnamed``: how many name none, Triton before 3.3, by the releases their keys' encoding
    says), which the preflight holds the entries without a version of their own (autotune results) to; and the
    note that says why it records less than the local Triton's fingerprint, if it does.

    The local Triton vouches for a build key and backend hashes only when it is the version the kernels name (or
    none names one, and their keys are in its release's encoding); a cache compiled by another Triton is recorded
    by its version alone, or not at all when no kernel names it; one compiled by several, not at all (the preflight
    judges its autotune results by the one version the kernels name, else reports them unchecked).
    """
    from .report import plural

    here = f"Triton here is {local.version}" if local else "Triton is not importable here"
    # kernels that name no version are this Triton's when their keys are in its release's encoding, else another's
    keyed: Counter[str]
    tritons, keyed = Counter(compilers), Counter()
    if local is not None:
        for releases, n in unnamed.items():
            if releases == releases_keyed_as(local.version):
                tritons[local.version] += n
            elif releases is not None:
                keyed[releases] += n
    everyone = tritons + Counter({f"{releases} by their keys": n for releases, n in keyed.items()})
    if len(everyone) > 1:
        most_first = sorted(everyone.items(), key=lambda vn: (-vn[1], vn[0]))
        counts = ", ".join(f"{v}: {plural(n, 'kernel')}" for v, n in most_first)
        # Triton caches autotune results since 3.4, whose kernels name their version: beside the kernels of one
        # version and those of Triton before 3.3, they are that version's (the preflight judges them so)
        tuned = f"by Triton {next(iter(compilers))}, the one version named" if len(compilers) == 1 else \
            "reported unchecked"
        return None, (f"kernels compiled by several Tritons ({counts}), {here}: the archive records none; each "
                      "kernel is judged by its own version only, and autotune results and launcher stubs, which name "
                      f"none, {tuned}")
    if keyed:
        return None, (f"kernels that name no Triton version, keyed by Triton {next(iter(keyed))}, {here}: the "
                      "archive records none; the preflight judges them by their keys' encoding")
    compiler = next(iter(tritons), None)
    if local is not None and compiler in (None, local.version):
        return TritonInfo(local.version, local.key_sha256,
                          {t: h for t, h in local.backend_hashes.items() if t in targets}), None
    if compiler is None:
        return None, f"{here}: the archive records no Triton build key or backend hashes"
    return TritonInfo(compiler, None, {}), (f"kernels compiled by Triton {compiler}, {here}: build key and backend "
                                            "hashes not recorded, entries judged by version only")


def pack(
    cache_dir: str | os.PathLike | None = None,
    output: str | os.PathLike = "kernels.tpack",
    *,
    level: int = DEFAULT_LEVEL,
    selection: Selection = EVERYTHING,
    since: float | None = None,
    progress: Progress | None = None,
    processes: bool = False,
    splice_ptx: bool = False,
) -> PackResult:
    """Pack a Triton cache root (Triton's default when ``None``) into a portable archive. Never modifies it.

    ``splice_ptx`` stores each cubin without the PTX text that ptxas embeds in it, derived from the group's
    ``.ptx`` when it is unpacked (format 1.1): archives of CUDA caches 12-15% smaller, unpacks that spend more CPU
    (``README.md``: Archive size and speed).

    ``selection`` packs part of the cache: some targets, some kernels, or binary-only groups. ``since`` (a Unix
    time) keeps the entries with a file modified since then: what recent runs compiled or tuned. ``processes``:
    scan a large root, and read its files, with forked processes too, where a fork is safe (``forking.fork_safe``;
    the command does).
    """
    from .archive.writer import forked_helpers, write_archive
    from .cacheroot import files_subset, not_a_root, scan_cache
    from .compat import attribution
    from .fingerprint import local_triton
    from .forking import uninterrupted
    from .report import PackResult, Thinned, kind_counts, plural
    from .toolchain import checked_hashes
    from .triton_env import python_info

    start = time.perf_counter()
    root = cache_root(cache_dir)
    if not 1 <= level <= 22:
        raise UsageError(f"compression level must be 1-22, not {level}")
    selection = selection.checked()
    refuse_output_inside(root, output)
    with contextlib.ExitStack() as stack:
        with uninterrupted():  # forked first, while this process is small; known to the stack before a Ctrl-C
            helpers = forked_helpers() if processes else None
            if helpers is not None:
                stack.enter_context(helpers)
        scan = scan_cache(root, processes=processes)
        found = len(scan.entries)
        if not found:
            raise not_a_root(root, scan.skipped)
        if since is not None:
            scan.keep(lambda e: e if _newest(e) >= since else None)
        not_since = found - len(scan.entries)
        selected_from: set[str] = set()  # the Tritons the selected kernels were chosen among
        offer = Offered()

        def select(e: LocalEntry) -> LocalEntry | None:
            if e.kernel is not None and e.kernel.triton_version:
                selected_from.add(e.kernel.triton_version)
            offer.add(e)
            return e._replace(files=files_subset(e.files, selection.file_indices(e))) if selection.wants(e) else None

        if not selection.everything:
            scan.keep(select)
        not_selected = found - not_since - len(scan.entries)
        if not scan.entries:
            hint = f"; {offer.words(selection)}" if not_selected and selection.chooses_kernels else ""
            raise UsageError(f"nothing to pack: {_left_out(not_since, not_selected)} (all {found} found{hint})", root)
        kinds: Counter[str]
        targets, total, kinds, foreign = set(), 0, Counter(), 0  # one read of each entry (a large scan's are
        compilers: Counter[str] = Counter()  # made again each time they are read: packedentries)
        unnamed: Counter[str | None] = Counter()
        thinned: list[Thinned] = []
        untagged = 0  # launcher stubs whose names say no Python (Triton 3.0-3.3): tagged with this one's
        for e in scan.entries:
            kernel = e.kernel
            if kernel and kernel.backend and kernel.arch is not None and kernel.warp_size:
                targets.add((kernel.backend, kernel.arch, kernel.warp_size))
            if kernel and kernel.triton_version:
                compilers[kernel.triton_version] += 1
            elif kernel:
                unnamed[key_releases(e.key)] += 1
            total += e.size
            kinds[e.kind] += 1
            foreign += e.foreign_manifest
            if e.missing and not selection.binary_only:  # which takes no IR file anyway
                thinned.append(Thinned(f"{e.key}/{manifest_name(e.name)}", e.missing))
            untagged += e.stub is not None and e.stub.tag_from == "packer"
        if selection.chooses_kernels and not kinds[GROUP]:
            raise UsageError(f"nothing to pack: no kernel matches --arch or --kernel ({_left_out(0, not_selected)}; "
                             f"{offer.words(selection)})", root)
        local = local_triton(targets)  # the cached fingerprint: no Triton import, no libtriton hash when warm
        triton, triton_note = _compiling_triton(compilers, unnamed, local, {hash_key(*t) for t in targets})
        triton, elsewhere = checked_hashes(triton, scan.entries)
        python = python_info()
        guessed = None
        beside = local is not None and (local.version in compilers or releases_keyed_as(local.version) in unnamed)
        if untagged and not beside:  # the Python that runs the kernels' Triton is another
            guessed = (f"{plural(untagged, 'launcher stub')} named <name>.so, as Triton 3.0-3.3 name them, which "
                       f"says no Python: tagged with this Python's ABI ({python.ext_suffix}), which may not be the one "
                       "that built them (no Triton that compiled these kernels is importable here); pack with that "
                       "Python, else the preflight may refuse them where they fit, or pass them to a Python they do "
                       "not fit")
        triton_note = "; ".join(filter(None, [triton_note, elsewhere, guessed])) or None
        info = ArchiveInfo(tritonpack=__version__, format_version=format_version(splice_ptx),
                           created=source_date_epoch(), python=python, triton=triton)
        left_out = selected_from - set(compilers)
        unowned = attribution(set(compilers), info) if left_out else None
        if unowned is not None:
            owners: Counter[str | None] = Counter()
            scan.keep(lambda e: _owned(e, unowned.version, left_out, owners))
            triton_note = "; ".join(filter(None, [triton_note, _owners_note(owners, unowned.version, left_out)]))
        written = write_archive(os.fspath(output), scan.entries, info, level=level, splice_ptx=splice_ptx,
                                helpers=helpers, on_file=progress_counter(total, progress))
    return PackResult(
        archive=os.fspath(output),
        cache_dir=os.path.abspath(root),  # absolute, as every other command's result names it
        entries=kind_counts(kinds),
        files=written.files,
        unique_blobs=written.blobs,
        bytes_in=written.bytes_in,
        bytes_out=written.bytes_out,
        seconds=time.perf_counter() - start,
        skipped=scan.skipped,
        not_since=not_since,
        not_selected=not_selected,
        foreign_manifests=foreign,
        triton_version=info.triton.version if info.triton else None,
        cubins=written.cubins if splice_ptx else None,
        spliced=written.spliced if splice_ptx else None,
        triton_note=triton_note,
        thinned=thinned,
    )


def _owned(entry: LocalEntry, version: str, left_out: set[str], owners: Counter[str | None]) -> LocalEntry:
    """An autotune result or a launcher stub packed beside the kernels of Triton ``version`` only, from a cache of
    kernels of other Tritons too (``left_out`` by the selection), which the archive would attribute to ``version``
    (spec §4.2): where one of those could have written it too, it says its Triton is unknown (1.3), or names the one
    other that could where ``version`` could not (1.2). Counted in ``owners`` by what it says (None: unknown)."""
    from .compat import could_write

    if entry.kind == GROUP or named_version(entry) is not None or disowned(entry):
        return entry
    others = sorted(v for v in left_out if could_write(entry, v))
    if not others:
        return entry
    if len(others) == 1 and not could_write(entry, version):
        owners[others[0]] += 1
        return naming_triton(entry, others[0])
    owners[None] += 1
    return naming_triton(entry, None, unknown=True)


def _owners_note(owners: Counter[str | None], version: str, left_out: set[str]) -> str | None:
    from .report import entries

    if not owners:
        return None
    said = [f"{entries(n)} say{'s its' if n == 1 else ' their'} Triton is unknown (reported unchecked where "
            "unpacked)" for n in [owners[None]] if n]
    said += [f"{entries(n)} name{'s' if n == 1 else ''} Triton {v}, by {'its name' if n == 1 else 'their names'}"
             for v, n in sorted((v, n) for v, n in owners.items() if v is not None)]
    return (f"autotune results and launcher stubs packed beside kernels of Triton {version} only, from a cache of "
            f"kernels of Triton {', '.join(sorted(left_out))} too (not selected), which could have written them: "
            + "; ".join(said))


def _left_out(not_since: int, not_selected: int) -> str:
    from .report import entries

    parts = [f"{entries(not_since)} unchanged since --since"] if not_since else []
    if not_selected:
        parts.append(f"{entries(not_selected)} not selected by --arch or --kernel")
    return ", ".join(parts)


def open(path: str | os.PathLike) -> ArchiveReader:
    """Open an archive for reading; ``.entries`` and ``.info`` come from the index alone.

    ``path`` may be a URL (``https://``, ``s3://``, ``hf://``, ``file://``: range reads, see ``remote``) or an
    ``oci://`` reference (pulled to a temp file).
    """
    return ArchiveReader(open_source(path))


def environment(entries: tuple[Entry, ...] = (), targets: list[str] | None = None,
                gpus: GpuProbe | None = None) -> Environment:
    """This machine as the preflight sees it: the local Triton's fingerprint and the GPU targets to check.

    ``targets`` (``["cuda:90"]``) replaces GPU detection, for building images on machines without a GPU. ``gpus``:
    a detection started earlier (``gpu_probe``), else it runs now.
    """
    from .compat import Environment
    from .fingerprint import local_triton
    from .gpus import parse_target, visible_targets
    from .triton_env import python_info

    wanted = {(e.kernel.backend, e.kernel.arch, e.kernel.warp_size) for e in entries
              if e.kernel and e.kernel.backend and e.kernel.arch is not None and e.kernel.warp_size}
    local = local_triton(wanted)
    here = python_info()
    abi = (here.ext_suffix, here.platform)
    if targets:
        values = [targets] if isinstance(targets, str) else targets  # one target, or a comma list, as a string
        try:
            return Environment(local, [parse_target(t) for value in values for t in value.split(",")], "--target",
                               *abi, cache_off=cache_off(local))
        except ValueError as e:
            raise UsageError(f"--target: {e}") from None
    found = gpus.targets() if gpus is not None else visible_targets()
    return Environment(local, found, "gpu" if found else "none", *abi, cache_off=cache_off(local))


def cache_off(local: LocalTriton | None) -> tuple[str, ...]:
    """The variables set here under which the local Triton misses what the preflight cannot see:
    ``TRITON_ALWAYS_COMPILE`` (it reads no kernel from the cache) and ``TRITON_DEBUG`` (its JIT compiles every
    kernel with debug on, part of the key; kernels record it in their metadata, the archive's index does not).
    Neither is among the variables Triton records in a kernel, which the preflight compares. Triton 3.4+ take
    ``1``, ``true``, ``yes``, ``on`` or ``y`` (its knobs); 3.0-3.3 take ``1`` alone."""
    from .triton_env import release_of

    if local is None:
        return ()
    release = release_of(local.version)
    truthy = ("1",) if release is not None and release < (3, 4) else ("1", "true", "yes", "on", "y")
    return tuple(name for name in ("TRITON_ALWAYS_COMPILE", "TRITON_DEBUG")
                 if os.environ.get(name, "").strip().lower() in truthy)


def gpu_probe(targets: list[str] | None) -> contextlib.AbstractContextManager[GpuProbe | None]:
    """GPU detection started now, to be read by the preflight once the index is read; none with ``--target``."""
    if targets:
        return contextlib.nullcontext()
    from .gpus import GpuProbe

    return GpuProbe()


def check(archive: str | os.PathLike, targets: list[str] | None = None) -> CheckReport:
    """Say, per entry, whether this environment's Triton will use it, and if not which factor differs."""
    from .compat import check_entries

    with gpu_probe(targets) as gpus, ArchiveReader(open_source(archive)) as reader:
        return check_entries(reader.entries, reader.info, environment(reader.entries, targets, gpus))


def preflight(reader: ArchiveReader, targets: list[str] | None, selection: Selection = EVERYTHING,
              force: bool = False, gpus: GpuProbe | None = None) -> tuple[array, CheckReport]:
    """The numbers in the archive of the selected entries to write, and the check report behind the choice (a
    pair of a number and an entry took 0.1 KB an entry, and a set of the usable entries as much again).

    Raises ``IncompatibleError`` when none of them would be used here, unless ``force``.
    """
    from .compat import check_entries
    from .report import none_used

    every = reader.entries
    selected = array("I", (n for n, e in enumerate(every) if selection.wants(e)))
    entries = tuple(map(every.__getitem__, selected))
    if selection.chooses_kernels and not any(e.kind == GROUP for e in entries):
        offer = Offered()
        for e in every:
            offer.add(e)
        kernels = sum(e.kind == GROUP for e in every)
        raise UsageError(f"no kernel of the {kernels} in the archive matches --arch or --kernel "
                         f"({offer.words(selection)})", reader.path)
    report = check_entries(entries, reader.info, environment(entries, targets, gpus), every)
    if entries and not report.usable_count and not force:
        raise IncompatibleError(f"{none_used(len(entries), report.reasons())}; --force writes them anyway",
                                reader.path, report=report)
    if force:
        return selected, report
    usable = report.verdicts.usable
    return array("I", (n for k, n in enumerate(selected) if usable(k))), report


def unpack(
    archive: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    *,
    overwrite: bool = False,
    force: bool = False,
    targets: list[str] | None = None,
    selection: Selection = EVERYTHING,
    progress: Progress | None = None,
    processes: bool = False,
) -> UnpackResult:
    """Materialise an archive under a cache root (Triton's default when ``None``) so that Triton hits.

    The preflight runs first: only entries this environment will use are written (all with ``force``); when none
    would be used, ``IncompatibleError`` is raised and the root is left untouched. ``selection`` takes part of
    the archive (targets, kernels, binary-only); only the blocks holding what it takes are decoded.
    ``processes``: write with forked worker processes, one a block, where a fork is safe (``forking.fork_safe``)
    and the archive is a local file, as the ``tritonpack`` command does. Off by default: inside a program of
    your own, a fork would copy whatever locks its native threads hold.
    """
    from .cachedest import holds_nothing, materialize, place, root_only
    from .report import unpack_result
    from .workers import Launcher

    start = time.perf_counter()
    root = resolved_root(cache_dir)
    selection = selection.checked()
    # Workers fork as soon as the block table is read, and decompress blocks while this process decodes the rest
    # of the index and compares the archive with the root.
    launcher = Launcher(root) if processes else None
    with gpu_probe(targets) as gpus, launcher or contextlib.nullcontext(), \
            ArchiveReader(open_source(archive), on_blocks=launcher,
                          on_blobs=launcher.on_blobs if launcher else None) as reader:
        chosen, report = preflight(reader, targets, selection, force, gpus)
        try:
            fresh = holds_nothing(root)
            every = reader.entries
            placements = [place(root, *_taken(every[n], selection.file_indices(every[n])), overwrite, fresh)
                          for n in chosen]
        except OSError as e:
            raise CacheError(f"cannot read: {e.strerror}", e.filename or root) from e
        total = sum(p.size for p in placements)
        written = materialize(reader, root, placements, on_file=progress_counter(total, progress),
                              workers=launcher.workers if launcher else None, overwrite=overwrite)
        # As done: an entry completed meanwhile by another writer is not rewritten
        return unpack_result(shown(os.fspath(archive)), root, written.placements, report, force, written.files,
                             written.bytes, time.perf_counter() - start, reader.index.unknown_entries,
                             not_selected=len(every) - len(report.verdicts), root_only=root_only(written.files),
                             digest=reader.digest)


def _taken(entry: Entry, keep: list[int]) -> tuple[Entry, tuple[int, ...] | None]:
    """An archive's entry as a selection takes it (its files ``keep``), and the blob of each file taken: None for
    an entry taken whole, the usual case, whose files know their blobs (not copied: a copy and an array an entry
    took 0.2 KB of an unpack's plan)."""
    if len(keep) == len(entry.files):
        return entry, None
    blobs = entry.files.blobs  # type: ignore[attr-defined]  # an archive's entry: StoredFiles
    return entry._replace(files=tuple(entry.files[i] for i in keep)), tuple(blobs[i] for i in keep)


def verify(cache_dir: str | os.PathLike | None = None) -> VerifyReport:
    """Ask Triton's own cache manager whether every group under the root resolves; flag stale and broken ones."""
    from .repair import verify as verify_root

    return verify_root(resolved_root(cache_dir))


def relocate(cache_dir: str | os.PathLike | None = None) -> RelocateReport:
    """Repair in place a cache copied by other means: manifests point into each group's own directory again."""
    from .repair import relocate as relocate_root

    return relocate_root(resolved_root(cache_dir))
