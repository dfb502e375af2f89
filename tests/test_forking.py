"""Forked processes for the command: pack's scan of a large root, and the map that runs it."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time

import pytest
from conftest import no_child_left, snapshot

import tritonpack
from tritonpack import cacheroot, forking


def test_results_come_back_in_order_from_the_children(counted_forks):
    parent = os.getpid()
    assert forking.forked_map(lambda n: (n * n, os.getpid() == parent), list(range(6))) == \
        [(0, True)] + [(n * n, False) for n in range(1, 6)]
    assert len(counted_forks) == 5 and no_child_left()
    assert forking.forked_map(lambda n: n, []) == [] and forking.forked_map(lambda n: -n, [3]) == [-3]
    assert len(counted_forks) == 5


def test_a_part_whose_child_fails_or_dies_is_done_here(counted_forks):
    parent = os.getpid()

    def fragile(n):
        if os.getpid() != parent and n == 1:
            raise RuntimeError("child failed")
        if os.getpid() != parent and n == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return n, os.getpid() == parent

    assert forking.forked_map(fragile, [0, 1, 2, 3]) == [(0, True), (1, True), (2, True), (3, False)]
    assert len(counted_forks) == 3 and no_child_left()


def test_a_fork_or_a_result_file_that_fails_leaves_the_part_here(monkeypatch):
    monkeypatch.setattr(os, "fork", lambda: (_ for _ in ()).throw(BlockingIOError(11, "out of processes")))
    assert forking.forked_map(lambda n: n + 1, [0, 1, 2]) == [1, 2, 3]
    monkeypatch.undo()
    monkeypatch.setattr(tempfile, "TemporaryFile", lambda: (_ for _ in ()).throw(OSError(24, "Too many open files")))
    assert forking.forked_map(lambda n: n + 1, [0, 1, 2]) == [1, 2, 3]
    assert no_child_left()


def test_a_child_that_cannot_write_its_result_leaves_the_part_here(counted_forks, monkeypatch):
    """A result file that fills up (a full temp directory) fails the child: its part is done here."""
    import pickle

    real_dump = pickle.dump

    def full_disk(obj, file, protocol=None):
        if os.getpid() != parent:
            raise OSError(28, "No space left on device")
        return real_dump(obj, file, protocol=protocol)

    parent = os.getpid()
    monkeypatch.setattr(pickle, "dump", full_disk)
    assert forking.forked_map(lambda n: (n, os.getpid() == parent), [0, 1, 2]) == [(0, True), (1, True), (2, True)]
    assert len(counted_forks) == 2 and no_child_left()


def test_an_interrupted_parent_kills_its_children(counted_forks):
    parent = os.getpid()

    def slow(n):
        if os.getpid() == parent:
            raise KeyboardInterrupt
        time.sleep(30)
        return n

    start = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        forking.forked_map(slow, [0, 1, 2])
    assert time.monotonic() - start < 10 and len(counted_forks) == 2 and no_child_left()


def test_a_ctrl_c_as_a_child_is_forked_leaves_no_child(monkeypatch, counted_forks, interruptible):
    """SIGINT the instant the fork returns, before the parent has recorded the child: it lands once the child is
    one the map kills and reaps, so a program that goes on after the KeyboardInterrupt keeps no child."""
    counted = os.fork

    def interrupted():
        pid = counted()
        if pid:
            signal.raise_signal(signal.SIGINT)
        return pid

    monkeypatch.setattr(os, "fork", interrupted)
    with pytest.raises(KeyboardInterrupt):
        forking.forked_map(lambda n: n, [0, 1, 2])
    assert len(counted_forks) == 1 and no_child_left()


def test_a_ctrl_c_as_the_run_lock_is_made_leaves_no_lock(tmp_path, monkeypatch, interruptible):
    """SIGINT the instant the run's lock file is created, before the run has recorded it: the run removes it."""
    from invariants import temp_files

    from tritonpack.tempfiles import RunLock

    real_open = os.open

    def interrupted(path, *args, **kwargs):
        fd = real_open(path, *args, **kwargs)
        if str(path).endswith(".lock"):
            signal.raise_signal(signal.SIGINT)
        return fd

    monkeypatch.setattr(os, "open", interrupted)
    lock, descriptors = RunLock(str(tmp_path)), set(os.listdir("/proc/self/fd"))
    with pytest.raises(KeyboardInterrupt):
        lock.acquire()
    monkeypatch.setattr(os, "open", real_open)
    assert lock.path is not None and os.path.exists(lock.path)  # recorded, so that the run's cleanup finds it
    lock.release()
    assert temp_files(tmp_path) == [] and set(os.listdir("/proc/self/fd")) <= descriptors


@pytest.fixture()
def odd_root(tmp_path, compiled_root):
    """A root of many key directories, with what the scan skips spread among them."""
    root = tmp_path / "cache"
    shutil.copytree(compiled_root, root)
    keys = sorted(p for p in root.iterdir() if p.is_dir())
    for n in range(40):
        shutil.copytree(keys[n % len(keys)], root / f"{n:02d}{keys[n % len(keys)].name[2:]}")
    (root / "tmp.12345").mkdir()
    (root / "stray.txt").write_text("x")
    (root / "ZZZZZZZZZZZZZZZZZZZZ").symlink_to(keys[0])
    (root / f"{keys[1].name}" / "tmp.partial").write_text("x")
    (root / f"{keys[1].name}" / "notes.txt").write_text("x")
    return root


def test_a_forked_scan_finds_what_one_process_finds_in_the_same_order(odd_root, counted_forks, monkeypatch):
    serial = cacheroot.scan_cache(str(odd_root))
    assert not counted_forks and len(serial.skipped) >= 5
    monkeypatch.setattr(cacheroot, "ITEMS_PER_PROCESS", 8)
    monkeypatch.setattr(cacheroot, "cores", lambda: 4)
    forked = cacheroot.scan_cache(str(odd_root), processes=True)
    assert len(counted_forks) == 3 and no_child_left()
    assert forked.entries == serial.entries and forked.skipped == serial.skipped


def test_pack_forks_its_scan_only_for_the_command_and_when_safe(tmp_path, odd_root, counted_forks, monkeypatch):
    monkeypatch.setattr(cacheroot, "ITEMS_PER_PROCESS", 8)
    monkeypatch.setattr(cacheroot, "cores", lambda: 4)
    tritonpack.pack(odd_root, tmp_path / "api.tpack")
    assert not counted_forks
    from tritonpack.commands import pack_output

    pack_output(str(odd_root), str(tmp_path / "cli.tpack"), quiet=True)
    assert len(counted_forks) == 3
    assert (tmp_path / "api.tpack").read_bytes() == (tmp_path / "cli.tpack").read_bytes()
    stop = threading.Event()
    other = threading.Thread(target=stop.wait)
    other.start()
    try:
        pack_output(str(odd_root), str(tmp_path / "threaded.tpack"), quiet=True)
    finally:
        stop.set()
        other.join()
    assert len(counted_forks) == 3  # another thread runs: no fork
    assert (tmp_path / "threaded.tpack").read_bytes() == (tmp_path / "api.tpack").read_bytes()


def test_no_fork_beside_a_native_thread(tmp_path, odd_root, counted_forks, monkeypatch):
    """A host program's native threads (torch's, CUDA's) are no ``threading.Thread``: the kernel counts them. Here
    one of CPython's own, faulthandler's watchdog."""
    import faulthandler

    from tritonpack.commands import pack_output

    monkeypatch.setattr(cacheroot, "ITEMS_PER_PROCESS", 8)
    monkeypatch.setattr(cacheroot, "cores", lambda: 4)
    faulthandler.dump_traceback_later(3600)
    try:
        assert threading.active_count() == 1 and not forking.fork_safe()
        pack_output(str(odd_root), str(tmp_path / "native.tpack"), quiet=True)
    finally:
        faulthandler.cancel_dump_traceback_later()
    assert not counted_forks
    tritonpack.pack(odd_root, tmp_path / "api.tpack")
    assert (tmp_path / "native.tpack").read_bytes() == (tmp_path / "api.tpack").read_bytes()
    for _ in range(100):  # the watchdog ends as it is cancelled, but the kernel may count it a moment longer
        if forking.fork_safe():
            break
        time.sleep(0.01)
    assert forking.fork_safe()


def _reap_every_child(signum, frame) -> None:
    """A host program's SIGCHLD handler that reaps whatever child ended, tritonpack's too."""
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


@pytest.mark.parametrize("handler", [signal.SIG_IGN, _reap_every_child], ids=["ignored", "reaping-handler"])
def test_no_fork_where_children_could_not_be_waited_for(tmp_path, compiled_root, counted_forks, monkeypatch,
                                                        handler):
    """A process that ignores SIGCHLD (inherited through exec) cannot read its children's exit status, nor can one
    whose handler reaps them first (a host program's): the command's unpack stages in threads and its pack scans in
    one process, and both still work, as does the API's unpack that asks for workers."""
    from tritonpack import workers
    from tritonpack.archive.writer import write_archive
    from tritonpack.commands import pack_output, unpack_output

    monkeypatch.setattr(cacheroot, "ITEMS_PER_PROCESS", 1)
    monkeypatch.setattr(cacheroot, "cores", lambda: 4)
    monkeypatch.setattr(workers, "cores", lambda: 4)
    small = tmp_path / "small-blocks.tpack"  # several blocks: an unpack that would fork its workers
    write_archive(str(small), cacheroot.scan_cache(str(compiled_root)).entries,
                  tritonpack.ArchiveInfo("test", (1, 0), None, None, None), block_size=4096)
    previous = signal.signal(signal.SIGCHLD, handler)
    try:
        assert not forking.fork_safe()
        pack_output(str(compiled_root), str(tmp_path / "k.tpack"), quiet=True)
        unpack_output(str(small), str(tmp_path / "root"), force=True, quiet=True)
        assert tritonpack.unpack(small, tmp_path / "api", force=True, processes=True).written
    finally:
        signal.signal(signal.SIGCHLD, previous)
    assert not counted_forks
    assert forking.fork_safe()
    unpack_output(str(small), str(tmp_path / "again"), force=True, quiet=True)
    assert len(counted_forks) == 4  # the same unpack counted_forks once SIGCHLD is handled again
    src, out = snapshot(compiled_root), snapshot(tmp_path / "root")
    assert {k: v[2] for k, v in src.items() if "__grp__" not in k} == \
           {k: v[2] for k, v in out.items() if "__grp__" not in k}


def test_cores_are_those_this_process_may_run_on(monkeypatch, compiled_root, tmp_path):
    """A pack limited to some CPUs of a large machine (a container's cpuset, taskset) runs as on that many cores:
    its writer's compressions too; with no affinity to ask for (macOS), the machine's count."""
    from tritonpack.archive import writer

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert forking.cores() == 2
    pools = []
    real_pool = writer.ThreadPoolExecutor

    def pool(max_workers, **kwargs):
        pools.append((kwargs.get("thread_name_prefix", "compress"), max_workers))
        return real_pool(max_workers, **kwargs)

    monkeypatch.setattr(writer, "ThreadPoolExecutor", pool)
    tritonpack.pack(compiled_root, tmp_path / "two.tpack")
    assert pools == [("compress", 2), ("read", 2)]
    monkeypatch.delattr(os, "sched_getaffinity")
    assert forking.cores() == 64
