"""Which GPU targets this machine has, without initialising CUDA or importing Triton when possible.

``None`` means no GPU is visible (an image build on a CPU machine): the arch is then not checked, and said so.
"""
from __future__ import annotations

import glob
import os
import re

Target = tuple[str, "str | int", int]  # (backend, arch, warp_size), as Triton's GPUTarget


def _which(name: str) -> str | None:
    """``shutil.which`` for a plain name, without importing shutil (with bz2 and lzma: 3 ms of an unpack's start)."""
    for directory in os.environ.get("PATH", os.defpath).split(os.pathsep):
        path = os.path.join(directory or os.curdir, name)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


KFD = "/dev/kfd"  # the device node through which ROCm reaches AMD GPUs
_KFD_NODES = "/sys/class/kfd/kfd/topology/nodes/*/properties"
# ROCm's target features, as rocminfo, amd-smi and torch's gcnArchName print an arch (gfx90a:sramecc+:xnack-)
_FEATURE = re.compile(r":[a-z][a-z0-9_]*[+-]")


def without_features(text: str) -> str:
    """``gfx90a:sramecc+:xnack-`` as Triton names that target, ``gfx90a``: its HIP driver keeps what comes before
    the first colon, and no cache key names a feature."""
    return _FEATURE.sub("", text)


def amd_hidden() -> bool:
    """Whether the HIP runtime would see no AMD GPU: ``HIP_VISIBLE_DEVICES``, ``ROCR_VISIBLE_DEVICES`` or
    ``CUDA_VISIBLE_DEVICES`` (which HIP honours) hide them all, or ``/dev/kfd`` cannot be opened (a container
    started without the device, as an image build on an MI300 host is: sysfs still lists the host's GPUs)."""
    for variable in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        visible = os.environ.get(variable)
        if visible is not None and visible.strip() in ("", "-1"):
            return True
    return not os.access(KFD, os.R_OK | os.W_OK)


def cuda_hidden() -> bool:
    """Whether ``CUDA_VISIBLE_DEVICES`` hides every GPU: the one thing of it the probe reads, since nvidia-smi lists
    every GPU of the host whichever it names (a rank's own GPU, ``0`` to ``7``)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible is not None and visible.strip() in ("", "-1")


def _start_nvidia_smi():
    """nvidia-smi asked for the compute capability of each visible GPU, not waited for; None where there is none."""
    if cuda_hidden():
        return None
    smi = _which("nvidia-smi")
    if smi is None:
        return None
    import subprocess

    try:
        return subprocess.Popen([smi, "--query-gpu=compute_cap", "--format=csv,noheader"], stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL, text=True)
    except OSError:
        return None


def _nvidia_answer(smi) -> list[Target]:
    """The targets a started nvidia-smi names; none if it fails or hangs."""
    if smi is None:
        return []
    import subprocess

    try:
        out, _ = smi.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        _stop(smi)
        return []
    if smi.returncode != 0:
        return []
    targets: list[Target] = []
    for line in out.splitlines():
        major, _, minor = line.strip().partition(".")
        if major.isdigit() and minor.isdigit():
            targets.append(("cuda", int(major) * 10 + int(minor), 32))
    return targets


def _stop(smi) -> None:
    """Kill a started nvidia-smi and reap it, its pipe closed."""
    smi.kill()
    smi.communicate()


def _amd() -> list[Target]:
    targets: list[Target] = []
    nodes = glob.glob(_KFD_NODES)
    if not nodes or amd_hidden():
        return targets
    for props in nodes:
        try:
            with open(props, encoding="ascii") as f:
                fields = dict(line.split(None, 1) for line in f if " " in line.strip())
        except (OSError, ValueError):
            continue
        version = int(fields.get("gfx_target_version", "0").strip() or 0)
        if version == 0:  # a CPU node
            continue
        major, minor, step = version // 10000, (version // 100) % 100, version % 100
        arch = f"gfx{major}{minor:x}{step:x}"
        targets.append(("hip", arch, 64 if major == 9 else 32))
    override = _override_arch()
    return [(backend, override, warp) for backend, _, warp in targets] if override and targets else targets


def _override_arch() -> str | None:
    """``TRITON_OVERRIDE_ARCH``, which Triton 3.4+'s HIP driver makes the current target's arch (what comes before
    its first colon), so that it compiles and looks up kernels for that arch on these GPUs; None where unset, or
    where the installed Triton is older."""
    override = without_features(os.environ.get("TRITON_OVERRIDE_ARCH", "").strip())
    if not override:
        return None
    from .fingerprint import installed_version
    from .triton_env import release_of

    release = release_of(installed_version())
    return override.split(":")[0] if release is not None and release >= (3, 4) else None


def visible_targets() -> list[Target] | None:
    """Distinct targets of the visible GPUs, or ``None`` when none is visible."""
    with GpuProbe() as probe:
        return probe.targets()


class GpuProbe:
    """``visible_targets()`` started at once and read when needed: nvidia-smi takes 25 ms on an H200 host, which
    then overlap the index's read instead of following it (``check`` there ends 18-27 ms sooner). A process, not a
    thread: unpack forks its workers only while no other thread runs. Closing it stops an answer never read (an
    error came first)."""

    def __init__(self) -> None:
        self._smi = _start_nvidia_smi()
        self._found: list[Target] | None = None  # None until read

    def targets(self) -> list[Target] | None:
        if self._found is None:
            self._found = sorted(set(_nvidia_answer(self._smi) + _amd()), key=str)
            self._smi = None
        return self._found or None

    def close(self) -> None:
        if self._smi is not None:
            _stop(self._smi)
            self._smi = None

    def __enter__(self) -> GpuProbe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def parse_target(text: str) -> Target:
    """``cuda:90``, ``hip:gfx942`` (warp size from the arch family) or ``hip:gfx1100:32``; ``90`` and ``gfx942``
    as ``--arch`` takes them: digits name only CUDA archs, ``gfx`` only AMD ones."""
    text = without_features(text.strip())
    if text.isdigit() or text.startswith("gfx"):
        text = f"{'cuda' if text.isdigit() else 'hip'}:{text}"
    parts = text.split(":")
    if len(parts) not in (2, 3) or parts[0] not in ("cuda", "hip") or not parts[1]:
        raise ValueError(f"a target looks like cuda:90, hip:gfx942, 90 or gfx942, not {text!r}")
    backend, arch = parts[0], parts[1]
    if backend == "cuda":
        if not arch.isdigit():
            raise ValueError(f"a CUDA arch is a number like 90, not {arch!r}")
        arch_value: str | int = int(arch)
        warp = 32
    else:
        arch_value = arch
        warp = 64 if arch.startswith("gfx9") else 32
    if len(parts) == 3:
        if not parts[2].isdigit():
            raise ValueError(f"warp size must be a number, not {parts[2]!r}")
        warp = int(parts[2])
    return (backend, arch_value, warp)
