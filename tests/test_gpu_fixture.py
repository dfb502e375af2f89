"""The real H200 cache (autotuned kernel with cache_results, launcher stubs) survives the round trip."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from conftest import snapshot

import tritonpack
from tritonpack.entry import main
from tritonpack.model import named_version
from tritonpack.selection import Selection

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
sys.path.insert(0, str(FIXTURES))
from make_golden import GOLDEN, GOLDEN_MERGED, GOLDEN_SPLICE, OTHER_TRITON, write, write_merged  # noqa: E402


def test_gpu_cache_round_trip(tmp_path, gpu_cache):
    before = snapshot(gpu_cache)
    archive = tmp_path / "gpu.tpack"
    result = tritonpack.pack(gpu_cache, archive)
    assert snapshot(gpu_cache) == before, "pack must never modify its source"
    assert result.entries == {"group": 5, "autotune": 1, "file": 3}
    assert result.foreign_manifests == 5  # made under /tmp/tpfix on the GPU machine
    assert result.skipped == []

    with tritonpack.open(archive) as reader:
        tuned = [e for e in reader.entries if e.kind == "autotune"]
        assert len(tuned) == 1 and tuned[0].autotune.configs == 4
        assert tuned[0].autotune.best_config["kwargs"] == {"BLOCK_SIZE": 2048}
        stubs = [e for e in reader.entries if e.kind == "file"]
        assert {e.stub.ext_suffix for e in stubs} == {".cpython-312-x86_64-linux-gnu.so"}
        assert {e.stub.tag_from for e in stubs} == {"filename"}
        kernels = [e for e in reader.entries if e.kind == "group"]
        assert {e.target for e in kernels} == {"cuda:90"}

    root = tmp_path / "deployed"
    tritonpack.unpack(archive, root, force=True)  # made by Triton 3.6 for Python 3.12: a round trip, not a deploy
    # Every file is back, byte for byte; only the manifests differ, and they point into the new root.
    for rel, (_, _, digest) in before.items():
        path = root / rel
        if path.name.startswith("__grp__"):
            children = json.loads(path.read_text())["child_paths"]
            assert list(children) == list(json.loads((gpu_cache / rel).read_text())["child_paths"])
            assert all(p == str(path.parent / name) and os.path.exists(p) for name, p in children.items())
        else:
            assert snapshot(path.parent)[path.name][2] == digest


def test_gpu_cache_resolves_through_tritons_cache_manager(tmp_path, gpu_cache, monkeypatch):
    pytest.importorskip("triton")
    from triton.runtime.cache import FileCacheManager

    archive = tmp_path / "gpu.tpack"
    tritonpack.pack(gpu_cache, archive)
    root = tmp_path / "root"
    tritonpack.unpack(archive, root, force=True)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(root))
    with tritonpack.open(archive) as reader:
        for entry in reader.entries:
            manager = FileCacheManager(entry.key)
            if entry.kind == "group":
                group = manager.get_group(f"{entry.name}.json")
                assert group is not None and sorted(group) == sorted(f.name for f in entry.files)
            else:
                assert manager.get_file(entry.name) == str(root / entry.key / entry.name)


@pytest.mark.parametrize("splice_ptx", [False, True])
def test_golden_archive_is_reproduced_byte_for_byte(tmp_path, splice_ptx):
    again = tmp_path / "again.tpack"
    write(again, splice_ptx)
    assert again.read_bytes() == (GOLDEN_SPLICE if splice_ptx else GOLDEN).read_bytes()


def test_merged_golden_archive_is_reproduced_byte_for_byte(tmp_path):
    again = tmp_path / "again.tpack"
    write_merged(again)
    assert again.read_bytes() == GOLDEN_MERGED.read_bytes()


def test_merged_golden_archive_reads(tmp_path, capsys):
    """Format 1.2: a merge of two Tritons' archives records no compiling Triton, so the 3.6 autotune result and
    launcher stubs name theirs; the kernels come back as both inputs hold them."""
    with tritonpack.open(GOLDEN_MERGED) as reader:
        assert reader.info.format_version == (1, 2) and reader.info.triton is None
        assert reader.info.created == 1767225600 and reader.info.tritonpack == "1.0.0"
        versions = {(e.kind, named_version(e)) for e in reader.entries}
        assert versions == {("group", "3.6.0"), ("group", "3.9.0"), ("autotune", "3.6.0"), ("file", "3.6.0")}
        assert len(reader.entries) == 15
    assert main(["list", str(GOLDEN_MERGED)]) == 0
    listed = capsys.readouterr().out
    assert listed.count("triton  key") == 3  # kernels, autotune results and other files each show their Triton
    merged, *parts = (tmp_path / name for name in ("merged", "golden", "other"))
    tritonpack.unpack(GOLDEN_MERGED, merged, force=True)
    for archive, root in zip((GOLDEN, OTHER_TRITON), parts, strict=True):
        tritonpack.unpack(archive, root, force=True)
    expected = {rel: digest for root in parts for rel, (_, _, digest) in snapshot(root).items()
                if "__grp__" not in rel}
    assert {rel: digest for rel, (_, _, digest) in snapshot(merged).items() if "__grp__" not in rel} == expected


SPLICED_SIZE_FIRST = GOLDEN.with_name("h200-triton36-v1.1-splice-ptx-size-first-writer.tpack")


@pytest.mark.parametrize("golden", [GOLDEN, GOLDEN_SPLICE,
                                    GOLDEN.with_name("h200-triton36-v1.0-size-first-writer.tpack"),
                                    SPLICED_SIZE_FIRST, GOLDEN.with_name("h200-triton36-v1.0-index12-writer.tpack"),
                                    GOLDEN.with_name("h200-triton36-v1.0-size-order-writer.tpack"),
                                    GOLDEN.with_name("h200-triton36-v1.0-ldm-writer.tpack"),
                                    GOLDEN.with_name("h200-triton36-v1.0-early-writer.tpack")],
                         ids=["current-writer", "splice-ptx", "size-first-writer", "splice-ptx-size-first-writer",
                              "index12-writer", "size-order-writer", "ldm-writer", "early-writer"])
def test_golden_archive_reads(tmp_path, gpu_cache, golden):
    """The current writer's goldens (as pack writes it, and with --splice-ptx: format 1.1, every cubin spliced)
    and those of earlier writers: the first (8 MiB blocks, level 3), the second (level 7 with long-distance
    matching, files by name), the third (types in name order, zstd's level 8), the fourth (today's layout, the
    index at level 12) and the fifth (machine code by size, not launch configuration, first; also spliced)."""
    spliced_golden = golden in (GOLDEN_SPLICE, SPLICED_SIZE_FIRST)
    with tritonpack.open(golden) as reader:
        assert reader.info.format_version == ((1, 1) if spliced_golden else (1, 0))
        spliced = sum(len(b.splices) for b in reader.index.blocks)
        assert spliced == (sum(1 for e in reader.entries if e.kind == "group") if spliced_golden else 0)
        assert reader.info.triton.version == "3.6.0"
        assert reader.info.created == 1767225600
        names = sorted((e.key, e.name) for e in reader.entries)
        assert len(names) == 9
    tritonpack.unpack(golden, tmp_path / "root", force=True)
    src = snapshot(gpu_cache)
    out = snapshot(tmp_path / "root")
    assert {k: v[2] for k, v in src.items() if "__grp__" not in k} == \
           {k: v[2] for k, v in out.items() if "__grp__" not in k}


def test_real_max_autotune_archive_reads_and_unpacks_in_part(tmp_path):
    """The torch.compile max-autotune cache from an H200 (bench/perf.py's real cache): its index lists what the
    compile left, and one kernel family unpacks from the blocks that hold it, as Triton's files and manifests."""
    archive = FIXTURES / "torch-max-autotune-h200-triton36.tpack"
    with tritonpack.open(archive) as reader:
        groups = [e for e in reader.entries if e.kind == "group"]
        assert len(groups) == 780 and {e.target for e in groups} == {"cuda:90"}
        assert sum(e.name.startswith("triton_mm") for e in groups) == 413
        assert len(reader.index.blocks) >= 6  # 211 MB in 32 MiB blocks
    result = tritonpack.unpack(archive, tmp_path / "root", force=True,
                               selection=Selection(kernels=("triton_per_fused_add_native_layer*",)))
    assert result.written > 10 and result.files_written == 7 * (result.written - 1) + 1  # and the launcher stub
    for manifest in (tmp_path / "root").glob("*/__grp__*.json"):
        children = json.loads(manifest.read_text())["child_paths"]
        assert all(os.path.isfile(p) and os.path.dirname(p) == str(manifest.parent) for p in children.values())
