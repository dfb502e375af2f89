"""The mission, end to end with the real Triton: a cache moved with tritonpack hits; one moved with cp -r misses."""
from __future__ import annotations

import json
import os
import shutil

import pytest

triton = pytest.importorskip("triton")

from conftest import snapshot  # noqa: E402
from kernels import HAS_LISTENER, SOURCES, compile_all, targets  # noqa: E402

import tritonpack  # noqa: E402
from tritonpack.entry import main  # noqa: E402

N_COMPILES = len(SOURCES) * len(targets())


def assert_all_hits(root, hits):
    """Listener says hit for every compile (3.4+); on every version, a hit writes nothing under the root."""
    assert len(hits) == N_COMPILES
    if HAS_LISTENER:
        assert hits == [True] * N_COMPILES


@pytest.mark.parametrize("via", ["TRITON_CACHE_DIR", "--cache-dir"])
def test_unpacked_cache_hits_and_copied_cache_misses(tmp_path, monkeypatch, via):
    a, b, c = tmp_path / "a" / "cache", tmp_path / "b" / "cache", tmp_path / "c" / "cache"
    first = compile_all(a)
    if HAS_LISTENER:
        assert first == [False] * N_COMPILES
    shutil.copytree(a, c)  # the negative control: what users do today
    archive = tmp_path / "kernels.tpack"
    result = tritonpack.pack(a, archive)
    assert result.entries["group"] == N_COMPILES and not result.skipped
    shutil.rmtree(a)

    if via == "TRITON_CACHE_DIR":
        monkeypatch.setenv("TRITON_CACHE_DIR", str(b))
        assert main(["unpack", str(archive), "-q"]) == 0
    else:
        monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
        assert main(["unpack", str(archive), "--cache-dir", str(b), "-q"]) == 0

    # Every manifest names files under B, in Triton's own format.
    for manifest in b.glob("*/__grp__*.json"):
        children = json.loads(manifest.read_text())["child_paths"]
        assert all(os.path.dirname(p) == str(manifest.parent) for p in children.values())

    before = snapshot(b)
    hits = compile_all(b)
    assert_all_hits(b, hits)
    assert snapshot(b) == before, "a cache hit must not write under the root"

    before_c = snapshot(c)
    misses = compile_all(c)
    if HAS_LISTENER:
        assert misses == [False] * N_COMPILES
    assert snapshot(c) != before_c, "the copied cache recompiled (Triton rewrote its manifests)"


def test_unpack_into_the_original_root_restores_tritons_exact_manifests(tmp_path):
    root = tmp_path / "cache"
    compile_all(root)
    original = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    archive = tmp_path / "k.tpack"
    tritonpack.pack(root, archive)
    shutil.rmtree(root)
    tritonpack.unpack(archive, root)
    restored = {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
    assert restored == original  # byte for byte, manifests included


def test_inductor_root_is_just_another_root(tmp_path, compiled_root):
    inductor = tmp_path / "torchinductor_user" / "triton" / "0"
    shutil.copytree(compiled_root, inductor)
    archive = tmp_path / "k.tpack"
    result = tritonpack.pack(inductor, archive)
    assert result.entries["group"] == N_COMPILES
    assert result.foreign_manifests == N_COMPILES  # copied: manifests point into the session root
    target = tmp_path / "elsewhere"
    tritonpack.unpack(archive, target)
    assert_all_hits(target, compile_all(target))
