"""tritonpack against tar/zstd/cp on one cache, side by side in one run: size, time, peak memory, partial unpack.

Every command runs as its own process, several rounds interleaved (machine noise hits all alike); medians are
reported, with ratios to the baselines the performance goals name. Seven rounds by default: on the shared 2-core
machine, single runs of a 0.22 s ``list`` had a standard deviation of 34-41 ms (hyperfine), too much for a median
of three. Peak RSS is the child's max RSS (wait4): of its largest process. Unpack forks worker processes, so
tritonpack's pack and unpack also run once more, untimed, while the memory of their whole process tree is sampled
every 2 ms (/proc/PID/smaps_rollup): the peak of its summed PSS (shared pages counted once) is the memory goal's
figure; the summed RSS (shared pages counted in each process) is reported beside it.
Usage: python bench/perf.py CACHE_DIR_OR_ARCHIVE [--rounds 7] [--out bench/results/perf.json]
  A real cache ships as an archive: fixtures/torch-max-autotune-h200-triton36.tpack (torch.compile max-autotune
  of a 4-block transformer on an H200, bench/make_torch_cache.py) is unpacked first and measured as a cache.
  A synthetic multi-target one: python bench/make_large_cache.py /tmp/large --kernels 1200
Every round also packs with ``--splice-ptx`` (cubins without the PTX text they embed, format 1.1) and unpacks that
archive in full: its goals are reported beside the default's ("splice-ptx: ...").
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

HERE = os.path.dirname(os.path.abspath(__file__))


def run(cmd: str | list[str], shell: bool = False, ok: tuple[int, ...] = (0,)) -> tuple[float, int]:
    """Wall seconds and peak RSS (bytes) of one process (for a shell pipeline: of its largest member)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, shell=shell, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) not in ok:
        raise SystemExit(f"failed: {cmd}\n{proc.stderr.read().decode()}")
    return wall, usage.ru_maxrss * 1024


def _tree(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    children.setdefault(int(f.read().rsplit(")", 1)[1].split()[1]), []).append(int(name))
            except OSError:
                continue
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def _pss_rss(pid: int) -> tuple[int, int]:
    pss = rss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1]) * 1024
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1]) * 1024
    except OSError:
        pass
    return pss, rss


def tree_memory(cmd: list[str]) -> dict[str, float]:
    """Peak summed PSS and summed RSS (MB) of a command's process tree, and its most processes at once."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    pss = rss = most = 0
    while proc.poll() is None:
        pids = _tree(proc.pid)
        samples = [_pss_rss(pid) for pid in pids]
        pss, rss = max(pss, sum(p for p, _ in samples)), max(rss, sum(r for _, r in samples))
        most = max(most, len(pids))
        time.sleep(0.002)
    if proc.returncode:
        raise SystemExit(f"failed: {cmd}\n{proc.stderr.read().decode()}")
    return {"peak_tree_pss_mb": round(pss / 2**20, 1), "peak_tree_rss_mb": round(rss / 2**20, 1),
            "processes": most}


def zstd(level: int) -> str:
    """The zstd CLI on all cores; where it is missing (the GPU machine), libzstd through python-zstandard."""
    if shutil.which("zstd"):
        return f"zstd -q -{level} -T0 -c"
    return (f"{sys.executable} -c 'import sys, zstandard; zstandard.ZstdCompressor(level={level}, threads=-1)"
            ".copy_stream(sys.stdin.buffer, sys.stdout.buffer)'")


def unzstd(path: str) -> str:
    if shutil.which("zstd"):
        return f"zstd -q -d -c {path}"
    return (f"{sys.executable} -c 'import sys, zstandard; zstandard.ZstdDecompressor()"
            f".copy_stream(open(\"{path}\", \"rb\"), sys.stdout.buffer)'")


def dir_stats(path: str) -> tuple[int, int]:
    files = size = 0
    for d, _, names in os.walk(path):
        for n in names:
            files += 1
            size += os.path.getsize(os.path.join(d, n))
    return files, size


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cache")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "perf.json"))
    parser.add_argument("--work", default=None, help="where archives and outputs go (default: the temp dir); "
                        "/dev/shm takes the disk's noise out and leaves the CPU's cost")
    args = parser.parse_args()
    work = tempfile.mkdtemp(prefix="tp-perf-", dir=args.work)
    try:
        measure(args, work)
    finally:  # the unpacked cache, archives and outputs go whatever failed
        shutil.rmtree(work, ignore_errors=True)


def measure(args, work: str) -> None:
    # What the console script runs (no runpy, unlike -m): also where the package is on PYTHONPATH, not installed.
    tp = [sys.executable, "-c", "from tritonpack.entry import run; run()"]
    # Bytecode for the package the commands import, as pip writes at install: where PYTHONDONTWRITEBYTECODE is
    # set (this VM), a source tree would otherwise be compiled again by every command (35 ms a start here).
    subprocess.run([sys.executable, "-c", "import compileall, os, tritonpack; "
                    "compileall.compile_dir(os.path.dirname(tritonpack.__file__), quiet=1)"], check=True)
    cache = os.path.abspath(args.cache)
    if os.path.isfile(cache):  # an archive of a real cache: its files, as a cache root to measure
        source, cache = cache, os.path.join(work, "cache")
        subprocess.run([*tp, "unpack", source, "--cache-dir", cache, "--force", "-q"], check=True)
    sys.path.insert(0, os.path.dirname(HERE))
    from tritonpack.cacheroot import scan_cache

    scanned = scan_cache(cache).entries
    targets = sorted({e.kernel.target for e in scanned if e.kernel})
    one_arch = targets[0] if len(targets) > 1 else None  # partial unpack: one target of several (the goal's row)
    partial = targets if one_arch else []  # and each of them, beside its share of the cache's files and bytes
    of_target = {t: [e for e in scanned if e.kernel and e.kernel.target == t] for t in partial}
    shares = {t: (sum(len(e.files) for e in of) / sum(len(e.files) for e in scanned),
                  sum(e.size for e in of) / sum(e.size for e in scanned)) for t, of in of_target.items()}
    paths = {name: os.path.join(work, name) for name in ("zst19", "zst3", "tpack", "spliced", "out")}
    paths["zst19"] += ".tar.zst"
    paths["zst3"] += ".tar.zst"
    paths["tpack"] += ".tpack"
    paths["spliced"] += ".tpack"
    counter = iter(range(10**6))
    out = paths["out"]

    def fresh_out():
        """A new empty directory each time: deleting the last output right before a timed run would make that
        run pay for the deletion (ext4 journals and discards it in the background)."""
        nonlocal out
        out = os.path.join(work, f"out-{next(counter)}")
        os.makedirs(out)

    def unpack(*extra, archive="tpack"):
        return lambda: [*tp, "unpack", paths[archive], "--cache-dir", out, "-q", "--force", *extra]

    cases = {
        "tar | zstd -19 -T0": (f"tar -C {cache} -cf - . | {zstd(19)} > {paths['zst19']}", None),
        "tar | zstd -3 -T0": (f"tar -C {cache} -cf - . | {zstd(3)} > {paths['zst3']}", None),
        "tritonpack pack": ([*tp, "pack", cache, "-o", paths["tpack"], "-q"], None),
        "tar -x (.tar.zst -19)": (lambda: f"{unzstd(paths['zst19'])} | tar -C {out} -xf -", fresh_out),
        "cp -r": (lambda: ["cp", "-r", cache, os.path.join(out, "copy")], fresh_out),
        "tritonpack unpack": (unpack(), fresh_out),
        **{f"tritonpack unpack --arch {t}": (unpack("--arch", t), fresh_out) for t in partial},
        "tritonpack unpack --binary-only": (unpack("--binary-only"), fresh_out),
        "tritonpack list": ([*tp, "list", paths["tpack"]], None),
        "tritonpack list --json": ([*tp, "list", paths["tpack"], "--json"], None),
        "tritonpack check": ([*tp, "check", paths["tpack"], "--target", targets[0] if targets else "cuda:90"], None),
        "tritonpack pack --splice-ptx": ([*tp, "pack", cache, "-o", paths["spliced"], "-q", "--splice-ptx"], None),
        "tritonpack unpack (--splice-ptx archive)": (unpack(archive="spliced"), fresh_out),
    }
    samples: dict[str, list[tuple[float, int]]] = {}
    # Untimed: the first pack on a machine fingerprints the local Triton for these targets (it imports Triton,
    # once; bench/unpack_overhead.py measures that cold case). Every timed run then finds it cached.
    subprocess.run([*tp, "pack", cache, "-o", paths["tpack"], "-q"], check=True)
    for round_number in range(args.rounds):
        for name, (cmd, before) in cases.items():
            if name == "tar | zstd -19 -T0" and round_number:  # minutes, and only its size is a goal
                continue
            if before:
                before()
            if callable(cmd):  # built after ``before`` chose the output directory
                cmd = cmd()
            ok = (0, 5, 6) if name == "tritonpack check" else (0,)  # 6: some entries are for other targets
            samples.setdefault(name, []).append(run(cmd, shell=isinstance(cmd, str), ok=ok))
    memory = {}
    if os.path.exists("/proc/self/smaps_rollup"):
        memory["tritonpack pack"] = tree_memory([*tp, "pack", cache, "-o", paths["tpack"], "-q"])
        fresh_out()
        memory["tritonpack unpack"] = tree_memory(unpack()())
        memory["tritonpack pack --splice-ptx"] = tree_memory([*tp, "pack", cache, "-o", paths["spliced"],
                                                              "-q", "--splice-ptx"])
        fresh_out()
        memory["tritonpack unpack (--splice-ptx archive)"] = tree_memory(unpack(archive="spliced")())
    files, size = dir_stats(cache)
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = f"{usable} cores" if usable == os.cpu_count() else f"{usable} cores (of {os.cpu_count()}: affinity)"
    result = {"machine": f"{platform.machine()}, {cores}", "python": platform.python_version(),
              "source": args.cache, "targets": targets, "work": os.path.dirname(work),
              "zstd": "cli" if shutil.which("zstd") else "python-zstandard (no zstd CLI)",
              "cache": {"files": files, "bytes": size,
                        "kernels": sum(1 for d, _, ns in os.walk(cache) for n in ns if n.startswith("__grp__"))},
              "rounds": args.rounds, "cases": {}}
    for name, runs in samples.items():
        result["cases"][name] = {"seconds": round(statistics.median(r[0] for r in runs), 3),
                                 "peak_rss_mb": round(max(r[1] for r in runs) / 2**20, 1)}
    sizes = {"tar | zstd -19 -T0": os.path.getsize(paths["zst19"]),
             "tar | zstd -3 -T0": os.path.getsize(paths["zst3"]),
             "tritonpack pack": os.path.getsize(paths["tpack"]),
             "tritonpack pack --splice-ptx": os.path.getsize(paths["spliced"])}
    for name, tree in memory.items():
        result["cases"][name].update(tree)
    for name, n in sizes.items():
        result["cases"][name]["bytes"] = n
    c = result["cases"]
    full = c["tritonpack unpack"]["seconds"]
    result["goals"] = {
        "archive bytes / tar|zstd-19 (<= 0.6)": round(sizes["tritonpack pack"] / sizes["tar | zstd -19 -T0"], 3),
        "pack time / tar|zstd-3 (<= 2.0)":
            round(c["tritonpack pack"]["seconds"] / c["tar | zstd -3 -T0"]["seconds"], 3),
        "unpack time / tar -x (<= 1.0)": round(full / c["tar -x (.tar.zst -19)"]["seconds"], 3),
        "peak RSS pack, MB (<= 256)": c["tritonpack pack"]["peak_rss_mb"],
        "peak RSS unpack, MB (<= 256)": c["tritonpack unpack"]["peak_rss_mb"],
        "peak memory of the pack process tree (summed PSS), MB (<= 256)":
            c["tritonpack pack"].get("peak_tree_pss_mb"),
        "peak memory of the unpack process tree (summed PSS), MB (<= 256)":
            c["tritonpack unpack"].get("peak_tree_pss_mb"),
        "list seconds (<= 0.2)": c["tritonpack list"]["seconds"],
        "check seconds (<= 0.2)": c["tritonpack check"]["seconds"],
        "one arch / full unpack (<= 0.4 for 1 of 3)":
            round(c[f"tritonpack unpack --arch {one_arch}"]["seconds"] / full, 3) if one_arch else None,
        "one arch / full unpack, each target [ratio, its share of the files, of the bytes]": {
            t: [round(c[f"tritonpack unpack --arch {t}"]["seconds"] / full, 3), round(shares[t][0], 3),
                round(shares[t][1], 3)] for t in partial} or None,
        "binary-only / full unpack": round(c["tritonpack unpack --binary-only"]["seconds"] / full, 3),
        "splice-ptx: archive bytes / tar|zstd-19 (<= 0.6)":
            round(sizes["tritonpack pack --splice-ptx"] / sizes["tar | zstd -19 -T0"], 3),
        "splice-ptx: pack time / tar|zstd-3 (<= 2.0)":
            round(c["tritonpack pack --splice-ptx"]["seconds"] / c["tar | zstd -3 -T0"]["seconds"], 3),
        "splice-ptx: unpack time / tar -x (<= 1.0)":
            round(c["tritonpack unpack (--splice-ptx archive)"]["seconds"] / c["tar -x (.tar.zst -19)"]["seconds"], 3),
        "splice-ptx: peak memory of the pack process tree (summed PSS), MB (<= 256)":
            c["tritonpack pack --splice-ptx"].get("peak_tree_pss_mb"),
        "splice-ptx: peak memory of the unpack process tree (summed PSS), MB (<= 256)":
            c["tritonpack unpack (--splice-ptx archive)"].get("peak_tree_pss_mb"),
    }
    print(f"cache: {files} files, {size / 1e6:.1f} MB, {result['cache']['kernels']} kernels")
    print(f"{'case':<42} {'seconds':>8} {'peak MB':>8} {'bytes':>12}")
    for name, v in c.items():
        print(f"{name:<42} {v['seconds']:8.3f} {v['peak_rss_mb']:8.1f} {v.get('bytes', ''):>12}")
    for goal, value in result["goals"].items():
        print(f"{goal:<45} {value}")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
