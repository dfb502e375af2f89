"""What an hf:// archive costs the Hub and the network: two revisions of tritonpack, side by side, against the
tests' Hugging Face Hub on 127.0.0.1 (``tests/servers.py``: ``resolve`` answers 302 to a CDN's signed link).

Counts, for ``list``, ``unpack --arch TARGET`` and a full ``unpack``: the requests to the Hub (its rate limits
count them per client; a fleet's pods share one address behind a NAT), the ranges asked of the CDN and the bytes
it sent, against the archive's size. The wall times are of loopback, where bytes cost almost nothing: on a real
network the bytes dominate. Needs huggingface_hub (and, for a revision before 1.0's hub module, its fsspec
``HfFileSystem``).
Usage: python bench/hub_reads.py ARCHIVE --old-src DIR [--new-src DIR] [--arch cuda:90] [--rounds 3] [--out F]
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
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from servers import asked_span, hugging_face_hub  # noqa: E402


def sent(asked: str | None, size: int) -> int:
    """The bytes the CDN sent for ``Range: asked``, of a file of ``size``."""
    start, end = asked_span(asked, size) or (0, size)
    return end - start


def run(src: str, args: list[str], endpoint: str, home: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGING"))}
    env.update(PYTHONPATH=src, HF_ENDPOINT=endpoint, HF_HOME=home, HF_HUB_DISABLE_TELEMETRY="1")
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", "from tritonpack.entry import run; run()", *args], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=home)
    seconds = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"{' '.join(args)} under {src} failed ({done.returncode}): {done.stderr.strip()}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("archive")
    parser.add_argument("--old-src", required=True)
    parser.add_argument("--new-src", default=str(HERE.parent))
    parser.add_argument("--arch", default="cuda:90")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    archive = Path(args.archive)
    size = archive.stat().st_size
    url = "hf://team/model/kernels.tpack"
    cases = {"list": ["list", url], f"unpack --arch {args.arch}": ["unpack", url, "--arch", args.arch],
             "unpack": ["unpack", url]}
    srcs = {"old": os.path.abspath(args.old_src), "new": os.path.abspath(args.new_src)}
    results: dict = {name: {which: {"seconds": []} for which in srcs} for name in cases}
    work = tempfile.mkdtemp(prefix="tp-hub-")
    try:
        with hugging_face_hub() as hub:
            hub.commit("team/model", {"kernels.tpack": archive.read_bytes()})
            for _ in range(args.rounds):
                for name, case in cases.items():
                    for which, src in srcs.items():
                        root = os.path.join(work, "root")
                        shutil.rmtree(root, ignore_errors=True)
                        hub.asked.clear()
                        extra = ["--cache-dir", root] if case[0] == "unpack" else []
                        seconds = run(src, case + extra, hub.endpoint, work)
                        result = results[name][which]
                        result["seconds"].append(round(seconds, 4))
                        result["hub requests"] = len(hub.by("hub"))
                        result["cdn requests"] = len(hub.by("cdn"))
                        result["bytes"] = sum(sent(a[3], size) for a in hub.by("cdn"))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"{archive.name}: {size} bytes; old {srcs['old']}, new {srcs['new']}")
    print(f"{'case':<24}{'hub requests':>16}{'cdn requests':>16}{'bytes / archive':>20}{'seconds':>16}")
    for name, by in results.items():
        old, new = by["old"], by["new"]
        for result in (old, new):
            result["bytes / archive"] = round(result["bytes"] / size, 3)
            result["median seconds"] = statistics.median(result["seconds"])
        print(f"{name:<24}{old['hub requests']:>8} -> {new['hub requests']:<5}{old['cdn requests']:>8} -> "
              f"{new['cdn requests']:<5}{old['bytes / archive']:>10} -> {new['bytes / archive']:<7}"
              f"{old['median seconds']:>7.2f} -> {new['median seconds']:.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps({"archive": archive.name, "size": size, "machine": platform.node(),
                                              "cpus": os.cpu_count(), "results": results}, indent=1) + "\n")


if __name__ == "__main__":
    main()
