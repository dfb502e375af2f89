"""Selective pack and unpack: one target, some kernels, binary-only groups that Triton still hits."""
from __future__ import annotations

import json

import pytest
from conftest import snapshot
from kernels import HAS_LISTENER, SOURCES, compile_all, targets

import tritonpack
import tritonpack.selection
from tritonpack.selection import Selection


@pytest.fixture()
def archive(tmp_path, compiled_root):
    path = tmp_path / "k.tpack"
    tritonpack.pack(compiled_root, path)
    return path


def group_targets(root):
    out = []
    for manifest in root.glob("*/__grp__*.json"):
        meta = next(p for p in manifest.parent.iterdir() if p.suffix == ".json" and not p.name.startswith("__grp__"))
        target = json.loads(meta.read_text())["target"]
        out.append(f"{target['backend']}:{target['arch']}")
    return sorted(out)


def test_unpack_one_arch(tmp_path, archive):
    result = tritonpack.unpack(archive, tmp_path / "root", selection=Selection(archs=("cuda:90",)))
    assert result.written == len(SOURCES)
    assert group_targets(tmp_path / "root") == ["cuda:90"] * len(SOURCES)
    result = tritonpack.unpack(archive, tmp_path / "root2", selection=Selection(archs=("80",)))
    assert group_targets(tmp_path / "root2") == ["cuda:80"] * len(SOURCES)


def test_unpack_kernel_glob(tmp_path, archive):
    tritonpack.unpack(archive, tmp_path / "root", selection=Selection(kernels=("soft*",)))
    names = {p.name for p in (tmp_path / "root").glob("*/__grp__*.json")}
    assert names == {"__grp__softmax_kernel.json"}


def test_binary_only_unpack_is_hit_by_triton(tmp_path, archive):
    root = tmp_path / "root"
    tritonpack.unpack(archive, root, selection=Selection(binary_only=True))
    for manifest in root.glob("*/__grp__*.json"):
        children = json.loads(manifest.read_text())["child_paths"]
        assert all(n.endswith((".json", ".cubin", ".hsaco")) for n in children)
        assert len(children) == 2
        assert sorted(p.name for p in manifest.parent.iterdir()) == sorted([*children, manifest.name])
    before = snapshot(root)
    hits = compile_all(root)
    if HAS_LISTENER:
        assert hits == [True] * len(SOURCES) * len(targets())
    assert snapshot(root) == before


def test_pack_filters(tmp_path, compiled_root):
    archive = tmp_path / "k.tpack"
    result = tritonpack.pack(compiled_root, archive,
                             selection=Selection(archs=("cuda:80",), kernels=("add_*", "scale_*"), binary_only=True))
    assert result.entries["group"] == 2
    with tritonpack.open(archive) as reader:
        assert {e.target for e in reader.entries} == {"cuda:80"}
        assert all(len(e.files) == 2 for e in reader.entries)


def test_what_the_filters_leave_out_is_counted_and_said(tmp_path, compiled_root, archive, capsys):
    from tritonpack.cli import main

    groups = len(SOURCES) * len(targets())
    result = tritonpack.pack(compiled_root, tmp_path / "p.tpack", selection=Selection(archs=("cuda:80",)))
    assert (result.entries["group"], result.not_selected) == (len(SOURCES), groups - len(SOURCES))
    assert f"left out {groups - len(SOURCES)} entries that --arch or --kernel does not select" in result.notes()
    result = tritonpack.unpack(archive, tmp_path / "root", selection=Selection(kernels=("soft*",)))
    assert result.not_selected == groups - len(targets())
    assert main(["unpack", str(archive), "--cache-dir", str(tmp_path / "r2"), "--arch", "90", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["not_selected"] == groups - len(SOURCES)


@pytest.mark.parametrize("value", ["foo", "", "cuda:gfx90a", "sm_90"])
def test_an_arch_that_selects_nothing_by_its_form_is_refused(tmp_path, compiled_root, capsys, value):
    assert main_exit(["pack", str(compiled_root), "-o", str(tmp_path / "k.tpack"), "--arch", value]) == 2
    assert capsys.readouterr().err == f"error: --arch takes cuda:90, hip:gfx942, or just 90 or gfx942, not {value!r}\n"
    assert not (tmp_path / "k.tpack").exists()


def test_archs_may_be_given_as_one_list(tmp_path, compiled_root):
    assert main_exit(["pack", str(compiled_root), "-o", str(tmp_path / "a.tpack"), "--arch", "cuda:80,90"]) == 0
    assert main_exit(["pack", str(compiled_root), "-o", str(tmp_path / "b.tpack"), "--arch", "80", "--arch",
                      "cuda:90"]) == 0
    for name in ("a.tpack", "b.tpack"):
        with tritonpack.open(tmp_path / name) as reader:
            assert {e.target for e in reader.entries if e.kernel} == {"cuda:80", "cuda:90"}


def test_a_pack_of_nothing_is_an_error_not_an_empty_archive(tmp_path, compiled_root, capsys):
    import shutil

    above = tmp_path / "triton"  # ~/.triton where ~/.triton/cache was meant
    shutil.copytree(compiled_root, above / "cache")
    (tmp_path / "empty").mkdir()
    out = str(tmp_path / "k.tpack")
    assert main_exit(["pack", str(above), "-o", out]) == 4
    assert capsys.readouterr().err == f"error: {above}: no Triton cache entry here; is the cache root {above}/cache?\n"
    assert main_exit(["pack", str(tmp_path / "empty"), "-o", out]) == 4
    assert "no Triton cache entry here" in capsys.readouterr().err
    assert main_exit(["pack", str(above / "cache"), "-o", out, "--since", "2099-01-01"]) == 2
    assert "nothing to pack: " in capsys.readouterr().err
    assert main_exit(["pack", str(above / "cache"), "-o", out, "--kernel", "no_such_*"]) == 2
    assert "not selected by --arch or --kernel" in capsys.readouterr().err
    assert not (tmp_path / "k.tpack").exists()


def test_pack_since(tmp_path, compiled_root):
    import os
    import shutil
    import time

    root = tmp_path / "cache"
    shutil.copytree(compiled_root, root)
    old = time.time() - 10 * 86400
    for path in root.rglob("*"):
        os.utime(path, (old, old))
    fresh = next(root.glob("*/__grp__softmax_kernel.json")).parent
    for path in fresh.iterdir():
        os.utime(path)  # touched now: "compiled by a recent run"
    since = tritonpack.selection.parse_since("2d")
    result = tritonpack.pack(root, tmp_path / "k.tpack", since=since)
    assert result.entries["group"] == 1
    assert main_exit(["pack", str(root), "-o", str(tmp_path / "x.tpack"), "--since", "yesterday"]) == 2


def test_merge_filters(tmp_path, compiled_root):
    from tritonpack.merging import merge

    a = tmp_path / "a.tpack"
    tritonpack.pack(compiled_root, a)
    out = tmp_path / "m.tpack"
    merge([a, a], out, selection=Selection(archs=("cuda:90",), kernels=("add_*",), binary_only=True))
    with tritonpack.open(out) as reader:
        assert [(e.target, len(e.files)) for e in reader.entries] == [("cuda:90", 2)]
    tritonpack.unpack(out, tmp_path / "root")
    if HAS_LISTENER:
        hits = compile_all(tmp_path / "root")
        assert hits.count(True) == 1


def main_exit(argv):
    from tritonpack.cli import main

    return main(argv)
