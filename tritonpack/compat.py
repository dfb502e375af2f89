"""The preflight: will this environment's Triton use an archive's entries, and if not, which factor differs.

An entry is used only if the local Triton computes the same cache key: same Triton build (``triton_key()``), same
backend hash (``ptxas --version`` for CUDA) and target, same cache-invalidating environment variables. Autotune
results and launcher stubs are judged by the Triton that produced them too (their own version, in a 1.2 archive,
else that of the kernels packed beside them), and launcher stubs must match the Python ABI and platform. What cannot
be checked here (no Triton, no GPU) is reported, never refused.
"""
from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from .fingerprint import LocalTriton
from .gpus import Target
from .model import AUTOTUNE, FILE, GROUP, ArchiveInfo, Described, Entry, TritonInfo, disowned, named_version
from .report import entries as count_entries
from .triton_env import key_releases, release_of, releases_keyed_as

TRITON = "triton"
BACKEND = "backend"
TARGET = "target"
ENV = "env"
PYTHON = "python"


class Mismatch(NamedTuple):
    """One factor that differs, with both values, so the message explains the miss."""

    factor: str
    archive: str
    here: str

    def __str__(self) -> str:
        labels = {TRITON: "Triton", BACKEND: "backend", TARGET: "target", ENV: "env", PYTHON: "launcher stub"}
        return f"{labels[self.factor]}: archive {self.archive}, here {self.here}"


class Verdict(NamedTuple):
    entry: Entry
    mismatches: tuple[Mismatch, ...] = ()

    @property
    def usable(self) -> bool:
        return not self.mismatches


class Environment(NamedTuple):
    """What this machine offers: the local Triton (``None`` if absent), its GPUs or the ``--target`` list, and
    the ABI that launcher stubs must match."""

    triton: LocalTriton | None
    targets: list[Target] | None  # None: no GPU visible and no --target
    targets_from: str  # "gpu", "--target" or "none"
    ext_suffix: str | None
    platform: str
    cache_off: tuple[str, ...] = ()  # TRITON_ALWAYS_COMPILE, TRITON_DEBUG where set here (``api.cache_off``)


class Verdicts(Sequence):
    """Each entry's verdict, made as it is read from the entries and the mismatches of those that have some (a
    verdict an entry took 64 bytes of an unpack's plan)."""

    __slots__ = ("_mismatches", "entries")

    def __init__(self, entries: Sequence[Entry], mismatches: dict[int, tuple[Mismatch, ...]]):
        self.entries = entries
        self._mismatches = mismatches  # by entry number, for the entries that have some

    def __len__(self) -> int:
        return len(self.entries)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        i = range(len(self))[i]  # an IndexError past the end
        return Verdict(self.entries[i], self._mismatches.get(i, ()))

    def __iter__(self) -> Iterator[Verdict]:
        mismatches = self._mismatches
        return (Verdict(e, mismatches.get(i, ())) for i, e in enumerate(self.entries))

    def usable(self, i: int) -> bool:
        """Whether entry ``i`` has no mismatch."""
        return i not in self._mismatches

    @property
    def unusable_count(self) -> int:
        return len(self._mismatches)

    def unusable(self) -> list[Verdict]:
        return [Verdict(self.entries[i], m) for i, m in sorted(self._mismatches.items())]


class CheckReport(NamedTuple):
    verdicts: Verdicts
    unchecked: list[str]  # factors that could not be checked here, each said once
    environment: Environment

    @property
    def usable(self) -> list[Verdict]:
        return [v for v in self.verdicts if v.usable]

    @property
    def unusable(self) -> list[Verdict]:
        return self.verdicts.unusable()

    @property
    def usable_count(self) -> int:
        return len(self.verdicts) - self.verdicts.unusable_count

    @property
    def unusable_count(self) -> int:
        return self.verdicts.unusable_count

    def reasons(self) -> list[tuple[str, int]]:
        """Each distinct mismatch with the number of entries it affects, most common first."""
        counts = Counter(str(m) for v in self.unusable for m in v.mismatches)
        return counts.most_common()

    def summary(self) -> str:
        n, ok = len(self.verdicts), self.usable_count
        if n == 0:
            return "the archive holds no entries"
        if self.environment.triton is None:  # nothing of Triton checked: no verdict may promise a hit
            if ok < n:
                return f"{ok} of {n} entries pass what could be checked without Triton; {n - ok} do not"
            passing = "the entry passes" if n == 1 else f"all {n} entries pass"
            return f"{passing} what could be checked without Triton (install Triton to check the rest)"
        if ok == n:
            return "the entry will be used here" if n == 1 else f"all {n} entries will be used here"
        return f"{ok} of {n} entries will be used here; {n - ok} will not"

    def to_dict(self, archive: str | None = None) -> dict:
        """What ``check --json`` prints for ``archive``."""
        from .listing import check_to_dict

        return check_to_dict(self, archive)

    def lines(self) -> list[str]:
        out = [f"{count} entr{'y' if count == 1 else 'ies'}: {reason}" for reason, count in self.reasons()]
        return out + [f"not checked: {note}" for note in self.unchecked]


def _toolchain_release(backend_hash: str) -> str:
    """The readable part of a backend hash: CUDA's ``ptxas --version`` output plus arch; before 3.5, AMD's
    ``ld.lld --version`` output plus target."""
    match = re.search(r"release ([\d.]+), (V[\d.]+)", backend_hash)
    if match:
        return f"ptxas {match.group(1)} ({match.group(2)})"
    match = re.search(r"\bLLD ([\w.\-]+)", backend_hash)
    if match:
        return f"ld.lld {match.group(1)}"
    return backend_hash if len(backend_hash) <= 60 else backend_hash[:57] + "..."


def _version_text(version: str | None, key: str | None) -> str:
    return f"{version or '?'} (build {key[:12]})" if key else (version or "?")


def attributed(entries: Sequence[Entry], info: ArchiveInfo) -> TritonInfo | None:
    """The Triton the entries that name no version of their own (autotune results and files without
    ``triton_version``, kernels of Triton before 3.3) came from: the one that compiled the kernels beside them
    (spec §4.2). The archive's record when the kernels name its version, or none names one; the version alone when
    they name another (earlier writers recorded the packing host's Triton); none when they name several, and those
    entries are then reported unchecked."""
    return attribution({e.kernel.triton_version for e in entries
                        if e.kind == GROUP and e.kernel and e.kernel.triton_version}, info)


def attribution(named: set[str], info: ArchiveInfo) -> TritonInfo | None:
    """``attributed``, from the versions the kernels name."""
    if not named or (info.triton is not None and named == {info.triton.version}):
        return info.triton
    return TritonInfo(next(iter(named)), None, {}) if len(named) == 1 else None


def compiler_of(entry: Entry, info: ArchiveInfo, unowned: TritonInfo | None) -> TritonInfo | None:
    """What the archive says of the Triton that produced ``entry``: its build key and backend hashes only when
    the archive's record is of the version the entry names. An entry that names none is ``unowned``'s (see
    ``attributed``), unless it says its Triton cannot be named (1.3), or that Triton could not have written it
    (``could_write``)."""
    own = named_version(entry)
    if own is None:
        if unowned is None or disowned(entry) or not could_write(entry, unowned.version):
            return None
        return unowned
    if info.triton is not None and info.triton.version == own:
        return info.triton
    return TritonInfo(own, None, {})


def could_write(entry: Described, version: str) -> bool:
    """Whether Triton ``version`` could have written ``entry``: not if its key is in another release's encoding (a
    root of kernels from before and after 3.3), nor if its file is named as other releases name it (a launcher stub
    of 3.3 or before beside kernels of 3.4 or later; an autotune result beside kernels of Triton before 3.4)."""
    theirs, by_name = key_releases(entry.key), _releases_by_name(entry)
    if theirs is not None and theirs != releases_keyed_as(version):
        return False
    return by_name is None or _writes(by_name, version)


_BY_NAME_SINCE = (3, 4)  # autotune results cached, launcher stubs named with the Python's EXT_SUFFIX, from 3.4


def _releases_by_name(entry: Described) -> str | None:
    """The Triton releases that write an entry of this kind so named, as Triton's source says: autotune results are
    cached from 3.4; a launcher stub is ``<name>.so`` through 3.3 and ``<name>`` + the Python's ``EXT_SUFFIX`` from
    3.4. None where the name says nothing (a kernel, another file, a stub of an archive that did not tag it)."""
    if entry.kind == AUTOTUNE:
        return "3.4+"
    stub = entry.stub
    if entry.kind != FILE or stub is None or stub.role != "launcher":
        return None
    return {"packer": "3.0-3.3", "filename": "3.4+"}.get(stub.tag_from or "")


def _writes(releases: str, version: str) -> bool:
    """Whether Triton ``version`` is of ``releases`` (``_releases_by_name``); an unknown version may be."""
    release = release_of(version)
    return release is None or (release >= _BY_NAME_SINCE) == (releases == "3.4+")


def _check_name(entry: Entry, local: LocalTriton) -> list[Mismatch]:
    """An autotune result or a launcher stub that this Triton never looks up, whatever the archive says of the
    Triton that produced it: Triton 3.3 and before read no autotune result from the cache and name stubs
    ``<name>.so``; 3.4 and later look for ``<name>`` + ``EXT_SUFFIX``."""
    releases = _releases_by_name(entry)
    if releases is None or _writes(releases, local.version):
        return []
    why = "autotune results are cached from 3.4" if entry.kind == AUTOTUNE else "by its file name"
    return [Mismatch(TRITON, f"{releases} ({why})", local.version)]


def _check_triton(compiler: TritonInfo | None, local: LocalTriton) -> list[Mismatch]:
    if compiler is None:
        return []
    if compiler.version != local.version:
        return [Mismatch(TRITON, compiler.version, local.version)]
    if compiler.key_sha256 and local.key_sha256 and compiler.key_sha256 != local.key_sha256:
        return [Mismatch(TRITON, _version_text(compiler.version, compiler.key_sha256),
                         _version_text(local.version, local.key_sha256))]
    return []


def _check_key(entry: Entry, local: LocalTriton) -> list[Mismatch]:
    """A key in another release's encoding, which this Triton never looks up, whatever the archive says of the
    Triton that compiled it: kernels before 3.3 name no version, and an archive of them packed beside another
    Triton records that one."""
    theirs, ours = key_releases(entry.key), releases_keyed_as(local.version)
    if theirs is None or ours is None or theirs == ours:
        return []
    return [Mismatch(TRITON, f"{theirs} (by its key's encoding)", local.version)]


def _check_backend(entry: Entry, compiler: TritonInfo | None, local: LocalTriton) -> list[Mismatch]:
    k = entry.kernel
    if k is None or compiler is None:
        return []
    theirs = compiler.backend_hashes.get(k.hash_key)
    ours = local.backend_hashes.get(k.hash_key)
    if theirs is None or ours is None or theirs == ours:
        return []
    return [Mismatch(BACKEND, _toolchain_release(theirs), _toolchain_release(ours))]


def _unrecorded_target(entry: Entry, compiler: TritonInfo | None) -> str | None:
    """The target of a kernel whose Triton the archive records by build key, but not the backend hash: its packer
    could not compute it, found the kernels compiled with another ptxas (``toolchain``), or merged archives that
    disagree on it."""
    k = entry.kernel
    if k is None or k.backend is None or compiler is None or not compiler.key_sha256 or \
            k.hash_key in compiler.backend_hashes:
        return None
    return k.hash_key


def _unhashed_target(entry: Entry, compiler: TritonInfo | None, local: LocalTriton) -> str | None:
    """The target of a kernel whose backend hash the archive records and this Triton cannot compute: its
    toolchain is missing (ROCm's ld.lld, which Triton 3.0-3.4 run even to hash the AMD backend)."""
    k = entry.kernel
    if k is None or compiler is None or k.hash_key not in compiler.backend_hashes or \
            k.hash_key in local.backend_hashes:
        return None
    return k.hash_key


def _check_target(entry: Entry, env: Environment) -> list[Mismatch]:
    k = entry.kernel
    if k is None or env.targets is None or k.backend is None:
        return []
    for backend, arch, warp in env.targets:
        if backend == k.backend and str(arch) == str(k.arch) and (k.warp_size in (None, warp)):
            return []
    # the warp size is said where it is what differs (the same arch), else on AMD where it is not 32
    warp_only = any(b == k.backend and str(a) == str(k.arch) for b, a, _ in env.targets)
    here = ", ".join(f"{b}:{a}" + (f":{w}" if b == "hip" and w is not None and (warp_only or w != 32) else "")
                     for b, a, w in env.targets)
    theirs = f"{k.target}:{k.warp_size}" if warp_only and k.warp_size is not None else k.target
    suffix = " (--target)" if env.targets_from == "--target" else ""
    return [Mismatch(TARGET, theirs, here + suffix)]


def _check_env(entry: Entry, local: LocalTriton) -> list[Mismatch]:
    recorded = entry.kernel.env if entry.kernel else {}
    mismatches = []
    for name in sorted(set(recorded) | set(local.env)):
        theirs, ours = recorded.get(name), local.env.get(name)
        if theirs != ours:
            mismatches.append(Mismatch(ENV, f"{name}={theirs}" if theirs is not None else f"{name} unset",
                                       f"{name}={ours}" if ours is not None else "unset"))
    return mismatches


def _check_stub(entry: Entry, env: Environment) -> list[Mismatch]:
    s = entry.stub
    if s is None or s.role != "launcher":
        return []
    mismatches = []
    if s.ext_suffix and env.ext_suffix and s.ext_suffix != env.ext_suffix:
        mismatches.append(Mismatch(PYTHON, s.ext_suffix, env.ext_suffix))
    elif s.platform and s.platform != env.platform:
        mismatches.append(Mismatch(PYTHON, s.platform, env.platform))
    return mismatches


def _triton_unchecked(no_compiler: int, unknown: int, by_version: int, unhashed: Counter[str],
                      unrecorded: Counter[str]) -> list[str]:
    """What the Triton comparison could not settle, counted: entries that no recorded Triton describes (of which
    ``unknown`` say that their archive cannot name theirs), entries whose Triton matched by version while the
    archive holds no build key to compare, and kernels whose backend hash this Triton cannot compute (by
    target)."""
    notes = []
    if unknown:
        own = "its" if unknown == 1 else "their"
        notes.append(f"{count_entries(unknown)} whose archive cannot name {own} Triton (autotune results, launcher "
                     f"stubs packed beside the kernels of one Triton, from a cache of several): {own} Triton was not "
                     "checked")
    no_compiler -= unknown
    if no_compiler:
        own = "its" if no_compiler == 1 else "their"
        notes.append(f"{count_entries(no_compiler)} without a Triton version of {own} own (autotune results, "
                     f"launcher stubs, kernels of Triton before 3.3): the archive records no one Triton that "
                     f"compiled its kernels, so {own} Triton was not checked")
    if by_version:
        notes.append(f"{count_entries(by_version)} matched by Triton version only: the archive holds no build key (nor "
                     "backend hash) of the Triton that compiled them")
    if unhashed:
        notes.append(f"{count_entries(sum(unhashed.values()))} for {', '.join(sorted(unhashed))}: this Triton cannot "
                     "compute the backend hash (its toolchain, e.g. ROCm's ld.lld, is missing), so the backend was "
                     "not checked")
    if unrecorded:
        notes.append(f"{count_entries(sum(unrecorded.values()))} for {', '.join(sorted(unrecorded))}: the archive "
                     "records no backend hash for their target (their packer could not compute it, or found them "
                     "compiled with another ptxas than its own), so the backend was not checked")
    return notes


def check_entries(entries: tuple[Entry, ...], info: ArchiveInfo, env: Environment,
                  packed: Sequence[Entry] | None = None) -> CheckReport:
    """The verdict on each of ``entries``, taken from the archive whose entries are ``packed`` (default: just
    ``entries``): what names no version is attributed by all the kernels packed (spec §4.2), not by those an
    unpack selects, so that a selection judges an entry as ``check`` does."""
    unchecked = []
    if env.triton is None:
        unchecked.append("Triton is not importable here: Triton build, backend and env vars were not checked")
    kernels = any(e.kind == GROUP for e in entries)
    if env.targets is None and kernels:
        unchecked.append("no GPU visible: target arch not checked (use --target to name the GPUs)")
    if any(e.kind == AUTOTUNE for e in entries):
        unchecked.append("autotune results record no target or env vars: only their Triton was checked")
    if "TRITON_ALWAYS_COMPILE" in env.cache_off and kernels:
        unchecked.append("TRITON_ALWAYS_COMPILE is set here: Triton compiles every kernel again and reads none from "
                         "the cache (the verdicts hold where a program runs without it)")
    if "TRITON_DEBUG" in env.cache_off and kernels:
        unchecked.append("TRITON_DEBUG is set here: Triton's JIT compiles every kernel with debug on, and those "
                         "compiled without it miss (the archive does not record which were)")
    unowned = attributed(entries if packed is None else packed, info) if env.triton is not None else None
    mismatches = {}
    no_compiler = unknown = by_version = 0
    unhashed: Counter[str] = Counter()  # usable kernels by target, whose backend hash cannot be computed here
    unrecorded: Counter[str] = Counter()  # usable kernels by target, whose backend hash the archive lacks
    # Triton 3.8+ keys a launcher stub by its install directory and libcuda's too (runtime/build.py), unrecorded
    keyed_by_place = env.triton is not None and (release_of(env.triton.version) or (0, 0)) >= (3, 8)
    placed = 0  # usable launcher stubs so keyed
    for n, entry in enumerate(entries):
        found: list[Mismatch] = []
        if env.triton is not None:
            compiler = compiler_of(entry, info, unowned)
            found += (_check_triton(compiler, env.triton) or _check_key(entry, env.triton)
                      or _check_name(entry, env.triton))
            if not found:
                no_compiler += compiler is None
                unknown += compiler is None and disowned(entry)
                by_version += compiler is not None and not compiler.key_sha256
            if entry.kind == GROUP and not found:
                found += _check_backend(entry, compiler, env.triton)
            if entry.kind == GROUP:
                found += _check_env(entry, env.triton)
        if entry.kind == GROUP:
            found += _check_target(entry, env)
            if not found and env.triton is not None and (target := _unhashed_target(entry, compiler, env.triton)):
                unhashed[target] += 1
            elif not found and env.triton is not None and (target := _unrecorded_target(entry, compiler)):
                unrecorded[target] += 1
        elif entry.kind == FILE:
            found += _check_stub(entry, env)
            placed += not found and entry.stub is not None and entry.stub.role == "launcher" and keyed_by_place
        if found:
            mismatches[n] = tuple(found)
    unchecked += _triton_unchecked(no_compiler, unknown, by_version, unhashed, unrecorded)
    if placed:
        unchecked.append(f"{count_entries(placed)} (launcher stubs): Triton 3.8+ looks one up by a key that names its "
                         "install directory and libcuda's, which the archive does not record, so it hits only where "
                         "both are where it was built (else Triton builds its own, in about a second)")
    return CheckReport(Verdicts(entries, mismatches), unchecked, env)
