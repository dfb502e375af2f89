"""Coverage-guided fuzzing of the reader and the unpacker with atheris (libFuzzer). Not a CI dependency.

Each input is an archive, fed to ``list``, ``list --json``, ``check`` and ``unpack --force`` into a fresh root
(tests/oracle.py). A crash is anything but a one-line ``TpackError`` exit, or a broken invariant: a file outside
the root, a temp file left, a visible group whose files are not exactly the archive's.

Most random byte flips only reach the sha256 of the index, so a structure-aware mutator keeps half of the inputs
valid at that layer: it decompresses the index, mutates the msgpack bytes (or one value of the decoded document),
and re-frames it with a correct trailer, so the fuzzer explores the index decoder and the unpack logic behind it.

    python3 -m venv .venv-fuzz && .venv-fuzz/bin/pip install atheris -e .
    .venv-fuzz/bin/python fuzz/fuzz_unpack.py fuzz/corpus -runs=100000 -max_len=65536 -timeout=20
    .venv-fuzz/bin/python fuzz/fuzz_unpack.py --replay crash-*      # re-run inputs without atheris

The seed corpus (fuzz/corpus) is made on first use from fixtures/golden, fixtures/archives and the hostile
corpus of tests/hostile.py. Work files live in /dev/shm when it exists.
"""
from __future__ import annotations

import glob
import hashlib
import os
import random
import shutil
import struct
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))

import msgpack  # noqa: E402
import zstandard  # noqa: E402

try:
    import atheris
except ImportError:  # --replay works without it
    atheris = None


def _import_targets():
    import tritonpack
    import tritonpack.api
    import tritonpack.archive.index
    import tritonpack.archive.limits
    import tritonpack.archive.reader
    import tritonpack.cachedest
    import tritonpack.cli
    import tritonpack.compat
    import tritonpack.listing
    import tritonpack.staging
    import tritonpack.tempfiles

    return tritonpack


if atheris is not None:
    with atheris.instrument_imports(include=["tritonpack"]):
        tritonpack = _import_targets()
else:
    tritonpack = _import_targets()

import oracle  # noqa: E402

ENV = tritonpack.api.environment(targets=["cuda:90"])
tritonpack.api.environment = lambda *a, **k: ENV  # the preflight's inputs are fixed; its logic still runs
def _work_dir() -> str:
    """``tpack-fuzz-<pid>`` in /dev/shm (or the temp dir); libFuzzer exits without Python's clean-up, so the dirs
    of fuzzers that are gone are removed here."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    for name in os.listdir(base):
        pid = name[len("tpack-fuzz-"):]
        if name.startswith("tpack-fuzz-") and pid.isdigit() and not os.path.exists(f"/proc/{pid}"):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
    path = os.path.join(base, f"tpack-fuzz-{os.getpid()}")
    os.makedirs(path, exist_ok=True)
    return path


WORK = _work_dir()


def TestOneInput(data: bytes) -> None:
    oracle.run_one(data, WORK)


# -- structure-aware mutation --

def _split(data: bytes):
    if len(data) < 80 or data[-8:] != b"TPACKEND":
        return None
    offset, length, size = struct.unpack("<QQQ", data[-64:-40])
    if not 16 <= offset <= len(data) - 64 or offset + length != len(data) - 64 or size > 8 << 20:
        return None
    frame = data[offset:offset + length]
    try:  # the declared size first: zstandard allocates it whatever max_output_size says
        if not 0 < zstandard.get_frame_parameters(frame).content_size <= 8 << 20:
            return None
        raw = zstandard.ZstdDecompressor().decompress(frame, max_output_size=8 << 20)
    except (zstandard.ZstdError, MemoryError):
        return None
    return data[:offset], raw


def _reframe(head: bytes, raw: bytes) -> bytes:
    frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw)
    trailer = struct.pack("<QQQ32s8s", len(head), len(frame), len(raw), hashlib.sha256(frame).digest(), b"TPACKEND")
    return head + frame + trailer


_VALUES = [None, True, False, 0, 1, -1, 15, 16, 2**31, 2**63 - 1, 2**64 - 1, -(2**63), 0.5, float("nan"), "",
           ".", "..", "../x", "/etc/passwd", "a\\b", "a\0b", "x" * 256, "tmp.x", "__grp__x.json", "zstd", "group",
           "autotune", "file", b"", b"\0" * 32, [], [0, 0, 0, b"\0" * 32], {}, {"kind": "group"}]


def _leaves(value, path=()):
    yield path, value
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _leaves(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _leaves(v, (*path, i))


def _mutate_doc(raw: bytes, rng: random.Random) -> bytes | None:
    try:
        doc = msgpack.unpackb(raw, raw=False, strict_map_key=False)
    except Exception:
        return None
    leaves = list(_leaves(doc))
    path, _ = rng.choice(leaves)
    if not path:
        return None
    parent = doc
    for p in path[:-1]:
        parent = parent[p]
    action = rng.random()
    if action < 0.6:
        parent[path[-1]] = rng.choice(_VALUES)
    elif action < 0.75 and isinstance(parent, list):
        parent.append(parent[path[-1]])  # duplicate an element (entries, files, blobs)
    elif action < 0.9 and isinstance(parent, (list, dict)):
        del parent[path[-1]]
    elif isinstance(parent[path[-1]], int) and not isinstance(parent[path[-1]], bool):
        parent[path[-1]] += rng.choice([-1, 1, 1 << 20, -(1 << 20)])
    try:
        return msgpack.packb(doc, use_bin_type=True)
    except Exception:
        return None


def CustomMutator(data: bytes, max_size: int, seed: int) -> bytes:
    rng = random.Random(seed)
    split = _split(data) if rng.random() < 0.6 else None
    if split is not None:
        head, raw = split
        new = _mutate_doc(raw, rng) if rng.random() < 0.5 else atheris.Mutate(raw, max(len(raw) * 2, 64))
        if new is not None:
            out = _reframe(head, new)
            if len(out) <= max_size:
                return out
    return atheris.Mutate(data, max_size)


def seed_corpus(directory: str) -> None:
    if os.path.isdir(directory) and os.listdir(directory):
        return
    os.makedirs(directory, exist_ok=True)
    for path in glob.glob(os.path.join(REPO, "fixtures", "*", "*.tpack")):
        shutil.copy(path, directory)
    import hostile

    hostile.write_corpus(directory)


def main() -> None:
    if "--replay" in sys.argv:
        crashes = 0
        for path in sys.argv[sys.argv.index("--replay") + 1:]:
            with open(path, "rb") as f:
                data = f.read()
            try:
                print(path, oracle.run_one(data, WORK))
            except oracle.Crash as e:
                crashes += 1
                print(path, "CRASH", e)
        shutil.rmtree(WORK, ignore_errors=True)
        sys.exit(1 if crashes else 0)
    if atheris is None:
        sys.exit("atheris is not installed (pip install atheris); --replay works without it")
    dirs = [a for a in sys.argv[1:] if not a.startswith("-")]
    if dirs:
        seed_corpus(dirs[0])
    atheris.Setup(sys.argv, TestOneInput, custom_mutator=CustomMutator)
    try:
        atheris.Fuzz()
    finally:
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
