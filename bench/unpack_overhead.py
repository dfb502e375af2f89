"""Fixed overhead of unpacking a one-kernel archive, Python start-up included, cold vs warm fingerprint.

Every figure is the median wall time of separate processes, measured side by side in one run, with the
interpreter's own start-up and `import triton` (what any check that asks Triton itself must pay) as baselines.
Usage: python bench/unpack_overhead.py [--runs 9] [--out bench/results/unpack_overhead.json]
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
TRITONPACK = [sys.executable, "-c", "from tritonpack.entry import run; run()"]  # as the console script runs it
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION is unset")


def make_archive(work: str) -> str:
    import triton
    from kernels import SOURCES, cache_dir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    root = os.path.join(work, "build")
    fn, signature, constexprs = SOURCES[0]
    with cache_dir(root):
        triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=GPUTarget("cuda", 90, 32))
    archive = os.path.join(work, "one.tpack")
    subprocess.run([*TRITONPACK, "pack", root, "-o", archive, "-q"], check=True)
    return archive


def timed(argv: list[str], env: dict, before=None) -> float:
    if before:
        before()
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "unpack_overhead.json"))
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="tp-bench-")
    try:
        archive = make_archive(work)
        target = os.path.join(work, "root")
        warm_env = {**os.environ, "XDG_CACHE_HOME": os.path.join(work, "xdg")}
        cli = [*TRITONPACK, "unpack", archive, "--cache-dir", target, "-q"]
        api = [sys.executable, "-c", f"import tritonpack; tritonpack.unpack({archive!r}, {target!r})"]

        def fresh_root():
            shutil.rmtree(target, ignore_errors=True)

        def cold():
            fresh_root()
            shutil.rmtree(os.path.join(work, "xdg"), ignore_errors=True)

        timed(cli, warm_env, fresh_root)  # warm the fingerprint and the page cache
        cases = {
            "python -c pass": ([sys.executable, "-c", "pass"], None),
            "python -c 'import triton'": ([sys.executable, "-c", "import triton"], None),
            "tritonpack unpack, cold fingerprint": (cli, cold),
            "tritonpack unpack, warm fingerprint": (cli, fresh_root),
            "tritonpack.unpack() API, warm fingerprint": (api, fresh_root),
        }
        results = {}
        for _ in range(args.runs):  # interleaved, so that machine noise hits every case alike
            for name, (argv, before) in cases.items():
                results.setdefault(name, []).append(timed(argv, warm_env, before))
        medians = {name: statistics.median(times) for name, times in results.items()}
        cold_s = medians["tritonpack unpack, cold fingerprint"]
        print(f"{'case':<45} {'median s':>9} {'x cold':>7}")
        for name, value in medians.items():
            print(f"{name:<45} {value:9.3f} {value / cold_s:7.2f}")
        goal = medians["tritonpack unpack, warm fingerprint"] <= 0.3
        print(f"goal (warm CLI unpack <= 0.3 s): {'met' if goal else 'NOT met'}")
        import triton

        doc = {"machine": f"{platform.machine()} {os.cpu_count()} cores", "python": platform.python_version(),
               "triton": triton.__version__, "runs": args.runs,
               "median_s": {k: round(v, 4) for k, v in medians.items()},
               "ratio_to_cold": {k: round(v / cold_s, 3) for k, v in medians.items()}}
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=2)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
