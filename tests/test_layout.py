"""The writer's file order (spec §6 rule 3): alike bytes side by side, decided by the files' own fields."""
from __future__ import annotations

from tritonpack.archive.writer import _layout_order, _unit_files
from tritonpack.cacheroot import LocalEntry, LocalFile
from tritonpack.model import GROUP, KernelInfo


def group(key: str, warps: int, stages: int, arch: int, sizes: dict[str, int], shared: int = 0) -> LocalEntry:
    kernel = KernelInfo("cuda", arch, 32, warps, stages, 1, shared, "3.6.0", None, {})
    files = tuple(LocalFile(f"k.{ext}", f"/c/{key}", size) for ext, size in sizes.items())
    return LocalEntry(GROUP, key, "k", (*files, LocalFile("k.json", f"/c/{key}", 100)), kernel)


def order(entries, block_size: int = 0) -> list[tuple[str, str]]:
    return [(entries[i].key, entries[i].files[j].name) for unit in _layout_order(entries, block_size)
            for i, j, _ in _unit_files(entries, unit)]


def test_machine_code_goes_by_launch_configuration_before_size_and_the_irs_by_size():
    """(num_warps, num_stages, shared) first for cubin, hsaco, ptx and amdgcn; every other type by size."""
    entries = [group("A" * 16, 8, 3, 90, {"cubin": 100, "ptx": 50, "llir": 300}),
               group("B" * 16, 4, 3, 80, {"cubin": 900, "ptx": 70, "llir": 200}),
               group("C" * 16, 4, 3, 90, {"cubin": 900, "ptx": 60, "llir": 100}),
               group("D" * 16, 4, 2, 90, {"cubin": 500, "ptx": 90, "llir": 400})]
    got = order(entries)
    by_type = {ext: [key[0] for key, name in got if name == f"k.{ext}"] for ext in ("cubin", "ptx", "llir", "json")}
    assert [name.rpartition(".")[2] for _, name in got][::4] == ["cubin", "ptx", "llir", "json"]  # slow types first
    # 4/2, then the two 4/3 (same shared memory and size: by target), then 8/3, whatever the sizes
    assert by_type["cubin"] == ["D", "B", "C", "A"]
    assert by_type["ptx"] == ["D", "C", "B", "A"]
    assert by_type["llir"] == ["C", "B", "A", "D"]  # by size alone
    assert by_type["json"] == ["B", "A", "C", "D"]  # same size: by target (cuda:80 first), then name and key


def test_shared_memory_orders_machine_code_of_one_warps_and_stages():
    entries = [group("A" * 16, 4, 3, 90, {"cubin": 100}, shared=32768),
               group("B" * 16, 4, 3, 90, {"cubin": 900}, shared=16384),
               group("C" * 16, 4, 3, 90, {"cubin": 500}, shared=32768)]
    assert [key[0] for key, name in order(entries) if name == "k.cubin"] == ["B", "A", "C"]


def test_a_paired_ptx_and_cubin_go_by_the_launch_configuration_too():
    entries = [group("A" * 16, 8, 3, 90, {"cubin": 100, "ptx": 50}),
               group("B" * 16, 2, 1, 90, {"cubin": 900, "ptx": 70})]
    pairs = [files for unit in _layout_order(entries, block_size=1 << 20)
             if len(files := _unit_files(entries, unit)) == 2]
    assert [(entries[i].key[0], entries[i].files[j].name) for unit in pairs for i, j, _ in unit] == \
        [("B", "k.ptx"), ("B", "k.cubin"), ("A", "k.ptx"), ("A", "k.cubin")]
