"""Cubins stored without the PTX text they embed, spliced back from their .ptx (spec §5.1, format 1.1)."""
from __future__ import annotations

import hashlib
import random
import shutil
import struct

import pytest
from conftest import snapshot
from kernels import HAS_LISTENER, compile_all

import tritonpack
from tritonpack.archive import splice
from tritonpack.archive.index import CODEC_ZSTD_SPLICE
from tritonpack.archive.writer import write_archive
from tritonpack.cacheroot import scan_cache
from tritonpack.entry import main


def elf(sections: list[tuple[bytes, bytes]]) -> bytes:
    """A minimal 64-bit little-endian ELF file holding ``(name, contents)`` sections and their name table."""
    names = b"\0" + b"".join(name + b"\0" for name, _ in sections) + b".shstrtab\0"
    body, offsets = b"", []
    for _, data in sections:
        offsets.append(64 + len(body))
        body += data
    names_at = 64 + len(body)
    body += names
    headers, position = [bytes(64)], 1
    for (name, data), offset in zip(sections, offsets, strict=True):
        headers.append(struct.pack("<IIQQQQIIQQ", position, 1, 0, 0, offset, len(data), 0, 0, 1, 0))
        position += len(name) + 1
    headers.append(struct.pack("<IIQQQQIIQQ", position, 3, 0, 0, names_at, len(names), 0, 0, 1, 0))
    head = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9) + struct.pack(
        "<HHIQQQIHHHHHH", 2, 190, 1, 0, 0, 64 + len(body), 0, 64, 0, 0, 64, len(headers), len(headers) - 1)
    return head + body + b"".join(headers)


VOCABULARY = [b"\tmov.u32 \t%r1, %tid.x;", b"\t.loc\t1 18 0   // k.py:18:0", b"$L__BB0_1:   // =>Loop",
              b"", b"{", b"}", b"\t// begin inline asm", b"  // @kernel", b"\t\tld.global.b32 %r2, [%rd1];",
              b".version 8.7", b"\t.file\t1 \"/tmp/k.py\"", b"\tret; // done", b"\t", b"\t\t", b" \tx"]


def _soup(rng: random.Random) -> tuple[bytes, bytes]:
    """A .ptx of random lines, and a text derived from it line for line as ptxas might: some lines blanked,
    a few rewritten, the rest without one leading tab."""
    lines = [rng.choice(VOCABULARY) for _ in range(rng.randrange(1, 60))]
    ptx = b"\n".join(lines) + rng.choice([b"", b"\n"])
    text = []
    for line in ptx.split(b"\n"):
        line = line[1:] if line[:1] == b"\t" else line
        roll = rng.random()
        text.append(b"" if roll < 0.3 else line.strip() if roll < 0.35 else line)
    return ptx, b"\0".join(text)


def test_plan_and_derive_round_trip_on_random_line_soups():
    rng = random.Random(5)
    planned = 0
    for _ in range(400):
        ptx, text = _soup(rng)
        cubin = elf([(b".text.k", b"\x01" * rng.randrange(0, 50)), (splice.SECTION, text), (b".nv.info", b"\2" * 8)])
        block = memoryview(ptx + cubin)
        found = splice.plan(block, len(ptx), len(cubin), 0, len(ptx))
        lines = [line[1:] if line[:1] == b"\t" else line for line in ptx.split(b"\n")]
        rewritten = sum(len(t) for t, line in zip(text.split(b"\0"), lines, strict=True) if t and t != line)
        if found is None:  # only where rewritten lines would cost more than a quarter of the text
            assert not text or 4 * rewritten > len(text)  # an empty section is not spliced either
            continue
        planned += 1
        assert found.length == len(text) and cubin[found.at - len(ptx):][:found.length] == text
        assert splice.derive(ptx, found) == text
        stored = bytes(block[:found.at]) + bytes(block[found.at + found.length:])
        content = splice.BlockContent(stored, [found])
        assert bytes(content.range(len(ptx), len(cubin))) == cubin
        for _ in range(5):  # any range: before, across or after the text
            start = rng.randrange(0, len(block))
            size = rng.randrange(0, len(block) - start + 1)
            assert bytes(content.range(start, size)) == bytes(block[start:start + size])
    assert planned > 300


def test_a_text_that_is_not_the_ptx_line_for_line_is_not_spliced():
    ptx = b".version 8.7\n\tmov.u32 %r1, 1;\n\tret;\n"
    block = lambda cubin: memoryview(ptx + cubin)  # noqa: E731
    other_lines = elf([(splice.SECTION, b".version 8.7\0mov.u32 %r1, 1;\0ret;")])  # one line fewer
    rewritten = elf([(splice.SECTION, b"something\0else\0entirely\0")])  # more than a quarter rewritten
    for cubin in (other_lines, rewritten, elf([(b".text", b"x")]), b"not an ELF file at all" * 4, b"\x7fELF",
                  elf([(splice.SECTION, b"")])):
        assert splice.plan(block(cubin), len(ptx), len(cubin), 0, len(ptx)) is None


def test_a_source_of_more_lines_than_its_text_can_hold_is_refused_before_it_is_split(monkeypatch):
    """Every line but the last adds a NUL to the text, so a source with more lines than the text has bytes is
    hostile; so is one past the reader's line limit (a list of lines costs 8 bytes a line and more)."""
    text = b"a\0b\0c"
    assert splice.derive(b"a\nb\nc", splice.Splice(0, 0, 5, len(text), b"\x01")) == text
    with pytest.raises(ValueError, match="more than a text of 2 bytes"):
        splice.derive(b"\n" * 10_000_000, splice.Splice(0, 0, 10_000_000, 2, b"\x01"))
    monkeypatch.setattr(splice, "MAX_SPLICE_LINES", 2)
    with pytest.raises(ValueError, match="reader limit 2"):
        splice.derive(b"a\nb\nc", splice.Splice(0, 0, 5, len(text), b"\x01"))


def test_gaps_encode_in_the_narrowest_width():
    for lines, width in (([0, 3, 4], 1), ([5, 300], 2), ([1, 70000], 4), ([], 1)):
        blanks = splice.encode_gaps(lines)
        assert blanks[0] == width
        gaps = splice.decode_gaps(blanks)
        assert [sum(gaps[:k + 1]) for k in range(len(gaps))] == lines


def test_real_cubins_are_spliced_and_unpack_as_cache_hits(tmp_path, compiled_root):
    """Every cubin Triton compiled here (cuda:80 and cuda:90, this version's ptxas) derives from its .ptx; the
    archive stores none of their PTX text, and the unpacked cache is a hit for every kernel."""
    assert tritonpack.pack(compiled_root, tmp_path / "plain.tpack").cubins is None  # counted only when asked
    result = tritonpack.pack(compiled_root, tmp_path / "k.tpack", splice_ptx=True)
    cubins = sum(1 for _ in compiled_root.glob("*/*.cubin"))
    assert result.cubins == result.spliced == cubins > 0
    with tritonpack.open(tmp_path / "k.tpack") as reader:
        assert reader.info.format_version == (1, 1)
        assert any(b.codec == CODEC_ZSTD_SPLICE for b in reader.index.blocks)
        stored = sum(b.stored for b in reader.index.blocks)
        texts = sum(s.length for b in reader.index.blocks for s in b.splices)
        assert stored + texts == sum(b.size for b in reader.index.blocks)
    root = tmp_path / "root"
    assert main(["unpack", str(tmp_path / "k.tpack"), "--cache-dir", str(root), "-q"]) == 0
    assert {k: v[2] for k, v in snapshot(root).items() if "__grp__" not in k} == \
           {k: v[2] for k, v in snapshot(compiled_root).items() if "__grp__" not in k}
    hits = compile_all(root)
    if HAS_LISTENER:
        assert hits == [True] * len(hits)


def test_binary_only_unpack_of_spliced_cubins_writes_no_ptx_and_hits(tmp_path, compiled_root):
    tritonpack.pack(compiled_root, tmp_path / "k.tpack", splice_ptx=True)
    root = tmp_path / "root"
    assert main(["unpack", str(tmp_path / "k.tpack"), "--cache-dir", str(root), "--binary-only", "-q"]) == 0
    assert not list(root.glob("*/*.ptx")) and list(root.glob("*/*.cubin"))
    for cubin in root.glob("*/*.cubin"):
        assert cubin.read_bytes() == (compiled_root / cubin.parent.name / cubin.name).read_bytes()
    hits = compile_all(root)
    if HAS_LISTENER:
        assert hits == [True] * len(hits)


def test_cubins_that_do_not_derive_are_stored_whole_and_counted(tmp_path, compiled_root, capsys):
    root = tmp_path / "cache"
    shutil.copytree(compiled_root, root)
    cubins = sorted(root.glob("*/*.cubin"))
    ptx = cubins[0].with_suffix(".ptx")
    ptx.write_bytes(ptx.read_bytes() + b"\n// one line more than the cubin embeds\n")
    cubins[1].write_bytes(b"\x7fELF\x02\x01".ljust(64, b"\0") + b"no text of its .ptx" * 100)  # an ELF header alone
    assert main(["pack", str(root), "-o", str(tmp_path / "k.tpack"), "--splice-ptx"]) == 0
    said = capsys.readouterr()
    assert f"2 of {len(cubins)} cubins stored whole" in said.out + said.err
    assert main(["unpack", str(tmp_path / "k.tpack"), "--cache-dir", str(tmp_path / "out"), "-q"]) == 0
    assert {k: v[2] for k, v in snapshot(tmp_path / "out").items() if "__grp__" not in k} == \
           {k: v[2] for k, v in snapshot(root).items() if "__grp__" not in k}


@pytest.mark.parametrize("block_size", [4096, 1 << 20])
def test_shared_ptx_and_pairs_too_big_for_a_block_round_trip(tmp_path, compiled_root, block_size):
    """Two groups whose .ptx is one blob: the second cubin derives from the first's .ptx (some lines rewritten)
    or is stored whole, and unpacks exact either way. A .ptx and cubin larger together than a block are not
    paired: nothing is spliced."""
    root = tmp_path / "cache"
    shutil.copytree(compiled_root, root)
    groups = sorted(p.parent for p in root.glob("*/*.cubin"))
    first, second = (next(g.glob("*.ptx")) for g in groups[:2])
    second.write_bytes(first.read_bytes())
    scan = scan_cache(str(root))
    info = tritonpack.ArchiveInfo("test", (1, 1), None, None, None)
    written = write_archive(str(tmp_path / "k.tpack"), scan.entries, info, block_size=block_size, splice_ptx=True)
    assert written.cubins == (0 if block_size == 4096 else len(groups)) and written.spliced <= written.cubins
    assert main(["unpack", str(tmp_path / "k.tpack"), "--cache-dir", str(tmp_path / "out"), "-q"]) == 0
    out = snapshot(tmp_path / "out")
    for path in root.glob("*/*"):
        if "__grp__" not in path.name:
            key = f"{path.parent.name}/{path.name}"
            assert out[key][2] == hashlib.sha256(path.read_bytes()).hexdigest(), key


def test_with_splices_a_cubin_goes_with_its_ptx_ranked_first(tmp_path, compiled_root):
    """spec §6.7: a group's .cubin goes with its .ptx in one block, ranked first and ordered by the .ptx: a run of
    pairs lays all its .ptx files, then all its cubins in the same order; the rest keeps §6.3's order."""
    from tritonpack.archive.writer import SLOW_FIRST

    tritonpack.pack(compiled_root, tmp_path / "k.tpack", splice_ptx=True)
    with tritonpack.open(tmp_path / "k.tpack") as reader:
        assert len(reader.index.blocks) == 1
        first: dict[int, tuple] = {}
        for n, entry in enumerate(reader.entries):
            sizes = {f.name: f.size for f in entry.files}
            for f, blob in zip(entry.files, reader.entry_blobs(n), strict=True):
                stem, dot, ext = f.name.rpartition(".")
                ext = "autotune.json" if f.name.endswith(".autotune.json") else ext if dot else ""
                rank = SLOW_FIRST.index(ext) if ext in SLOW_FIRST else len(SLOW_FIRST)
                key = (rank, ext, f.size, entry.target or "")
                if ext in ("cubin", "ptx") and {f"{stem}.cubin", f"{stem}.ptx"} <= set(sizes):
                    key = (0, ext == "cubin", sizes[f"{stem}.ptx"], entry.target)  # the pair's .ptx, then cubin
                first[blob] = min(first.get(blob, key), key)
        refs = reader.index.blobs
        assert [(refs[b].block, refs[b].offset) for b in sorted(first)] == sorted((r.block, r.offset) for r in refs)
        keys = [first[b] for b in sorted(first)]
    pairs = [k for k in keys if k[1] in (False, True)]
    assert pairs and keys[:len(pairs)] == pairs  # the pairs first: every .ptx, then every cubin, in one order
    assert [k[2:] for k in pairs if not k[1]] == [k[2:] for k in pairs if k[1]] == sorted(k[2:] for k in pairs if k[1])
    rest = keys[len(pairs):]
    assert rest == sorted(rest)


def test_workers_write_assembled_cubins_as_they_go(tmp_path, compiled_root, monkeypatch, counted_forks):
    """A spliced block's cubins are new bytes, not views of the decoded block: a worker writes them every few MB
    instead of holding a block's worth. At a limit of one byte, every cubin is written on its own, and each file
    is still staged, reported and committed once."""
    from tritonpack import workers

    monkeypatch.setattr(workers, "HELD_ASSEMBLED", 1)
    monkeypatch.setattr(workers, "worker_count", lambda reader, blocks: min(3, len(blocks)))  # any machine's cores
    info = tritonpack.ArchiveInfo("test", (1, 1), None, None, None)
    written = write_archive(str(tmp_path / "k.tpack"), scan_cache(str(compiled_root)).entries, info,
                            block_size=64 << 10, splice_ptx=True)  # several blocks: worker processes
    assert written.spliced == written.cubins > 0
    with tritonpack.open(tmp_path / "k.tpack") as reader:
        assert len(reader.index.blocks) >= 2
    assert main(["unpack", str(tmp_path / "k.tpack"), "--cache-dir", str(tmp_path / "out"), "-q"]) == 0
    assert counted_forks, "the command stages with worker processes"
    assert {k: v[2] for k, v in snapshot(tmp_path / "out").items() if "__grp__" not in k} == \
           {k: v[2] for k, v in snapshot(compiled_root).items() if "__grp__" not in k}
    assert not list((tmp_path / "out").rglob("tmp.*"))


def test_splicing_with_no_cubin_beside_its_ptx_writes_a_1_0_archive_and_says_so(tmp_path, compiled_root):
    """A binary-only pack (no .ptx) or a HIP cache asked to splice: nothing can be, so no 1.1 feature is used and
    the archive says 1.0 (spec §9); without --splice-ptx the cubins are not counted (null), not 0."""
    from tritonpack.selection import Selection

    result = tritonpack.pack(compiled_root, tmp_path / "b.tpack", splice_ptx=True,
                             selection=Selection(binary_only=True))
    assert (result.cubins, result.spliced) == (0, 0)
    assert "--splice-ptx: no cubin beside its group's .ptx, so nothing was spliced (a 1.0 archive)" in result.notes()
    with tritonpack.open(tmp_path / "b.tpack") as reader:
        assert reader.info.format_version == (1, 0)
    plain = tritonpack.pack(compiled_root, tmp_path / "p.tpack")
    assert (plain.to_dict()["cubins"], plain.to_dict()["spliced"]) == (None, None)
