"""`tritonpack record` on a real GPU: what a run uses, from which roots, and whether the recording replays as hits.

One shell script starts two Pythons (the workloads of gpu_first_call.py): (a) a matmul autotuned over 32 configs
with cache_results=True, Triton cache in $TRITON_CACHE_DIR; (b) a transformer under torch.compile with
TRITON_CACHE_DIR unset, so that Inductor points Triton at $TORCHINDUCTOR_CACHE_DIR/triton/0. Steps:

  record_cold  record the script on empty roots (everything compiled and autotuned)
  record_warm  record it again on the now warm roots: only what a warm run uses
  replay       unpack the warm recording into one fresh root, run both workloads against it (fresh Inductor
               dir, FX graph cache off) and count the files created under it: 0 means every kernel, launcher
               stub and autotune result came from the recording

Usage (GPU machine): python bench/gpu_record.py --out bench/results/gpu_record.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "gpu_first_call.py")
QUIET_INDUCTOR = {"TORCHINDUCTOR_FX_GRAPH_CACHE": "0", "TORCHINDUCTOR_AUTOGRAD_CACHE": "0",
                  "TORCHINDUCTOR_BUNDLE_TRITON_INTO_FX_GRAPH_CACHE": "0", "PYTHONUNBUFFERED": "1"}


def files_under(root: str) -> set[str]:
    return {os.path.relpath(os.path.join(d, n), root) for d, _, names in os.walk(root) for n in names}


def tritonpack(command: str, *args: str, env: dict | None = None) -> tuple[dict, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "tritonpack", command, "--json", *args], capture_output=True,
                          text=True, env=env)
    seconds = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"tritonpack {command} {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout), seconds


def worker(workload: str, env: dict) -> dict:
    proc = subprocess.run([sys.executable, WORKER, "--worker", workload], env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"worker {workload} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def summary(doc: dict, seconds: float) -> dict:
    kinds = {}
    for r in doc["recorded"]:
        kinds.setdefault(r["root"], {}).setdefault(r["kind"], 0)
        kinds[r["root"]][r["kind"]] += 1
    return {"seconds_with_command": round(seconds, 2), "pack_s": round(doc["pack_seconds"], 3),
            "entries": doc["entries"], "by_root": kinds, "processes": doc["processes"],
            "served_from_cache": sum(1 for r in doc["recorded"] if not r["writes"]),
            "written_by_run": sum(1 for r in doc["recorded"] if r["writes"]),
            "not_packed": doc["not_packed"], "archive_bytes": doc["bytes_out"], "files": doc["files"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(HERE, "results", "gpu_record.json"))
    args = parser.parse_args()
    import torch
    import triton

    work = tempfile.mkdtemp(prefix="tp-gpu-record-")
    doc = {"gpu": torch.cuda.get_device_name(), "triton": triton.__version__, "torch": torch.__version__,
           "python": sys.version.split()[0]}
    try:
        script = os.path.join(work, "run.sh")
        with open(script, "w") as f:
            f.write(f"""#!/bin/sh
set -e
TRITON_CACHE_DIR={work}/triton-cache {sys.executable} {WORKER} --worker a
env -u TRITON_CACHE_DIR TORCHINDUCTOR_CACHE_DIR={work}/inductor {sys.executable} {WORKER} --worker b
""")
        os.chmod(script, 0o755)
        env = {**os.environ, **QUIET_INDUCTOR}
        env.pop("TRITON_CACHE_DIR", None)
        for step in ("cold", "warm"):
            result, seconds = tritonpack("record", "-o", os.path.join(work, f"{step}.tpack"), "--", script, env=env)
            doc[f"record_{step}"] = summary(result, seconds)
            print(step, json.dumps(doc[f"record_{step}"]), flush=True)
        full, _ = tritonpack("pack", os.path.join(work, "triton-cache"), "-o", os.path.join(work, "full-a.tpack"))
        doc["pack_whole_root_a"] = {"entries": full["entries"], "archive_bytes": full["bytes_out"]}

        replay_root = os.path.join(work, "replay-cache")
        unpacked, _ = tritonpack("unpack", os.path.join(work, "warm.tpack"), "--cache-dir", replay_root)
        doc["replay"] = {"unpacked": {k: unpacked[k] for k in ("written", "not_used_entries", "unchecked")}}
        before = files_under(replay_root)
        replay_env = {**env, "TRITON_CACHE_DIR": replay_root, "TORCHINDUCTOR_CACHE_DIR": os.path.join(work, "ind2")}
        for workload in ("a", "b"):
            row = worker(workload, replay_env)
            doc["replay"][workload] = {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}
        doc["replay"]["files_created_under_root"] = sorted(files_under(replay_root) - before)
        print("replay", json.dumps(doc["replay"]), flush=True)
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
