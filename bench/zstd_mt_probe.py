"""Would zstd's multithreaded frames speed up pack? Bytes, CPU, per-block time and peak RSS, measured here.

Every pack compresses its blocks single-threaded today (several blocks at once). zstd's multithreaded mode makes
frames that are the same bytes for any number of workers from 1 up, so the archive would still not depend on the
machine, and one 32 MiB block could use two cores. This measures what that would cost.

Usage: python bench/zstd_mt_probe.py [--work DIR] [--out FILE]
  blocks: the real cache's blocks, laid out as the writer lays them out, each compressed at the default level
  single-threaded, then in multithreaded mode with 8 and 16 MiB jobs and 1-8 workers (CPU of all threads, the
  longest block, a digest of the bytes). rss: peak RSS of a whole pack (write_archive) with its blocks compressed
  each way, in a fresh process per case, with 2 and 16 pack threads.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

import zstandard

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
ARCHIVE = os.path.join(os.path.dirname(HERE), "fixtures", "torch-max-autotune-h200-triton36.tpack")


def params(size: int, **extra) -> zstandard.ZstdCompressionParameters:
    from tritonpack.archive import writer

    window_log = max(17, min(writer.MAX_WINDOW_LOG, (size - 1).bit_length()))
    return zstandard.ZstdCompressionParameters.from_level(
        writer.DEFAULT_LEVEL, source_size=size, window_log=window_log, write_content_size=True,
        search_log=writer.DEFAULT_SEARCH_LOG, **extra)


def writer_blocks(root: str) -> list[bytes]:
    from tritonpack.archive import writer
    from tritonpack.cacheroot import scan_cache

    entries = sorted(scan_cache(root).entries, key=lambda e: (e.key, e.kind, e.name))
    seen, blocks, current, size = set(), [], [], 0
    for source in (s for unit in writer._layout_order(entries) for _, _, s in writer._unit_files(entries, unit)):
        data = source.read()
        digest = hashlib.sha256(data).digest()
        if digest in seen:
            continue
        seen.add(digest)
        if size and size + len(data) > writer.BLOCK_SIZE:
            blocks.append(b"".join(current))
            current, size = [], 0
        current.append(data)
        size += len(data)
    return [*blocks, b"".join(current)]


def compress_all(blocks: list[bytes], **extra) -> dict:
    start, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    outs, longest = [], 0.0
    for block in blocks:
        t = time.perf_counter()
        outs.append(zstandard.ZstdCompressor(compression_params=params(len(block), **extra)).compress(block))
        longest = max(longest, time.perf_counter() - t)
    after = resource.getrusage(resource.RUSAGE_SELF)
    return {"bytes": sum(map(len, outs)), "wall": round(time.perf_counter() - start, 3), "longest": round(longest, 3),
            "cpu": round(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime, 3),
            "sha256": hashlib.sha256(b"".join(outs)).hexdigest()[:16]}


def rss_child(root: str, threads: int, mode: str) -> None:
    """One pack in this process, its blocks compressed single-threaded or in 16 MiB multithreaded jobs."""
    from tritonpack.archive import writer
    from tritonpack.cacheroot import scan_cache
    from tritonpack.model import ArchiveInfo

    if mode == "mt":
        workers = max(1, min(2, threads // 3))
        writer.compress_block = lambda data, level: zstandard.ZstdCompressor(compression_params=params(
            len(data), threads=workers, job_size=16 << 20)).compress(data)
    info = ArchiveInfo(tritonpack="probe", format_version=(1, 0), created=0, python=None, triton=None)
    with tempfile.TemporaryDirectory() as out:
        writer.write_archive(os.path.join(out, "p.tpack"), scan_cache(root).entries, info, threads=threads)
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", default=None)
    parser.add_argument("--out", default=os.path.join(HERE, "results", "zstd_mt_probe.json"))
    parser.add_argument("--rss-child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rss_child:
        root, threads, mode = args.rss_child
        return rss_child(root, int(threads), mode)
    import tritonpack

    with tempfile.TemporaryDirectory(dir=args.work) as work:
        root = os.path.join(work, "cache")
        tritonpack.unpack(ARCHIVE, root, force=True)
        report = {"machine": f"{os.uname().machine}, {os.cpu_count()} cores", "zstd": zstandard.ZSTD_VERSION,
                  "peak_rss_mb": {}, "cases": {}}
        # First, while this process is small: a child's peak RSS counts what it inherited at fork.
        for mode in ("single", "mt"):
            for threads in (2, 16):
                out = subprocess.run([sys.executable, __file__, "--rss-child", root, str(threads), mode],
                                     check=True, capture_output=True, text=True).stdout
                report["peak_rss_mb"][f"{mode}, {threads} pack threads"] = round(int(out) / 2**20)
        blocks = writer_blocks(root)
        report["blocks_mib"] = [round(len(b) / 2**20, 1) for b in blocks]
        report["cases"]["single-threaded"] = compress_all(blocks)
        for job in (8, 16):
            for workers in (1, 2, 4, 8):
                report["cases"][f"mt, {job} MiB jobs, {workers} workers"] = compress_all(
                    blocks, threads=workers, job_size=job << 20)
    for name, case in report["cases"].items():
        print(f"{name:32s} {case}")
    print(report["peak_rss_mb"])
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
