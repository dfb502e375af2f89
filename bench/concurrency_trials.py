"""8 unpackers of one archive and 2 Triton compiles of the same kernels into one root at once, repeated.

Each run: a fresh root; two processes import Triton and wait at a barrier; when both are ready, they start
``compile_all`` (tests/kernels.py), and 8 ``python -m tritonpack unpack`` processes start after a random head start
of the compiles (0-3 s) and staggered by up to ``--stagger`` seconds, so that they meet the compiles at different
points: before Triton wrote anything, amid its writes, after its manifests. Afterwards: every process exited 0
with no error line, every group of the archive resolves through Triton's ``FileCacheManager.get_group`` and holds
exactly the archive's files, no temp file or run lock is left, and a further ``compile_all`` is all cache hits
(Triton's listener, 3.4+) and writes nothing.

Usage: python bench/concurrency_trials.py --runs 20 [--out bench/results/concurrency_trials.json]
(tests/test_crash_concurrency.py runs one in CI.)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.join(HERE, "..", "tests")
sys.path.insert(0, TESTS)

from conftest import snapshot  # noqa: E402
from invariants import expected_groups, group_problems, manifests, temp_files, triton_resolves  # noqa: E402
from kernels import HAS_LISTENER, compile_all  # noqa: E402

import tritonpack  # noqa: E402
from tritonpack.archive.writer import write_archive  # noqa: E402
from tritonpack.cacheroot import scan_cache  # noqa: E402


def one_run(archive: str, work: str, rng: random.Random, stagger: float, env: dict) -> dict:
    root = os.path.join(work, "shared")
    go = os.path.join(work, "go")
    compilers = [subprocess.Popen([sys.executable, "-c", (
        f"import json, os, sys, time; sys.path.insert(0, {TESTS!r}); import kernels\n"
        f"open({os.path.join(work, f'ready{i}')!r}, 'w').close()\n"
        f"while not os.path.exists({go!r}): time.sleep(0.005)\n"
        f"print(json.dumps(kernels.compile_all({root!r})))")], env=dict(env, TRITON_CACHE_DIR=root),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    while not all(os.path.exists(os.path.join(work, f"ready{i}")) for i in range(2)):
        time.sleep(0.005)
    open(go, "w").close()
    start = time.perf_counter()
    unpackers = []
    head = rng.uniform(0, 3.0)  # the compiles' head start: from none to most kernels compiled by Triton first
    for delay in sorted(head + rng.uniform(0, stagger) for _ in range(8)):
        time.sleep(max(0.0, delay - (time.perf_counter() - start)))
        unpackers.append(subprocess.Popen([sys.executable, "-m", "tritonpack", "unpack", archive, "--cache-dir",
                                           root, "-q"], env=env, stderr=subprocess.PIPE, text=True))
    problems = []
    compiled = []  # per compile of the two processes: True = hit (an unpacked group), False = Triton compiled it
    for proc in unpackers + compilers:
        out, err = proc.communicate(timeout=600)
        if proc.returncode != 0 or "error" in err.lower():
            problems.append(f"exit {proc.returncode}: {err.strip()[-300:]}")
        if proc in compilers and out.strip():
            compiled += json.loads(out.strip().splitlines()[-1])
    wall = time.perf_counter() - start
    expected = expected_groups(archive)
    problems += group_problems(root, {k: [v] for k, v in expected.items()})
    present = {(os.path.dirname(m), os.path.basename(m)[7:-5]) for m in manifests(root)}
    if present != set(expected):
        problems.append(f"groups: {len(present)} present, {len(expected)} expected")
    unresolved = [k for k in expected if not triton_resolves(root, *k)]
    if unresolved:
        problems.append(f"{len(unresolved)} groups do not resolve through Triton")
    if temp_files(root):
        problems.append(f"temp files left: {temp_files(root)[:3]}")
    before = snapshot(root)
    hits = compile_all(root)
    all_hits = all(hits) if HAS_LISTENER else None
    if all_hits is False:
        problems.append(f"compile after the run missed: {hits}")
    if snapshot(root) != before:
        problems.append("compile after the run wrote files")
    shutil.rmtree(root)
    for name in ("go", "ready0", "ready1"):
        os.unlink(os.path.join(work, name))
    return {"wall_s": round(wall, 2), "head_start_s": round(head, 2), "concurrent_compiles_hit": compiled.count(True),
            "concurrent_compiles_missed": compiled.count(False), "all_hits_after": all_hits, "problems": problems}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--stagger", type=float, default=2.0, help="unpackers start within this many seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    work = tempfile.mkdtemp(prefix="tpack-concurrency-")
    env = dict(os.environ, XDG_CACHE_HOME=os.path.join(work, "xdg"))
    os.environ["XDG_CACHE_HOME"] = env["XDG_CACHE_HOME"]
    start = time.time()
    try:
        build = os.path.join(work, "build")
        compile_all(build)
        archive = os.path.join(work, "k.tpack")
        tritonpack.pack(build, archive)
        with tritonpack.open(archive) as reader:  # again in 16 KiB blocks: several, so unpack forks its workers
            info = reader.info
        write_archive(archive, scan_cache(build).entries, info, block_size=16384)
        tritonpack.check(archive)  # fingerprint cached before the unpackers start
        results = []
        for n in range(args.runs):
            r = one_run(archive, work, rng, args.stagger, env)
            results.append(r)
            print(f"run {n:3d}: {r['wall_s']:5.2f} s, head start {r['head_start_s']:4.2f} s, concurrent compiles: "
                  f"{r['concurrent_compiles_missed']} compiled, "
                  f"{r['concurrent_compiles_hit']} hit unpacked groups; after: all hits {r['all_hits_after']}  "
                  f"{r['problems'] or 'OK'}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    import triton

    summary = {"runs": args.runs, "unpackers": 8, "compilers": 2, "stagger_s": args.stagger,
               "failed_runs": sum(bool(r["problems"]) for r in results),
               "concurrent_compiles_missed": sum(r["concurrent_compiles_missed"] for r in results),
               "concurrent_compiles_hit": sum(r["concurrent_compiles_hit"] for r in results),
               "seconds": round(time.time() - start, 1), "triton": triton.__version__,
               "python": platform.python_version(), "cpus": os.cpu_count(), "results": results}
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    sys.exit(1 if summary["failed_runs"] else 0)


if __name__ == "__main__":
    main()
