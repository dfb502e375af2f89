"""Reading cache roots of every layout, and reporting what is skipped."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from conftest import cache_key, snapshot, thin, without_root_powers

import tritonpack
from tritonpack.cacheroot import scan_cache
from tritonpack.triton_env import key_releases


def first_group(root):
    return next(p.parent for p in sorted(root.glob("*/__grp__*.json")))


@pytest.fixture()
def root(tmp_path, compiled_root):
    copy = tmp_path / "cache"
    shutil.copytree(compiled_root, copy)
    return copy


def test_reads_every_key_encoding(tmp_path, root):
    group = first_group(root)
    for key in ("a" * 64, "AbC-_" + "x" * 38, "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567ABCDEFGHIJKLMNOPQRST"):
        shutil.copytree(group, root / key)  # hex (3.0-3.1), urlsafe base64 (3.2), base32 (3.3+)
    scan = scan_cache(str(root))
    keys = {e.key for e in scan.entries}
    assert {"a" * 64, "AbC-_" + "x" * 38, "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567ABCDEFGHIJKLMNOPQRST"} <= keys
    assert scan.skipped == []


def test_hand_made_keys_are_in_the_encoding_of_the_keys_this_triton_writes(compiled_root):
    """Tests that build archives by hand name their keys with ``cache_key``, which the preflight must take for this
    Triton's."""
    written = {key_releases(p.name) for p in compiled_root.iterdir()}
    assert written == {key_releases(cache_key("hand made"))} != {None}


def test_group_without_source_file(root):
    group = first_group(root)
    manifest = next(group.glob("__grp__*.json"))
    children = json.loads(manifest.read_text())["child_paths"]
    for name in [n for n in children if n.endswith(".source")]:
        del children[name]
        (group / name).unlink()
    manifest.write_text(json.dumps({"child_paths": children}))
    entry = next(e for e in scan_cache(str(root)).entries if e.key == group.name)
    assert [f.name for f in entry.files] == list(children)


def extensions(root) -> set[str]:
    return {os.path.splitext(f.name)[1] for e in scan_cache(str(root)).entries for f in e.files}


def test_nvidia_files(root):
    from kernels import TRITON_VERSION

    exts = extensions(root)
    assert {".cubin", ".ptx", ".json", ".ttir", ".ttgir", ".llir"} <= exts
    if TRITON_VERSION >= (3, 4):
        assert ".source" in exts


def test_amd_files(root):
    import triton
    from kernels import links_amd

    if not links_amd():
        pytest.skip(f"Triton {triton.__version__} runs ROCm's ld.lld to compile for AMD, and finds none here "
                    "(set TRITON_HIP_LLD_PATH to one)")
    assert {".amdgcn", ".hsaco"} <= extensions(root)


def test_skips_are_counted_and_explained(root):
    groups = sorted(p.parent for p in root.glob("*/__grp__*.json"))
    # Triton's temp dir of an interrupted write
    (groups[0] / "tmp.pid_123_abc").mkdir()
    (groups[0] / "tmp.pid_123_abc" / "x.cubin").write_bytes(b"partial")
    # Triton 3.0-3.1's temp file, beside the file it was to replace
    (groups[0] / "add_kernel.cubin.tmp.pid_123_0a1b").write_bytes(b"partial")
    # a killed compile: kernel files, no manifest
    next(groups[1].glob("__grp__*.json")).unlink()
    # a manifest whose child is gone
    victim = next(p for p in groups[2].iterdir() if p.suffix == ".cubin" or p.suffix == ".hsaco")
    victim.unlink()
    # an unreadable manifest
    next(groups[3].glob("__grp__*.json")).write_text("{not json")
    (root / "README").write_text("stray")
    (root / "notakey").mkdir()
    os.symlink(groups[4], root / ("L" * 52))
    scan = scan_cache(str(root))
    reasons = {s.reason.split(":")[0] for s in scan.skipped}
    assert reasons >= {"temporary file of an unfinished write", "incomplete group", "unreadable manifest",
                       "stray file at the root", "not a cache key directory", "symbolic link (never followed)"}
    skipped_keys = {s.path.split("/")[0] for s in scan.skipped}
    assert {groups[1].name, groups[2].name, groups[3].name} <= skipped_keys
    packed_keys = {e.key for e in scan.entries}
    assert not packed_keys & {groups[1].name, groups[2].name, groups[3].name}
    assert groups[0].name in packed_keys  # its temp dir is skipped, the group is fine
    assert [s.reason for s in scan.skipped if s.path.startswith(groups[0].name)] == \
        ["temporary file of an unfinished write"] * 2
    # once each: the unreadable manifest's kernel files are not reported again as a group without a manifest
    assert [s.reason for s in scan.skipped if s.path.startswith(groups[3].name)] == ["unreadable manifest"]


def test_a_key_directory_that_cannot_be_listed_is_a_group_verify_cannot_vouch_for(root, monkeypatch):
    """As for a user who may not read it (the tests run as root, whom permissions do not stop)."""
    import errno

    from tritonpack import cacheroot
    from tritonpack.repair import verify

    hidden = first_group(root)
    listing = os.scandir

    def scandir(path="."):
        if os.fspath(path) == str(hidden):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), os.fspath(path))
        return listing(path)

    monkeypatch.setattr(cacheroot.os, "scandir", scandir)
    report = verify(str(root))  # the fixture's manifests are stale (a copy): they need attention too
    assert [(g.state, g.detail) for g in report.problems if g.path == hidden.name] == \
        [("unreadable", "unreadable: Permission denied")]


def test_an_unreadable_file_skips_its_entry_not_the_whole_pack(tmp_path, root):
    """As an unreadable manifest does: the entry is reported, the rest is packed (a cubin that could not be read
    failed the whole pack when the writer came to it)."""
    prefix = without_root_powers()
    cubin = next(root.glob("*/*.cubin"))
    key = cubin.parent.name
    cubin.chmod(0)
    out = subprocess.run([*prefix, sys.executable, "-m", "tritonpack", "pack", str(root), "-o",
                          str(tmp_path / "k.tpack"), "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    skipped = json.loads(out.stdout)["skipped"]
    assert [s["path"] for s in skipped if s["reason"].startswith("unreadable: Permission denied")] == \
        [f"{key}/{cubin.name}"]
    with tritonpack.open(tmp_path / "k.tpack") as reader:
        keys = {e.key for e in reader.entries}
    assert key not in keys and len(keys) == len({p.parent.name for p in root.glob("*/__grp__*.json")}) - 1


def test_relocate_fixes_what_it_can_and_reports_the_rest(root, monkeypatch):
    """A group whose manifest cannot be rewritten (a read-only key directory) is reported; the others are fixed
    (relocate stopped at the first). Notes are one line per kind of problem."""
    import errno

    from tritonpack import repair

    stuck = first_group(root)
    rewrite = repair.atomic_write

    def atomic_write(directory, name, data):
        if directory == str(stuck):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), directory)
        return rewrite(directory, name, data)

    monkeypatch.setattr(repair, "atomic_write", atomic_write)
    groups = len(list(root.glob("*/__grp__*.json")))
    report = repair.relocate(str(root))
    assert (len(report.fixed), [p.split("/")[0] for p, _ in report.not_fixed]) == (groups - 1, [stuck.name])
    assert report.notes() == [f"not fixed: 1 group: cannot rewrite manifest: Permission denied: "
                              f"{report.not_fixed[0][0]}"]
    stale = repair.verify(str(root)).notes()
    assert len(stale) == 1 and stale[0].startswith("stale: 1 group: points into another root")


def test_verify_reports_what_breaks_triton_and_says_what_it_ignored(tmp_path, root):
    """A manifest Triton's cache manager fails on (a child path that is null: verify raised TypeError, as Triton's
    compile does), a file where a key directory goes (Triton's makedirs fails): broken, and the rest of what the
    scan skipped is listed, where verify said nothing of it and passed."""
    tritonpack.relocate(root)  # a copy of the compiled root: its own manifests first
    manifest = next(root.glob("*/__grp__*.json"))
    doc = json.loads(manifest.read_text())
    doc["child_paths"][next(iter(doc["child_paths"]))] = None
    manifest.write_text(json.dumps(doc))
    key_file = "A" * 52
    (root / key_file).write_text("x")
    (root / "notes.txt").write_text("x")
    report = tritonpack.verify(root)
    broken = {g.path: g.detail for g in report.problems if g.state == "broken"}
    assert broken.keys() == {f"{manifest.parent.name}/{manifest.name}", key_file}
    group = f"{manifest.parent.name}/{manifest.name}"
    assert "Triton's cache manager fails on its manifest (TypeError" in broken[group]
    assert "ignored: 1 item: stray file at the root: notes.txt" in report.notes()
    assert tritonpack.relocate(root).fixed == [f"{manifest.parent.name}/{manifest.name}"]
    assert [g.path for g in tritonpack.verify(root).problems] == [key_file]


@pytest.mark.parametrize("keep", [0, 1000, -1])
def test_a_kernel_binary_cut_short_is_no_group_to_pack_nor_to_relocate(tmp_path, root, keep):
    """A cubin emptied or cut short (a cp killed mid-file, a power loss before the data reached the disk) is a hit
    for Triton, which then fails to load it: pack, verify and relocate report its group incomplete, where they
    packed, passed and repointed it. Cubins end with their program headers, hsaco files with their section headers:
    a cut of the last byte is seen too."""
    cubin = next(root.glob("*/*.cubin"))
    data = cubin.read_bytes()
    cubin.write_bytes(data[:keep])
    group = next(p for p in cubin.parent.glob("__grp__*.json"))
    result = tritonpack.pack(root, tmp_path / "k.tpack")
    cut = [s for s in result.skipped if s.reason.startswith(f"incomplete group: {cubin.name} is cut short")]
    assert [s.path for s in cut] == [f"{cubin.parent.name}/{group.name}"]
    assert f"{cubin.parent.name}/{group.name}" in [g.path for g in tritonpack.verify(root).problems]
    assert f"{cubin.parent.name}/{group.name}" not in tritonpack.relocate(root).fixed


def test_a_second_group_that_lists_another_group_s_file_is_left_out_and_said(tmp_path, root):
    """Two manifests of one key directory naming one file: the pack failed whole at its index's check, naming the
    archive it wrote, exit 3 (bad archive). The second group is left out, with its reason."""
    tritonpack.relocate(root)
    manifest = next(root.glob("*/__grp__*.json"))
    twin = manifest.with_name("__grp__twin_kernel.json")
    doc = json.loads(manifest.read_text())
    metadata = next(n for n in doc["child_paths"] if n == manifest.name.removeprefix("__grp__"))
    (manifest.parent / "twin_kernel.json").write_bytes((manifest.parent / metadata).read_bytes())
    doc["child_paths"]["twin_kernel.json"] = str(manifest.parent / "twin_kernel.json")
    twin.write_text(json.dumps(doc))
    result = tritonpack.pack(root, tmp_path / "k.tpack")
    said = [s for s in result.skipped if s.path == f"{manifest.parent.name}/{twin.name}"]
    assert said and said[0].reason.startswith("its group lists ") and manifest.name in said[0].reason
    assert not any("no manifest" in s.reason for s in result.skipped)


def test_a_relative_cache_dir_s_manifests_are_relocated(tmp_path, root, monkeypatch):
    """Triton under a relative TRITON_CACHE_DIR names the files relative to the working directory: verify said ok
    from that directory only, and relocate left them."""
    tritonpack.relocate(root)
    for manifest in root.glob("*/__grp__*.json"):
        doc = json.loads(manifest.read_text())
        doc["child_paths"] = {n: os.path.relpath(p, tmp_path) for n, p in doc["child_paths"].items()}
        manifest.write_text(json.dumps(doc))
    monkeypatch.chdir(tmp_path)
    report = tritonpack.verify(root)
    assert report.problems and all("relative paths" in g.detail for g in report.problems)
    assert len(tritonpack.relocate(root).fixed) == len(report.problems)
    assert not tritonpack.verify(root).problems
    for manifest in root.glob("*/__grp__*.json"):
        assert all(os.path.isabs(p) for p in json.loads(manifest.read_text())["child_paths"].values())


def test_verify_and_relocate_of_what_is_no_cache_root_are_errors(tmp_path, root, capsys):
    """The directory above a cache root (``~/.triton``), or any other: a health check must not pass on it."""
    from tritonpack.cli import main

    above = tmp_path / "triton"
    above.mkdir()
    shutil.move(str(root), str(above / "cache"))
    for command in ("verify", "relocate"):
        assert main([command, str(above)]) == 4
        assert capsys.readouterr().err == f"error: {above}: no Triton cache entry here; is the cache root " \
                                          f"{above}/cache?\n"
    (tmp_path / "empty").mkdir()  # a fresh root holds nothing: nothing to say
    assert main(["verify", str(tmp_path / "empty"), "-q"]) == 0
    inductor = tmp_path / "torchinductor_me"  # an Inductor root's parent: its Triton root is triton/0
    (inductor / "triton").mkdir(parents=True)
    shutil.move(str(above / "cache"), str(inductor / "triton" / "0"))
    for where in (inductor, inductor / "triton"):
        assert main(["pack", str(where), "-o", str(tmp_path / "k.tpack")]) == 4
        assert f"is the cache root {inductor}/triton/0?" in capsys.readouterr().err


def test_a_root_reached_through_a_symbolic_link_is_no_other_root(tmp_path, root):
    """``~/.triton -> /cache``: manifests written for one path name the very files seen through the other, which
    Triton reads. verify passes both ways (it said stale, exit 1), relocate and unpack write nothing (they rewrote
    every manifest, which fails on a read-only root, and back at the next run through the other path). A
    hard-linked copy is another root: its manifests stay stale until relocated."""
    from kernels import HAS_LISTENER, compile_all

    from tritonpack.cli import main

    archive, real, home = tmp_path / "k.tpack", tmp_path / "volume" / "cache", tmp_path / "home"
    tritonpack.pack(root, archive)
    tritonpack.unpack(archive, real)
    home.mkdir()
    (home / ".triton").symlink_to(real.parent)
    linked = home / ".triton" / "cache"
    before = snapshot(real)
    for path in (linked, real):
        assert main(["verify", str(path)]) == 0
        assert tritonpack.relocate(path).fixed == []
        result = tritonpack.unpack(archive, path)
        assert result.present == result.entries and result.relinked == 0
    hits = compile_all(linked)
    if HAS_LISTENER:
        assert all(hits)
    assert snapshot(real) == before
    copy = tmp_path / "copy"
    shutil.copytree(real, copy, copy_function=os.link)
    assert {g.state for g in tritonpack.verify(copy).groups} == {"stale"}
    assert len(tritonpack.relocate(copy).fixed) == len(list(copy.glob("*/__grp__*.json")))
    assert snapshot(real) == before


def test_pack_never_modifies_the_source_and_reports_skips(tmp_path, root):
    (root / "stray.txt").write_text("x")
    before = snapshot(root)
    result = tritonpack.pack(root, tmp_path / "k.tpack")
    assert snapshot(root) == before
    assert any("stray" in line for line in result.notes())


def test_foreign_manifest_is_read_from_its_own_directory(tmp_path, root):
    """A cp -r'd cache whose old root still exists: read the files here, never the old root's."""
    group = first_group(root)
    json_name = next(n for n in os.listdir(group) if n.endswith(".json") and not n.startswith("__grp__"))
    elsewhere = tmp_path / "old-root" / group.name
    shutil.copytree(group, elsewhere)
    (elsewhere / json_name).write_text('{"poisoned": true}')
    manifest = next(group.glob("__grp__*.json"))
    children = {n: str(elsewhere / n) for n in json.loads(manifest.read_text())["child_paths"]}
    manifest.write_text(json.dumps({"child_paths": children}))
    archive = tmp_path / "k.tpack"
    result = tritonpack.pack(root, archive)
    assert result.foreign_manifests >= 1
    out = tmp_path / "out"
    tritonpack.unpack(archive, out)
    assert (out / group.name / json_name).read_bytes() == (group / json_name).read_bytes()


def test_launcher_stub_tags(tmp_path):
    root = tmp_path / "cache"
    (root / ("K" * 52)).mkdir(parents=True)
    (root / ("K" * 52) / "cuda_utils.so").write_bytes(b"\x7fELF old style")
    (root / ("M" * 52)).mkdir()
    (root / ("M" * 52) / "__triton_launcher.cpython-310-x86_64-linux-gnu.so").write_bytes(b"\x7fELF")
    entries = {e.name: e for e in scan_cache(str(root)).entries}
    assert entries["cuda_utils.so"].stub.tag_from == "packer"
    tagged = entries["__triton_launcher.cpython-310-x86_64-linux-gnu.so"].stub
    assert tagged.ext_suffix == ".cpython-310-x86_64-linux-gnu.so" and tagged.tag_from == "filename"


def test_a_json_that_changed_size_since_the_scan_is_read_whole(tmp_path):
    """The scan reads a manifest or metadata file with one read of the size it saw and a byte more: a file that
    grew since is read to its end, one that shrank is what it now holds, one that is gone or not JSON is None."""
    from tritonpack.cacheroot import _read_json

    path = tmp_path / "k.json"
    data = {"child_paths": {f"file{i}.ptx": "/x" * 40 for i in range(2000)}}
    path.write_text(json.dumps(data))
    size = path.stat().st_size
    for seen in (size, 0, 10, size - 1, size + 1, 10 * size):
        assert _read_json(str(path), seen) == data
    path.write_text("{not json")
    assert _read_json(str(path), size) is None
    assert _read_json(str(tmp_path / "gone.json"), size) is None


def test_missing_root_is_a_clear_error(tmp_path):
    with pytest.raises(tritonpack.CacheError, match="does not exist"):
        tritonpack.pack(tmp_path / "nope", tmp_path / "k.tpack")


def test_odd_but_legal_inputs_pack_into_readable_archives(tmp_path, monkeypatch):
    """Whatever pack writes, the reader accepts: empty files, malformed autotune json, odd names."""
    root = tmp_path / "cache"
    (root / ("E" * 52)).mkdir(parents=True)
    (root / ("E" * 52) / "empty.so").write_bytes(b"")
    (root / ("A" * 52)).mkdir()
    (root / ("A" * 52) / "f.autotune.json").write_text('{"configs_timings": [1]}')
    (root / ("B" * 52)).mkdir()
    (root / ("B" * 52) / "__grp__.json").write_text('{"child_paths": {"x": "/x"}}')
    (root / (("C" * 52) + "\n")).mkdir()
    result = tritonpack.pack(root, tmp_path / "k.tpack")
    assert result.entries == {"group": 0, "autotune": 0, "file": 1}
    assert {s.reason for s in result.skipped} >= {"unreadable autotune result", "manifest names no kernel",
                                                   "not a cache key directory"}
    with tritonpack.open(tmp_path / "k.tpack") as reader:
        assert [e.name for e in reader.entries] == ["empty.so"]
    tritonpack.unpack(tmp_path / "k.tpack", tmp_path / "out", force=True)  # a stub of some Triton, written anyway
    assert (tmp_path / "out" / ("E" * 52) / "empty.so").read_bytes() == b""
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "-1")
    with pytest.raises(tritonpack.UsageError, match="SOURCE_DATE_EPOCH"):
        tritonpack.pack(root, tmp_path / "k2.tpack")


def test_values_an_index_cannot_hold_are_left_out_or_skipped(tmp_path, root):
    """A kernel's metadata whose numbers are no uint (spec §1) packs without them; an autotune result whose values
    msgpack cannot hold, or nested deeper than a reader accepts (§7), is skipped and reported. Either used to fail
    the whole pack, with a traceback past 2^64."""
    group = first_group(root)
    manifest = next(group.glob("__grp__*.json"))
    kernel = group / f"{manifest.name[len('__grp__'):]}"
    fields = json.loads(kernel.read_text())
    fields["num_warps"], fields["shared"] = 1 << 70, 1 << 63
    kernel.write_text(json.dumps(fields))
    deep: object = 1
    for _ in range(32):
        deep = [deep]
    for label, key in (("huge", [1 << 64]), ("deep", [deep])):
        (group / f"{label}.autotune.json").write_text(json.dumps({"key": key, "configs_timings": []}))
    result = tritonpack.pack(root, tmp_path / "k.tpack")
    assert {s.path.rsplit("/", 1)[-1] for s in result.skipped if s.reason == "unreadable autotune result"} == \
        {"huge.autotune.json", "deep.autotune.json"}
    with tritonpack.open(tmp_path / "k.tpack") as reader:
        packed = next(e.kernel for e in reader.entries if e.key == group.name and e.kind == "group")
    assert packed.num_warps is None and packed.shared is None and packed.arch is not None


def test_a_thinned_group_is_packed_with_what_is_left_and_triton_hits_it(tmp_path, root):
    """A group whose IR files are gone, its metadata and binary left: Triton 3.0-3.7 hits it where it is, and pack
    refused it ("incomplete group"), leaving those kernels out of the archive. It is packed with what is left, said
    so, and unpacked as a binary-only group, which every Triton hits."""
    from kernels import HAS_LISTENER, SOURCES, compile_all, targets

    lost = thin(root)
    result = tritonpack.pack(root, tmp_path / "k.tpack")
    assert not result.skipped and {t.path: list(t.missing) for t in result.thinned} == lost
    line = next(n for n in result.notes() if "packed without files" in n)
    assert line.startswith(f"{len(lost)} kernels packed without files their manifests list that are gone")
    assert ".ttir" in line
    assert result.to_dict()["thinned"][0]["missing"] == lost[result.thinned[0].path]
    deploy = tmp_path / "deploy"
    tritonpack.unpack(tmp_path / "k.tpack", deploy)
    before = snapshot(deploy)
    hits = compile_all(deploy)
    if HAS_LISTENER:
        assert hits == [True] * len(SOURCES) * len(targets())
    assert snapshot(deploy) == before


def test_verify_says_which_triton_misses_a_thinned_group_and_relocate_lists_what_is_left(tmp_path, root):
    """Triton 3.8+ recompiles a group that lacks a file its manifest lists; 3.0-3.7 keeps the files that exist.
    verify says so as Triton's own cache manager answers, and relocate rewrites the manifest to list what is left,
    which every Triton hits."""
    import triton
    from kernels import HAS_LISTENER, SOURCES, compile_all, targets

    tritonpack.relocate(root)  # the fixture's copy points into the compiled root
    lost = thin(root)
    strict = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 8)
    report = tritonpack.verify(root)
    if strict:
        assert {g.path for g in report.problems} == set(lost)
        assert all(g.state == "broken" and g.detail.startswith("lists files that are gone (") for g in report.problems)
    else:
        assert report.problems == []
    fixed = tritonpack.relocate(root)
    assert sorted(fixed.fixed) == sorted(fixed.trimmed) == sorted(lost)
    assert any("listed files that are gone" in n for n in fixed.notes())
    assert tritonpack.verify(root).problems == [] and tritonpack.relocate(root).fixed == []
    before = snapshot(root)
    hits = compile_all(root)
    if HAS_LISTENER:
        assert hits == [True] * len(SOURCES) * len(targets())
    assert snapshot(root) == before


def test_a_thinned_group_behind_a_linked_root_is_its_own_not_another_root_s(tmp_path, root):
    """Manifests naming the root through a symbolic link (``TRITON_CACHE_DIR=link``) are the root's own, thinned
    or not: verify called a thinned one "stale: points into another root" (exit 1) on Triton 3.0-3.7, which hits
    it, because the names it lists were compared with those left."""
    import triton

    link = tmp_path / "link"
    link.symlink_to(root)
    for manifest in root.glob("*/__grp__*.json"):  # as Triton writes them with TRITON_CACHE_DIR=link
        children = json.loads(manifest.read_text())["child_paths"]
        manifest.write_text(json.dumps({"child_paths": {n: str(link / manifest.parent.name / n) for n in children}}))
    assert tritonpack.verify(root).problems == []
    lost = thin(root)
    states = {g.path: g.state for g in tritonpack.verify(root).problems}
    strict = tuple(int(p) for p in triton.__version__.split(".")[:2]) >= (3, 8)
    assert states == ({path: "broken" for path in lost} if strict else {})


@pytest.mark.parametrize("there_as", ["link", "directory"])
def test_a_listed_ir_name_there_as_no_file_skips_the_group_saying_what_it_is(tmp_path, root, there_as):
    ttir = next(root.glob("*/*.ttir"))
    manifest = next(ttir.parent.glob("__grp__*.json"))
    ttir.rename(tmp_path / ttir.name)
    if there_as == "link":
        ttir.symlink_to(tmp_path / ttir.name)
    else:
        ttir.mkdir()
    result = tritonpack.pack(root, tmp_path / "k.tpack")
    what = "a symbolic link (never followed)" if there_as == "link" else "no file"
    assert (f"{manifest.parent.name}/{manifest.name}", f"incomplete group: {ttir.name} is {what}") in \
        [(s.path, s.reason) for s in result.skipped]


@pytest.mark.parametrize("kind", [".json", ".cubin"])
def test_a_group_that_lost_its_metadata_or_binary_is_not_packed(tmp_path, root, kind):
    cubin = next(root.glob("*/*.cubin"))
    manifest = next(cubin.parent.glob("__grp__*.json"))
    name = cubin.stem + kind
    (manifest.parent / name).unlink()
    result = tritonpack.pack(root, tmp_path / "k.tpack")
    assert [(s.path, s.reason) for s in result.skipped] == [
        (f"{manifest.parent.name}/{manifest.name}", f"incomplete group: {name} is missing")]
    assert result.thinned == []
