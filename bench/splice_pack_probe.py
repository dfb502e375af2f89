"""Where ``pack --splice-ptx`` time goes: a cache root packed in-process, without splices and with them, each
with the files read (and the splices planned) in the writer's threads and by forked helpers (as the command does
with 4 cores or more), in turn; each ``splice.plan`` of this process and each ``compress_block`` call timed (wall
and thread CPU), and the whole pack.

Usage: python bench/splice_pack_probe.py CACHE_DIR OUT.json [ROUNDS]
"""
from __future__ import annotations

import contextlib
import json
import sys
import time

from tritonpack.archive import splice, writer
from tritonpack.archive.format import format_version
from tritonpack.cacheroot import scan_cache
from tritonpack.model import ArchiveInfo


def main(root: str, out: str, rounds: int) -> None:
    log: list[tuple] = []
    real_plan, real_compress = splice.plan, writer.compress_block

    def plan(*args):
        start, cpu = time.perf_counter(), time.thread_time()
        found = real_plan(*args)
        log.append(("plan", start, time.perf_counter() - start, time.thread_time() - cpu, 0))
        return found

    def compress(data, level):
        start, cpu = time.perf_counter(), time.thread_time()
        frame = real_compress(data, level)
        log.append(("compress", start, time.perf_counter() - start, time.thread_time() - cpu, len(data)))
        return frame

    splice.plan, writer.compress_block = plan, compress
    entries = scan_cache(root).entries
    results = []
    for _ in range(rounds):
        for spliced, processes in ((False, False), (False, True), (True, False), (True, True)):
            log.clear()
            start = time.perf_counter()
            info = ArchiveInfo("probe", format_version(spliced), None, None, None)
            helpers = writer.forked_helpers() if processes else None
            with helpers if helpers is not None else contextlib.nullcontext():
                writer.write_archive("/dev/shm/probe.tpack", entries, info, splice_ptx=spliced, helpers=helpers)
            wall = time.perf_counter() - start
            plans = [x for x in log if x[0] == "plan"]
            compressions = [x for x in log if x[0] == "compress"]
            results.append({
                "splice": spliced, "helpers": processes, "wall": round(wall, 3), "plans": len(plans),
                "plan_wall": round(sum(x[2] for x in plans), 3), "plan_cpu": round(sum(x[3] for x in plans), 3),
                "compress_wall": [round(x[2], 3) for x in compressions],
                "compress_start": [round(x[1] - start, 3) for x in compressions],
                "compress_mb": [round(x[4] / 2**20, 1) for x in compressions]})
            print(json.dumps(results[-1]))
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) > 3 else 5)
