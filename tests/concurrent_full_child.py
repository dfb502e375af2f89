"""Run inside a private mount namespace (``unshare -m``) by tests/test_diskfull.py: several ``tritonpack unpack``
commands of one archive at once into one root, on a real tmpfs that holds one copy of it but not two; report each
trial as JSON on stdout.

Usage: unshare -m python tests/concurrent_full_child.py ARCHIVE WORKDIR [TRIALS] [UNPACKS]
(exit 77: mounting is not possible)
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from diskfull_child import mount, umount
from invariants import expected_groups, group_problems, temp_files

import tritonpack


def trial(archive: str, mnt: str, size: int, unpacks: int) -> dict:
    mount(mnt, size, 10000)
    try:
        root = os.path.join(mnt, "cache")
        command = [sys.executable, "-m", "tritonpack", "unpack", archive, "--cache-dir", root, "--force", "-q"]
        runs = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(unpacks)]
        done = [(run.wait(), run.stderr.read()) for run in runs]
        for run in runs:
            run.stdout.close()
            run.stderr.close()
        expected = expected_groups(archive)
        return {
            "exits": [code for code, _ in done],
            "stderr": [err for _, err in done],
            "problems": group_problems(root, {k: [v] for k, v in expected.items()}),
            "missing": sorted(f"{k}/__grp__{n}.json" for k, n in expected
                              if not os.path.exists(os.path.join(root, k, f"__grp__{n}.json"))),
            "temp_files": temp_files(root),
        }
    finally:
        umount(mnt)


def main_child() -> None:
    archive, work = sys.argv[1], sys.argv[2]
    trials = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    unpacks = int(sys.argv[4]) if len(sys.argv) > 4 else 3
    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt, exist_ok=True)
    try:
        mount(mnt, 64 * 1024, 100)
        umount(mnt)
    except (subprocess.CalledProcessError, OSError) as e:
        print(f"cannot mount a tmpfs here: {getattr(e, 'stderr', b'') or e}", file=sys.stderr)
        sys.exit(77)
    with tritonpack.open(archive) as reader:  # what one copy takes, in pages: room for it, not for two
        need = sum(-(-f.size // 4096) * 4096 for e in reader.entries for f in e.files)
        need += 4096 * sum(e.kind == "group" for e in reader.entries)  # the manifests
    results = [trial(archive, mnt, need * 3 // 2, unpacks) for _ in range(trials)]
    shutil.rmtree(mnt, ignore_errors=True)
    print(json.dumps({"need": need, "trials": results}))


if __name__ == "__main__":
    main_child()
