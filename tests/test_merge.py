"""merge: union of archives, identical entries once, conflicts named, deterministic, honest producer maps."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import textwrap
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from conftest import FIXTURES, cache_key, full_and_thinned, snapshot  # noqa: E402
from kernels import HAS_LISTENER, TRITON_VERSION, compile_all, targets  # noqa: E402

import tritonpack  # noqa: E402
from tritonpack.archive.writer import write_archive  # noqa: E402
from tritonpack.cacheroot import LocalEntry, scan_cache  # noqa: E402
from tritonpack.cli import main  # noqa: E402
from tritonpack.merging import merged_info  # noqa: E402
from tritonpack.model import FILE, ArchiveInfo, PythonInfo, StubInfo, TritonInfo, named_version  # noqa: E402
from tritonpack.triton_env import key_releases, releases_keyed_as  # noqa: E402


def subset_root(src, dst, keys):
    for key in keys:
        shutil.copytree(src / key, dst / key)
    return dst


def contents(archive) -> dict:
    with tritonpack.open(archive) as reader:
        return {e.ident: [(f.name, f.sha256) for f in e.files] for e in reader.entries}


@pytest.fixture()
def halves(tmp_path, compiled_root):
    """Two archives of overlapping parts of one root (one key in both), and the archive of the whole root."""
    keys = sorted(p.name for p in compiled_root.iterdir())
    mid = len(keys) // 2
    a, b, whole = tmp_path / "a.tpack", tmp_path / "b.tpack", tmp_path / "whole.tpack"
    tritonpack.pack(subset_root(compiled_root, tmp_path / "ra", keys[: mid + 1]), a)
    tritonpack.pack(subset_root(compiled_root, tmp_path / "rb", keys[mid:]), b)
    tritonpack.pack(compiled_root, whole)
    return a, b, whole


def test_union_stores_shared_entries_once_and_equals_packing_the_whole(tmp_path, halves, monkeypatch):
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    a, b, whole = halves
    ab, ba = tmp_path / "ab.tpack", tmp_path / "ba.tpack"
    result = tritonpack.merge([a, b], ab)
    assert result.identical == 1 and result.conflicts == []
    assert contents(ab) == contents(whole)
    with tritonpack.open(whole) as reader:
        assert result.unique_blobs == len(reader.index.blobs)
    # Deterministic, independent of input order, and byte for byte what packing the whole root gives.
    tritonpack.merge([b, a], ba)
    assert ab.read_bytes() == ba.read_bytes() == whole.read_bytes()
    assert result.blocks_decoded == result.blocks_needed


def test_merged_archive_unpacks_to_cache_hits(tmp_path, halves):
    a, b, _ = halves
    tritonpack.merge([a, b], tmp_path / "m.tpack")
    root = tmp_path / "root"
    tritonpack.unpack(tmp_path / "m.tpack", root)
    before = snapshot(root)
    hits = compile_all(root)
    if HAS_LISTENER:
        assert all(hits)
    assert snapshot(root) == before


def test_conflict_is_an_error_naming_the_key_unless_prefer(tmp_path, compiled_root, halves, capsys):
    _, _, whole = halves
    changed = tmp_path / "changed"
    shutil.copytree(compiled_root, changed)
    victim = sorted(changed.glob("*/*.ttir"))[0]
    victim.write_text(victim.read_text() + "\n// patched\n")
    patched = tmp_path / "patched.tpack"
    tritonpack.pack(changed, patched)
    key = victim.parent.name
    out = tmp_path / "m.tpack"
    assert main(["merge", str(whole), str(patched), "-o", str(out)]) == 9
    err = capsys.readouterr().err
    assert err.startswith(f"error: {patched}: {key}/") and f"differs from {whole}'s" in err  # error: <file>: ...
    assert "--prefer first|last" in err and err.count("\n") == 1
    assert not out.exists()
    first = tritonpack.merge([whole, patched], out, prefer="first")
    assert len(first.conflicts) == 1 and contents(out) == contents(whole)
    last = tritonpack.merge([whole, patched], out, prefer="last")
    assert len(last.conflicts) == 1 and contents(out) == contents(patched)
    assert str(patched) in last.conflicts[0]
    assert main(["merge", str(whole), "-o", str(out), "--prefer", "middle"]) == 2


# Compiles the first test kernel for cuda:90 into a root, from the copy of kernels.py in the working directory.
COMPILE_HERE = textwrap.dedent("""
    import os, sys
    os.environ["TRITON_CACHE_DIR"] = sys.argv[1]
    import triton
    from triton.backends.compiler import GPUTarget
    import kernels
    triton.compile(kernels.source(*kernels.SOURCES[0]), target=GPUTarget("cuda", 90, 32))
""")


@pytest.mark.parametrize("order", ["full first", "thinned first"])
def test_a_thinned_copy_of_a_group_is_the_same_kernel_and_the_fuller_one_is_kept(tmp_path, compiled_root, order,
                                                                                  capsys):
    """One host's cache thinned to its binaries, another's whole: merge raised a conflict blaming the source path
    (exit 9), and --prefer could keep the IR-less copy. The copy with more files is kept, said, in either order."""
    full, thinned = full_and_thinned(compiled_root, tmp_path)
    out = tmp_path / "m.tpack"
    inputs = [full, thinned] if order == "full first" else [thinned, full]
    for prefer in (None, "first", "last"):
        result = tritonpack.merge(inputs, out, prefer=prefer)
        assert contents(out) == contents(full) and result.conflicts == []
        groups = sum(1 for _, kind, _ in contents(full) if kind == "group")
        assert len(result.fuller_kept) == groups and result.identical == len(contents(full))
        assert all(f"kept from {full}, whose copy has files {thinned}'s lacks" in c for c in result.fuller_kept)
    assert main(["merge", str(thinned), str(full), "-o", str(out)]) == 0
    assert "a kernel with fewer files in one input (thinned, binary-only), the fuller copy kept" in \
        capsys.readouterr().err


def test_copies_of_a_group_that_each_lack_a_file_of_the_other_still_conflict(tmp_path, compiled_root):
    root = tmp_path / "root"
    shutil.copytree(compiled_root, root)
    manifest = sorted(root.glob("*/__grp__*.json"))[0]
    names = json.loads(manifest.read_text())["child_paths"]
    ir = sorted(n for n in names if not n.endswith((".json", ".cubin", ".hsaco")))
    archives = []
    for n, gone in enumerate((ir[0], ir[1])):
        copy = tmp_path / f"r{n}"
        shutil.copytree(root, copy)
        (copy / manifest.parent.name / gone).unlink()
        archives.append(tmp_path / f"{n}.tpack")
        tritonpack.pack(copy, archives[-1])
    with pytest.raises(tritonpack.ConflictError):
        tritonpack.merge(archives, tmp_path / "m.tpack")


def test_every_conflict_is_counted_and_their_usual_cause_said(tmp_path, compiled_root, halves, capsys):
    """Per-model archives recorded on other machines: a kernel compiled from its source file at another path has
    the same cache key and other files (the path is in its IR and metadata), a conflict the user settles with
    --prefer. The error counts every conflict at once (it named the first only) and says why they usually are."""
    import kernels

    _, _, whole = halves
    checkout = tmp_path / "elsewhere"
    checkout.mkdir()
    shutil.copy(kernels.__file__, checkout / "kernels.py")
    moved = tmp_path / "moved"
    subprocess.run([sys.executable, "-c", COMPILE_HERE, str(moved)], cwd=checkout, check=True, capture_output=True)
    patched = tmp_path / "patched"
    shutil.copytree(compiled_root, patched)
    victim = next(p for p in sorted(patched.glob("*/*.ttir")) if p.parent.name not in {d.name for d in
                                                                                       moved.iterdir()})
    victim.write_text(victim.read_text() + "\n// patched\n")
    other = tmp_path / "other.tpack"
    tritonpack.pack(moved, other)
    tritonpack.pack(patched, tmp_path / "patched.tpack")
    out = tmp_path / "fleet.tpack"
    assert main(["merge", str(whole), str(other), str(tmp_path / "patched.tpack"), "-o", str(out)]) == 9
    err = capsys.readouterr().err
    (key,) = [d.name for d in moved.iterdir()]
    assert err.startswith(f"error: {other}: {key}/add_kernel (group) differs from {whole}'s, and 1 more entry "
                          "differs (the same cache key, other files: usually a kernel compiled from a source file at "
                          "another path") and "--prefer first|last" in err and err.count("\n") == 1
    assert not out.exists()
    assert len(tritonpack.merge([whole, other, tmp_path / "patched.tpack"], out, prefer="first").conflicts) == 2


def test_two_entries_claiming_one_file_are_refused_and_output_may_be_an_input(tmp_path, compiled_root, halves):
    _, _, whole = halves
    group = next(e for e in scan_cache(str(compiled_root)).entries if e.kind == "group")
    metadata = next(f for f in group.files if f.name == f"{group.name}.json")
    loose = LocalEntry(FILE, group.key, metadata.name, (metadata,), stub=StubInfo("other"))
    with tritonpack.open(whole) as reader:
        write_archive(str(tmp_path / "loose.tpack"), [loose], reader.info)
    with pytest.raises(tritonpack.ConflictError, match=f"{group.key}/{metadata.name} is claimed by group"):
        tritonpack.merge([whole, tmp_path / "loose.tpack"], tmp_path / "m.tpack")
    copy = tmp_path / "copy.tpack"
    shutil.copyfile(whole, copy)
    tritonpack.merge([copy, whole], copy)  # written beside, then moved over the input it read
    assert copy.read_bytes() == whole.read_bytes()


def test_each_block_is_decoded_once_and_memory_stays_bounded(tmp_path, compiled_root):
    entries = scan_cache(str(compiled_root)).entries
    with tritonpack.open(tritonpack.pack(compiled_root, tmp_path / "ref.tpack").archive) as reader:
        info = reader.info
    small = []
    for n, part in enumerate((entries[::2], entries[1::2])):  # many small blocks: 4 kB each
        small.append(tmp_path / f"small{n}.tpack")
        write_archive(str(small[-1]), part, info, block_size=4096)
    result = tritonpack.merge(small, tmp_path / "m.tpack")
    assert result.blocks_needed > 20
    assert result.blocks_decoded == result.blocks_needed, "every block decoded exactly once"
    assert result.peak_blocks <= 2 * len(small)
    capped = tritonpack.merge(small, tmp_path / "capped.tpack", max_blocks=1)
    assert capped.peak_blocks == 1
    assert (tmp_path / "capped.tpack").read_bytes() == (tmp_path / "m.tpack").read_bytes()
    assert contents(tmp_path / "m.tpack") == contents(tmp_path / "ref.tpack")


def test_archives_of_different_tritons_claim_no_packing_triton(tmp_path):
    archives = sorted((FIXTURES / "archives").glob("triton-*.tpack"))
    out = tmp_path / "all.tpack"
    result = tritonpack.merge(archives, out)
    assert sum(result.entries.values()) == 6 * len(archives)
    assert "different Tritons" in result.notes()[0]
    with tritonpack.open(out) as reader:
        assert reader.info.triton is None
    # The preflight falls back to each kernel's own version, and where it names none (Triton before 3.3) to its
    # key's encoding: here, a Triton of 3.0-3.1 passes the kernels of both (triton-3.0.0.tpack's).
    for verdict in tritonpack.check(out).verdicts:
        own = verdict.entry.kernel.triton_version
        if own:
            assert verdict.usable == (own == triton.__version__)
        else:
            assert verdict.usable == (key_releases(verdict.entry.key) == releases_keyed_as(triton.__version__))


def test_merged_info_keeps_only_what_all_inputs_agree_on():
    py = PythonInfo("cpython", "3.11", "cpython-311", ".so", "linux-x86_64")

    def info(version, key, hashes, python=py):
        return ArchiveInfo("1.0.0", (1, 0), None, python, TritonInfo(version, key, hashes))

    a = info("3.6.0", "k1", {"cuda:90": "ptxas 12.8", "cuda:80": "ptxas 12.8-80"})
    same = merged_info([(a, {"cuda:90"}), (info("3.6.0", "k1", {"cuda:90": "ptxas 12.8"}), {"cuda:90"})], 5)
    assert same.triton == TritonInfo("3.6.0", "k1", {"cuda:90": "ptxas 12.8"}) and same.python == py
    assert same.created == 5
    other_build = merged_info([(a, {"cuda:90", "cuda:80"}),
                               (info("3.6.0", "k2", {"cuda:90": "ptxas 13.0"}), {"cuda:90"})], None)
    assert other_build.triton == TritonInfo("3.6.0", None, {"cuda:80": "ptxas 12.8-80"})
    unknown_hash = merged_info([(a, {"cuda:90"}), (info("3.6.0", "k1", {}), {"cuda:90"})], None)
    assert unknown_hash.triton.backend_hashes == {}
    other_python = merged_info([(a, set()), (info("3.6.0", "k1", {}, py.__class__(*"abcde")), set())], None)
    assert other_python.python is None
    assert merged_info([(a, set()), (info("3.9.0", "k1", {}), set())], None).triton is None


FIXTURE_TRITON = "3.6.0"  # the Triton that compiled the H200 cache (fixtures/h200-triton36)
HERE = triton.__version__
THIS_PYTHON = sysconfig.get_config_var("EXT_SUFFIX")
another_triton = pytest.mark.skipif(HERE == FIXTURE_TRITON, reason="the H200 cache was compiled by this Triton")


def with_stub_and_autotune(src: Path, dst: Path, label: str, autotune: bool) -> Path:
    """A copy of the root ``src`` with a launcher stub for this Python and, if ``autotune``, an autotune result,
    each in a key directory of its own as Triton puts them (no GPU here to build or tune real ones)."""
    shutil.copytree(src, dst)
    stub = dst / cache_key(f"{label}-stub") / f"__triton_launcher{THIS_PYTHON}"
    stub.parent.mkdir()
    stub.write_bytes(b"\x7fELF launcher of " + label.encode())
    if autotune:
        tuned = dst / cache_key(f"{label}-autotune") / f"{label}_kernel.autotune.json"
        tuned.parent.mkdir()
        tuned.write_text(json.dumps({"key": [1024], "configs_timings": [[{"kwargs": {"BLOCK": 64}, "num_warps": 4},
                                                                         [0.5]]]}))
    return dst


def named_versions(archive) -> dict[str, str | None]:
    """``key/name`` -> the Triton version each autotune result and file of ``archive`` names."""
    with tritonpack.open(archive) as reader:
        return {f"{e.key}/{e.name}": named_version(e) for e in reader.entries if e.kind != "group"}


@another_triton
@pytest.mark.skipif(TRITON_VERSION < (3, 4), reason=f"Triton {HERE} writes no autotune result and names stubs "
                    "<name>.so: the autotune result and stub this test makes for it are 3.4's and later")
def test_merged_archive_of_two_tritons_judges_autotune_results_and_stubs_by_their_own(tmp_path, gpu_cache,
                                                                                      compiled_root, capsys):
    """The H200's Triton 3.6 archive (kernels, an autotune result, launcher stubs) merged with one of this Triton:
    no one Triton compiled the merged kernels, so the archive records none, but each autotune result and stub
    names the Triton its input attributed it to (format 1.2). An unpack here skips 3.6's with the version as the
    reason, counted, and writes this Triton's; where the entries name none (the same cache packed whole, as
    merges wrote them before), they are reported unchecked and written, as before."""
    old = with_stub_and_autotune(gpu_cache, tmp_path / "old", "old", autotune=False)
    here = with_stub_and_autotune(compiled_root, tmp_path / "here", "here", autotune=True)
    a36, ours, merged = tmp_path / "a36.tpack", tmp_path / "here.tpack", tmp_path / "m.tpack"
    tritonpack.pack(old, a36)
    tritonpack.pack(here, ours)
    for packed, version in ((a36, FIXTURE_TRITON), (ours, HERE)):  # one Triton each: its record says it all
        with tritonpack.open(packed) as reader:
            assert reader.info.format_version == (1, 0) and reader.info.triton.version == version
        assert set(named_versions(packed).values()) == {None}
    alone = tmp_path / "alone.tpack"  # a merge whose record says it too names none
    assert tritonpack.merge([a36], alone).versions_written == 0 and alone.read_bytes() == a36.read_bytes()

    assert main(["merge", str(a36), str(ours), "-o", str(merged)]) == 0
    err = capsys.readouterr().err
    assert ("7 entries (autotune results, launcher stubs) name the Triton that produced them (format 1.2): the "
            "merged archive's kernels would attribute them to none or to another") in err.splitlines()
    with tritonpack.open(merged) as reader:
        assert reader.info.format_version == (1, 2) and reader.info.triton is None
    versions = named_versions(merged)
    theirs = {k for k in versions if k.split("/")[0] in {p.name for p in old.iterdir()}}
    assert len(theirs) == 5 and len(versions) == 7  # 3.6: 1 autotune result, 4 stubs; here: 1 of each
    assert {k: v for k, v in versions.items() if k in theirs} == dict.fromkeys(theirs, FIXTURE_TRITON)
    assert {k: v for k, v in versions.items() if k not in theirs} == dict.fromkeys(set(versions) - theirs, HERE)
    assert main(["list", str(merged), "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)["entries"]
    assert {f"{e['key']}/{e['name']}": e["triton_version"] for e in listed if e["kind"] != "group"} == versions

    every_target = ",".join(f"{t.backend}:{t.arch}" for t in targets())
    assert main(["check", str(merged), "--target", every_target, "--json"]) == 6
    doc = json.loads(capsys.readouterr().out)
    assert {"reason": f"Triton: archive {FIXTURE_TRITON}, here {HERE}", "entries": 10} in doc["reasons"]
    assert not any("without a Triton version" in note for note in doc["unchecked"])
    for e in doc["entries"]:
        if e["kind"] != "group":
            mine = f"{e['key']}/{e['name']}" not in theirs
            assert e["usable"] == mine, e
            assert mine or {"factor": "triton", "archive": FIXTURE_TRITON, "here": HERE} in e["mismatches"]

    root = tmp_path / "root"
    assert main(["unpack", str(merged), "--cache-dir", str(root), "--target", every_target]) == 0
    err = capsys.readouterr().err
    assert f"skipped 10 entries that will not be used here: Triton: archive {FIXTURE_TRITON}, here {HERE}" in err
    written = {f"{p.parent.name}/{p.name}" for p in root.glob("*/*") if not p.name.startswith("__grp__")
               and p.name.endswith((".so", ".autotune.json"))}
    assert written == set(versions) - theirs  # this Triton's autotune result and stub, none of 3.6's

    # Without the names (one root packed whole: its kernels name several Tritons), nothing says whose they are
    mixed = tmp_path / "mixed"
    shutil.copytree(old, mixed)
    shutil.copytree(here, mixed, dirs_exist_ok=True)
    unnamed = tmp_path / "mixed.tpack"
    tritonpack.pack(mixed, unnamed, splice_ptx=True)
    with tritonpack.open(unnamed) as reader:
        assert reader.info.format_version == (1, 1) and reader.info.triton is None
    result = tritonpack.unpack(unnamed, tmp_path / "unnamed", targets=every_target.split(","))
    assert ("not checked: 7 entries without a Triton version of their own (autotune results, launcher stubs, kernels "
            "of Triton before 3.3): the archive records no one Triton that compiled its kernels, so their Triton was "
            "not checked") in result.notes()
    assert len(list((tmp_path / "unnamed").glob("*/*.autotune.json"))) == 2


@another_triton
@pytest.mark.skipif(TRITON_VERSION < (3, 4), reason=f"Triton {HERE} writes no autotune result: the one this test "
                    "makes for it is 3.4's and later")
def test_one_autotune_result_from_two_tritons_is_explained_and_its_conflict_names_them(tmp_path, gpu_cache,
                                                                                        compiled_root, capsys):
    """The same autotune result (key directory and name) in archives attributed to different Tritons: with the
    same bytes it is stored once, as before, and said; with other bytes it is a conflict, as before, whose error and
    notes name both Tritons, and the version kept is the kept entry's."""
    (tuned,) = gpu_cache.glob("*/*.autotune.json")
    a36, same, other = tmp_path / "a36.tpack", tmp_path / "same.tpack", tmp_path / "other.tpack"
    tritonpack.pack(gpu_cache, a36)
    for archive, data in ((same, tuned.read_bytes()), (other, b'{"key": [2], "configs_timings": []}')):
        root = tmp_path / archive.stem
        shutil.copytree(compiled_root, root)
        (root / tuned.parent.name).mkdir()
        (root / tuned.parent.name / tuned.name).write_bytes(data)
        tritonpack.pack(root, archive)
    where = f"{tuned.parent.name}/{tuned.name} (autotune)"

    out = tmp_path / "m.tpack"
    result = tritonpack.merge([a36, same], out)
    assert result.identical == 1 and result.identical_other_triton == [
        f"{where} (Triton {FIXTURE_TRITON} in {a36}, {HERE} in {same}): kept as {a36}'s"]
    assert f"the same bytes from different Tritons, stored once: {result.identical_other_triton[0]}" in result.notes()
    assert named_versions(out)[f"{tuned.parent.name}/{tuned.name}"] == FIXTURE_TRITON

    assert main(["merge", str(a36), str(other), "-o", str(out)]) == 9
    err = capsys.readouterr().err
    assert err.startswith(f"error: {other}: {where} differs from {a36}'s (Triton {FIXTURE_TRITON} in {a36}, {HERE} "
                          f"in {other}) (the same cache key, other files") and err.count("\n") == 1
    last = tritonpack.merge([a36, other], out, prefer="last")
    assert last.conflicts == [f"{where}: kept from {other} (Triton {HERE} in {other}, {FIXTURE_TRITON} in {a36})"]
    assert named_versions(out)[f"{tuned.parent.name}/{tuned.name}"] == HERE
    (verdict,) = [v for v in tritonpack.check(out).verdicts if v.entry.kind == "autotune"]
    assert verdict.usable  # this Triton's, here
