"""The command's own heap: glibc's malloc thresholds, fixed.

glibc raises its mmap threshold (up to 32 MiB), and its trim threshold with it, each time it frees a mapped chunk:
later buffers of that size come from a heap, which keeps them once freed. Fixed (which stops the adjustment), a
pack of 187,230 files peaked at 143 MB of summed PSS instead of 171, an unpack of them at 154 MB instead of 158
(2-core VM); pack times 0.97-0.98 of the moving thresholds' (2 of the H200 host's CPUs, paired). The mmap threshold
is 16 MiB, not glibc's first 128 KiB: with that, each block's zstd context was mapped and faulted in anew (pack
peak 138 MB, but 1.04-1.06 of the time). ``mallopt`` sets them for the whole process, so only the commands, each
its own process, fix them; the API, which runs in a host program, never does.
"""
from __future__ import annotations

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
TRIM_THRESHOLD = 128 * 1024  # glibc's default: a heap's free top past it goes back to the system
MMAP_THRESHOLD = 16 * 1024 * 1024  # blocks' compressed outputs and buffers are mapped; zstd contexts are not


def fix_malloc_thresholds() -> None:
    """Fix glibc's malloc thresholds from now on (nothing where the C library has no ``mallopt``)."""
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (ImportError, OSError, AttributeError):
        return
    mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
    mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)


__all__ = ["fix_malloc_thresholds"]
