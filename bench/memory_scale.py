"""Peak memory of pack, unpack and list against the number of files: the real cache, copied N times.

The memory goal (summed PSS of the process tree at most 256 MB) holds whatever the cache's bytes: blocks stream
through a bounded number of buffers. What grows is what a pack or an unpack knows about each file (its name, size,
digest, place in the index and on disk): this benchmark measures it. Each copy of the cache has new keys, and
every file's bytes differ from its other copies' by a few bytes (near-duplicates: the archive stays small, the
index does not).
Usage: python bench/memory_scale.py ARCHIVE WORK_DIR [--copies 1,10,30] [--out F]
  ARCHIVE: fixtures/torch-max-autotune-h200-triton36.tpack (6,241 files); WORK_DIR: tmpfs is best (/dev/shm).
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
from perf import _pss_rss, _tree

BASE32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567"
TP = [sys.executable, "-c", "from tritonpack.entry import run; run()"]


def copy_cache(source: str, target: str, copies: int) -> None:
    """``copies`` copies of the cache at ``source``, each key's last two characters replaced (still a key), each
    file made distinct: a field added to a json, a comment line appended to anything else; manifests point at
    their new directory."""
    for k in range(copies):
        tag = BASE32[k // 32 % 32] + BASE32[k % 32]
        for key in os.listdir(source):
            if not os.path.isdir(os.path.join(source, key)):
                continue
            new_dir = os.path.join(target, key[:-2] + tag)
            os.makedirs(new_dir, exist_ok=True)
            for name in os.listdir(os.path.join(source, key)):
                with open(os.path.join(source, key, name), "rb") as f:
                    data = f.read()
                if name.startswith("__grp__"):
                    manifest = json.loads(data)
                    manifest["child_paths"] = {c: os.path.join(new_dir, c) for c in manifest["child_paths"]}
                    data = json.dumps(manifest).encode()
                elif name.endswith(".json"):
                    value = json.loads(data)
                    if isinstance(value, dict):
                        value["_copy"] = k
                    data = json.dumps(value).encode()
                else:
                    data += b"\n//copy %d\n" % k
                with open(os.path.join(new_dir, name), "wb") as f:
                    f.write(data)


def measure(cmd: list[str]) -> dict:
    """Wall seconds, peak summed PSS of the process tree, and each process's own peak PSS (MB)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    peaks: dict[int, int] = {}
    tree = most = 0
    while proc.poll() is None:
        pids = _tree(proc.pid)
        total = 0
        for pid in pids:
            pss, _ = _pss_rss(pid)
            total += pss
            peaks[pid] = max(peaks.get(pid, 0), pss)
        tree, most = max(tree, total), max(most, len(pids))
        time.sleep(0.002)
    if proc.returncode:
        raise SystemExit(f"failed: {cmd}\n{proc.stderr.read().decode()}")
    main = peaks.pop(proc.pid, 0)
    return {"seconds": round(time.perf_counter() - start, 2), "tree_pss_mb": round(tree / 2**20, 1),
            "main_pss_mb": round(main / 2**20, 1), "processes": most,
            "others_pss_mb": sorted(round(v / 2**20, 1) for v in peaks.values())}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("archive")
    parser.add_argument("work")
    parser.add_argument("--copies", default="1,10,30")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    real = os.path.join(args.work, "real")
    subprocess.run([*TP, "unpack", args.archive, "--cache-dir", real, "--force", "-q"], check=True)
    results: dict = {"cpus": len(os.sched_getaffinity(0)), "python": sys.version.split()[0]}
    for copies in (int(c) for c in args.copies.split(",")):
        cache = real if copies == 1 else os.path.join(args.work, f"copies{copies}")
        if copies != 1:
            copy_cache(real, cache, copies)
        archive = os.path.join(args.work, f"copies{copies}.tpack")
        out = os.path.join(args.work, f"out{copies}")
        row = {"files": sum(len(names) for _, _, names in os.walk(cache)),
               "pack": measure([*TP, "pack", cache, "-o", archive, "-q"]),
               "archive_bytes": os.path.getsize(archive),
               "unpack": measure([*TP, "unpack", archive, "--cache-dir", out, "-q", "--force"]),
               "list": measure([*TP, "list", archive])}
        results[f"copies{copies}"] = row
        print(f"{copies:3d} copies, {row['files']:7d} files: summed PSS pack {row['pack']['tree_pss_mb']} MB "
              f"({row['pack']['seconds']} s), unpack {row['unpack']['tree_pss_mb']} MB "
              f"({row['unpack']['seconds']} s), list {row['list']['tree_pss_mb']} MB", flush=True)
        shutil.rmtree(out)
        if copies != 1:
            shutil.rmtree(cache)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
