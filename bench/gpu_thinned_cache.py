"""A cache thinned to its binaries, on a real GPU: packed with what is left, and still a hit wherever it is unpacked.

A script that slims a root or an image (``find -name '*.ptx' -delete``), or a copy that leaves files out, removes
the IR files of a Triton cache (``.ttir``, ``.ttgir``, ``.llir``, ``.ptx``, ``.source``) and leaves each kernel's
metadata and binary, from which Triton loads it. (A cleaner going by access time does not: a hit reads every file
of a group, IR files too.) Workload a of ``gpu_first_call.py`` compiles cold; its groups are thinned so;
Triton 3.0-3.7 still hits them where they are (3.8+ recompiles them). The thinned root is packed, unpacked into a
fresh root, and the workload's first call there must be a hit: no file created or modified, its time near a warm
run's. ``relocate`` then trims the thinned root's manifests, after which every Triton hits them too.

Usage (GPU machine): python bench/gpu_thinned_cache.py --out bench/results/gpu_thinned_cache.json
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from gpu_fleet_smoke import first_call, machine, report, workspace  # noqa: E402

KEPT = (".json", ".cubin", ".hsaco")  # what Triton loads a kernel from, and TRITON_STORE_BINARY_ONLY keeps


def thin(root: str) -> int:
    """Remove every group's IR files; returns how many were removed."""
    removed = 0
    for key in os.listdir(root):
        key_dir = os.path.join(root, key)
        if not os.path.isdir(key_dir) or not any(n.startswith("__grp__") for n in os.listdir(key_dir)):
            continue
        for name in os.listdir(key_dir):
            if not name.endswith(KEPT):
                os.unlink(os.path.join(key_dir, name))
                removed += 1
    return removed


def tritonpack(*args: str) -> dict:
    """``tritonpack ARGS --json``: its exit status, its result and what it said."""
    done = subprocess.run([sys.executable, "-m", "tritonpack", *args, "--json"], capture_output=True, text=True)
    return {"exit": done.returncode, "result": json.loads(done.stdout) if done.stdout.strip() else None,
            "stderr": done.stderr.strip().splitlines()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.path.join(HERE, "results", "gpu_thinned_cache.json"))
    args = parser.parse_args()
    work, home = workspace("tp-thinned-")
    build, deploy = os.path.join(work, "build", "cache"), os.path.join(work, "deploy", "cache")
    archive = os.path.join(work, "kernels.tpack")
    doc = machine()
    try:
        doc["cold"] = first_call(None, build, home)
        doc["ir_files_removed"] = thin(build)
        doc["first_call_in_thinned_root"] = first_call(None, build, home)
        packed = tritonpack("pack", build, "-o", archive)
        result = packed["result"] or {}
        doc["pack"] = {"exit": packed["exit"], "entries": result.get("entries"),
                       "thinned": len(result.get("thinned", [])), "skipped": result.get("skipped"),
                       "stderr": packed["stderr"]}
        unpacked = tritonpack("unpack", archive, "--cache-dir", deploy)
        doc["unpack"] = {"exit": unpacked["exit"], "written": (unpacked["result"] or {}).get("written")}
        doc["first_call_after_unpack"] = first_call(None, deploy, home)
        doc["verify_thinned_root"] = tritonpack("verify", build)["result"]
        relocated = tritonpack("relocate", build)["result"] or {}
        doc["relocate"] = {"fixed": len(relocated.get("fixed", [])), "trimmed": len(relocated.get("trimmed", []))}
        doc["first_call_after_relocate"] = first_call(None, build, home)
    finally:
        report(doc, args.out)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
