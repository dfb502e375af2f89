"""Would blocks of one target make a partial unpack proportional? A multi-target cache packed three ways, each
archive unpacked in full and one target at a time, rounds interleaved, medians reported:

- ``default``: the writer's layout (spec §6 rule 3: a type's files by size, then target, so that a kernel's builds
  for several targets lie side by side and every block holds every target);
- ``backend``: the same order within each backend (``cuda``, ``hip``), the blocks cut where the backend changes;
- ``target``: the same order within each target, the blocks cut where the target changes, so that a partial
  unpack decodes only its target's blocks (and those holding blobs its entries share with the others).

The two others are made by this script (the writer's order, stably sorted by the unit's backend or target, then
planned a run at a time); they are valid archives that any reader unpacks. A block's content is the same bytes
whatever the layout; only what compresses next to what changes, and which blocks a target needs.

Usage: python bench/target_split_probe.py CACHE_DIR_OR_ARCHIVE [--rounds 5] [--out OUT.json] [--work DIR]
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from array import array

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from perf import run

LAYOUTS = ("default", "backend", "target")


def _key_of(layout: str):
    def key(entry) -> str:
        target = entry.kernel.target if entry.kernel else ""
        return target.split(":")[0] if layout == "backend" else target
    return key


def pack_with_layout(layout: str, root: str, out: str) -> None:
    """Pack ``root`` into ``out`` with the writer's order regrouped by ``layout`` (in this process)."""
    from tritonpack.archive import writer
    from tritonpack.cli import main

    if layout != "default":
        key = _key_of(layout)
        order, plan = writer._layout_order, writer._plan

        def unit_key(entries):
            return lambda unit: key(entries[writer._unit_numbers(unit)[0]])

        def layout_order(entries, block_size=0):
            return array("Q", sorted(order(entries, block_size), key=unit_key(entries)))  # stable: type order kept

        def plan_by_run(entries, units, block_size):
            for _, run in itertools.groupby(units, unit_key(entries)):
                yield from plan(entries, array("Q", run), block_size)

        writer._layout_order, writer._plan = layout_order, plan_by_run
    sys.argv = ["tritonpack", "pack", root, "-o", out, "-q"]
    main()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("cache")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--work", default=None)
    args = parser.parse_args()
    tp = [sys.executable, "-c", "from tritonpack.entry import run; run()"]
    subprocess.run([sys.executable, "-c", "import compileall, os, tritonpack; "
                    "compileall.compile_dir(os.path.dirname(tritonpack.__file__), quiet=1)"], check=True)
    work = tempfile.mkdtemp(prefix="tp-split-", dir=args.work)
    try:
        cache = os.path.abspath(args.cache)
        if os.path.isfile(cache):
            source, cache = cache, os.path.join(work, "cache")
            subprocess.run([*tp, "unpack", source, "--cache-dir", cache, "--force", "-q"], check=True)
        archives = {layout: os.path.join(work, f"{layout}.tpack") for layout in LAYOUTS}
        for layout, path in archives.items():
            subprocess.run([sys.executable, __file__, "--pack-layout", layout, cache, path], check=True)
        listing = json.loads(subprocess.run([*tp, "list", archives["default"], "--json"], check=True,
                                            capture_output=True, text=True).stdout)
        targets = sorted({e["target"] for e in listing["entries"] if e.get("target")})
        cases = [(layout, target) for layout in LAYOUTS for target in ("all", *targets)]
        times: dict[tuple[str, str], list[float]] = {case: [] for case in cases}
        out_dir = os.path.join(work, "out")
        for _ in range(args.rounds):
            for layout, target in cases:
                shutil.rmtree(out_dir, ignore_errors=True)
                arch = [] if target == "all" else ["--arch", target]
                times[layout, target].append(
                    run([*tp, "unpack", archives[layout], "--cache-dir", out_dir, "--force", "-q", *arch])[0])
        report = {"cores": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)), "rounds": args.rounds,
                  "layouts": {}}
        base = os.path.getsize(archives["default"])
        for layout in LAYOUTS:
            full = statistics.median(times[layout, "all"])
            size = os.path.getsize(archives[layout])
            report["layouts"][layout] = {
                "bytes": size, "bytes / default": round(size / base, 4), "full unpack s": round(full, 3),
                "one target / full": {t: round(statistics.median(times[layout, t]) / full, 3) for t in targets},
                "seconds": {t: [round(s, 3) for s in times[layout, t]] for t in ("all", *targets)}}
        print(json.dumps(report, indent=1))
        if args.out:
            with open(args.out, "w") as f:
                json.dump(report, f, indent=1)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--pack-layout":
        pack_with_layout(*sys.argv[2:])
    else:
        main()
