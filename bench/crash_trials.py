"""kill -9 the unpacker at random points, then check what Triton would see and that a re-run completes.

A many-kernel archive is made from real compiled kernels (tests/kernels.py), each group copied under more valid
cache keys so that an unpack writes hundreds of files. Each trial starts ``python -m tritonpack unpack`` in its
own process and SIGKILLs it at a random point: in 20% of the trials a random time from its start; in 40% a random
time after its run lock appears (staging); in 40% a random time after the first entry's manifest changes (commit;
entries commit in archive order). The windows come from a timed run. Then:

1. every manifest in the root resolves through Triton's own ``FileCacheManager(key).get_group(name)`` (with
   TRITON_CACHE_DIR set to the root), or is absent, or hidden (a replace lists no file in it meanwhile); and
   every visible group holds exactly the archive's files, or exactly the user's own (the ``overwrite`` scenario
   starts from a root whose groups differ in 3 files);
2. a re-run (the CLI's entry point, in the runner's process) exits 0, leaves no temp file or run lock anywhere,
   and every group is then present and resolves.

Scenarios rotate: ``fresh`` (empty root), ``resume`` (the previous trial's killed fresh root, not re-run: the
leftovers of a killed run meet a new run, killed too), ``overwrite`` (every group differs, --overwrite),
``partial`` (half the groups present). Where the kill landed is classified from the root: before any write,
staging (temp files, nothing visible changed), committing (some entries made visible, temp files left), after its
last write (exiting), or after the process had finished. (tests/test_faults.py kills a forked unpack before each
single rename, deterministically.)

Usage: python bench/crash_trials.py --trials 60 [--copies 24] [--out bench/results/crash_trials.json]
(tests/test_crash_concurrency.py runs 10 trials in CI; 10 more, up to 30, while fewer than 3 kills land mid-run.)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from conftest import cache_key  # noqa: E402
from invariants import expected_groups, group_problems, manifests, sha, temp_files, tree, triton_resolves  # noqa: E402

import tritonpack  # noqa: E402


def build_archive(work: str, copies: int, source: str | None = None, block_size: int = 16384) -> str:
    """Compile the test kernels (or copy ``source``, a root they were compiled into), copy each group under
    ``copies`` keys, pack in blocks of ``block_size`` bytes (small: many blocks, so that the unpack forks its
    worker processes as it does for a real cache of 32 MiB blocks). Returns the archive path."""
    from kernels import compile_all

    from tritonpack.archive.writer import write_archive
    from tritonpack.cacheroot import scan_cache

    root = os.path.join(work, "build")
    if source is None:
        compile_all(root)
    else:
        shutil.copytree(source, root)
    originals = [os.path.dirname(os.path.join(root, m)) for m in manifests(root)]
    for directory in originals:
        for j in range(copies - 1):
            shutil.copytree(directory, os.path.join(root, cache_key(f"{os.path.basename(directory)}-{j}")))
    tritonpack.relocate(root)  # the copies' manifests point into their own directories
    archive = os.path.join(work, "many.tpack")
    tritonpack.pack(root, archive)
    with tritonpack.open(archive) as reader:
        info = reader.info
    write_archive(archive, scan_cache(root).entries, info, block_size=block_size)
    shutil.rmtree(root)
    return archive


def unpack_cmd(archive: str, root: str, overwrite: bool) -> list[str]:
    return [sys.executable, "-m", "tritonpack", "unpack", archive, "--cache-dir", root, "-q",
            *(["--overwrite"] if overwrite else [])]


def _stat(path: str):
    try:
        st = os.stat(path)
        return (st.st_ino, st.st_mtime_ns)
    except FileNotFoundError:
        return None


def time_run(cmd: list[str], root: str, env: dict, marker: str) -> tuple[float, float, float]:
    """Seconds until the run's lock appears under ``root`` (staging starts), until the manifest ``marker`` (that
    of the first entry, committed first) changes (commit starts), and until the run exits."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env)
    first = commit = None
    initial = _stat(marker)
    while proc.poll() is None:
        if first is None and os.path.isdir(root) and any(n.endswith(".lock") for n in os.listdir(root)):
            first = time.perf_counter() - start
        if commit is None and _stat(marker) != initial:
            commit = time.perf_counter() - start
        time.sleep(0.0005)
    full = time.perf_counter() - start
    if proc.returncode:
        raise RuntimeError(f"unpack failed: {proc.returncode}")
    return (first if first is not None else 0.5 * full), (commit if commit is not None else 0.9 * full), full


def wait_for_change(proc: subprocess.Popen, marker: str) -> float:
    """Poll until the manifest ``marker`` changes (appears, disappears, is replaced): the commit has begun."""
    start = time.perf_counter()
    initial = _stat(marker)
    while proc.poll() is None and _stat(marker) == initial:
        time.sleep(0.0002)
    return time.perf_counter() - start


def wait_for_lock(proc: subprocess.Popen, root: str) -> float:
    """Poll until ``proc`` has taken its run lock under ``root`` (it is about to write); seconds since start."""
    start = time.perf_counter()
    prefix = f"tmp.tpack.{proc.pid}."
    while proc.poll() is None:
        if os.path.isdir(root) and any(n.startswith(prefix) for n in os.listdir(root)):
            break
        time.sleep(0.0005)
    return time.perf_counter() - start


def rerun(archive: str, root: str, overwrite: bool, env: dict) -> tuple[int, str]:
    """The re-run, in this process (the CLI's own entry point; it is not killed, so no new interpreter)."""
    import contextlib
    import io

    from tritonpack.cli import main as cli_main

    err = io.StringIO()
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = env["XDG_CACHE_HOME"]
    try:
        with contextlib.redirect_stderr(err):
            code = cli_main(unpack_cmd(archive, root, overwrite)[3:])
    finally:
        if old is None:
            os.environ.pop("XDG_CACHE_HOME", None)
        else:
            os.environ["XDG_CACHE_HOME"] = old
    return code, err.getvalue()


def snapshot_groups(root: str) -> dict:
    out = {}
    for rel in manifests(root):
        key, manifest = os.path.split(rel)
        with open(os.path.join(root, rel), "rb") as f:
            children = json.loads(f.read())["child_paths"]
        out[(key, manifest[7:-5])] = {c: sha(p) for c, p in children.items()}
    return out


def make_user_root(archive: str, root: str, fraction: float, differ: bool, rng: random.Random) -> None:
    tritonpack.unpack(archive, root, force=True)
    groups = sorted(expected_groups(archive))
    for key, name in groups:
        if rng.random() >= fraction:
            shutil.rmtree(os.path.join(root, key))
        elif differ:  # the user's own build of the kernel: three of its files differ from the archive's
            for suffix in (".json", ".ttir", ".llir"):
                with open(os.path.join(root, key, name + suffix), "ab") as f:
                    f.write(b" ")


def check_visible(root: str, allowed: dict) -> list[str]:
    problems = group_problems(root, allowed)
    for rel in manifests(root):
        key, manifest = os.path.split(rel)
        if triton_resolves(root, key, manifest[7:-5]) is False:
            problems.append(f"{rel}: Triton's get_group does not resolve it")
    return problems


def classify(root: str, before: set, before_groups: dict) -> str:
    """Where a kill landed, from what it left: nothing, temp files only (staging), or visible changes."""
    if snapshot_groups(root) != before_groups:
        return "committing" if temp_files(root) else "after-writes"
    if not os.path.isdir(root) or tree(root) == before:
        return "before-writes"
    return "staging"


def run_trials(trials: int, copies: int, work: str, seed: int = 0, log=print, source: str | None = None) -> dict:
    rng = random.Random(seed)
    env = dict(os.environ, XDG_CACHE_HOME=os.path.join(work, "xdg"), PYTHONDONTWRITEBYTECODE="1")
    archive = build_archive(work, copies, source)
    expected = expected_groups(archive)
    log(f"archive: {len(expected)} groups, {sum(len(v) for v in expected.values())} files, "
        f"{os.path.getsize(archive)} bytes")
    # a full run, timed, with the moment its first write appears (the first run fills the fingerprint cache)
    subprocess.run(unpack_cmd(archive, os.path.join(work, "warm"), False), check=True, env=env)
    shutil.rmtree(os.path.join(work, "warm"))
    first_key, first_name = sorted(expected)[0]
    timing = os.path.join(work, "timing")
    runs = []
    for _ in range(3):  # medians: one slow run must not skew where the kills land
        runs.append(time_run(unpack_cmd(archive, timing, False), timing, env,
                             os.path.join(timing, first_key, f"__grp__{first_name}.json")))
        shutil.rmtree(timing)
    first, commit, full = (sorted(column)[1] for column in zip(*runs, strict=True))
    log(f"full unpack: {full:.2f} s, staging from {first:.2f} s, commit from {commit:.2f} s")
    results = []
    root = os.path.join(work, "root")
    scenarios = ["fresh", "resume", "overwrite", "partial"]
    for trial in range(trials):
        scenario = scenarios[trial % len(scenarios)]
        overwrite = scenario == "overwrite"
        user_groups: dict = {}
        if scenario != "resume" or not os.path.isdir(root):
            shutil.rmtree(root, ignore_errors=True)
            if scenario in ("overwrite", "partial"):
                make_user_root(archive, root, 1.0 if overwrite else 0.5, overwrite, rng)
                user_groups = snapshot_groups(root)
        allowed = {k: [v] + ([user_groups[k]] if k in user_groups else []) for k, v in expected.items()}
        before, before_groups = tree(root) if os.path.isdir(root) else set(), snapshot_groups(root)
        started = time.perf_counter()
        proc = subprocess.Popen(unpack_cmd(archive, root, overwrite), env=env, stderr=subprocess.PIPE)
        aim = rng.random()
        if aim < 0.2:  # anywhere in the run, start-up and planning included
            delay = rng.uniform(0, full)
            time.sleep(delay)
        elif aim < 0.6:  # while it stages: a random time after its run lock appears (start-up time varies)
            delay = wait_for_lock(proc, root) + rng.uniform(0, 1.1 * (commit - first))
            time.sleep(max(0.0, delay - (time.perf_counter() - started)))
        else:  # while it commits: a random time after the first entry's manifest changes
            marker = os.path.join(root, first_key, f"__grp__{first_name}.json")
            delay = wait_for_change(proc, marker) + rng.uniform(0, 1.1 * (full - commit))
            time.sleep(max(0.0, delay - (time.perf_counter() - started)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed = proc.returncode == -signal.SIGKILL
        phase = classify(root, before, before_groups) if killed else "after-exit"
        leftovers = len(temp_files(root))
        problems = check_visible(root, allowed)
        if scenario != "fresh" or trial + 1 == trials:  # a killed fresh root is what the next trial resumes
            code, err = rerun(archive, root, overwrite, env)
            if code != 0:
                problems.append(f"re-run exit {code}: {err.strip()}")
            left = temp_files(root)
            if left:
                problems.append(f"temp files after the re-run: {left[:3]}")
            final_allowed = {k: [v] if overwrite or k not in user_groups else [user_groups[k]]
                             for k, v in expected.items()}
            problems += check_visible(root, final_allowed)
            missing = set(expected) - set(snapshot_groups(root))
            if missing:
                problems.append(f"{len(missing)} groups missing after the re-run")
            completed = True
        else:
            completed = False  # the next trial (a resume) starts from this killed root
        results.append({"trial": trial, "scenario": scenario, "delay_s": round(delay, 3), "killed": killed,
                        "phase": phase, "leftovers_after_kill": leftovers, "rerun": completed,
                        "problems": problems})
        log(f"trial {trial:3d} {scenario:9s} kill at {delay:5.2f} s: {phase:13s} leftovers {leftovers:4d}"
            f"{'' if completed else ' (kept for the next trial)'}  {problems or 'OK'}")
    phases: dict[str, int] = {}
    for r in results:
        phases[r["phase"]] = phases.get(r["phase"], 0) + 1
    return {
        "trials": trials,
        "groups": len(expected),
        "files": sum(len(v) for v in expected.values()),
        "archive_bytes": os.path.getsize(archive),
        "full_unpack_s": round(full, 3),
        "killed_mid_run": sum(r["killed"] for r in results),
        "phases": phases,
        "leftovers_cleaned": sum(r["leftovers_after_kill"] for r in results if r["rerun"]),
        "reruns": sum(r["rerun"] for r in results),
        "violations": sum(bool(r["problems"]) for r in results),
        "results": results,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--copies", type=int, default=24, help="keys per compiled group (more files per unpack)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=None, help="work directory (default: a temp dir)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="tpack-crash-", dir=args.dir)
    start = time.time()
    try:
        summary = run_trials(args.trials, args.copies, work, args.seed)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    import triton

    summary.update(seconds=round(time.time() - start, 1), triton=triton.__version__, python=platform.python_version(),
                   cpus=os.cpu_count())
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)
    sys.exit(1 if summary["violations"] else 0)


if __name__ == "__main__":
    main()
