"""Unpack onto real small filesystems, full by bytes or by inodes: the long run of tests/test_diskfull.py.

Compiles the test kernels (tests/kernels.py), packs them, and runs tests/diskfull_child.py in a private mount
namespace (``unshare -m`` as root, ``unshare -Urm`` otherwise), which mounts a fresh tmpfs for every attempt:
STEPS sizes from 1/8 to 3/2 of what the archive needs, with and without tritonpack's free-space precheck, and
STEPS inode limits. Every refused unpack must exit 4 with one line and leave the filesystem exactly as it was;
every other must be complete.

Usage: python bench/diskfull_sweep.py [--steps 40] [--out bench/results/diskfull.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "tests")
sys.path.insert(0, TESTS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    import triton
    from kernels import compile_all

    import tritonpack

    work = tempfile.mkdtemp(prefix="tpack-diskfull-")
    try:
        compile_all(os.path.join(work, "build"))
        archive = os.path.join(work, "k.tpack")
        tritonpack.pack(os.path.join(work, "build"), archive)
        prefix = ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-Urm"]
        proc = subprocess.run([*prefix, sys.executable, os.path.join(TESTS, "diskfull_child.py"), archive,
                               os.path.join(work, "mnt"), str(args.steps)], capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"the sweep could not run: {proc.stderr.strip()}")
        results = json.loads(proc.stdout)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    done = [r for r in results if "skipped" not in r]
    refused = [r for r in done if r["exit"] != 0]
    bad = [r for r in done if r["temp_files"] or r["problems"] or not r["precious_kept"]
           or (r["exit"] != 0 and (not r["unchanged"] or r["exit"] != 4 or r["stderr"].count("\n") != 1))
           or (r["exit"] == 0 and not r["complete"])]
    summary = {
        "attempts": len(done),
        "complete": len(done) - len(refused),
        "refused": len(refused),
        "refused_by_enospc_mid_write": sum("No space left" in r["stderr"] for r in refused),
        "refused_by_precheck": sum("not enough free" in r["stderr"] for r in refused),
        "inode_limited_attempts": sum(r["inodes"] != 10000 for r in done),
        "violations": len(bad),
        "triton": triton.__version__, "python": platform.python_version(),
    }
    print(proc.stderr.strip())
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**summary, "results": results}, f, indent=2)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
