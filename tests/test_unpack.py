"""Unpack semantics: idempotent, never replaces differing content unless asked, never a partial group."""
from __future__ import annotations

import json
import os
import shutil

import pytest
from conftest import snapshot

import tritonpack


@pytest.fixture()
def archive(tmp_path, compiled_root):
    path = tmp_path / "k.tpack"
    tritonpack.pack(compiled_root, path)
    return path


def test_rerun_is_idempotent(tmp_path, archive):
    root = tmp_path / "root"
    first = tritonpack.unpack(archive, root)
    assert first.written == first.entries and first.files_written > 0
    before = snapshot(root)
    again = tritonpack.unpack(archive, root)
    assert again.present == again.entries and again.written == 0 and again.files_written == 0
    assert snapshot(root) == before


def test_differing_group_is_kept_unless_overwrite(tmp_path, archive):
    root = tmp_path / "root"
    tritonpack.unpack(archive, root)
    victim = next(root.glob("*/*.ptx")) if list(root.glob("*/*.ptx")) else next(root.glob("*/*.llir"))
    victim.write_text("// locally different\n")
    kept = tritonpack.unpack(archive, root)
    assert kept.conflicts == [f"{victim.parent.name}/{victim.stem}"]
    assert victim.read_text() == "// locally different\n"
    assert "--overwrite" in kept.notes()[0]
    replaced = tritonpack.unpack(archive, root, overwrite=True)
    assert replaced.replaced == 1 and replaced.conflicts == []
    assert victim.read_text() != "// locally different\n"


def test_stale_manifest_with_identical_files_is_relinked(tmp_path, archive):
    root = tmp_path / "root"
    tritonpack.unpack(archive, root)
    manifest = next(root.glob("*/__grp__*.json"))
    children = json.loads(manifest.read_text())["child_paths"]
    manifest.write_text(json.dumps({"child_paths": {n: f"/gone/{n}" for n in children}}))
    result = tritonpack.unpack(archive, root)
    assert result.relinked == 1
    assert json.loads(manifest.read_text())["child_paths"] == children


def test_leftovers_of_an_interrupted_unpack_are_completed(tmp_path, archive):
    root = tmp_path / "root"
    tritonpack.unpack(archive, root)
    group = next(root.glob("*/__grp__*.json")).parent
    next(group.glob("__grp__*.json")).unlink()
    next(p for p in group.iterdir() if p.suffix == ".json").write_text("half")
    result = tritonpack.unpack(archive, root)
    assert result.written == 1
    assert next(group.glob("__grp__*.json")).exists()


def test_corrupt_block_leaves_no_visible_partial_group(tmp_path, archive):
    data = bytearray(archive.read_bytes())
    with tritonpack.open(archive) as reader:
        block = reader.index.blocks[-1]
    data[block.offset + block.length // 2] ^= 0xFF
    bad = tmp_path / "bad.tpack"
    bad.write_bytes(bytes(data))
    root = tmp_path / "root"
    with pytest.raises(tritonpack.ArchiveError):
        tritonpack.unpack(bad, root)
    assert not list(root.glob("*/__grp__*.json")), "no manifest may be written when the archive is corrupt"
    assert not [p for p in root.rglob("tmp.*")], "no temp files left behind"


def test_default_root_is_tritons(tmp_path, archive, monkeypatch):
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))
    result = tritonpack.unpack(archive)
    assert result.cache_dir == str(tmp_path / "home" / ".triton" / "cache")
    assert list((tmp_path / "home" / ".triton" / "cache").glob("*/__grp__*.json"))


def test_files_get_normal_modes(tmp_path, archive):
    root = tmp_path / "root"
    old = os.umask(0o022)
    try:
        tritonpack.unpack(archive, root)
    finally:
        os.umask(old)
    modes = {p.stat().st_mode & 0o7777 for p in root.rglob("*") if p.is_file()}
    assert modes == {0o644}


def test_pack_is_deterministic(tmp_path, compiled_root, monkeypatch):
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    tritonpack.pack(compiled_root, tmp_path / "1.tpack")
    copy = tmp_path / "copy"
    shutil.copytree(compiled_root, copy)
    tritonpack.pack(copy, tmp_path / "2.tpack")
    assert (tmp_path / "1.tpack").read_bytes() == (tmp_path / "2.tpack").read_bytes()
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    tritonpack.pack(compiled_root, tmp_path / "3.tpack")
    with tritonpack.open(tmp_path / "3.tpack") as reader:
        assert reader.info.created == 1700000000
