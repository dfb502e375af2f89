"""What a pack's block buffers cost the kernel: five 32 MiB anonymous maps, filled once (every page faulted in),
filled again (no faults), then unmapped; shared maps (what the forked helpers need), private ones (a pack without
helpers), and private ones with ``MADV_HUGEPAGE`` (not used: with THP's defrag on ``madvise`` a fault may compact
memory first, which took 164-318 ms where it usually takes 44 on the 2-core VM). Each kind runs in a fresh process,
interleaved, several rounds; medians in ms.
Usage: python bench/block_buffer_probe.py [--rounds 5] [--out FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BLOCK = 32 << 20
BUFFERS = 5
KINDS = ("shared", "private", "private, MADV_HUGEPAGE")


def measure(kind: str) -> dict[str, float]:
    import mmap

    data = bytes(range(256)) * (BLOCK // 256)
    start = time.perf_counter()
    buffers = []
    for _ in range(BUFFERS):
        if kind == "shared":
            buffer = mmap.mmap(-1, BLOCK)
        else:
            buffer = mmap.mmap(-1, BLOCK, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            if kind != "private":
                buffer.madvise(mmap.MADV_HUGEPAGE)
        buffer[:] = data
        buffers.append(buffer)
    filled = time.perf_counter()
    for buffer in buffers:
        buffer[:] = data
    refilled = time.perf_counter()
    for buffer in buffers:
        buffer.close()
    unmapped = time.perf_counter()
    return {"fill": (filled - start) * 1000, "refill": (refilled - filled) * 1000,
            "unmap": (unmapped - refilled) * 1000}


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--child":
        print(json.dumps(measure(sys.argv[2])))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    samples: dict[str, list[dict[str, float]]] = {kind: [] for kind in KINDS}
    for _ in range(args.rounds):
        for kind in KINDS:
            out = subprocess.run([sys.executable, __file__, "--child", kind], check=True, capture_output=True).stdout
            samples[kind].append(json.loads(out))
    report = {"cpus": os.cpu_count(), "rounds": args.rounds, "block_mib": BLOCK >> 20, "buffers": BUFFERS,
              "medians_ms": {kind: {k: round(statistics.median(s[k] for s in runs), 1) for k in runs[0]}
                             for kind, runs in samples.items()},
              "samples": samples}
    for kind, medians in report["medians_ms"].items():
        print(f"{kind:24s} " + "  ".join(f"{k} {v:6.1f} ms" for k, v in medians.items()))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
