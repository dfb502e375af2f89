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


def _reference_order(entries, block_size: int = 0) -> list[tuple[int, int]]:
    """Spec rule 3 written out with tuples: type rank, then (configuration, size, target, name, key, entry, file)."""
    from tritonpack.archive.writer import BY_CONFIG, _type_rank

    keys = []
    for i, entry in enumerate(entries):
        kernel = entry.kernel
        config = (kernel.num_warps or 0, kernel.num_stages or 0, kernel.shared or 0) if kernel else (0, 0, 0)
        target = kernel.target if kernel else ""
        files = list(entry.files)
        numbers = {f.name: j for j, f in enumerate(files)}
        pairs = {}
        if kernel is not None and block_size:
            for name, j in numbers.items():
                ptx = numbers.get(name[:-len("cubin")] + "ptx") if name.endswith(".cubin") else None
                if ptx is not None and files[ptx].size + files[j].size <= block_size:
                    pairs[ptx] = j
        for j, f in enumerate(files):
            if j in pairs.values():
                continue
            ext = "\0ptx" if j in pairs else "autotune.json" if f.name.endswith(".autotune.json") else \
                f.name.rpartition(".")[2] if "." in f.name else ""
            keys.append((_type_rank(ext), config if ext in BY_CONFIG else (0, 0, 0), f.size, target, f.name,
                         entry.key, i, j))
            if j in pairs:
                keys.append((_type_rank(ext), config, f.size, target, f.name, entry.key, i, j, pairs[j]))
    order = []
    for key in sorted(keys):
        order.append((key[6], key[7]) if len(key) == 8 else (key[6], key[8]))
    return order


def test_the_layouts_int_keys_order_the_files_as_the_fields_would():
    """Each file's sort key is one int (ranks, size and unit): it must order exactly as the tuple of fields."""
    import random

    rng = random.Random(7)
    entries = []
    for n in range(300):
        kernel = KernelInfo(rng.choice(["cuda", "hip"]), rng.choice([80, 90, "gfx942"]), 32, rng.choice([1, 4, 8]),
                            rng.choice([1, 2, 3]), 1, rng.choice([None, 0, 16384]), "3.6.0", None, {}) \
            if n % 7 else None
        names = rng.sample(["k.cubin", "k.ptx", "k.llir", "j.cubin", "j.ptx", "k.json", "x.autotune.json", "plain",
                            "k.hsaco"], rng.randint(1, 6))
        files = tuple(LocalFile(name, f"/c/{n:016d}", rng.choice([0, 10, 100, 2 ** 40, rng.randint(0, 5000)]))
                      for name in names)
        entries.append(LocalEntry(GROUP, f"{n:016d}", "k", files, kernel))
    for block_size in (0, 6000):
        got = [(i, j) for unit in _layout_order(entries, block_size) for i, j, _ in _unit_files(entries, unit)]
        assert got == _reference_order(entries, block_size)
