"""Where a pack's time goes, block by block: when each block's files are read, when it is handed to the
compressors, and when its compression starts and ends (ms from the start of ``write_archive``).

Usage: python bench/pack_timeline.py CACHE [--rounds N] [--splice-ptx] [--out FILE]

The writer is instrumented from outside (its functions wrapped in this process); the archive goes to a temp dir.
Rounds after the first show the machine warm. A gap between a compression's end and the next start, with a
block ready, is the writer's scheduling; a block that waits for its reads is the readers'.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tritonpack import api
from tritonpack.archive import writer

ORIGINAL_POOL, ORIGINAL_WRITE = writer.ThreadPoolExecutor, writer.write_archive


class Timeline:
    def __init__(self):
        self.t0 = time.perf_counter()
        self.events: list[tuple[float, str, int, int]] = []  # (ms, what, buffer id, size)
        self.lock = threading.Lock()

    def log(self, what: str, buffer: int, size: int = 0) -> None:
        with self.lock:
            self.events.append(((time.perf_counter() - self.t0) * 1000, what, buffer, size))


def instrumented(timeline: Timeline):
    """Wrap the writer's reads (a batch of a block's files, in a reader thread, whether a forked helper or the
    thread reads it) and its compressions (in a compress thread)."""
    compress = writer.splice_and_compress

    def timed(what: str, fn, buffer: int, size: int = 0):
        def run(*args, **kwargs):
            timeline.log(what, buffer, size)
            try:
                return fn(*args, **kwargs)
            finally:
                timeline.log(f"{what}-end", buffer, size)
        return run

    class Pool(ThreadPoolExecutor):
        def submit(self, fn, *args, **kwargs):
            if fn is compress:
                timeline.log("submit", id(args[4]), len(args[0]))
                fn = timed("compress", fn, id(args[4]), len(args[0]))
            elif fn.__name__ == "read":  # the writer's read of a batch: (buffer, view, run, batch number, batch)
                fn = timed("read", fn, id(args[0]))
            return super().submit(fn, *args, **kwargs)

    writer.ThreadPoolExecutor = Pool
    writer.write_archive = timed("write_archive", ORIGINAL_WRITE, 0)


def blocks_of(timeline: Timeline) -> list[dict]:
    """Per block, in submission order: its reads (first start, last end), submission, compression."""
    blocks, reading = [], {}
    for ms, what, buffer, size in timeline.events:
        if what == "read":
            reading.setdefault(buffer, {"read": ms, "read_end": ms})
        elif what == "read-end":
            reading[buffer]["read_end"] = max(reading[buffer]["read_end"], ms)
        elif what == "submit":
            blocks.append({**reading.pop(buffer, {}), "buffer": buffer, "mb": round(size / 2**20, 1),
                           "submit": ms})
        elif what in ("compress", "compress-end"):
            block = next(b for b in blocks if b["buffer"] == buffer and what not in b)
            block[what] = ms
    return blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("cache")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--splice-ptx", action="store_true")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    rounds = []
    with tempfile.TemporaryDirectory() as work:
        for n in range(args.rounds):
            timeline = Timeline()
            instrumented(timeline)
            start = time.perf_counter()
            api.pack(args.cache, os.path.join(work, "t.tpack"), splice_ptx=args.splice_ptx,
                     processes=True)  # as the command packs
            total = (time.perf_counter() - start) * 1000
            blocks = blocks_of(timeline)
            phases = {what: round(ms, 1) for ms, what, _, _ in timeline.events if what.startswith("write_archive")}
            rounds.append({"total_ms": round(total, 1), **phases, "blocks": blocks})
            last = max(b.get("compress-end", 0) for b in blocks)
            print(f"## round {n + 1}: {total:.0f} ms (cpus {os.cpu_count()}); write_archive "
                  f"{phases['write_archive']:.0f}-{phases['write_archive-end']:.0f}, its last compression ends at "
                  f"{last:.0f}")
            print("   MB   read  read_end  submit  compress  end     wait(submit->compress)")
            for b in blocks:
                print(f"{b['mb']:6.1f} {b.get('read', 0):6.0f} {b.get('read_end', 0):8.0f} {b['submit']:7.0f} "
                      f"{b.get('compress', 0):9.0f} {b.get('compress-end', 0):6.0f}  "
                      f"{b.get('compress', 0) - b['submit']:6.0f}")
            writer.ThreadPoolExecutor, writer.write_archive = ORIGINAL_POOL, ORIGINAL_WRITE
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"cache": args.cache, "cpus": os.cpu_count(), "rounds": rounds}, f, indent=1)


if __name__ == "__main__":
    main()
