"""What blocks that follow windows of entries would cost: an unpack could then plan one window at a time, in
memory bounded whatever the number of files. The blobs of an archive, in its order (the writer's layout), are
regrouped into N windows of entries (a blob goes to the window of the first entry that has it), each window cut
into blocks as the writer cuts them and compressed with the writer's parameters; the entries go into windows in
key order (the index's) and in name order (a kernel's configurations and targets together).

Usage: python bench/window_layout_probe.py ARCHIVE [WINDOWS...]   (default: 1 2 4 8)
"""
from __future__ import annotations

import json
import os
import sys
from concurrent.futures import ProcessPoolExecutor

import zstandard

from tritonpack.archive.format import DEFAULT_LEVEL
from tritonpack.archive.reader import ArchiveReader
from tritonpack.archive.writer import BLOCK_SIZE, compress_block

_contents: list[bytes] = []  # the archive's block contents, inherited by the forked pool


def _compressed_size(ranges: list[tuple[int, int, int]]) -> int:
    return len(compress_block(b"".join(_contents[b][o:o + n] for b, o, n in ranges), DEFAULT_LEVEL))


def _blocks(ranges: list[tuple[int, int, int]]) -> list[list[tuple[int, int, int]]]:
    cut, run, size = [], [], 0
    for blob in ranges:
        if run and size + blob[2] > BLOCK_SIZE:
            cut.append(run)
            run, size = [], 0
        run.append(blob)
        size += blob[2]
    return [*cut, run] if run else cut


def main(path: str, counts: list[int]) -> None:
    reader = ArchiveReader(path)
    with open(path, "rb") as f:
        raw = f.read()
    decompressor = zstandard.ZstdDecompressor()
    _contents.extend(decompressor.decompress(raw[b.offset:b.offset + b.length]) for b in reader.index.blocks)
    blobs = reader.index.blobs
    entries = reader.entries
    orders = {"key": list(range(len(entries))),
              "name": sorted(range(len(entries)), key=lambda n: (entries[n].name, entries[n].key))}
    report: dict = {"archive": os.path.basename(path), "entries": len(entries), "blobs": len(blobs)}
    with ProcessPoolExecutor(os.cpu_count()) as pool:
        for order, numbers in orders.items():
            place = {n: i for i, n in enumerate(numbers)}
            first: dict[int, int] = {}
            for n in range(len(entries)):
                for b in reader.entry_blobs(n):
                    first[b] = min(first.get(b, place[n]), place[n])
            sizes = {}
            for count in counts:
                per = -(-len(entries) // count)
                windows: list[list[tuple[int, int, int]]] = [[] for _ in range(count)]
                for b in range(len(blobs)):
                    windows[first[b] // per].append((blobs.blocks[b], blobs.offsets[b], blobs.sizes[b]))
                jobs = [block for window in windows for block in _blocks(window)]
                sizes[count] = {"bytes": sum(pool.map(_compressed_size, jobs)), "blocks": len(jobs)}
            base = sizes[counts[0]]["bytes"]
            for figures in sizes.values():
                figures[f"/ {counts[0]} window(s)"] = round(figures["bytes"] / base, 4)
            report[f"entries by {order}"] = sizes
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], [int(n) for n in sys.argv[2:]] or [1, 2, 4, 8])
