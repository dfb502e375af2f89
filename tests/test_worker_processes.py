"""Unpack's forked worker processes (``staging._stage_in_processes``): the same cache as the threads make, Triton
hits it, and a failure in a worker or in the parent leaves the root as it was, with no worker left running."""
from __future__ import annotations

import errno
import os
import select
import shutil
import signal
import sys
import threading
import time

import pytest
from conftest import no_child_left, snapshot
from invariants import group_problems, temp_files
from kernels import HAS_LISTENER, compile_all

import tritonpack
from tritonpack import staging, workers
from tritonpack.errors import ArchiveError, CacheError

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers are forked on Linux only")


@pytest.fixture()
def archive(tmp_path, compiled_root):
    """The compiled cache in 4 KiB blocks: many blocks, so that several workers share them."""
    from tritonpack.archive.writer import write_archive
    from tritonpack.cacheroot import scan_cache

    tritonpack.pack(compiled_root, tmp_path / "usual.tpack")
    with tritonpack.open(tmp_path / "usual.tpack") as reader:
        info = reader.info
    path = tmp_path / "small-blocks.tpack"
    write_archive(str(path), scan_cache(str(compiled_root)).entries, info, block_size=4096)
    with tritonpack.open(path) as reader:
        assert len(reader.index.blocks) > 8
    return path


@pytest.fixture()
def three_workers(monkeypatch, counted_forks):
    """Three workers whatever the machine's cores (a 1-core CI machine would otherwise stage in threads)."""
    monkeypatch.setattr(workers, "worker_count", lambda reader, blocks: min(3, len(blocks)))
    return counted_forks


def comparable(root) -> dict[str, str]:
    """Files and their sha256, with the root's own path taken out of the manifests' bytes; not ensure's stamps,
    which name the root and its directories' mtimes."""
    out = {}
    for rel, (_, _, digest) in snapshot(root).items():
        if rel.startswith(".tritonpack/"):
            continue
        if "__grp__" in rel:
            digest = (root / rel).read_text().replace(str(root), "ROOT")
        out[rel] = digest
    return out


def test_workers_write_what_threads_write_and_triton_hits(tmp_path, archive, three_workers):
    """Fresh key directories (staged whole) and existing ones (temp names) alike."""
    threads, forked = tmp_path / "threads", tmp_path / "forked"
    tritonpack.unpack(archive, threads)
    with tritonpack.open(archive) as reader:
        keys = sorted({e.key for e in reader.entries})
    for key in keys[::2]:
        (forked / key).mkdir(parents=True)
    result = tritonpack.unpack(archive, forked, processes=True)
    assert len(three_workers) == 3
    assert no_child_left()
    assert result.files_written == sum(1 for rel in snapshot(threads) if "__grp__" not in rel)
    assert comparable(forked) == comparable(threads)
    assert temp_files(forked) == [] and group_problems(str(forked)) == []
    before = snapshot(forked)
    hits = compile_all(forked)
    if HAS_LISTENER:
        assert hits == [True] * len(hits)
    assert snapshot(forked) == before, "a cache hit writes nothing"


def test_blocks_decoded_ahead_but_not_needed_are_dropped(tmp_path, archive, three_workers):
    """Workers decode their first blocks before the plan: where the root holds all but one group, most of those
    are not needed, and only that group is written; where it holds everything, nothing is, and no worker is
    left."""
    root = tmp_path / "root"
    tritonpack.unpack(archive, root)
    complete = snapshot(root)
    result = tritonpack.unpack(archive, root, processes=True)
    assert result.written == 0 and result.files_written == 0 and no_child_left()
    assert snapshot(root) == complete
    victim = sorted(p for p in root.iterdir() if p.is_dir())[-1]
    shutil.rmtree(victim)
    result = tritonpack.unpack(archive, root, processes=True)
    assert result.written == 1 and no_child_left() and len(three_workers) == 6
    assert {rel for rel in snapshot(root)} == set(complete) and temp_files(root) == []
    assert all(snapshot(root)[rel][2] == complete[rel][2] for rel in complete)


def test_a_share_of_manifests_is_written_a_few_mb_at_a_time(tmp_path, archive, monkeypatch, counted_forks):
    """One worker (a large index leaves room for no more) takes every manifest: they are written as they add up,
    not all held until the last (110 MB in the worker for 23,000 groups)."""
    from tritonpack.staging import StageWriter

    log = tmp_path / "batches.log"
    real = StageWriter.stage_batch

    def logged(self, jobs):
        if jobs and all((name or "").startswith("__grp__") for _, name, _ in jobs):
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.write(fd, f"{len(jobs)}\n".encode())
            os.close(fd)
        return real(self, jobs)

    monkeypatch.setattr(workers, "worker_count", lambda reader, blocks: 1)
    monkeypatch.setattr(workers, "HELD_ASSEMBLED", 1)  # every manifest is past it: written one at a time
    monkeypatch.setattr(StageWriter, "stage_batch", logged)
    root = tmp_path / "root"
    tritonpack.unpack(archive, root, processes=True)
    groups = sum(1 for _ in root.rglob("__grp__*.json"))
    batches = [int(line) for line in log.read_text().split()]
    assert len(counted_forks) == 1 and groups > 1 and batches == [1] * groups
    tritonpack.unpack(archive, tmp_path / "threads")
    assert comparable(root) == comparable(tmp_path / "threads")
    assert no_child_left()


@pytest.mark.parametrize("most", [2_000, 1])
def test_the_manifests_go_out_in_a_share_a_worker(tmp_path, archive, three_workers, monkeypatch, most):
    """Small last items even out the workers' ends: each manifest is written once, in one of three shares; or,
    where there are more than three shares' worth (a large cache), in shares of ``MANIFESTS_A_SHARE`` at most,
    items added after the fork."""
    monkeypatch.setattr(workers, "MANIFESTS_A_SHARE", most)
    log = tmp_path / "shares.log"
    real = workers._stage_item

    def logged(w, reader, number, block, data, plan, *rest):
        if block is None:  # runs in a worker: an appended line is the parent's to read
            fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.write(fd, f"{len(plan)}\n".encode())
            os.close(fd)
        return real(w, reader, number, block, data, plan, *rest)

    monkeypatch.setattr(workers, "_stage_item", logged)
    tritonpack.unpack(archive, tmp_path / "root", processes=True)
    groups = sum(1 for p in (tmp_path / "root").rglob("__grp__*.json"))
    shares = [int(line) for line in log.read_text().split()]
    assert len(shares) == max(3, -(-groups // most)) and sum(shares) == groups and max(shares) - min(shares) <= 1
    assert max(shares) <= most and groups > 3  # more shares than workers where ``most`` is 1
    tritonpack.unpack(archive, tmp_path / "threads")
    assert comparable(tmp_path / "root") == comparable(tmp_path / "threads")
    assert no_child_left()


def test_progress_counts_every_file_once(tmp_path, archive, three_workers):
    seen = []
    result = tritonpack.unpack(archive, tmp_path / "root", processes=True,
                               progress=lambda done, total: seen.append((done, total)))
    assert seen and seen[-1][0] == seen[-1][1] == result.bytes_written


def _prepared_root(tmp_path, archive):
    """A root with a key directory for every other group of the archive, emptied: their files get temp names in
    them; the others are staged in fresh directories. Every block is needed."""
    root = tmp_path / "root"
    tritonpack.unpack(archive, root)
    for n, key_dir in enumerate(sorted(p for p in root.iterdir() if p.is_dir())):
        if n % 2:
            shutil.rmtree(key_dir)
        else:
            for f in key_dir.iterdir():
                f.unlink()
    return root


def fails_and_changes_nothing(archive, root, monkeypatch, write_all, expected: str) -> None:
    """Unpack with workers whose every file write goes through ``write_all``: a ``CacheError`` that says
    ``expected``, no child process left, and the root byte for byte as it was, with no temp file."""
    before = snapshot(root)
    monkeypatch.setattr(staging, "_write_all", write_all)
    with pytest.raises(CacheError) as failure:
        tritonpack.unpack(archive, root, processes=True)
    assert expected in failure.value.message
    assert no_child_left()
    assert snapshot(root) == before and temp_files(root) == []


def test_a_corrupt_block_fails_in_its_worker_and_changes_nothing(tmp_path, archive, three_workers):
    with tritonpack.open(archive) as reader:
        block = reader.index.blocks[len(reader.index.blocks) // 2]
    data = bytearray(archive.read_bytes())
    data[block.offset + block.length // 2] ^= 0xFF
    archive.write_bytes(bytes(data))
    root = _prepared_root(tmp_path, archive.with_name("usual.tpack"))
    before = snapshot(root)
    with pytest.raises(ArchiveError) as failure:
        tritonpack.unpack(archive, root, processes=True)
    assert failure.value.path == str(archive) and "block" in failure.value.message
    assert three_workers and no_child_left()
    assert snapshot(root) == before and temp_files(root) == []


@pytest.mark.parametrize("fail_at", [0, 3, 10])
def test_a_full_disk_in_a_worker_changes_nothing(tmp_path, archive, three_workers, monkeypatch, fail_at):
    real, calls = staging._write_all, []

    def failing(fd, data):  # each worker counts its own writes: every worker fails at its fail_at-th
        calls.append(1)
        if len(calls) > fail_at:
            os.close(fd)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd, data)

    fails_and_changes_nothing(archive, _prepared_root(tmp_path, archive), monkeypatch, failing, "No space left")


def test_a_worker_that_is_killed_is_reported_and_its_files_go(tmp_path, archive, three_workers, monkeypatch):
    """It dies mid-block without a word: the parent names the signal, and removes the temp files it never heard
    of, in existing key directories too."""
    parent, real, calls = os.getpid(), staging._write_all, []

    def dying(fd, data):
        calls.append(1)
        real(fd, data)
        if os.getpid() != parent and len(calls) == 5:
            os.kill(os.getpid(), signal.SIGKILL)

    fails_and_changes_nothing(archive, _prepared_root(tmp_path, archive), monkeypatch, dying, "killed by signal 9")


def test_an_interrupted_parent_stops_its_workers_and_changes_nothing(tmp_path, archive, three_workers,
                                                                    monkeypatch):
    root = _prepared_root(tmp_path, archive)
    before = snapshot(root)
    looks = []

    def interrupted(*args):
        looks.append(1)
        if len(looks) == 2:
            raise KeyboardInterrupt
        return select.select(*args)

    monkeypatch.setattr(workers, "select", type("Select", (), {"select": staticmethod(interrupted)}))
    with pytest.raises(KeyboardInterrupt):
        tritonpack.unpack(archive, root, processes=True)
    assert no_child_left()
    assert snapshot(root) == before and temp_files(root) == []


def test_workers_only_where_a_fork_is_safe_and_memory_allows(archive, monkeypatch):
    """Workers where a fork is safe and helps, as many as cores, blocks and memory allow."""
    from types import SimpleNamespace

    from tritonpack.archive.format import IN_FLIGHT
    from tritonpack.archive.source import LocalFile

    cores = len(os.sched_getaffinity(0))
    with tritonpack.open(archive) as reader:
        blocks = list(reader.index.blocks)
        # Other tests may leave a server thread running in this process: say how many threads there are.
        monkeypatch.setattr(threading, "active_count", lambda: 1)
        expected = min(cores, len(blocks))
        assert reader.local and workers.worker_count(reader, blocks) == (expected if expected > 1 else 0)
        assert workers.worker_count(reader, []) == 0
        monkeypatch.setattr(threading, "active_count", lambda: 2)
        assert workers.worker_count(reader, blocks) == 0  # a fork would copy another thread's locks
        monkeypatch.setattr(threading, "active_count", lambda: 1)

    class Wrapped:  # any source but a local file (HTTP ranges, a registry blob) keeps its connection to itself
        def __init__(self, path):
            self.file = LocalFile(path)
            self.name = self.file.name

        def size(self):
            return self.file.size()

        def read_at(self, offset, length):
            return self.file.read_at(offset, length)

        def close(self):
            self.file.close()

    with tritonpack.ArchiveReader(Wrapped(archive)) as remote:
        assert not remote.local and workers.worker_count(remote, blocks) == 0

    small_index = SimpleNamespace(local=True, index_size=1 << 20)
    halves = [SimpleNamespace(size=IN_FLIGHT // 2)] * 8
    assert workers.worker_count(small_index, halves) == (2 if cores > 1 else 0)  # two at once
    # The parent's share grows with the index: fewer workers, and one at least where threads would hold more.
    blocks = [SimpleNamespace(size=32 << 20)] * 64
    monkeypatch.setattr(workers, "cores", lambda: 16)
    assert workers.worker_count(small_index, blocks) == 4  # IN_FLIGHT's share
    assert workers.worker_count(SimpleNamespace(local=True, index_size=10 << 20), blocks) == 3
    assert workers.worker_count(SimpleNamespace(local=True, index_size=30 << 20), blocks) == 2
    assert workers.worker_count(SimpleNamespace(local=True, index_size=60 << 20), blocks) == 1


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")  # a zombie no longer holds anything
    except FileNotFoundError:
        return True


def test_workers_die_with_a_killed_parent_and_the_next_unpack_cleans_up(tmp_path, archive, three_workers,
                                                                      monkeypatch):
    """kill -9 of the command: its workers must not live on, writing temp files for a dead run after the next
    unpack has cleaned up."""
    root, marks = tmp_path / "root", tmp_path / "workers"
    marks.mkdir()
    real = staging._write_all

    def slow(fd, data):
        real(fd, data)
        (marks / str(os.getpid())).touch()
        time.sleep(30)  # left alone, a worker would outlive its parent by this much

    monkeypatch.setattr(staging, "_write_all", slow)
    parent = os.fork()
    if parent == 0:
        try:
            tritonpack.unpack(archive, root, processes=True)
        finally:
            os._exit(0)
    deadline = time.monotonic() + 60
    while len(list(marks.iterdir())) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    workers = [int(p.name) for p in marks.iterdir()]
    assert len(workers) == 3
    os.kill(parent, signal.SIGKILL)
    os.waitpid(parent, 0)
    deadline = time.monotonic() + 10
    while not all(_gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert all(_gone(pid) for pid in workers)
    assert temp_files(root), "the killed run left staged files"
    monkeypatch.setattr(staging, "_write_all", real)
    tritonpack.unpack(archive, root)
    assert temp_files(root) == [] and group_problems(str(root)) == []


@pytest.mark.parametrize("fork", [1, 2, 3])
def test_a_ctrl_c_as_a_worker_is_forked_leaves_no_worker_nor_pipe(tmp_path, archive, three_workers, monkeypatch,
                                                                  fork, interruptible):
    """SIGINT the instant the parent's fork returns, before it has recorded the child: in a program that goes on
    after the KeyboardInterrupt (a server), the workers forked so far, their pipes and the run's lock are gone."""
    counted = os.fork

    def interrupted():
        pid = counted()
        if pid and len(three_workers) == fork:
            signal.raise_signal(signal.SIGINT)
        return pid

    monkeypatch.setattr(os, "fork", interrupted)
    root = _prepared_root(tmp_path, archive)
    before, descriptors = snapshot(root), set(os.listdir("/proc/self/fd"))
    with pytest.raises(KeyboardInterrupt):
        tritonpack.unpack(archive, root, processes=True)
    assert len(three_workers) >= fork and no_child_left()  # it lands once they are recorded
    assert set(os.listdir("/proc/self/fd")) <= descriptors
    assert snapshot(root) == before and temp_files(root) == []


@pytest.mark.parametrize("forks", [0, 1])
def test_a_fork_that_fails_leaves_the_work_to_those_there_are(tmp_path, archive, three_workers, monkeypatch,
                                                              forks):
    """A container's pids limit: with no worker, the threads stage everything; with one, it does all the items."""
    counted, made = os.fork, []

    def limited():
        if len(made) == forks:
            raise BlockingIOError(errno.EAGAIN, os.strerror(errno.EAGAIN))
        pid = counted()
        if pid:
            made.append(pid)
        return pid

    monkeypatch.setattr(os, "fork", limited)
    root = tmp_path / "root"
    tritonpack.unpack(archive, root, processes=True)
    assert len(made) == forks and no_child_left()
    tritonpack.unpack(archive, tmp_path / "threads")
    assert comparable(root) == comparable(tmp_path / "threads") and temp_files(root) == []


def test_the_progress_bar_starts_no_thread(monkeypatch):
    """On a terminal the command draws a progress bar; a refresh thread there would keep unpack from forking."""
    from tritonpack import cli

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    before = threading.active_count()
    with cli._progress(True, "unpacking") as update:
        assert update is not None
        for done in range(0, 11):
            update(done, 10)
        assert threading.active_count() == before


@pytest.mark.parametrize("command", ["unpack", "ensure"])
def test_the_commands_write_with_workers_and_the_api_only_when_asked(tmp_path, archive, three_workers, command):
    """``unpack`` and ``ensure`` (the pod-start path) fork workers; a library call keeps threads by default."""
    from tritonpack.entry import main

    assert main([command, str(archive), "--cache-dir", str(tmp_path / "cli"), "-q"]) == 0
    assert len(three_workers) == 3 and no_child_left()
    api_call = tritonpack.unpack if command == "unpack" else tritonpack.ensure
    api_call(archive, tmp_path / "api")
    assert len(three_workers) == 3
    assert comparable(tmp_path / "cli") == comparable(tmp_path / "api")


def test_workers_fork_on_the_block_table_and_die_with_a_bad_index(tmp_path, three_workers):
    """They fork once the block table is read, before the rest of the index is checked: an index that fails
    after it (an invalid cache key) is refused as without workers, they are gone, and nothing was written."""
    from hostile import KEY, Crafted, group

    entries = [group(KEY, "add_kernel"), group("B" * 52, "mul_kernel")]
    good = Crafted(entries=entries, split=True).build()
    bad = Crafted(entries=entries, split=True, doc_hook=lambda doc: doc["entries"][1].update(key="../x")).build()
    (tmp_path / "good.tpack").write_bytes(good)
    (tmp_path / "bad.tpack").write_bytes(bad)
    tritonpack.unpack(tmp_path / "good.tpack", tmp_path / "good", force=True, processes=True)
    assert len(three_workers) == 3 and no_child_left() and temp_files(tmp_path / "good") == []
    with pytest.raises(ArchiveError) as failure:
        tritonpack.unpack(tmp_path / "bad.tpack", tmp_path / "bad", force=True, processes=True)
    assert "invalid cache key" in failure.value.message
    assert len(three_workers) == 6 and no_child_left() and not (tmp_path / "bad").exists()


def test_the_block_table_is_handed_on_before_the_blobs_where_the_index_is_in_a_writer_s_order(archive):
    """Unpack forks its workers with the block table (``on_head``) and has them verify with the blob table
    (``on_blobs``), both read off the index as it streams in; an index in another order gets neither, and decodes
    the same."""
    import msgpack
    import zstandard

    from tritonpack.archive.format import TRAILER_SIZE, parse_trailer
    from tritonpack.archive.index import decode_index

    data = archive.read_bytes()
    trailer = parse_trailer(data[-TRAILER_SIZE:], len(data), "x")
    start = trailer.index_offset
    raw = zstandard.ZstdDecompressor().decompress(data[start:start + trailer.index_length])
    calls = []
    index = decode_index(raw, "x", (1, 0), on_head=lambda blocks: calls.append(("head", list(blocks))),
                         on_blobs=lambda blobs: calls.append(("blobs", len(blobs))))
    assert calls == [("head", list(index.blocks)), ("blobs", len(index.blobs))]
    doc = msgpack.unpackb(raw)
    reordered = msgpack.packb({"blobs": doc.pop("blobs"), **doc})
    calls.clear()
    assert decode_index(reordered, "x", (1, 0), on_head=calls.append, on_blobs=calls.append) == index
    assert calls == []


def test_a_corrupt_block_that_is_not_needed_fails_nothing(tmp_path, archive, three_workers):
    """Workers decompress the largest blocks before the plan says which are needed: a corrupt one the plan does
    not need (its files are in place) must not fail an unpack that never reads it, as without workers."""
    root = tmp_path / "root"
    tritonpack.unpack(archive, root)
    with tritonpack.open(archive) as reader:
        victim = next(n for n, e in enumerate(reader.entries) if e.kind == "group")
        needed = {reader.index.blobs[reader.blob_of(victim, j)].block for j in range(len(reader.entries[victim].files))}
        blocks = reader.index.blocks
        spare = max((n for n in range(len(blocks)) if n not in needed), key=lambda n: blocks[n].size)
        key = reader.entries[victim].key
    data = bytearray(archive.read_bytes())
    data[blocks[spare].offset + blocks[spare].length // 2] ^= 0xFF
    archive.write_bytes(bytes(data))
    shutil.rmtree(root / key)
    result = tritonpack.unpack(archive, root, processes=True)
    assert result.written >= 1 and len(three_workers) == 3 and no_child_left()
    assert temp_files(root) == [] and group_problems(str(root)) == []


def test_the_first_blocks_blobs_are_verified_while_the_parent_plans(tmp_path, archive, three_workers, monkeypatch):
    """Each worker verifies the blobs of the block it decompressed ahead as soon as the blob table is decoded, not
    after the plan comes: with a slow plan, all of them; and the cache is the one the threads write."""
    from tritonpack import api

    log = tmp_path / "verified.log"
    real_verify, real_preflight = workers._verify_ahead, api.preflight

    def logged(reader, number, data, blobs, checked, commands):
        real_verify(reader, number, data, blobs, checked, commands)
        fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # in a worker: a line for the parent to read
        os.write(fd, f"{len(blobs[1]) // 4} {len(checked)}\n".encode())
        os.close(fd)

    def slow_preflight(*args, **kwargs):
        time.sleep(0.5)
        return real_preflight(*args, **kwargs)

    monkeypatch.setattr(workers, "_verify_ahead", logged)
    monkeypatch.setattr(api, "preflight", slow_preflight)
    tritonpack.unpack(archive, tmp_path / "threads")
    tritonpack.unpack(archive, tmp_path / "workers", processes=True)
    lines = [tuple(map(int, line.split())) for line in log.read_text().splitlines()]
    assert len(lines) == len(three_workers) == 3
    assert all(listed == checked and listed > 0 for listed, checked in lines)
    assert comparable(tmp_path / "workers") == comparable(tmp_path / "threads") and no_child_left()


def test_a_blob_verified_ahead_is_one_that_matches_and_a_waiting_plan_comes_first(archive):
    """Verification ahead adds only the blobs that match their digest (one that does not is checked again, and
    fails, if the plan needs it), and stops as soon as a message waits: staging goes first."""
    import hashlib
    from array import array

    from tritonpack.archive.splice import BlockContent

    data = BlockContent(bytes(range(256)) * 4)
    places = [(0, 100), (100, 300), (400, 624)]
    digests = [hashlib.sha256(data.range(offset, size)).digest() for offset, size in places]
    digests[1] = bytes(32)
    blobs = (10, array("I", [o for o, _ in places]).tobytes(), array("I", [s for _, s in places]).tobytes(),
             b"".join(digests))
    read, write = os.pipe()
    try:
        with tritonpack.open(archive) as reader:
            checked: set[int] = set()
            workers._verify_ahead(reader, 0, data, blobs, checked, read)
            assert checked == {10, 12}
            os.write(write, b"x")  # a plan waits
            checked = set()
            workers._verify_ahead(reader, 0, data, blobs, checked, read)
            assert checked == set()
    finally:
        os.close(read)
        os.close(write)
