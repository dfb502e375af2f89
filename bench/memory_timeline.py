"""When pack, unpack and list peak, and which process holds what: summed-PSS timelines at N copies of a real cache.

``memory_scale.py`` gives each command's peak; this one samples the whole process tree every 5 ms and keeps the
moment of the peak (seconds, summed PSS MB, processes, the main process's PSS MB), the main process's own peak, the
peak while more than six processes ran (a pack's forked scan), and the timeline itself. The copies are made once
and measured with each tree in turn, so that two revisions are compared on the same files.
Usage: python bench/memory_timeline.py ARCHIVE WORK_DIR COPIES TREE [TREE ...] [--out F] [--commands pack,...]
  ARCHIVE: fixtures/torch-max-autotune-h200-triton36.tpack (6,241 files); WORK_DIR: tmpfs is best (/dev/shm; a copy
  of 170 copies, 1,060,970 files, takes 36 GB, and its unpack as much again); TREE: a directory holding a
  tritonpack/ (a checkout, or ``git archive REV tritonpack | tar -x -C DIR``).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from memory_scale import copy_cache
from perf import _pss_rss, _tree

MB = 2**20


def timeline(cmd: list[str], env: dict) -> dict:
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, cwd="/")
    samples = []
    while proc.poll() is None:
        pss = {pid: _pss_rss(pid)[0] for pid in _tree(proc.pid)}
        samples.append((round(time.perf_counter() - start, 2), round(sum(pss.values()) / MB, 1), len(pss),
                        round(pss.get(proc.pid, 0) / MB, 1)))
        time.sleep(0.005)
    if proc.returncode:
        raise SystemExit(f"failed: {cmd}\n{proc.stderr.read().decode()[-2000:]}")
    many = [s for s in samples if s[2] > 6]
    return {"seconds": samples[-1][0], "peak": max(samples, key=lambda s: s[1]),
            "main_peak": max(samples, key=lambda s: s[3]),
            "many_processes_peak": max(many, key=lambda s: s[1]) if many else None,
            "timeline": samples[::max(1, len(samples) // 40)]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("archive")
    parser.add_argument("work")
    parser.add_argument("copies", type=int)
    parser.add_argument("trees", nargs="+")
    parser.add_argument("--out", default=None)
    parser.add_argument("--commands", default="pack,unpack,list",
                        help="which to run, in this order (unpack and list need a pack before them)")
    args = parser.parse_args()
    commands = args.commands.split(",")
    real, cache = os.path.join(args.work, "real"), os.path.join(args.work, "cache")
    archive, out = os.path.join(args.work, "copies.tpack"), os.path.join(args.work, "out")

    def tp(tree: str) -> tuple[list[str], dict]:
        path = os.pathsep.join(p for p in (os.path.abspath(tree), os.environ.get("PYTHONPATH")) if p)
        return [sys.executable, "-c", "from tritonpack.entry import run; run()"], dict(os.environ, PYTHONPATH=path)

    command, env = tp(args.trees[0])
    subprocess.run([*command, "unpack", args.archive, "--cache-dir", real, "--force", "-q"], check=True, env=env)
    copy_cache(real, cache, args.copies)
    results: dict = {"cpus": len(os.sched_getaffinity(0)), "python": sys.version.split()[0], "copies": args.copies,
                     "files": sum(len(names) for _, _, names in os.walk(cache)),
                     "sample": "(seconds, summed PSS MB, processes, main process PSS MB)"}
    arguments = {"pack": ["pack", cache, "-o", archive, "-q"],
                 "unpack": ["unpack", archive, "--cache-dir", out, "-q", "--force"], "list": ["list", archive]}
    for n, tree in enumerate(args.trees):  # a tree named again is measured again: rounds, interleaved
        command, env = tp(tree)
        row = {name: timeline([*command, *arguments[name]], env) for name in commands}
        shutil.rmtree(out, ignore_errors=True)
        results[tree if tree not in args.trees[:n] else f"{tree} ({args.trees[:n].count(tree) + 1})"] = row
        print(f"{tree}, {results['files']} files: " + ", ".join(
            f"{name} peak {row[name]['peak'][1]} MB at {row[name]['peak'][0]} s ({row[name]['seconds']} s)"
            for name in row), flush=True)
        if args.out:  # after each tree: a run cut short still leaves the trees it measured
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
