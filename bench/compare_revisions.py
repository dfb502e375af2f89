"""Two revisions of tritonpack on one machine, in one run: pack, unpack, list and check, interleaved rounds.

Ratios between separate runs of bench/perf.py mislead on shared machines (the same command moved 20% between two
runs here); this runs the old and the new code alternately on the same cache and reports medians and new/old.
Usage: python bench/compare_revisions.py ARCHIVE --old REV [--new-src DIR] [--rounds 7] [--work DIR] [--out F]
       [--detect-gpus] [--arch TARGET] [--cases pack,unpack]
  ARCHIVE is unpacked once and measured as a cache (fixtures/torch-max-autotune-h200-triton36.tpack).
  --old REV: a git revision, extracted with git archive; or --old-src DIR: a tree that holds its tritonpack/.
  Both run as the console script does (``tritonpack.entry.run``, or ``tritonpack.cli.run`` before it existed).
  --arch TARGET: also a partial unpack, of that target's kernels alone (a multi-target archive's one of three).
  --cases: the commands to time (default: all); fewer take less of a session's device time for more rounds.
  Each case reports the medians, their ratio, and the median of the rounds' own ratios (old and new run next to
  each other in a round: a machine that slows for a while slows both); the JSON keeps every sample.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
CASES = ("pack", "unpack", "list", "check")


def command(src: str, *args: str) -> tuple[list[str], dict]:
    """Run with the work directory as cwd: ``-c`` puts the cwd first on sys.path, before PYTHONPATH."""
    entry = "entry" if os.path.exists(os.path.join(src, "tritonpack", "entry.py")) else "cli"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (src, os.environ.get("PYTHONPATH")) if p))
    return [sys.executable, "-c", f"from tritonpack.{entry} import run; run()", *args], env


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("archive")
    old = parser.add_mutually_exclusive_group(required=True)
    old.add_argument("--old", help="git revision")
    old.add_argument("--old-src", help="a directory that holds the old tritonpack/")
    parser.add_argument("--new-src", default=os.path.dirname(HERE))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--work", default=None)
    parser.add_argument("--target", default="cuda:90", help="for check")
    parser.add_argument("--detect-gpus", action="store_true",
                        help="check without --target: it detects the visible GPUs, as on a GPU host")
    parser.add_argument("--arch", default=None, help="also time an unpack of this target alone")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: " + ", ".join(CASES))
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="tp-compare-", dir=args.work)
    try:
        srcs = {"old": args.old_src and os.path.abspath(args.old_src), "new": os.path.abspath(args.new_src)}
        if args.old:
            srcs["old"] = os.path.join(work, "old-src")
            os.makedirs(srcs["old"])
            tar = subprocess.run(["git", "-C", srcs["new"], "archive", args.old, "tritonpack"], check=True,
                                 capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", srcs["old"]], input=tar, check=True)
        report = measure(args, srcs, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for name, r in report["cases"].items():
        print(f"{name:13s} old {r['old']:7.3f} s   new {r['new']:7.3f} s   new/old {r['ratio']:.2f}   "
              f"rounds' new/old {r['paired']:.2f}")
    print(f"archive bytes: old {report['bytes']['old']}, new {report['bytes']['new']}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


def measure(args, srcs: dict[str, str], work: str) -> dict:
    cache = os.path.join(work, "cache")
    cmd, env = command(srcs["new"], "unpack", os.path.abspath(args.archive), "--cache-dir", cache, "--force", "-q")
    subprocess.run(cmd, env=env, check=True, cwd=work)
    for which, src in srcs.items():  # untimed: each writes its archive (and the fingerprint gets cached)
        cmd, env = command(src, "pack", cache, "-o", os.path.join(work, f"{which}.tpack"), "-q")
        subprocess.run(cmd, env=env, check=True, cwd=work)
    for src in srcs.values():  # bytecode, as pip writes at install (PYTHONDONTWRITEBYTECODE would skip it)
        subprocess.run([sys.executable, "-m", "compileall", "-q", os.path.join(src, "tritonpack")], check=True)
    chosen = tuple(name for name in args.cases.split(",") if name)
    unknown = set(chosen) - set(CASES)
    if unknown:
        raise SystemExit(f"unknown cases: {', '.join(sorted(unknown))}")
    cases = (*chosen, "unpack --arch") if args.arch else chosen
    samples: dict[str, dict[str, list[float]]] = {name: {"old": [], "new": []} for name in cases}
    runs = 0
    for round_number in range(args.rounds):
        for which in ("old", "new") if round_number % 2 == 0 else ("new", "old"):
            archive = os.path.join(work, f"{which}.tpack")
            runs += 1
            out = os.path.join(work, f"out-{runs}")
            argv = {"pack": ["pack", cache, "-o", archive, "-q"],
                    "unpack": ["unpack", archive, "--cache-dir", out, "--force", "-q"],
                    "list": ["list", archive],
                    "check": ["check", archive, *([] if args.detect_gpus else ["--target", args.target])],
                    "unpack --arch": ["unpack", archive, "--cache-dir", out + "-arch", "--force", "-q",
                                      "--arch", args.arch or ""]}
            for name in cases:
                cmd, env = command(srcs[which], *argv[name])
                start = time.perf_counter()
                proc = subprocess.run(cmd, env=env, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
                samples[name][which].append(time.perf_counter() - start)
                if proc.returncode not in (0, 5, 6):  # check: 5/6 when entries are for other targets
                    raise SystemExit(f"{which} {name} failed: {proc.stderr.decode()}")
            shutil.rmtree(out, ignore_errors=True)
            shutil.rmtree(out + "-arch", ignore_errors=True)
    results = {}
    for name, by in samples.items():
        old, new = statistics.median(by["old"]), statistics.median(by["new"])
        paired = statistics.median(n / o for o, n in zip(by["old"], by["new"], strict=True))
        results[name] = {"old": round(old, 3), "new": round(new, 3), "ratio": round(new / old, 3),
                         "paired": round(paired, 3), "samples": {k: [round(t, 4) for t in v] for k, v in by.items()}}
    return {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "archive": args.archive,
        "old": args.old or args.old_src,
        "work": args.work or tempfile.gettempdir(),
        "rounds": args.rounds,
        "check": "visible GPUs" if args.detect_gpus else f"--target {args.target}",
        "arch": args.arch,
        "cases": results,
        "bytes": {which: os.path.getsize(os.path.join(work, f"{which}.tpack")) for which in srcs},
    }


if __name__ == "__main__":
    main()
