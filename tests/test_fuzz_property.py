"""Property: any mutation of a valid archive (bit flips, truncations, splices, repeats, a re-framed index) is either
refused with one line or unpacked whole; never another exception, a file outside the root or a partial group.

A bounded budget for CI (``TPACK_PROPERTY_EXAMPLES``, default 200); fuzz/fuzz_unpack.py runs the same oracle
coverage-guided for as long as asked. Inputs that ever broke the oracle are kept in tests/regressions/.
"""
from __future__ import annotations

import glob
import hashlib
import os
import shutil
import struct
import tempfile

import oracle
import pytest
import zstandard
from hostile import KEY, KEY2, Crafted, autotune, group
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tritonpack import api

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(os.path.dirname(HERE), "fixtures")
EXAMPLES = int(os.environ.get("TPACK_PROPERTY_EXAMPLES", "200"))


def _bases() -> list[bytes]:
    small = Crafted(entries=[group(KEY, "add_kernel"), group(KEY2, "mul_kernel"), autotune(KEY2, "mul_kernel")],
                    split=True).build()
    with open(os.path.join(FIXTURES, "archives", "triton-3.9.0.tpack"), "rb") as f:
        real = f.read()
    return [small, real]


BASES = _bases()


def _reframe_index(data: bytes, edit) -> bytes:
    """Apply ``edit`` to the decompressed index and write a correct frame and trailer around it, so that the
    mutation reaches the index decoder instead of the sha256 check."""
    offset, length, _ = struct.unpack("<QQQ", data[-64:-40])
    raw = zstandard.ZstdDecompressor().decompress(data[offset:offset + length])
    raw = edit(raw)
    frame = zstandard.ZstdCompressor(level=1, write_content_size=True).compress(raw)
    trailer = struct.pack("<QQQ32s8s", offset, len(frame), len(raw), hashlib.sha256(frame).digest(), b"TPACKEND")
    return data[:offset] + frame + trailer


@st.composite
def mutated(draw) -> bytes:
    data = bytearray(draw(st.sampled_from(BASES)))
    reframe = draw(st.booleans())
    if reframe:  # mutate the index bytes behind a valid frame and digest
        edits = draw(st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 7), st.sampled_from(
            ["flip", "cut", "dup", "zero"])), min_size=1, max_size=4))

        def edit(raw: bytes) -> bytes:
            raw = bytearray(raw)
            for pos, bit, kind in edits:
                pos %= max(len(raw), 1)
                if kind == "flip" and raw:
                    raw[pos] ^= 1 << bit
                elif kind == "cut":
                    raw = raw[:pos]
                elif kind == "dup":
                    raw[pos:pos] = raw[pos:pos + 1 + bit * 8]
                else:
                    raw[pos:pos + bit + 1] = bytes(bit + 1)
            return bytes(raw)

        return _reframe_index(bytes(data), edit)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "flip", "truncate", "splice", "repeat", "delete"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if kind == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del data[pos:]
        elif kind == "splice":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=64))
        elif kind == "repeat":
            data[pos:pos] = data[pos:pos + draw(st.integers(1, 256))]
        else:
            del data[pos:pos + draw(st.integers(1, 64))]
    return bytes(data)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    """Thousands of small files are written and removed: on a tmpfs when there is one (see conftest.fast_tmp)."""
    if os.access("/dev/shm", os.W_OK):
        path = tempfile.mkdtemp(prefix="tritonpack-test-", dir="/dev/shm")
        yield path
        shutil.rmtree(path, ignore_errors=True)
    else:
        yield str(tmp_path_factory.mktemp("property"))


@pytest.fixture(scope="module", autouse=True)
def _fast_preflight():
    env = api.environment(targets=["cuda:90"])
    real, api.environment = api.environment, lambda *a, **k: env
    yield
    api.environment = real


@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=mutated())
def test_mutated_archive_is_refused_or_unpacked_whole(work, data):
    oracle.run_one(data, work)


def test_the_bases_unpack(work):
    assert [oracle.run_one(base, work) for base in BASES] == ["unpacked", "unpacked"]


@pytest.mark.parametrize("path", sorted(glob.glob(os.path.join(HERE, "regressions", "*.bin"))) or [None])
def test_fuzz_regressions(work, path):
    """Every input fuzzing ever found to break the oracle, replayed."""
    if path is None:
        pytest.skip("no regression inputs")
    with open(path, "rb") as f:
        oracle.run_one(f.read(), work)
