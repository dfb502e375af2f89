"""One target of three against the whole unpack, as a multi-target archive grows.

A partial unpack pays the same start as a whole one (Python, imports, the index, the plan, the workers' first
block) and the rest in proportion to what it takes; on the bench's synthetic cache of three targets (9,600 files,
215 MB) that start is most of a one-target unpack. This measures where the ratio goes as the archive grows: N
copies of the archive's cache (``memory_scale.copy_cache``: each file made distinct), packed at the default
settings, then, in rounds, a whole unpack and an unpack of each target alone (``--arch``), each into a fresh root,
run as the ``tritonpack`` command. ``list`` of the same archive is timed beside them: the start without the files.
Each target's share of the bytes a whole unpack writes is printed too: the ratio a proportional unpack would
reach, less its start (the bench's targets are not thirds: 40, 36 and 24%).
Usage: python bench/target_scale.py ARCHIVE [--copies 1,2,4,8] [--rounds 5] [--work DIR] [--out F]
  ARCHIVE: a multi-target archive (bench/make_large_cache.py --targets 3, packed); WORK: tmpfs is best.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory_scale import TP, copy_cache
from perf import dir_stats, run


def timed(argv: list[str]) -> float:
    return run([*TP, *argv])[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("archive")
    parser.add_argument("--copies", default="1,2,4,8")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--work", default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="tp-target-scale-", dir=args.work)
    real = os.path.join(work, "real")
    subprocess.run([*TP, "unpack", os.path.abspath(args.archive), "--cache-dir", real, "--force", "-q"], check=True)
    listed = json.loads(subprocess.run([*TP, "list", os.path.abspath(args.archive), "--json"], check=True,
                                       capture_output=True).stdout)
    targets = sorted({e["target"] for e in listed["entries"] if e["kind"] == "group" and e.get("backend")})
    # What each target's unpack writes, as a share of the whole's (entries without a target go with every one):
    # a perfectly proportional unpack would take that share of the time, plus the start.
    written = sum(e["size"] for e in listed["entries"])
    common = sum(e["size"] for e in listed["entries"] if not e.get("backend"))
    shares = {t: round((common + sum(e["size"] for e in listed["entries"] if e.get("target") == t)) / written, 3)
              for t in targets}
    results = {"cpus": len(os.sched_getaffinity(0)), "python": sys.version.split()[0], "targets": targets,
               "shares": shares, "rounds": args.rounds, "sizes": []}
    print("each target's share of the bytes written: " + ", ".join(f"{t} {shares[t]:.2f}" for t in targets))
    try:
        for copies in map(int, args.copies.split(",")):
            cache, archive, out = (os.path.join(work, name) for name in ("cache", "copies.tpack", "out"))
            copy_cache(real, cache, copies)
            files, size = dir_stats(cache)
            pack_seconds = timed(["pack", cache, "-o", archive, "-q"])
            shutil.rmtree(cache)
            samples: dict[str, list[float]] = {"whole": [], "list": [], **{t: [] for t in targets}}
            for _ in range(args.rounds):  # interleaved: a machine that slows for a while slows every case
                for case in samples:
                    if case == "list":
                        samples[case].append(timed(["list", archive]))
                        continue
                    arch = [] if case == "whole" else ["--arch", case]
                    samples[case].append(timed(["unpack", archive, "--cache-dir", out, "--force", "-q", *arch]))
                    shutil.rmtree(out)
            medians = {case: statistics.median(values) for case, values in samples.items()}
            row = {"copies": copies, "files": files, "bytes": size, "archive_bytes": os.path.getsize(archive),
                   "pack_seconds": round(pack_seconds, 2), "medians": medians, "samples": samples,
                   "ratios": {t: round(medians[t] / medians["whole"], 3) for t in targets}}
            results["sizes"].append(row)
            print(f"{copies} copies, {files} files, {size / 2**20:.0f} MB: whole {medians['whole']:.3f} s, "
                  f"list {medians['list']:.3f} s, " + ", ".join(
                      f"{t} {medians[t]:.3f} s ({row['ratios'][t]:.2f}x)" for t in targets), flush=True)
            os.unlink(archive)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump(results, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
