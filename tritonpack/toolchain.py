"""Whether the ptxas whose backend hash an archive would record is the one that compiled its kernels.

A CUDA backend hash is ``ptxas --version`` plus the arch (Triton 3.0-3.9), and the packing process computes it with
its own ptxas: where the compiling process used another (``TRITON_PTXAS_PATH``, which vLLM and PyTorch set inside
the process for new GPUs; a CUDA toolkit upgraded since), the archive would name the wrong one, and the preflight
would refuse kernels that Triton hits and pass kernels that it recompiles. Nothing in a kernel's metadata names its
ptxas, but its ``.ptx`` names the PTX ISA that Triton chose for that ptxas's release (``ptx_get_version``): where it
is another, the hash is not recorded, and the kernels' backend is reported unchecked where they are unpacked.
"""
from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from .model import TritonInfo

if TYPE_CHECKING:
    from .cacheroot import LocalEntry

_RELEASE = re.compile(r"release (\d+)\.(\d+)")
_PTX_VERSION = re.compile(rb"^\s*\.version\s+(\d+)\.(\d+)", re.M)
PTX_HEAD = 4096  # bytes of a .ptx read for its .version line (after LLVM's few lines of comments)


def ptx_isa(backend_hash: str) -> tuple[int, int] | None:
    """The PTX ISA version Triton writes with the ptxas of a CUDA backend hash (its ``ptx_get_version``, the same in
    3.0-3.9: CUDA 12.0-12.5 give 8.0-8.5, 12.6 and later 12.x one less, 13.x 9.x, 11.x 7.x); None for another
    backend's hash or a release it does not know."""
    match = _RELEASE.search(backend_hash)
    if match is None:
        return None
    major, minor = int(match.group(1)), int(match.group(2))
    if major == 12:
        number = 80 + minor - (minor >= 6)
    elif major == 11:
        number = 70 + minor
    elif major >= 13:
        number = 90 + (major - 13) * 10 + minor
    else:
        return None
    return number // 10, number % 10


def ptx_version_of(path: str) -> tuple[int, int] | None:
    """The ``.version`` a .ptx file declares; None where there is no such file or line."""
    try:
        with open(path, "rb") as f:
            head = f.read(PTX_HEAD)
    except OSError:
        return None
    match = _PTX_VERSION.search(head)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _asked_for(directory: str, name: str) -> bool:
    """Whether a kernel was compiled with a ``ptx_version`` option (its metadata says so): then its .ptx says
    nothing of its ptxas. Read only for a kernel whose .ptx disagrees."""
    import json

    try:
        with open(os.path.join(directory, f"{name}.json"), "rb") as f:
            return json.load(f).get("ptx_version") is not None
    except (OSError, ValueError, AttributeError):
        return False


def compiled_elsewhere(kernels: Iterable[tuple[str, str, str]], hashes: Mapping[str, str]) -> dict[str, Counter]:
    """Of ``kernels`` (target, key directory, name), those whose .ptx declares another PTX ISA than the ptxas of
    their target's hash gives: by target, a count of each version they declare. Kernels without a .ptx (thinned)
    tell nothing, nor those compiled with a ``ptx_version`` option. One read of 4 KiB a kernel, in this process:
    10,000 kernels in 0.1 s here from the page cache (threads took 0.45 s, taking turns on the interpreter lock)."""
    expected = {target: ptx_isa(h) for target, h in hashes.items()}
    found: dict[str, Counter] = {}
    for target, directory, name in kernels:
        isa = expected.get(target)
        if isa is None:
            continue
        version = ptx_version_of(os.path.join(directory, f"{name}.ptx"))
        if version is not None and version != isa and not _asked_for(directory, name):
            found.setdefault(target, Counter())[version] += 1
    return found


def compiled_elsewhere_note(found: Mapping[str, Counter], hashes: Mapping[str, str]) -> str:
    """What ``compiled_elsewhere`` found, in words: whose backend hash the archive leaves out, and why."""
    from .report import plural

    parts = []
    for target, versions in sorted(found.items()):
        major, minor = ptx_isa(hashes[target]) or (0, 0)  # found only for targets whose ptxas it knows
        declared = ", ".join(f"{v[0]}.{v[1]}" for v in sorted(versions))
        count = sum(versions.values())
        parts.append(f"{plural(count, 'kernel')} for {target} {'declares' if count == 1 else 'declare'} PTX "
                     f"{declared}, where the ptxas here writes {major}.{minor}")
    targets = ", ".join(sorted(found))
    return (f"{'; '.join(parts)}: they were compiled with another ptxas (TRITON_PTXAS_PATH in the compiling process, "
            f"a CUDA upgraded since), so the archive records no backend hash for {targets}, and their backend is "
            "reported unchecked where they are unpacked")


def checked_hashes(triton: TritonInfo | None, entries: Iterable[LocalEntry]) -> tuple[TritonInfo | None, str | None]:
    """``triton`` without the backend hashes of targets whose kernels among ``entries``
    (found on disk) were compiled with another ptxas, and the note that says so (None where there is none)."""
    if triton is None or not triton.backend_hashes:
        return triton, None
    kernels = ((e.kernel.hash_key, e.files[0].directory, e.name) for e in entries
               if e.kernel is not None and e.kernel.backend == "cuda" and e.files)
    found = compiled_elsewhere(kernels, triton.backend_hashes)
    if not found:
        return triton, None
    kept = {t: h for t, h in triton.backend_hashes.items() if t not in found}
    return triton._replace(backend_hashes=kept), compiled_elsewhere_note(found, triton.backend_hashes)
