"""The commands fix glibc's malloc thresholds: freed buffers go back to the system instead of staying in a heap."""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

PROBE = textwrap.dedent("""
    import sys
    from tritonpack.heap import fix_malloc_thresholds

    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * 4096

    if sys.argv[1] == "fixed":
        fix_malloc_thresholds()
    big = bytearray(16 << 20)
    del big  # a mapped chunk freed: glibc raises its thresholds to its size, unless they are fixed
    before = rss()
    chunks = [bytearray(1 << 20) for _ in range(30)]
    del chunks
    print((rss() - before) >> 20)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux") or sys.implementation.name != "cpython",
                    reason="glibc's malloc on Linux")
def test_freed_megabytes_leave_the_process_once_the_thresholds_are_fixed():
    def kept(mode: str) -> int:
        return int(subprocess.run([sys.executable, "-c", PROBE, mode], check=True, capture_output=True,
                                  text=True).stdout)

    if kept("moving") < 20:
        pytest.skip("this C library does not keep freed buffers in its heap (not glibc)")
    assert kept("fixed") < 5
