"""A pack's forked helpers (``archive/helpers.py``) read the cache's files into the block buffers and plan the
splices, beside the writer's compressions: the archive is the same bytes as without them, whatever happens to
them (a file that changes during a pack with helpers: ``test_unpack.py``)."""
from __future__ import annotations

import os
import time

import pytest
from conftest import no_child_left

import tritonpack
from tritonpack.archive import helpers, splice, writer
from tritonpack.archive.helpers import BlockHelpers
from tritonpack.archive.writer import write_archive
from tritonpack.cacheroot import scan_cache

BLOCK = 64 << 10  # the compiled root makes several blocks


def _write(path, entries, splice_ptx: bool, with_helpers: BlockHelpers | None = None, threads: int = 4) -> bytes:
    info = tritonpack.ArchiveInfo("test", (1, 1) if splice_ptx else (1, 0), None, None, None)
    write_archive(str(path), entries, info, block_size=BLOCK, splice_ptx=splice_ptx, threads=threads,
                  helpers=with_helpers)
    return path.read_bytes()


@pytest.mark.parametrize("threads", [4, 8])  # four compress and the fifth buffer is filled; or all five compress
@pytest.mark.parametrize("splice_ptx", [False, True])
@pytest.mark.parametrize("failing", [None, "reads", "helpers die"])
def test_helpers_make_the_same_archive(tmp_path, compiled_root, monkeypatch, counted_forks, splice_ptx, failing,
                                       threads):
    """Reads (and plans) go to the helpers; a read a helper cannot do, or a helper that dies, leaves the work to
    the writer: the same bytes each time, and no child left behind."""
    entries = scan_cache(str(compiled_root)).entries
    plain = _write(tmp_path / "threads.tpack", entries, splice_ptx)
    assert not counted_forks
    parent = os.getpid()
    read_here, planned_here = [], []
    real_fill, real_read_files, real_plan = writer._fill, helpers.read_files, splice.plan

    def fill(files, view):
        read_here.append(len(files))
        return real_fill(files, view)

    def read_files(files, view):  # the helpers inherit it
        if failing == "reads":
            raise OSError("a read the helper cannot do")
        if failing == "helpers die":
            os._exit(3)
        return real_read_files(files, view)

    def plan(*args):
        if os.getpid() == parent:
            planned_here.append(args)
        elif failing == "helpers die":
            os._exit(3)
        return real_plan(*args)

    made = []  # buffers the writer makes itself: with helpers, only for a file larger than a block
    real_buffer = writer.block_buffer

    def block_buffer(size):
        made.append(size)
        return real_buffer(size)

    monkeypatch.setattr(writer, "HELD", 5 * BLOCK)  # five buffers, as the command's 32 MiB blocks have
    monkeypatch.setattr(writer, "block_buffer", block_buffer)
    real_compress = writer.compress_block

    def slow_compress(data, level):  # compressions that outlast reads, as a 32 MiB block's do: they pile up
        time.sleep(0.02)
        return real_compress(data, level)

    monkeypatch.setattr(writer, "compress_block", slow_compress)
    monkeypatch.setattr(writer, "_fill", fill)
    monkeypatch.setattr(helpers, "read_files", read_files)
    monkeypatch.setattr(splice, "plan", plan)
    helpers_at_index = []  # helpers still running when the index is encoded: none unless they plan splices
    real_encoding = writer.IndexEncoding

    def encoding(*args):
        helpers_at_index.append(len(forked._children))
        return real_encoding(*args)

    monkeypatch.setattr(writer, "IndexEncoding", encoding)
    with BlockHelpers(2, 5, BLOCK) as forked:
        assert len(counted_forks) == forked.count == 2
        assert _write(tmp_path / "helpers.tpack", entries, splice_ptx, forked, threads) == plain
    assert helpers_at_index == [2 if splice_ptx else 0]
    assert all(size > BLOCK for size in made)  # never a sixth block buffer (a read ahead on 4 cores once made one)
    assert bool(read_here) == (failing is not None)  # every read in the helpers, unless they fail
    assert bool(planned_here) == (splice_ptx and failing == "helpers die")
    assert no_child_left()


@pytest.fixture()
def many_cores(monkeypatch):
    """As on a machine of 8 cores where a fork is safe (in the full suite an earlier test leaves a thread)."""
    monkeypatch.setattr(writer, "cores", lambda: 8)
    monkeypatch.setattr(writer, "fork_safe", lambda: True)


def test_pack_forks_its_helpers_before_the_scan(tmp_path, compiled_root, monkeypatch, counted_forks, many_cores):
    """``pack`` with processes (as the command packs) forks four helpers on 8 cores, before the scan: the same
    archive as a pack without them."""
    from tritonpack import cacheroot

    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    tritonpack.pack(compiled_root, tmp_path / "plain.tpack")
    assert not counted_forks
    real_scan = cacheroot.scan_cache
    forks_at_scan = []

    def scan(path, processes=False):
        forks_at_scan.append(len(counted_forks))
        return real_scan(path, False)

    monkeypatch.setattr(cacheroot, "scan_cache", scan)
    tritonpack.pack(compiled_root, tmp_path / "helpers.tpack", processes=True)
    assert forks_at_scan == [4] == [len(counted_forks)]
    assert (tmp_path / "helpers.tpack").read_bytes() == (tmp_path / "plain.tpack").read_bytes()
    assert no_child_left()


@pytest.mark.parametrize("with_helpers", [False, True])
def test_block_buffers_are_released_after_their_last_block(tmp_path, compiled_root, monkeypatch, with_helpers):
    """Once the last block is read, each buffer's pages are given back as soon as its block is compressed (not all
    at the pack's end), never while a compression reads it; the archive is the same bytes as with none given back."""
    entries = scan_cache(str(compiled_root)).entries
    monkeypatch.setattr(writer, "release", lambda buffer, shared: None)
    kept = _write(tmp_path / "kept.tpack", entries, False)
    events = []
    real_compress, real_release = writer.compress_block, writer.release

    def compress(data, level):
        events.append(("compress", id(data.obj)))
        try:
            return real_compress(data, level)
        finally:
            events.append(("compressed", id(data.obj)))

    def release(buffer, shared):
        events.append(("release", id(buffer)))
        assert shared == with_helpers
        real_release(buffer, shared)

    monkeypatch.setattr(writer, "compress_block", compress)
    monkeypatch.setattr(writer, "release", release)
    monkeypatch.setattr(writer, "HELD", 5 * BLOCK)
    if with_helpers:
        with BlockHelpers(2, 5, BLOCK) as forked:
            written = _write(tmp_path / "released.tpack", entries, False, forked)
    else:
        written = _write(tmp_path / "released.tpack", entries, False)
    assert written == kept
    released = [buffer for what, buffer in events if what == "release"]
    assert len(set(released)) == len(released)  # each once (with helpers, spare buffers too)
    assert {buffer for what, buffer in events if what == "compress"} <= set(released)
    compressing, gone = set(), set()
    for what, buffer in events:
        assert buffer not in gone  # never used again
        if what == "compress":
            compressing.add(buffer)
        elif what == "compressed":
            compressing.discard(buffer)
        else:
            assert buffer not in compressing
            gone.add(buffer)


def test_a_file_span_reads_as_its_bytes(tmp_path):
    """A spilled index is read through ``FileSpan`` where a writer read bytes: items and slices the same."""
    from tritonpack.archive.index import FileSpan

    data = bytes(range(256)) * 3
    with open(tmp_path / "spill", "w+b") as f:
        f.write(b"head" + data)
        f.flush()
        span = FileSpan(f, 4, len(data))
        assert len(span) == len(data)
        assert [span[k] for k in (0, 1, 255, len(data) - 1)] == [data[k] for k in (0, 1, 255, len(data) - 1)]
        for a, b in ((0, 0), (0, 10), (5, 700), (700, 10_000), (-3, None), (None, None)):
            assert span[a:b] == data[a:b]
        with pytest.raises(IndexError):
            span[len(data)]
