"""Selective pack and unpack: one target, some kernels, binary-only groups that Triton still hits."""
from __future__ import annotations

import json
import os

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


def cli(capsys, *args) -> tuple[int, str, str]:
    """The ``tritonpack`` command, in this process: exit status, standard output and error."""
    from tritonpack.entry import main

    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def manifests(root) -> dict[str, dict[str, str]]:
    return {p.parent.name: json.loads(p.read_text())["child_paths"] for p in root.glob("*/__grp__*.json")}


def test_binary_only_over_whole_groups_leaves_them_whole(tmp_path, compiled_root, archive, capsys):
    """An unpack never makes a good group smaller: a group that already lists more files than a binary-only
    unpack (or archive) takes, with the same binary and metadata, is present, and Triton still hits it."""
    root = tmp_path / "root"
    assert cli(capsys, "unpack", archive, "--cache-dir", root)[0] == 0
    before, whole = snapshot(root), manifests(root)
    code, out, err = cli(capsys, "unpack", archive, "--cache-dir", root, "--binary-only", "--json")
    doc = json.loads(out)
    assert code == 0 and (doc["written"], doc["relinked"], doc["replaced"], doc["conflicts"]) == (0, 0, 0, []), err
    assert doc["present"] == doc["entries"] == len(SOURCES) * len(targets())
    assert snapshot(root) == before and all(len(children) > 2 for children in whole.values())
    binary = tmp_path / "binary.tpack"  # packed binary-only: unpacked over the whole groups, the same
    assert cli(capsys, "pack", compiled_root, "-o", binary, "--binary-only", "-q")[0] == 0
    code, out, _ = cli(capsys, "unpack", binary, "--cache-dir", root)
    assert code == 0 and f"0 written, {doc['entries']} already present;" in out
    assert snapshot(root) == before
    code, out, err = cli(capsys, "verify", root)
    assert code == 0 and "all resolve" in out, (out, err)
    hits = compile_all(root)
    if HAS_LISTENER:
        assert hits == [True] * len(SOURCES) * len(targets())
    assert snapshot(root) == before  # a hit writes nothing


def test_binary_only_relinks_a_copied_root_keeping_every_file_listed(tmp_path, archive, capsys):
    """A copied root's manifests point into the old root: a binary-only unpack rewrites them for this root, still
    listing every file of the group that is here."""
    import shutil

    old = tmp_path / "old"
    assert cli(capsys, "unpack", archive, "--cache-dir", old)[0] == 0
    root = tmp_path / "root"
    shutil.copytree(old, root)
    shutil.rmtree(old)
    code, out, err = cli(capsys, "unpack", archive, "--cache-dir", root, "--binary-only")
    groups = len(SOURCES) * len(targets())
    assert code == 0 and f"0 written, 0 already present, {groups} relinked;" in out, (out, err)
    for key, children in manifests(root).items():
        assert children == {p.name: str(p) for p in sorted((root / key).iterdir()) if "__grp__" not in p.name}
    assert cli(capsys, "verify", root)[0] == 0
    before = snapshot(root)
    hits = compile_all(root)
    if HAS_LISTENER:
        assert hits == [True] * groups
    assert snapshot(root) == before


def test_binary_only_groups_grow_whole_and_differing_ones_follow_the_conflict_rules(tmp_path, archive, capsys):
    root = tmp_path / "root"
    assert cli(capsys, "unpack", archive, "--cache-dir", root, "--binary-only", "-q")[0] == 0
    code, out, _ = cli(capsys, "unpack", archive, "--cache-dir", root, "--json")  # the rest of each group: repaired
    doc = json.loads(out)
    assert code == 0 and doc["written"] == doc["entries"] and doc["present"] == 0
    assert all(len(children) > 2 for children in manifests(root).values())
    assert cli(capsys, "verify", root)[0] == 0
    binary = next(p for p in root.glob("*/*") if p.suffix in (".cubin", ".hsaco"))
    binary.write_bytes(b"compiled differently")
    listed = manifests(root)[binary.parent.name]
    code, out, err = cli(capsys, "unpack", archive, "--cache-dir", root, "--binary-only")
    assert code == 0 and "1 kept (differ)" in out and "--overwrite replaces them" in err, (out, err)
    assert binary.read_bytes() == b"compiled differently" and manifests(root)[binary.parent.name] == listed
    code, out, err = cli(capsys, "unpack", archive, "--cache-dir", root, "--binary-only", "--overwrite")
    assert code == 0 and "1 replaced" in out, (out, err)
    assert binary.read_bytes() != b"compiled differently"
    kept = sorted([binary.name, binary.with_suffix(".json").name])
    assert sorted(manifests(root)[binary.parent.name]) == kept  # replaced by the archive's binary-only group
    assert sorted(p.name for p in binary.parent.iterdir() if "__grp__" not in p.name) == kept
    assert cli(capsys, "verify", root)[0] == 0
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
    merged = tritonpack.merge([archive, archive], tmp_path / "m.tpack", selection=Selection(archs=("cuda:80",)))
    assert merged.not_selected == groups - len(SOURCES)  # each left-out entry once, though in both inputs
    assert f"left out {groups - len(SOURCES)} entries that --arch or --kernel does not select" in merged.notes()


@pytest.mark.parametrize("value", ["foo", "", "cuda:gfx90a", "sm_90"])
def test_an_arch_that_selects_nothing_by_its_form_is_refused(tmp_path, compiled_root, capsys, value):
    assert main_exit(["pack", str(compiled_root), "-o", str(tmp_path / "k.tpack"), "--arch", value]) == 2
    assert capsys.readouterr().err == f"error: --arch takes cuda:90, hip:gfx942, or just 90 or gfx942, not {value!r}\n"
    assert not (tmp_path / "k.tpack").exists()


def test_the_api_checks_a_selection_as_the_command_line_does(tmp_path, compiled_root, archive):
    """A typo'd arch passed to the functions is refused as --arch's is, not silently matched to nothing; a string
    where a tuple goes is one value."""
    for call in (lambda s: tritonpack.pack(compiled_root, tmp_path / "p.tpack", selection=s),
                 lambda s: tritonpack.unpack(archive, tmp_path / "r", selection=s),
                 lambda s: tritonpack.merge([archive], tmp_path / "m.tpack", selection=s)):
        with pytest.raises(tritonpack.UsageError, match="not 'sm80'"):
            call(tritonpack.Selection(archs=("90", "sm80")))
    assert not any((tmp_path / name).exists() for name in ("p.tpack", "r", "m.tpack"))
    result = tritonpack.unpack(archive, tmp_path / "r", selection=tritonpack.Selection(archs="cuda:80",
                                                                                         kernels="add_*"))
    assert result.written == 1


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
    kernels = ", ".join(sorted(fn.fn.__name__ for fn, _, _ in SOURCES))
    assert f"not selected by --arch or --kernel (all {len(SOURCES) * len(targets())} found; kernels: {kernels})" \
        in capsys.readouterr().err
    (above / "cache" / ("S" * 52)).mkdir()  # a launcher stub, which every selection keeps: still nothing to pack
    (above / "cache" / ("S" * 52) / "__triton_launcher.cpython-311-x86_64-linux-gnu.so").write_bytes(b"stub")
    assert main_exit(["pack", str(above / "cache"), "-o", out, "--kernel", "no_such_*"]) == 2
    assert "nothing to pack: no kernel matches --arch or --kernel" in capsys.readouterr().err
    assert main_exit(["pack", str(above / "cache"), "-o", out]) == 0
    assert main_exit(["unpack", out, "--cache-dir", str(tmp_path / "r"), "--force", "--kernel", "no_such_*"]) == 2
    assert "matches --arch or --kernel" in capsys.readouterr().err and not (tmp_path / "r").exists()
    assert main_exit(["merge", out, "-o", str(tmp_path / "m.tpack"), "--arch", "cuda:75"]) == 2
    here = ", ".join(sorted(f"{t.backend}:{t.arch}" for t in targets()))  # what --arch could have named instead
    assert f"nothing to merge: no kernel of the inputs matches --arch or --kernel (targets: {here})" \
        in capsys.readouterr().err
    assert main_exit(["unpack", out, "--cache-dir", str(tmp_path / "r"), "--arch", "75", "--kernel", "x"]) == 2
    assert f"(targets: {here}; kernels: {kernels})" in capsys.readouterr().err
    os.unlink(out)
    assert not (tmp_path / "k.tpack").exists() and not (tmp_path / "m.tpack").exists()


def one_fresh_group(tmp_path, compiled_root):
    """A copy of the compiled root whose files are 10 days old, but for one group's, touched now ("compiled by a
    recent run")."""
    import shutil
    import time

    root = tmp_path / "cache"
    shutil.copytree(compiled_root, root)
    old = time.time() - 10 * 86400
    for path in root.rglob("*"):
        os.utime(path, (old, old))
    fresh = next(root.glob("*/__grp__softmax_kernel.json")).parent
    for path in fresh.iterdir():
        os.utime(path)
    return root


def test_pack_since(tmp_path, compiled_root):
    root = one_fresh_group(tmp_path, compiled_root)
    since = tritonpack.selection.parse_since("2d")
    result = tritonpack.pack(root, tmp_path / "k.tpack", since=since)
    assert result.entries["group"] == 1
    assert main_exit(["pack", str(root), "-o", str(tmp_path / "x.tpack"), "--since", "yesterday"]) == 2


def test_pack_since_a_utc_date_time_on_every_python(tmp_path, compiled_root, capsys):
    """``Z`` names UTC (``date -u +%FT%TZ``): Python 3.10's ``fromisoformat`` refused it, 3.11's reads it."""
    import datetime
    import time

    root = one_fresh_group(tmp_path, compiled_root)
    moment = datetime.datetime.fromtimestamp(time.time() - 2 * 86400, datetime.timezone.utc)
    for since in (moment.strftime("%Y-%m-%dT%H:%M:%SZ"), moment.strftime("%Y-%m-%dT%HZ"), moment.isoformat()):
        out = tmp_path / "k.tpack"
        assert main_exit(["pack", str(root), "-o", str(out), "--since", since, "--json"]) == 0
        assert json.loads(capsys.readouterr().out)["entries"]["group"] == 1, since
        out.unlink()


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
