"""Hostile archives: every way an archive can lie is refused with one line and a non-zero exit, nothing is written
outside the target root, and no group becomes visible unless it is whole."""
from __future__ import annotations

import itertools
import os
import shutil
import struct
import tempfile

import pytest
import zstandard
from hostile import KEY, KEY2, Crafted, autotune, corpus, group
from invariants import expected_groups, group_problems, temp_files, tree

import tritonpack
from tritonpack import api
from tritonpack.archive import limits
from tritonpack.cli import main

CASES = corpus()


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def assert_one_line_error(err: str, archive, code: int, expected: int) -> None:
    assert code == expected, err
    assert err.count("\n") == 1 and err.startswith(f"error: {archive}: "), err
    assert "Traceback" not in err


@pytest.fixture(scope="module")
def fixed_environment():
    return api.environment()


@pytest.fixture(autouse=True)
def _fast_preflight(monkeypatch, fixed_environment):
    """The preflight's view of this machine, computed once: these tests are about the reader and the writer, not
    the local fingerprint (test_compat covers it), and they run thousands of unpacks."""
    monkeypatch.setattr(api, "environment", lambda *a, **k: fixed_environment)


@pytest.mark.parametrize("name", sorted(CASES))
def test_hostile_archive_is_refused(tmp_path, capsys, monkeypatch, name):
    build, expected, env = CASES[name]
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    archive = tmp_path / "hostile.tpack"
    archive.write_bytes(build())
    root = tmp_path / "root"
    before = tree(tmp_path)
    code, out, err = run_cli(capsys, "unpack", archive, "--cache-dir", root)
    assert_one_line_error(err, archive, code, expected)
    assert out == ""
    assert tree(tmp_path) == before, "nothing may be created, not even the root"
    # Listing and checking read the index only: the same refusal, or (for data-region faults) a normal answer.
    for command in (["list"], ["list", "--json"], ["check"]):
        code, out, err = run_cli(capsys, *command, archive)
        if code in (0, 5, 6) and not err:
            assert out
        else:
            assert_one_line_error(err, archive, code, expected)
    assert tree(tmp_path) == before


def _three_entries() -> bytes:
    return Crafted(entries=[group(KEY, "add_kernel"), group(KEY2, "mul_kernel"), autotune(KEY2, "mul_kernel")],
                   split=True).build()


def _boundaries(data: bytes) -> list[int]:
    """Cut points: around the header, every block's start, middle and end, the index and the trailer."""
    index_offset = struct.unpack("<Q", data[-64:-56])[0]
    cuts = {0, 1, 8, 15, 16, 17, index_offset - 1, index_offset, index_offset + 1, (index_offset + len(data)) // 2,
            len(data) - 64, len(data) - 63, len(data) - 56, len(data) - 8, len(data) - 1}
    offset = 16
    while offset < index_offset:
        reader = zstandard.ZstdDecompressor().decompressobj()
        reader.decompress(data[offset:index_offset])
        end = index_offset - len(reader.unused_data)
        cuts.update({offset, offset + 1, (offset + end) // 2, end - 1, end})
        offset = end
    return sorted(c for c in cuts if 0 <= c < len(data))


def test_truncation_at_every_region_boundary(tmp_path, capsys):
    data = _three_entries()
    cuts = _boundaries(data)
    assert len(cuts) >= 20
    for cut in cuts:
        archive = tmp_path / f"cut-{cut}.tpack"
        archive.write_bytes(data[:cut])
        root = tmp_path / f"root-{cut}"
        code, _, err = run_cli(capsys, "unpack", archive, "--cache-dir", root)
        assert_one_line_error(err, archive, code, 3)
        assert not root.exists()


def test_bit_flip_anywhere(tmp_path):
    """Every byte of a small archive (every third in the compressed block) with one bit flipped: refused, or (a
    flip the format does not cover, like the minor version) unpacked whole and correct. Never another exception,
    never a partial group. (tests/test_fuzz_property.py and fuzz/ flip bits at random.)"""
    data = Crafted(entries=[group(KEY, "add_kernel"), autotune(KEY2, "f")]).build()
    good = tmp_path / "good.tpack"
    good.write_bytes(data)
    expected = expected_groups(good)
    outcomes = {"refused": 0, "unpacked": 0}
    index_offset = struct.unpack("<Q", data[-64:-56])[0]
    for i in range(len(data)):
        if 16 < i < index_offset and i % 3:
            continue
        flipped = bytearray(data)
        flipped[i] ^= 1 << (i % 8)
        archive = tmp_path / "flipped.tpack"
        archive.write_bytes(bytes(flipped))
        root = tmp_path / "root"
        try:
            tritonpack.unpack(archive, root, force=True)
        except tritonpack.TpackError:
            outcomes["refused"] += 1
            assert not root.exists(), f"byte {i}: a refused archive left {tree(root)}"
            continue
        outcomes["unpacked"] += 1
        assert not group_problems(root, {k: [v] for k, v in expected.items()}), f"byte {i}"
        assert len([m for m in tree(root) if "__grp__" in m]) == len(expected)
        assert not temp_files(root)
        shutil.rmtree(root)
    assert outcomes["refused"] > 0.9 * sum(outcomes.values()), outcomes


def test_index_value_budget(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(limits, "MAX_INDEX_VALUES", 5000)
    ok = tmp_path / "ok.tpack"
    ok.write_bytes(Crafted().build())
    assert run_cli(capsys, "list", ok)[0] == 0
    archive = tmp_path / "padded.tpack"
    archive.write_bytes(Crafted(doc_hook=lambda d: d.update(padding=[{"v": i} for i in range(3000)])).build())
    code, _, err = run_cli(capsys, "list", archive)
    assert_one_line_error(err, archive, code, 3)
    assert "index holds more than 5000 values" in err
    # The array of blobs is read one blob at a time: it spends as it would in one document.
    archive = tmp_path / "blobs.tpack"
    archive.write_bytes(Crafted(doc_hook=lambda d: d["blobs"].extend([[0, 0, 1, b"x" * 32]] * 1000)).build())
    code, _, err = run_cli(capsys, "list", archive)
    assert_one_line_error(err, archive, code, 3)
    assert "index holds more than 5000 values" in err


def test_an_honest_index_past_the_limit_names_the_limit_and_how_to_raise_it(tmp_path, compiled_root, capsys,
                                                                               monkeypatch):
    """One array longer than the limit (the blobs) is past it, not invalid msgpack: a real archive of a large cache
    meets it. The same archive reads once the limit is raised."""
    archive = tmp_path / "k.tpack"
    tritonpack.pack(compiled_root, archive)
    with tritonpack.open(archive) as reader:
        blobs = len(reader.index.blobs)
    for limit in (blobs - 1, blobs + 10):  # the blobs alone, then all the values
        monkeypatch.setenv(limits.ENV_MAX_INDEX_VALUES, str(limit))
        code, _, err = run_cli(capsys, "list", archive)
        assert_one_line_error(err, archive, code, 3)
        assert err.endswith(f"index holds more than {limit} values, the reader's limit "
                            f"(set {limits.ENV_MAX_INDEX_VALUES} to raise it)\n"), err
    monkeypatch.setenv(limits.ENV_MAX_INDEX_VALUES, str(100 * blobs))
    assert run_cli(capsys, "list", archive)[0] == 0


@pytest.mark.parametrize("variable", [limits.ENV_MAX_INDEX_VALUES, limits.ENV_MAX_UNPACK_BYTES])
def test_pack_refuses_an_archive_past_a_readers_limit_and_says_how_to_write_less(tmp_path, compiled_root, capsys,
                                                                                monkeypatch, variable):
    """Never write what a reader would refuse; an archive that was there stays, and no temp file is left."""
    archive = tmp_path / "k.tpack"
    archive.write_bytes(b"an earlier archive")
    monkeypatch.setenv(variable, "100")  # past the smallest test cache (6 kernels, without hip)
    code, _, err = run_cli(capsys, "pack", compiled_root, "-o", archive)
    assert_one_line_error(err, archive, code, 3)
    assert f"more than a reader {'accepts' if 'VALUES' in variable else 'unpacks'}" in err and variable in err
    assert "write part of it (--arch, --kernel; pack --since)" in err
    assert archive.read_bytes() == b"an earlier archive" and os.listdir(tmp_path) == ["k.tpack"]


@pytest.mark.parametrize("order", ["reversed", "entries-first", "unknown-keys-between"])
def test_an_index_in_another_key_order_reads_the_same(tmp_path, order):
    """A writer's order lets a reader take blobs and entries one by one as msgpack reads them; any other order is
    read as one document, to the same index."""
    def reorder(pairs):
        if order == "reversed":
            return pairs[::-1]
        if order == "entries-first":
            return [pairs[-1], *pairs[:-1]]
        return [*pairs[:-2], ("x", [1, 2]), pairs[-2], ("y", {"z": 1}), pairs[-1], ("w", None)]

    entries = [group(KEY, "add_kernel"), group(KEY2, "mul_kernel"), autotune(KEY2, "mul_kernel")]
    indexes = []
    for hook in (None, reorder):
        path = tmp_path / f"{order}-{hook is None}.tpack"
        path.write_bytes(Crafted(entries=entries, split=True, pairs_hook=hook).build())
        with tritonpack.open(path) as reader:
            indexes.append(reader.index)
    assert indexes[0] == indexes[1]


@pytest.mark.parametrize("chunk", [1, 7, 4096])
def test_the_index_reads_the_same_whatever_its_chunks(monkeypatch, chunk):
    """The index decompresses as msgpack reads it, a chunk of compressed bytes at a time, and ``decode_index``
    looks at the byte after each top-level key for an array: the same index whatever the chunks, including where
    a key ends a chunk."""
    from conftest import FIXTURES

    from tritonpack.archive import reader as reader_module

    archive = FIXTURES / "torch-max-autotune-h200-triton36.tpack"  # 6,241 files, a 0.6 MB index
    with tritonpack.open(archive) as reader:
        whole = reader.index
    monkeypatch.setattr(reader_module, "INDEX_CHUNK", chunk)
    seen = []  # the blocks and the blobs were each read as an array, element by element (not one document)
    with reader_module.ArchiveReader(archive, on_blocks=lambda _, blocks: seen.append(len(blocks)),
                                     on_blobs=lambda blobs: seen.append(len(blobs))) as reader:
        assert reader.index == whole and len(whole.entries) == 781
    assert seen == [len(whole.blocks), len(whole.blobs)]


def test_names_with_control_characters_print_on_one_line(tmp_path, capsys):
    evil = "evil\x1b[2J\nkernel\u202e"
    archive = tmp_path / "evil.tpack"
    archive.write_bytes(Crafted(entries=[group(KEY, evil)]).build())
    root = tmp_path / "root"
    code, out, err = run_cli(capsys, "unpack", archive, "--cache-dir", root, "--force")
    assert code == 0 and out.count("\n") == 1, (out, err)
    assert (root / KEY / f"{evil}.json").exists()
    code, out, _ = run_cli(capsys, "list", archive)
    assert code == 0 and "\x1b" not in out and "\u202e" not in out and "evil\\x1b[2J\\x0akernel\\u202e" in out
    (root / KEY / f"{evil}.ttir").write_text("locally different")
    code, out, err = run_cli(capsys, "unpack", archive, "--cache-dir", root, "--force")
    assert code == 0
    kept = [line for line in err.splitlines() if line.startswith("kept 1 existing entry")]
    assert len(kept) == 1 and "\x1b" not in err and "evil\\x1b[2J\\x0akernel" in kept[0]


def test_symlinked_key_directory_is_never_written_through(tmp_path, capsys):
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    (root / KEY).symlink_to(outside)
    archive = tmp_path / "a.tpack"
    archive.write_bytes(Crafted().build())
    for extra in ([], ["--overwrite"]):
        code, out, err = run_cli(capsys, "unpack", archive, "--cache-dir", root, "--force", *extra)
        assert code == 0 and "1 kept (key directory is a symbolic link)" in out, (out, err)
        assert "kept 1 entry whose key directory is a symbolic link (never written through" in err
        assert "content differs" not in err
        assert list(outside.iterdir()) == []
        assert (root / KEY).is_symlink()


def test_symlinked_file_is_replaced_never_followed(tmp_path, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    archive = tmp_path / "a.tpack"
    archive.write_bytes(Crafted().build())
    root = tmp_path / "root"
    (root / KEY).mkdir(parents=True)
    (root / KEY / "add_kernel.ttir").symlink_to(victim)
    code, _, err = run_cli(capsys, "unpack", archive, "--cache-dir", root, "--force")
    assert code == 0, err  # no manifest: leftovers of an unfinished write, completed
    assert victim.read_text() == "precious"
    assert not (root / KEY / "add_kernel.ttir").is_symlink()
    assert not group_problems(root, {k: [v] for k, v in expected_groups(archive).items()})


def test_an_endless_device_is_refused_at_its_first_bytes(tmp_path, capsys):
    """A character device is read as a stream (``streams``): its header is checked as it arrives, so that
    ``/dev/zero`` is refused at once, not copied until the temp directory is full. (A FIFO: tests/test_streams.py.)"""
    code, _, err = run_cli(capsys, "unpack", "/dev/zero", "--cache-dir", tmp_path / "root")
    assert code == 3 and err == "error: /dev/zero: not a tpack archive (bad magic)\n"
    assert not (tmp_path / "root").exists()


@pytest.mark.parametrize("meta", [
    {}, {"env": None}, {"env": {}}, {"env": []}, {"env": 0}, {"env": {"A": 1}}, {"arch": True}, {"arch": -1},
    {"arch": "gfx942"}, {"num_warps": True}, {"num_warps": -1}, {"shared": 2**63}, {"backend": 1}, {"hash": None},
])
def test_kernel_metadata_fast_path_agrees_with_the_checked_path(meta):
    """Well-formed group metadata skips the field-by-field checks; anything else must go to them unchanged."""
    from tritonpack.archive.index import _decode_meta, _Fields, _kernel_fast

    fast = _kernel_fast(meta, {})
    try:
        checked = _decode_meta("group", _Fields(meta, "entries[0].meta", "x.tpack"))[0]
    except tritonpack.ArchiveError:
        checked = None
    assert fast is None or fast == checked


@pytest.mark.parametrize("name", sorted(CASES))
def test_the_writers_check_refuses_what_the_reader_refuses(name, monkeypatch):
    """``check_index`` (a writer's check of its own index, which keeps nothing it decodes and reads it in parts)
    takes and refuses the indexes ``decode_index`` takes and refuses, with the same message, however the index is
    cut into parts, and with a part read from a file."""
    from tritonpack.archive.index import FileSpan, check_index, decode_index

    build, _, env = CASES[name]
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    data = build()
    try:
        offset, length, size = struct.unpack_from("<QQQ", data, len(data) - 64)
        raw = zstandard.ZstdDecompressor().decompress(data[offset:offset + length], max_output_size=size)
    except Exception:  # no index to decode: a header, trailer or frame case
        return
    bounds = sorted({0, min(1, len(raw)), len(raw) // 3, len(raw) // 2, max(0, len(raw) - 1), len(raw)})
    parts = [b"", *(raw[a:b] for a, b in itertools.pairwise(bounds)), b""]  # empty parts too
    with tempfile.TemporaryFile() as spill:  # the middle of the index read from a file, as a writer spills it
        spill.write(b"x" * 5 + raw[len(raw) // 3:len(raw) // 2])
        spill.flush()
        spilled = [raw[:len(raw) // 3], FileSpan(spill, 5, len(raw) // 2 - len(raw) // 3),
                   raw[len(raw) // 2:]]
        decodes = [lambda: decode_index(raw, "a.tpack", (1, 1)), lambda: check_index([raw], "a.tpack", (1, 1)),
                   lambda: check_index(parts, "a.tpack", (1, 1)), lambda: check_index(spilled, "a.tpack", (1, 1))]
        outcomes = []
        for decode in decodes:
            try:
                decode()
                outcomes.append(None)
            except tritonpack.ArchiveError as e:
                outcomes.append(str(e))
    assert outcomes[0] == outcomes[1] == outcomes[2] == outcomes[3]


def _raw_index(data: bytes) -> bytes:
    offset, length, size = struct.unpack_from("<QQQ", data, len(data) - 64)
    return zstandard.ZstdDecompressor().decompress(data[offset:offset + length], max_output_size=size)


def test_entries_out_of_key_order_are_each_checked_against_all_the_others():
    """In key order an entry is checked against the others of its key only; past one out of order, against all:
    the reader with the entries it kept, the writer's check (which keeps none) by reading the index again. Both
    find a duplicate, or a file claimed twice, that the entry out of order stands between."""
    from tritonpack.archive.index import check_index, decode_index

    for name, message in (("entry-duplicate-out-of-order", f"index: duplicate entry {KEY}/add_kernel"),
                          ("paths-claimed-twice-out-of-order", f"index: {KEY}/b.json is claimed by two entries")):
        raw = _raw_index(CASES[name][0]())
        for decode in (decode_index, lambda raw, *args: check_index([raw], *args)):
            with pytest.raises(tritonpack.ArchiveError) as caught:
                decode(raw, "a.tpack", (1, 0))
            assert str(caught.value).endswith(message), name
    raw = _raw_index(Crafted(entries=[group(KEY, "a"), group(KEY2, "b"), group(KEY, "c"), autotune(KEY2, "f")]).build())
    assert [(e.key, e.name) for e in decode_index(raw, "a.tpack", (1, 0)).entries] == \
        [(KEY, "a"), (KEY2, "b"), (KEY, "c"), (KEY2, "f.autotune.json")]
    check_index([raw], "a.tpack", (1, 0))
