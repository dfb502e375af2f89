"""Choosing part of a cache or an archive: by target, by kernel name, and binary-only groups.

The same selection filters pack (what goes into the archive) and unpack (what comes out of it), so that a
partial unpack costs in proportion to what it takes.
"""
from __future__ import annotations

import datetime
import fnmatch
import re
import time
from collections.abc import Sequence
from typing import NamedTuple

from .errors import UsageError
from .gpus import without_features
from .model import AUTOTUNE, GROUP, names_of

BINARY_SUFFIXES = (".cubin", ".hsaco")  # with <name>.json, what Triton's TRITON_STORE_BINARY_ONLY keeps


def binary_only_names(kernel_name: str, names: Sequence[str]) -> list[str]:
    """The files of a group that Triton needs to load it: its metadata json and its binary."""
    return [n for n in names if n == f"{kernel_name}.json" or n.endswith(BINARY_SUFFIXES)]


class Selection(NamedTuple):
    """``archs``: ``cuda:90``, ``90``, ``hip:gfx942`` or ``gfx942``; ``kernels``: shell globs on kernel names.

    Autotune results (which record no target) and launcher stubs (shared by kernels) are kept by an arch filter;
    a kernel filter keeps the autotune results of the functions it names, and the stubs.
    """

    archs: tuple[str, ...] = ()
    kernels: tuple[str, ...] = ()
    binary_only: bool = False

    @property
    def everything(self) -> bool:
        return not (self.archs or self.kernels or self.binary_only)

    def checked(self) -> Selection:
        """This selection, its archs split at commas (``--arch 80,90``) and each one checked: a typo would
        otherwise select nothing, silently. A string where a tuple goes is one value, not its characters."""
        values = (self.archs,) if isinstance(self.archs, str) else self.archs
        archs = tuple(without_features(a.strip()) for value in values for a in value.split(","))
        for arch in archs:
            if not _ARCH.fullmatch(arch):
                raise UsageError(f"--arch takes cuda:90, hip:gfx942, or just 90 or gfx942, not {arch!r}")
        kernels = (self.kernels,) if isinstance(self.kernels, str) else tuple(self.kernels)
        return self._replace(archs=archs, kernels=kernels)

    @property
    def chooses_kernels(self) -> bool:
        """Whether it names targets or kernels: then taking no kernel is a mistake to say, not an empty result (a
        typo in a glob left the launcher stubs alone)."""
        return bool(self.archs or self.kernels)

    def wants(self, entry) -> bool:
        if entry.kind == GROUP:
            if self.archs and not self._arch_matches(entry.kernel):
                return False
            return not self.kernels or self._name_matches(entry.name)
        if entry.kind == AUTOTUNE and self.kernels:
            return self._name_matches(entry.autotune.function if entry.autotune else entry.name)
        return True

    def file_indices(self, entry) -> list[int]:
        """Indices of the entry's files to take."""
        if self.binary_only and entry.kind == GROUP:
            names = names_of(entry.files)
            keep = set(binary_only_names(entry.name, names))
            return [i for i, n in enumerate(names) if n in keep]
        return list(range(len(entry.files)))

    def _arch_matches(self, kernel) -> bool:
        if kernel is None or kernel.backend is None:
            return False
        return any(a in (kernel.target, str(kernel.arch)) for a in self.archs)

    def _name_matches(self, name: str) -> bool:
        return any(fnmatch.fnmatchcase(name, pattern) for pattern in self.kernels)


EVERYTHING = Selection()
_ARCH = re.compile(r"(cuda:)?[0-9]+|(hip:)?gfx[0-9a-z]+")


class Offered:
    """What a selection that takes no kernel could have taken: the targets and names of the kernels it was
    offered, so that its error shows what to type instead of a typo."""

    def __init__(self) -> None:
        self.targets: set[str] = set()
        self.names: set[str] = set()

    def add(self, entry) -> None:
        if entry.kind == GROUP:
            if entry.kernel is not None and entry.kernel.backend is not None:
                self.targets.add(entry.kernel.target)
            self.names.add(entry.name)

    def words(self, selection: Selection) -> str:
        parts = [f"targets: {', '.join(sorted(self.targets)) or 'none named'}"] if selection.archs else []
        if selection.kernels:
            names = sorted(self.names)
            parts.append(f"kernels: {', '.join(names[:5])}{', ...' if len(names) > 5 else ''}")
        return "; ".join(parts)


_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhdw])")
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _utc_as_offset(value: str) -> str:
    """A date-time's ``Z`` (UTC, as ``date -u +%FT%TZ`` writes it) as ``+00:00``: ``fromisoformat`` reads ``Z``
    only from Python 3.11. A date alone (10 characters) takes no zone on any Python."""
    return value[:-1] + "+00:00" if len(value) > 10 and value.endswith("Z") else value


def parse_since(text: str, now: float | None = None) -> float:
    """``--since``: a duration back from now (``90m``, ``12h``, ``7d``, ``2w``) or an ISO date or date-time
    (``2026-11-01``, ``2026-11-01T12:00``, local time unless it names a zone). Returns a Unix time."""
    value = text.strip()
    match = _DURATION.fullmatch(value)
    if match:
        return (time.time() if now is None else now) - float(match.group(1)) * _SECONDS[match.group(2)]
    try:
        moment = datetime.datetime.fromisoformat(_utc_as_offset(value))
    except ValueError:
        raise ValueError(f"--since takes a duration like 7d or 12h, or a date like 2026-11-01, not {text!r}") from None
    return moment.timestamp()
