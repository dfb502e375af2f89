"""Peak memory (RSS, ``/usr/bin/time -f %M``) of ``tritonpack push`` and ``pull`` of a large archive, against a real
registry (Debian's docker-registry on 127.0.0.1, as the tests start it), and the round trip's digests.

The archive holds the test kernels compiled for every target and launcher stubs of random bytes (incompressible,
so the archive is as large as asked); a push that held the whole file in memory would show it in its peak.
Usage: python bench/push_memory.py WORK_DIR [--mb 400]   (WORK_DIR: a disk, not a tmpfs, which counts as memory)
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION is unset")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))
from kernels import compile_all  # noqa: E402
from servers import registry  # noqa: E402

import tritonpack  # noqa: E402

TP = [sys.executable, "-c", "from tritonpack.entry import run; run()"]
STUB = "cuda_utils.cpython-311-x86_64-linux-gnu.so"
STUB_MB = 100  # under the writer's largest block: each stub is a block of its own


def make_archive(work: str, megabytes: int) -> str:
    root = os.path.join(work, "cache")
    compile_all(root)
    for n in range(max(1, megabytes // STUB_MB)):
        key = base64.b32encode(hashlib.sha256(b"stub %d" % n).digest()).decode().rstrip("=")
        os.makedirs(os.path.join(root, key), exist_ok=True)
        with open(os.path.join(root, key, STUB), "wb") as f:
            for _ in range(STUB_MB):
                f.write(os.urandom(1 << 20))
    path = os.path.join(work, "big.tpack")
    tritonpack.pack(root, path, level=1)
    return path


def peak_kb(argv: list[str]) -> tuple[int, dict]:
    """The command's peak RSS in kB and its --json document."""
    done = subprocess.run(["/usr/bin/time", "-f", "%M", *argv, "--json"], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr)
    return int(done.stderr.strip().splitlines()[-1]), json.loads(done.stdout)


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("work")
    parser.add_argument("--mb", type=int, default=400)
    args = parser.parse_args()
    os.makedirs(args.work, exist_ok=True)
    archive = make_archive(args.work, args.mb)
    pulled = os.path.join(args.work, "pulled.tpack")
    with registry(Path(args.work) / "registry") as host:
        reference = f"oci://{host}/bench/big:v1"
        push_kb, pushed = peak_kb([*TP, "push", archive, reference])
        pull_kb, pull = peak_kb([*TP, "pull", reference, "-o", pulled])
    received = sha256(pulled)
    print(json.dumps({"archive_bytes": os.path.getsize(archive), "push_peak_rss_kb": push_kb,
                      "pull_peak_rss_kb": pull_kb, "pushed_archive_digest": pushed["archive_digest"],
                      "pulled_archive_digest": pull["archive_digest"], "pulled_file_sha256": received,
                      "same_manifest_digest": pushed["digest"] == pull["digest"],
                      "same_bytes": received == sha256(archive)}, indent=1))


if __name__ == "__main__":
    main()
