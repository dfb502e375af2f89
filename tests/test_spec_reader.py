"""Conformance: the clean-room reader (``spec_reader``, written from spec/tpack-v1.md alone, never importing
tritonpack) and the reference unpack each archive to the same tree, byte for byte (files, manifests, modes), and
refuse the same archives. Where they part, the spec is unclear or one of them is wrong."""
from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import msgpack
import pytest
import spec_reader
from conftest import FIXTURES
from hostile import (
    KEY,
    KEY2,
    MAGIC,
    Crafted,
    autotune,
    empty_source_in_a_splice,
    group,
    repeat_first_meta_key,
    spliced_group,
)

import tritonpack
from tritonpack.archive.reader import ArchiveReader
from tritonpack.cachedest import manifest_bytes
from tritonpack.errors import ArchiveError
from tritonpack.report import UnpackResult
from tritonpack.selection import Selection

ARCHIVES = [*sorted((FIXTURES / "golden").glob("*.tpack")), FIXTURES / "torch-max-autotune-h200-triton36.tpack"]


def tree(root: Path) -> dict[str, tuple[str, int, bytes]]:
    """Every path under ``root``: its type, mode and bytes, with the root's own path taken out of the manifests
    (the only place it appears)."""
    found = {}
    for directory, names, files in os.walk(root):
        for name in names + files:
            path = os.path.join(directory, name)
            st = os.lstat(path)
            data = b""
            if stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    data = f.read()
                if name.startswith("__grp__"):
                    data = data.replace(os.fsencode(root), b"<root>")
            found[os.path.relpath(path, root)] = (stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), data)
    return found


def assert_same_trees(archive: Path, under: Path) -> None:
    ours, theirs = under / "ref", under / "spc"  # one length: the manifests differ only in the root's path
    tritonpack.unpack(archive, ours, force=True)
    spec_reader.unpack(str(archive), str(theirs))
    expected = tree(ours)
    assert expected, "the archive wrote nothing"
    assert tree(theirs) == expected


@pytest.mark.parametrize("archive", ARCHIVES, ids=[p.name for p in ARCHIVES])
def test_both_readers_unpack_the_checked_in_archives_alike(fast_tmp, archive):
    assert_same_trees(archive, fast_tmp)


@pytest.mark.parametrize("splice_ptx", [False, True], ids=["zstd", "zstd-splice"])
def test_both_readers_unpack_a_fresh_archive_alike(fast_tmp, compiled_root, splice_ptx):
    archive = fast_tmp / "k.tpack"
    tritonpack.pack(compiled_root, archive, splice_ptx=splice_ptx)
    assert_same_trees(archive, fast_tmp)


def test_both_readers_unpack_an_archive_whose_stubs_name_no_triton_alike(fast_tmp, gpu_cache):
    """Format 1.3: the H200's stubs and autotune result packed beside only the cuda:80 kernels of Triton 3.9, from a
    root of both, say that their Triton is unknown; a reader that knows no such key unpacks them all the same."""
    root = fast_tmp / "mixed"
    shutil.copytree(gpu_cache, root)
    tritonpack.unpack(FIXTURES / "archives" / "triton-3.9.0.tpack", root, force=True)
    archive = fast_tmp / "k.tpack"
    tritonpack.pack(root, archive, selection=Selection(archs=("cuda:80",)))
    with tritonpack.open(archive) as reader:
        assert reader.info.format_version == (1, 3)
    shutil.rmtree(root)
    assert_same_trees(archive, fast_tmp)


def _tuning_key(arrays: int) -> bytes:
    """An archive of a group and an autotune result whose ``tuning_key`` is a scalar inside ``arrays`` nested
    arrays: ``arrays + 1`` deep (§7)."""
    value: object = 1
    for _ in range(arrays):
        value = [value]
    return Crafted(entries=[group(KEY, "k"), autotune(KEY2, "k")],
                   doc_hook=lambda doc: doc["entries"][1]["meta"].update(tuning_key=value)).build()


# Archives a reader must accept (§1, §2, §7, §9): both write the same tree
ACCEPTED = {
    "ext-values-under-unknown-keys": lambda: Crafted(doc_hook=lambda d: d.update(
        {"x-ext": msgpack.ExtType(5, b"ab"), "x-time": msgpack.Timestamp(1, 2)})).build(),
    "spliced-block-under-a-1.0-header": lambda: Crafted(header=(MAGIC, 1, 0, 0), splice=True,
                                                        entries=[spliced_group(KEY)]).build(),
    "unused-bytes-around-blocks": lambda: Crafted(split=True, gap=7).build(),
    "negative-arch": lambda: Crafted(doc_hook=lambda d: d["entries"][0]["meta"].update(arch=-3)).build(),
    "tuning-key-32-deep": lambda: _tuning_key(31),
    "autotune-result-and-file-naming-their-triton-1.2": lambda: Crafted(
        header=(MAGIC, 1, 2, 0),
        entries=[group(KEY, "k"), autotune(KEY2, "k"),
                 {"kind": "file", "key": KEY2, "name": "x.so", "files": {"x.so": b"\x7fELF"},
                  "meta": {"role": "launcher", "triton_version": "3.9.0"}}],
        doc_hook=lambda d: (d.update(version=[1, 2]), d["entries"][1]["meta"].update(triton_version="3.6.0"))).build(),
    "autotune-result-and-file-whose-triton-is-unknown-1.3": lambda: Crafted(
        header=(MAGIC, 1, 3, 0),
        entries=[group(KEY, "k"), autotune(KEY2, "k"),
                 {"kind": "file", "key": KEY2, "name": "x.so", "files": {"x.so": b"\x7fELF"},
                  "meta": {"role": "launcher", "triton_unknown": True}}],
        doc_hook=lambda d: (d.update(version=[1, 3]), d["entries"][1]["meta"].update(triton_unknown=True))).build(),
}

# Archives a reader must refuse (§4, §7): both refuse them, creating nothing
REFUSED = {
    "bin-key-in-meta": lambda: Crafted(doc_hook=lambda d: d["entries"][0]["meta"].update({b"x": 1})).build(),
    "key-twice-in-meta": lambda: Crafted(raw_hook=repeat_first_meta_key).build(),
    "tuning-key-33-deep": lambda: _tuning_key(32),
    "autotune-triton-version-int": lambda: Crafted(entries=[group(KEY, "k"), autotune(KEY2, "k")], doc_hook=lambda d:
                                                   d["entries"][1]["meta"].update(triton_version=36)).build(),
    "autotune-triton-unknown-int": lambda: Crafted(entries=[group(KEY, "k"), autotune(KEY2, "k")], doc_hook=lambda d:
                                                   d["entries"][1]["meta"].update(triton_unknown=1)).build(),
    "blanks-empty": lambda: Crafted(entries=[spliced_group(KEY)], splice=True,
                                    doc_hook=lambda d: d["blocks"][0]["splices"][0].__setitem__(4, b"")).build(),
    "empty-source-inside-a-text": lambda: Crafted(entries=[spliced_group(KEY)], splice=True,
                                                  doc_hook=empty_source_in_a_splice).build(),
}


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_both_readers_accept_and_agree(tmp_path, name):
    archive = tmp_path / "a.tpack"
    archive.write_bytes(ACCEPTED[name]())
    assert_same_trees(archive, tmp_path)


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_both_readers_refuse(tmp_path, name):
    archive = tmp_path / "a.tpack"
    archive.write_bytes(REFUSED[name]())
    with pytest.raises(ArchiveError):
        tritonpack.unpack(archive, tmp_path / "ref", force=True)
    with pytest.raises(spec_reader.SpecError):
        spec_reader.unpack(str(archive), str(tmp_path / "spc"))
    assert not (tmp_path / "ref").exists() and not (tmp_path / "spc").exists()


def unpack_both(archive: Path, under: Path, prepare: Callable[[Path], None] = lambda root: None,
                overwrite: bool = False) -> tuple[UnpackResult, dict[str, int]]:
    """``prepare`` a root for each reader, unpack ``archive`` over each and require the same trees."""
    ours, theirs = under / "ref", under / "spc"
    for root in (ours, theirs):
        prepare(root)
    result = tritonpack.unpack(archive, ours, force=True, overwrite=overwrite)
    summary = spec_reader.unpack(str(archive), str(theirs), overwrite=overwrite)
    assert tree(ours) == tree(theirs)
    return result, summary


@pytest.mark.parametrize("overwrite", [False, True], ids=["keep", "overwrite"])
def test_both_readers_keep_what_a_rename_cannot_replace(tmp_path, overwrite):
    """§8.1: a group with a directory where the archive has a file, or where its manifest goes, is kept, whatever
    ``overwrite`` says; a file in a key directory's place is kept without ``overwrite`` and replaced with it. The
    rest is written alike."""
    archive = FIXTURES / "golden" / "h200-triton36-v1.0.tpack"
    first = tmp_path / "first"
    tritonpack.unpack(archive, first, force=True)
    groups = sorted(p.parent for p in first.glob("*/__grp__*.json"))
    ptx = next(groups[0].glob("*.ptx"))
    ptx.unlink()
    ptx.mkdir()
    manifest = next(groups[1].glob("__grp__*.json"))
    manifest.unlink()
    manifest.mkdir()
    blocked = [groups[0].name, groups[1].name]
    other = next(p for p in sorted(first.iterdir()) if p.name not in blocked)
    shutil.rmtree(other)
    other.write_bytes(b"the user's")
    before = {}

    def prepare(root: Path) -> None:
        shutil.copytree(first, root, symlinks=True)  # the manifests name the first root's files, in both copies
        before[root.name] = [tree(root / key) for key in blocked]

    result, summary = unpack_both(archive, tmp_path, prepare, overwrite)
    for root in (tmp_path / "ref", tmp_path / "spc"):
        assert [tree(root / key) for key in blocked] == before[root.name]
        assert (root / other.name).is_dir() if overwrite else (root / other.name).read_bytes() == b"the user's"
    assert len(result.file_is_directory) == 2 and len(result.key_not_directory) == (0 if overwrite else 1)
    assert summary["kept"] == (2 if overwrite else 3) and summary["replaced"] == result.replaced == int(overwrite)


@pytest.fixture()
def archives(fast_tmp, compiled_root) -> tuple[Path, Path]:
    """The compiled cache packed whole, and binary-only (each group its metadata json and binary)."""
    whole, binary = fast_tmp / "whole.tpack", fast_tmp / "binary.tpack"
    tritonpack.pack(compiled_root, whole)
    tritonpack.pack(compiled_root, binary, selection=Selection(binary_only=True))
    return whole, binary


def listed(root: Path) -> dict[str, list[str]]:
    """Each group's manifest: the names it lists, in its order."""
    return {str(p.relative_to(root)): list(json.loads(p.read_bytes())["child_paths"])
            for p in sorted(root.glob("*/__grp__*.json"))}


def binary_of(group: Path) -> Path:
    return next(p for p in group.iterdir() if p.suffix in (".cubin", ".hsaco"))


def test_both_readers_find_whole_groups_present_under_a_binary_only_archive(fast_tmp, archives):
    """§8.1's ``O``: a binary-only archive over the complete groups finds them present, whole."""
    whole, binary = archives
    result, summary = unpack_both(binary, fast_tmp, lambda root: tritonpack.unpack(whole, root, force=True))
    assert result.present == summary["present"] == len(listed(fast_tmp / "ref")) > 0
    assert all(len(names) > 2 for names in listed(fast_tmp / "ref").values())


def test_both_readers_drop_from_a_manifest_what_the_key_directory_lacks(fast_tmp, archives):
    """§8.1's ``gone``: a binary-only archive over whole groups, one missing a file its manifest lists and another
    holding a symbolic link there (not a regular file of the key directory): both are repaired, their manifests
    listing the archive's files, then those left of ``O`` in the old manifest's order."""
    whole, binary = archives

    def prepare(root: Path) -> None:
        tritonpack.unpack(whole, root, force=True)
        missing, linked = [p.parent for p in sorted(root.glob("*/__grp__*.json"))[:2]]
        next(missing.glob("*.ttir")).unlink()
        ttir = next(linked.glob("*.ttir"))
        ttir.rename(root.parent / f"{root.name}.ttir")
        ttir.symlink_to(root.parent / f"{root.name}.ttir")

    result, summary = unpack_both(binary, fast_tmp, prepare)
    assert result.written == summary["written"] == 2
    repaired = list(listed(fast_tmp / "ref").values())[:2]
    assert all(names[2:] and not any(n.endswith(".ttir") for n in names) for names in repaired)


def test_both_readers_grow_binary_only_groups_to_the_whole(fast_tmp, archives):
    """A complete archive over binary-only groups writes the missing files and a manifest of them all: the tree a
    fresh unpack gives."""
    whole, binary = archives
    result, summary = unpack_both(whole, fast_tmp, lambda root: tritonpack.unpack(binary, root, force=True))
    assert result.written == summary["written"] == len(listed(fast_tmp / "ref"))
    tritonpack.unpack(whole, fast_tmp / "new", force=True)
    assert tree(fast_tmp / "ref") == tree(fast_tmp / "new")


@pytest.mark.parametrize("overwrite", [False, True], ids=["keep", "overwrite"])
def test_both_readers_replace_a_differing_group_with_what_the_archive_takes(fast_tmp, archives, overwrite):
    """A binary-only archive over a whole group whose binary differs: a conflict, or with ``overwrite`` replaced by
    the archive's files alone (its manifest lists them only; ``O``'s files removed). The other groups are
    present."""
    whole, binary = archives

    def prepare(root: Path) -> None:
        tritonpack.unpack(whole, root, force=True)
        with binary_of(next(root.glob("*/__grp__*.json")).parent).open("ab") as f:
            f.write(b"\0")

    result, summary = unpack_both(binary, fast_tmp, prepare, overwrite)
    group = next((fast_tmp / "ref").glob("*/__grp__*.json")).parent
    if overwrite:
        assert result.replaced == summary["replaced"] == 1
        manifest = next(group.glob("__grp__*.json"))
        names = list(json.loads(manifest.read_bytes())["child_paths"])
        assert len(names) == 2 and sorted(p.name for p in group.iterdir()) == sorted([manifest.name, *names])
    else:
        assert len(result.conflicts) == summary["conflicts"] == 1
        assert len(list(group.iterdir())) > 3
    assert result.present == summary["present"] == len(listed(fast_tmp / "ref")) - 1


@pytest.mark.parametrize("overwrite", [False, True], ids=["keep", "overwrite"])
def test_both_readers_keep_a_linked_key_directory(fast_tmp, archives, overwrite):
    """§8.1: a key directory that is a symbolic link is kept, never written through, even with ``overwrite``."""
    whole, _ = archives
    links, targets, before = [], {}, {}

    def prepare(root: Path) -> None:
        tritonpack.unpack(whole, root, force=True)
        group = next(root.glob("*/__grp__*.json")).parent
        links.append(group)
        targets[root.name] = fast_tmp / f"linked-{root.name}"
        group.rename(targets[root.name])
        binary_of(targets[root.name]).write_bytes(b"another binary")
        group.symlink_to(targets[root.name])
        before[root.name] = tree(targets[root.name])

    result, summary = unpack_both(whole, fast_tmp, prepare, overwrite)
    assert {name: tree(target) for name, target in targets.items()} == before
    assert all(link.is_symlink() for link in links)
    assert len(result.linked) == summary["kept"] == 1


def test_both_readers_find_groups_present_through_a_linked_root(fast_tmp, archives):
    """§8.1's manifest that names the same files: a root unpacked under one path and reached through a symbolic
    link (``~/.triton -> /cache``) is present, its manifests left as they are."""
    whole, _ = archives
    volume = fast_tmp / "volume"
    for name in ("ref", "spc"):
        tritonpack.unpack(whole, volume / name, force=True)
        (fast_tmp / name).symlink_to(volume / name)
    before = tree(volume)
    result = tritonpack.unpack(whole, fast_tmp / "ref", force=True)
    summary = spec_reader.unpack(str(whole), str(fast_tmp / "spc"))
    assert result.present == summary["present"] == result.entries > 0
    assert tree(volume) == before


def test_neither_reader_opens_a_fifo(fast_tmp, archives):
    """A FIFO is not a regular file, never opened (it would block): in a manifest's place it equals nothing and the
    group is relinked; in a file's place it differs and is replaced (``overwrite``). Each reader runs in a child
    with a timeout, so that a hang fails instead of hanging."""
    whole, _ = archives
    for name, command in (("ref", ["-m", "tritonpack", "unpack", str(whole), "--force", "--overwrite",
                                   "--cache-dir"]),
                          ("spc", [spec_reader.__file__, str(whole), "--overwrite"])):
        root = fast_tmp / name
        tritonpack.unpack(whole, root, force=True)
        groups = sorted(p.parent for p in root.glob("*/__grp__*.json"))
        manifest, ttir = next(groups[0].glob("__grp__*.json")), next(groups[1].glob("*.ttir"))
        for fifo in (manifest, ttir):
            fifo.unlink()
            os.mkfifo(fifo)
        done = subprocess.run([sys.executable, *command, str(root)], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0 and "1 relinked" in done.stdout and "1 replaced" in done.stdout, done
        assert manifest.is_file() and ttir.is_file()
    assert tree(fast_tmp / "ref") == tree(fast_tmp / "spc")


@pytest.mark.parametrize("root", ["/", "//", "///", "//a//b/", "/a/./b/../c", "/..", "//..", "a/../../b", ".", "x/"])
def test_the_spec_normalises_a_root_as_the_reference_does(root):
    """§8's lexical normalisation, written out, is what the reference's ``os.path.abspath`` does."""
    assert spec_reader.normalised_root(root) == os.path.abspath(root)


def test_manifests_under_the_filesystem_root_name_one_slash():
    """§8: under ``R`` = ``/`` a key directory is ``/<key>``, in the reference's manifests and the spec's; nothing
    is written to ``/``."""
    archive = FIXTURES / "golden" / "h200-triton36-v1.0.tpack"
    with ArchiveReader(archive) as reader:
        groups = [e for e in reader.entries if e.kind == "group"]
    names = list(groups[0].file_names)
    assert manifest_bytes("/", groups[0]) == spec_reader.manifest_bytes("/", groups[0].key, names)
    assert f'"/{groups[0].key}/'.encode() in manifest_bytes("/", groups[0])
