"""Which ptxas compiled a real GPU cache, as its .ptx files say, and what pack records and check says of it.

A CUDA backend hash is ``ptxas --version``: pack records its own, and where PyTorch sets ``TRITON_PTXAS_PATH`` inside
the process (a CUDA toolkit newer than Triton's bundled ptxas) the kernels were compiled with another. Each workload
of ``gpu_first_call.py`` compiles cold into a fresh root; then: the PTX ISA versions its .ptx files declare, what
``pack --json`` records (backend hashes, its note), what ``check`` says on this GPU, and the workload's first call
after ``unpack`` into another root (a hit: no file created or modified).

Usage (GPU machine): python bench/gpu_ptxas_evidence.py --out bench/results/gpu_ptxas_evidence.json
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gpu_first_call import run_worker  # noqa: E402


def tritonpack(*args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "tritonpack", *args, "--json"], capture_output=True, text=True)
    document = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return {"exit": proc.returncode, "json": document, "stderr": proc.stderr.strip().splitlines()}


def ptx_versions(root: str) -> dict[str, int]:
    found: collections.Counter[str] = collections.Counter()
    for path in glob.glob(os.path.join(root, "*", "*.ptx")):
        with open(path, "rb") as f:
            match = re.search(rb"^\s*\.version\s+(\d+\.\d+)", f.read(4096), re.M)
        found[match.group(1).decode() if match else "none"] += 1
    return dict(sorted(found.items()))


def workload(name: str, work: str) -> dict:
    build, deploy, inductor = (os.path.join(work, name, part) for part in ("build", "deploy", "inductor"))
    cold = run_worker(name, build, inductor)
    archive = os.path.join(work, f"{name}.tpack")
    packed = tritonpack("pack", build, "-o", archive)
    listed = tritonpack("list", archive)
    checked = tritonpack("check", archive)
    unpacked = tritonpack("unpack", archive, "--cache-dir", deploy)
    first = run_worker(name, deploy, inductor)
    hashes = (listed["json"].get("triton") or {}).get("backend_hashes") or {}
    return {
        "cold_first_call_ms": cold["first_call_ms"],
        "ptx_versions": ptx_versions(build),
        "pack_note": packed["json"].get("triton_note"),
        "backend_hashes_recorded": {t: next((line for line in h.splitlines() if "release" in line), h)
                                    for t, h in hashes.items()},
        "check": {"exit": checked["exit"], "usable": checked["json"].get("usable"),
                  "unusable": checked["json"].get("unusable"), "unchecked": checked["json"].get("unchecked")},
        "unpack_exit": unpacked["exit"],
        "first_call_after_unpack": {k: first[k] for k in ("first_call_ms", "files_created", "files_modified",
                                                         "correct")},
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(HERE, "results", "gpu_ptxas_evidence.json"))
    parser.add_argument("--workloads", default="a,b")
    args = parser.parse_args()
    import torch
    import triton

    result = {"gpu": torch.cuda.get_device_name(0), "triton": triton.__version__, "torch": torch.__version__,
              "TRITON_PTXAS_PATH": os.environ.get("TRITON_PTXAS_PATH")}
    with tempfile.TemporaryDirectory(prefix="tp-ptxas-") as work:
        for name in args.workloads.split(","):
            result[name] = workload(name, work)
            print(name, json.dumps(result[name], indent=1), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
