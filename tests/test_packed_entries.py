"""A large root's scan holds its entries as packed records (``packedentries``): each reads back as the entry the
plain scan holds, and a pack of them is the same archive, whose unpack Triton hits."""
from __future__ import annotations

import os
import pickle
import shutil
from array import array

import pytest
from conftest import no_child_left

import tritonpack
from tritonpack import cacheroot
from tritonpack.cacheroot import LocalEntry, LocalFiles, scan_cache
from tritonpack.model import GROUP, KernelInfo, index_order
from tritonpack.packedentries import PackedEntries
from tritonpack.selection import Selection


@pytest.fixture()
def mixed_root(tmp_path, compiled_root, gpu_cache):
    """Groups of three targets beside a real cache's autotune results and launcher stubs."""
    root = tmp_path / "cache"
    shutil.copytree(compiled_root, root)
    for key in os.listdir(gpu_cache):
        shutil.copytree(gpu_cache / key, root / key)
    return root


def _packed(monkeypatch, forked: bool):
    monkeypatch.setattr(cacheroot, "PACKED_KEYS", 0)
    if forked:
        monkeypatch.setattr(cacheroot, "ITEMS_PER_PROCESS", 2)
        monkeypatch.setattr(cacheroot, "cores", lambda: 4)


@pytest.mark.parametrize("forked", [False, True])
def test_a_packed_scan_reads_as_the_plain_one(mixed_root, monkeypatch, counted_forks, forked):
    plain = scan_cache(str(mixed_root))
    assert isinstance(plain.entries, list)
    _packed(monkeypatch, forked)
    packed = scan_cache(str(mixed_root), processes=forked)
    assert isinstance(packed.entries, PackedEntries)
    assert list(packed.entries) == plain.entries and packed.skipped == plain.skipped
    assert [packed.entries[i] for i in range(-len(plain.entries), 0)] == plain.entries
    assert plain.entries == sorted(plain.entries, key=index_order)  # the index's order, so the writer sorts none
    kinds = {e.kind for e in plain.entries}
    assert kinds == {"group", "autotune", "file"}
    kept = sum(len(run.kept) for run in packed.entries._runs)  # every group a record, the others as they are
    assert kept == sum(e.kind != "group" for e in plain.entries)
    assert bool(counted_forks) == forked and no_child_left()
    assert list(pickle.loads(pickle.dumps(packed.entries))) == plain.entries


def test_packed_entries_as_a_sequence(tmp_path):
    kernel = KernelInfo("cuda", 90, 32, 4, 3, 1, 1024, "3.6.0", "ab" * 32, {"TRITON_X": "1"})

    def group(key: str, shared: int = 1024) -> LocalEntry:
        files = LocalFiles(str(tmp_path), key, ("k.json", "k.cubin"), array("Q", [10, 20]))
        return LocalEntry(GROUP, key, "k", files, kernel._replace(shared=shared))

    first, second = PackedEntries(str(tmp_path)), PackedEntries(str(tmp_path))
    first.append(group("A" * 52))
    huge = group("B" * 52, shared=2**70)  # past what a record holds: kept as it is
    second.extend([huge, group("C" * 52)])
    first += second
    first.append(group("D" * 52))
    assert [e.key[0] for e in first] == ["A", "B", "C", "D"] and len(second) == 2  # the runs taken, not changed
    assert first[1] is huge and first[-1] == group("D" * 52) and first[2].kernel.env == {"TRITON_X": "1"}
    assert list(pickle.loads(pickle.dumps(first))) == list(first)
    with pytest.raises(IndexError):
        first[4]
    with pytest.raises(TypeError):
        first[1:2]


@pytest.mark.parametrize("options", [{}, {"selection": Selection(archs=("cuda:80",))}, {"since": 0.0}])
def test_a_pack_of_packed_entries_is_the_same_archive_and_hits(tmp_path, compiled_root, monkeypatch, options):
    from kernels import HAS_LISTENER, compile_all

    plain = tritonpack.pack(compiled_root, tmp_path / "plain.tpack", processes=True, **options)
    _packed(monkeypatch, forked=True)
    packed = tritonpack.pack(compiled_root, tmp_path / "packed.tpack", processes=True, **options)
    assert (tmp_path / "packed.tpack").read_bytes() == (tmp_path / "plain.tpack").read_bytes()
    assert packed.entries == plain.entries and packed.files == plain.files
    if options:
        return
    root = tmp_path / "root"
    tritonpack.unpack(tmp_path / "packed.tpack", cache_dir=root)
    hits = compile_all(root)
    if HAS_LISTENER:
        assert hits == [True] * len(hits)


def test_the_writer_sorts_lists_and_refuses_other_sequences_out_of_order(tmp_path, compiled_root, monkeypatch):
    from tritonpack.archive.writer import write_archive
    from tritonpack.errors import ArchiveError

    info = tritonpack.ArchiveInfo("test", (1, 0), None, None, None)
    entries = list(scan_cache(str(compiled_root)).entries)
    write_archive(str(tmp_path / "sorted.tpack"), entries, info)
    write_archive(str(tmp_path / "reversed.tpack"), entries[::-1], info)
    assert (tmp_path / "sorted.tpack").read_bytes() == (tmp_path / "reversed.tpack").read_bytes()
    packed = PackedEntries(str(compiled_root))
    packed.extend(entries[::-1])
    with pytest.raises(ArchiveError, match="out of the index's order"):
        write_archive(str(tmp_path / "packed.tpack"), packed, info)
    assert sorted(os.listdir(tmp_path)) == ["reversed.tpack", "sorted.tpack"]  # no archive, no temp file
