"""What `tritonpack.ensure` costs when there is nothing to do, and what many processes at once cost.

The archive holds the test kernels (3 kernels x 2-3 targets, compiled on the CPU). Figures:
  in process   the first call (unpacks; warm fingerprint) and the median of repeat calls (stamp found)
  processes    medians of separate processes, interleaved: `python -c pass`, `import tritonpack`, a repeat
               `ensure` (import included), and `tritonpack unpack` of the same archive into the same, complete root
  racing       N processes started together on a fresh root (one unpacks, the others wait) and on a done root
Usage: python bench/ensure_overhead.py [--runs 9] [--racers 6] [--out bench/results/ensure_overhead.json]
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
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION is unset")


def timed(argv: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def race(n: int, archive: str, root: str, env: dict) -> dict:
    """Wall time from the gate opening to the last process done; how many unpacked, waited, found the stamp."""
    gate = os.path.join(os.path.dirname(root), "gate")
    os.makedirs(os.path.dirname(root), exist_ok=True)
    code = ("import json, os, sys, time, tritonpack\n"
            "open(sys.argv[3] + '.ready.' + str(os.getpid()), 'w').close()\n"
            "while not os.path.exists(sys.argv[3]): time.sleep(0.0005)\n"
            "r = tritonpack.ensure(sys.argv[1], sys.argv[2])\n"
            "print(json.dumps({'status': r.status, 'waited': r.waited, 'ms': r.seconds * 1000}))\n")
    for stale in [gate] + [os.path.join(os.path.dirname(root), f) for f in os.listdir(os.path.dirname(root))
                           if f.startswith("gate.ready.")]:
        if os.path.exists(stale):
            os.unlink(stale)
    procs = [subprocess.Popen([sys.executable, "-c", code, archive, root, gate], env=env, stdout=subprocess.PIPE,
                              text=True) for _ in range(n)]
    while sum(f.startswith("gate.ready.") for f in os.listdir(os.path.dirname(root))) < n:
        time.sleep(0.005)
    start = time.perf_counter()
    open(gate, "w").close()
    results = [json.loads(p.communicate()[0]) for p in procs]
    wall = time.perf_counter() - start
    return {"processes": n, "wall_s": round(wall, 4),
            "unpacked": sum(r["status"] == "unpacked" for r in results),
            "waited": sum(r["waited"] for r in results),
            "present": sum(r["status"] == "present" for r in results),
            "ensure_ms_median": round(statistics.median(r["ms"] for r in results), 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--racers", type=int, default=6)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "ensure_overhead.json"))
    args = parser.parse_args()
    import triton
    from kernels import compile_all

    import tritonpack

    work = tempfile.mkdtemp(prefix="tp-ensure-")
    env = {**os.environ, "XDG_CACHE_HOME": os.path.join(work, "xdg")}
    os.environ["XDG_CACHE_HOME"] = env["XDG_CACHE_HOME"]
    try:
        compile_all(os.path.join(work, "build"))
        archive = os.path.join(work, "kernels.tpack")
        tritonpack.pack(os.path.join(work, "build"), archive)
        tritonpack.check(archive)  # warm the fingerprint, as any machine after its first tritonpack call
        root = os.path.join(work, "root")
        first = tritonpack.ensure(archive, root)
        repeats = []
        for _ in range(200):
            start = time.perf_counter()
            tritonpack.ensure(archive, root)
            repeats.append(time.perf_counter() - start)
        doc = {
            "machine": f"{os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()}, "
                       f"Triton {triton.__version__}",
            "archive": {"entries": first.entries, "bytes": os.path.getsize(archive)},
            "in_process": {"first_call_ms": round(first.seconds * 1000, 2), "first_status": first.status,
                           "repeat_call_ms_median": round(statistics.median(repeats) * 1000, 3),
                           "repeat_call_ms_p90": round(sorted(repeats)[int(len(repeats) * 0.9)] * 1000, 3)},
        }
        cases = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "python -c 'import tritonpack'": [sys.executable, "-c", "import tritonpack"],
            "tritonpack.ensure(), done before": [sys.executable, "-c",
                                                 f"import tritonpack; tritonpack.ensure({archive!r}, {root!r})"],
            "tritonpack unpack, all present": [sys.executable, "-m", "tritonpack", "unpack", archive,
                                               "--cache-dir", root, "-q"],
        }
        samples: dict[str, list[float]] = {}
        for _ in range(args.runs):  # interleaved, so that machine noise hits every case alike
            for name, argv in cases.items():
                samples.setdefault(name, []).append(timed(argv, env))
        doc["processes"] = {name: round(statistics.median(s), 4) for name, s in samples.items()}
        doc["racing"] = {"fresh_root": race(args.racers, archive, os.path.join(work, "race", "root"), env),
                         "done_root": race(args.racers, archive, os.path.join(work, "race", "root"), env)}
        print(json.dumps(doc, indent=2))
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
