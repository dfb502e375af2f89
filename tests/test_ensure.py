"""ensure: unpack once, near-free afterwards, one writer among many concurrent processes, preflight honoured."""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from conftest import FIXTURES, snapshot, without_root_powers  # noqa: E402
from kernels import HAS_LISTENER, compile_all  # noqa: E402

import tritonpack  # noqa: E402
from tritonpack.ensuring import KEPT_STAMPS, archive_digest, environment_key  # noqa: E402
from tritonpack.entry import main  # noqa: E402

OTHER_VERSION = next((p for p in sorted((FIXTURES / "archives").glob("triton-*.tpack"))
                      if p.stem.removeprefix("triton-") != triton.__version__), None)

# Waits for the start gate, then calls ensure: every process arrives at (nearly) the same moment.
RACER = textwrap.dedent("""
    import json, os, sys, time
    import tritonpack
    archive, root, gate = sys.argv[1:4]
    open(f"{gate}.ready.{os.getpid()}", "w").close()
    while not os.path.exists(gate):
        time.sleep(0.001)
    result = tritonpack.ensure(archive, root)
    print(json.dumps(result.to_dict()))
""")
# Compiles the test kernels against a root, in a process of its own: prints the listener's cache_hit per compile.
COMPILER = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, sys.argv[1])
    from kernels import compile_all
    print(json.dumps(compile_all(sys.argv[2])))
""")


@pytest.fixture()
def archive(tmp_path, compiled_root):
    path = tmp_path / "checkpoint" / "kernels.tpack"
    path.parent.mkdir()
    tritonpack.pack(compiled_root, path)
    return path


def test_first_call_unpacks_then_calls_are_near_free_and_write_nothing(tmp_path, archive):
    root = tmp_path / "root"
    first = tritonpack.ensure(archive, root)
    assert first.status == "unpacked" and first.ok and not first.waited
    assert first.written == first.usable == first.entries > 0
    before = snapshot(root)
    again = tritonpack.ensure(archive, root)
    assert again.status == "present" and again.written == 0 and again.usable == first.usable
    assert snapshot(root) == before
    assert again.stamp == first.stamp and os.path.dirname(again.stamp) == str(root / ".tritonpack")
    # The unpacked root is a plain Triton cache: hits, and the stamp directory is not cache content to pack.
    hits = compile_all(root)
    if HAS_LISTENER:
        assert all(hits)
    assert tritonpack.pack(root, tmp_path / "again.tpack").skipped == []


def test_many_processes_at_once_exactly_one_writes(tmp_path, archive):
    root, gate = tmp_path / "root", tmp_path / "go"
    tritonpack.check(archive)  # warm the fingerprint cache that every process shares
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(archive), str(root), str(gate)],
                              stdout=subprocess.PIPE, text=True) for _ in range(6)]
    while len(list(tmp_path.glob("go.ready.*"))) < len(procs):  # all imported, all waiting at the gate
        time.sleep(0.01)
    gate.touch()
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    writers = [r for r in results if r["status"] == "unpacked"]
    assert len(writers) == 1 and writers[0]["written"] == writers[0]["entries"]
    assert all(r["status"] == "present" and r["written"] == 0 for r in results if r not in writers)
    alone = tmp_path / "alone"
    tritonpack.unpack(archive, alone)
    assert {p.relative_to(alone) for p in alone.rglob("*")} == \
        {p.relative_to(root) for p in root.rglob("*") if ".tritonpack" not in p.parts}


def test_a_caller_waits_for_the_lock_holder(tmp_path, archive):
    import fcntl

    root = tmp_path / "root"
    (root / ".tritonpack").mkdir(parents=True)
    tritonpack.check(archive)
    with open(root / ".tritonpack" / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as a process in the middle of unpacking
        waiter = subprocess.Popen([sys.executable, "-c", RACER, str(archive), str(root), str(tmp_path / "go")],
                                  stdout=subprocess.PIPE, text=True)
        (tmp_path / "go").touch()
        with pytest.raises(subprocess.TimeoutExpired):
            waiter.wait(timeout=1.5)
        assert not list(root.glob("*/__grp__*.json"))
    result = json.loads(waiter.communicate(timeout=60)[0])
    assert result["waited"] and result["status"] == "unpacked"


def test_a_long_wait_is_said_naming_the_holder(tmp_path, archive, monkeypatch, capsys):
    """A rank stuck behind another that hangs (stopped, or on a stalled mount) waited in silence: the command now
    says who holds the lock, at 5 s and at each doubling; the holder writes its pid and host into the lock file."""
    import fcntl
    import threading

    from tritonpack import ensuring

    monkeypatch.setattr(ensuring, "WAIT_NOTE_AFTER", 0.1)
    root = tmp_path / "root"
    (root / ".tritonpack").mkdir(parents=True)
    tritonpack.check(archive)
    lock = open(root / ".tritonpack" / "lock", "w")  # noqa: SIM115  # held by the timer below
    fcntl.flock(lock, fcntl.LOCK_EX)
    lock.write("pid 4242 on host-a\n")
    lock.flush()
    release = threading.Timer(0.5, lock.close)
    release.start()
    try:
        assert main(["ensure", str(archive), "--cache-dir", str(root)]) == 0
    finally:
        release.join()
    err = capsys.readouterr().err
    said = [line for line in err.splitlines() if line.startswith("waiting ")]
    assert 2 <= len(said) <= 3 and all(f"s for pid 4242 on host-a, which holds {root}/.tritonpack/lock" in line
                                       for line in said), err
    assert (root / ".tritonpack" / "lock").read_text() == f"pid {os.getpid()} on {os.uname().nodename}\n"
    assert tritonpack.ensure(archive, root).status == "present"
    assert main(["ensure", str(archive), "--cache-dir", str(root), "-q"]) == 0 and not capsys.readouterr().err


def versions(archive, count: int, monkeypatch) -> list:
    """``count`` versions of the archive, as a deploy makes: the same entries, each its own digest (its date)."""
    made = []
    for number in range(count):
        monkeypatch.setenv("SOURCE_DATE_EPOCH", str(1_700_000_000 + number))
        made.append(archive.with_name(f"v{number}.tpack"))
        tritonpack.merge([archive], made[-1])
    monkeypatch.delenv("SOURCE_DATE_EPOCH")
    return made


def stamps(root) -> list:
    """The stamps in the root: regular files named ``ensure-<digest>-<environment>.json``."""
    return sorted(p for p in (root / ".tritonpack").glob("ensure-*-*.json")
                  if re.fullmatch(r"ensure-[0-9a-f]{32}-[0-9a-f]{32}\.json", p.name) and not p.is_symlink()
                  and p.is_file())


def plant_stale_stamps(root, count: int) -> list:
    """Stamps of archives ensured long ago (named as ensure names them), oldest first."""
    (root / ".tritonpack").mkdir(parents=True, exist_ok=True)
    planted = []
    for number in range(count):
        planted.append(root / ".tritonpack" / f"ensure-{number:032x}-{'e' * 32}.json")
        planted[-1].write_text('{"stamp": 1}')
        os.utime(planted[-1], (1_000_000_000 + number, 1_000_000_000 + number))
    return planted


def test_a_root_that_sees_a_new_archive_at_every_deploy_keeps_the_most_recent_stamps(tmp_path, archive,
                                                                                      monkeypatch):
    """A persistent volume ensured at every deploy kept one stamp per archive version, forever: each stamp written
    now prunes all but the most recent, and the URL records whose stamp is gone, and nothing else in the directory
    (the lock, a temp file, a link or a directory named as a stamp, a file of the user's)."""
    root = tmp_path / "root"
    planted = plant_stale_stamps(root, 3)
    bookkeeping = root / ".tritonpack"
    others = [bookkeeping / f"ensure-url-{'a' * 32}.json.tmp", bookkeeping / "tmp.tpack.1.abcdef",
              bookkeeping / "notes"]
    for other in others:
        other.write_text("not a stamp")
    # URL records go with the stamp they name: one naming a planted stamp, and one that names none (unreadable)
    stale_records = [bookkeeping / f"ensure-url-{'a' * 32}.json", bookkeeping / f"ensure-url-{'f' * 32}.json"]
    stale_records[0].write_text(json.dumps({"stamp": 1, "location": "https://h/a.tpack", "environment": "e" * 64,
                                            "digest": f"{0:032x}" + "0" * 32}))
    stale_records[1].write_text("not a record")
    deployed = versions(archive, KEPT_STAMPS + 4, monkeypatch)
    link = bookkeeping / f"ensure-{'b' * 32}-{'c' * 32}.json"
    directory = bookkeeping / f"ensure-{'d' * 32}-{'c' * 32}.json"
    (tmp_path / "kept").write_text("a link's target")
    link.symlink_to(tmp_path / "kept")
    directory.mkdir()
    os.utime(directory, (1, 1))
    ensured = [tritonpack.ensure(version, root) for version in deployed]
    assert [r.status for r in ensured] == ["unpacked"] + ["present"] * (len(ensured) - 1)
    left = stamps(root)
    assert len(left) == KEPT_STAMPS and root / ".tritonpack" / os.path.basename(ensured[-1].stamp) in left
    assert not any(p.exists() for p in planted), "the oldest go first"
    assert all(p.read_text() == "not a stamp" for p in others) and (tmp_path / "kept").exists()
    assert not any(p.exists() for p in stale_records)
    assert link.is_symlink() and directory.is_dir() and (bookkeeping / "lock").exists()
    pruned = next(r for r in ensured if not os.path.exists(r.stamp))
    live_record = bookkeeping / f"ensure-url-{'b' * 32}.json"  # names the last deploy's stamp: kept
    live_record.write_text(json.dumps({"stamp": 1, "location": "https://h/b.tpack", "environment": environment_key(),
                                       "digest": archive_digest(str(deployed[-1]))}))
    again = tritonpack.ensure(pruned.archive, root)  # a pruned stamp costs one check of the entries, no write
    assert (again.status, again.written, os.path.exists(again.stamp)) == ("present", 0, True)
    assert live_record.exists() and os.path.exists(ensured[-1].stamp)
    assert len(stamps(root)) == KEPT_STAMPS


def test_processes_ensuring_new_archives_at_once_prune_only_older_stamps(tmp_path, archive, monkeypatch):
    """Every process stamps and prunes under the lock: none removes the stamp another has just written."""
    root, gate = tmp_path / "root", tmp_path / "go"
    planted = plant_stale_stamps(root, KEPT_STAMPS)
    racing = versions(archive, 6, monkeypatch)
    tritonpack.check(archive)
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(version), str(root), str(gate)],
                              stdout=subprocess.PIPE, text=True) for version in racing]
    while len(list(tmp_path.glob("go.ready.*"))) < len(procs):
        time.sleep(0.01)
    gate.touch()
    results = [json.loads(p.communicate(timeout=120)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(r["status"] for r in results) == ["present"] * 5 + ["unpacked"]
    assert all(os.path.exists(r["stamp"]) for r in results)
    assert len(stamps(root)) == KEPT_STAMPS and sum(p.exists() for p in planted) == KEPT_STAMPS - len(racing)
    assert all(tritonpack.ensure(version, root).stamp == r["stamp"] for version, r in zip(racing, results, strict=True))


def test_removed_entry_is_restored(tmp_path, archive):
    root = tmp_path / "root"
    tritonpack.ensure(archive, root)
    manifest = sorted(root.glob("*/__grp__*.json"))[0]
    manifest.unlink()
    result = tritonpack.ensure(archive, root)
    assert result.status == "unpacked" and result.written == 1 and manifest.exists()


def test_a_copied_root_is_relinked_not_written(tmp_path, archive, compiled_root):
    """A root copied with cp -r holds every file: ensure rewrites the manifests only, and says so, not "written"."""
    root = shutil.copytree(compiled_root, tmp_path / "copied")
    result = tritonpack.ensure(archive, root)
    assert (result.status, result.written, result.relinked) == ("unpacked", 0, result.usable)
    assert f"unpacked: 0 written, {result.usable} relinked" in result.summary()
    assert tritonpack.ensure(archive, root).status == "present" and not tritonpack.verify(root).problems


def test_a_root_moved_since_its_ensure_is_relinked_and_hits(tmp_path, archive):
    """An image's root copied, or a volume mounted, at another path holds the stamp of its first path, with
    manifests naming it: ensure relinks them (it answered "present", and Triton missed every kernel)."""
    built = tmp_path / "build" / "cache"
    tritonpack.ensure(archive, built)
    moved = tmp_path / "pod" / "cache"
    shutil.copytree(built, moved, symlinks=True)
    shutil.rmtree(built)
    result = tritonpack.ensure(archive, moved)
    assert (result.status, result.written, result.relinked) == ("unpacked", 0, result.usable)
    assert not tritonpack.verify(moved).problems
    assert tritonpack.ensure(archive, moved).status == "present"
    hits = json.loads(subprocess.run([sys.executable, "-c", COMPILER, str(Path(__file__).parent), str(moved)],
                                     capture_output=True, text=True, check=True).stdout)
    if HAS_LISTENER:
        assert all(hits)


def test_key_directories_whose_mtimes_an_image_cut_to_seconds_are_the_stamped_ones(tmp_path, archive):
    """An image's layers carry mtimes to the second (the build's ensure stamped them to the ns): the start on a host
    that pulled it still finds its stamp."""
    root = tmp_path / "root"
    tritonpack.ensure(archive, root)
    for key in (p for p in root.iterdir() if p.name != ".tritonpack"):
        mtime = key.stat().st_mtime_ns
        os.utime(key, ns=(mtime, mtime - mtime % 1_000_000_000))
    assert tritonpack.ensure(archive, root).status == "present"


def test_a_file_removed_from_a_group_is_restored(tmp_path, archive):
    """IR files removed to slim a root (the binaries kept) leave the manifests listing them: Triton 3.8+ then
    misses the group. The stamp sees the key directory changed, and ensure writes the file again."""
    def contents():
        return {path: (size, digest) for path, (size, _, digest) in snapshot(root).items()
                if not path.startswith(".tritonpack/")}  # the stamp records the directories' new mtimes

    root = tmp_path / "root"
    tritonpack.ensure(archive, root)
    before = contents()
    victim = next(root.glob("*/*.ptx"))
    victim.unlink()
    result = tritonpack.ensure(archive, root)
    assert result.status == "unpacked" and result.written == 1 and contents() == before
    assert tritonpack.ensure(archive, root).status == "present"


def test_what_ensure_keeps_is_said_with_its_reason_then_and_later(tmp_path, archive, capsys):
    with tritonpack.open(archive) as reader:
        group = next(e for e in reader.entries if e.kind == "group")
    root, elsewhere = tmp_path / "root", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    (root / group.key).symlink_to(elsewhere)
    for status in ("unpacked", "present"):  # the second from the stamp
        assert main(["ensure", str(archive), "--cache-dir", str(root), "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert doc["status"] == status and doc["linked"] == [f"{group.key}/{group.name}"] and not doc["conflicts"]
        assert main(["ensure", str(archive), "--cache-dir", str(root)]) == 0
        assert "kept 1 entry whose key directory is a symbolic link" in capsys.readouterr().err
    assert (root / group.key).is_symlink() and list(elsewhere.iterdir()) == []


@pytest.mark.skipif(OTHER_VERSION is None, reason="no archive of another Triton version")
def test_unusable_archive_writes_nothing_and_says_so(tmp_path, capsys):
    root = tmp_path / "root"
    result = tritonpack.ensure(OTHER_VERSION, root)
    assert result.status == "unusable" and not result.ok and result.usable == 0 and result.written == 0
    assert f"Triton: archive {OTHER_VERSION.stem.removeprefix('triton-')}" in result.not_used[0][0]
    assert [p.name for p in root.iterdir()] == [".tritonpack"], "no entry written, only the stamp"
    assert tritonpack.ensure(OTHER_VERSION, root).status == "unusable"  # decided once, from the stamp
    with pytest.raises(tritonpack.IncompatibleError):
        tritonpack.ensure(OTHER_VERSION, root, strict=True)
    assert main(["ensure", str(OTHER_VERSION), "--cache-dir", str(root)]) == 0
    assert "none will be used here" in capsys.readouterr().out
    assert main(["ensure", str(OTHER_VERSION), "--cache-dir", str(root), "--strict", "-q"]) == 5


def test_environment_key_follows_what_the_preflight_depends_on(monkeypatch):
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    base = environment_key()
    assert environment_key() == base
    assert environment_key(["cuda:90"]) != base
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    assert environment_key() != base
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")  # no GPU visible: the arch is not checked
    assert environment_key() != base


def test_every_rank_given_its_own_gpu_finds_one_stamp(tmp_path, archive, monkeypatch):
    """torchrun or Slurm give each rank ``CUDA_VISIBLE_DEVICES=<its GPU>``; the GPU probe lists the host's GPUs
    whatever it names, so the stamp's key does not follow it, but for a value that hides them all: each rank found
    no stamp of its own, and checked every entry again, one after the other under the lock."""
    root = tmp_path / "root"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    first = tritonpack.ensure(archive, root)
    for rank in ("7", "GPU-6f1c2b9e-4a1d-4c59-9a57-3b6a1f1e2d3c"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", rank)
        assert tritonpack.ensure(archive, root).stamp == first.stamp
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert tritonpack.ensure(archive, root).stamp != first.stamp


def test_a_start_that_names_the_root_by_triton_cache_dir_finds_the_stamp_of_the_build(tmp_path, archive,
                                                                                        monkeypatch):
    """An image is built with ``--cache-dir /cache`` and run with ``TRITON_CACHE_DIR=/cache`` (or a
    ``TRITON_HOME``): the variables that only say where the cache is are not in the stamp's key, so the start finds
    the build's stamp and writes nothing (it took them for cache-invalidating ones, and unpacked again)."""
    root = tmp_path / "root"
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_HOME", raising=False)
    built = tritonpack.ensure(archive, root)
    before = snapshot(root)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(root))
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))
    started = tritonpack.ensure(archive)
    assert (started.status, started.stamp, started.cache_dir) == ("present", built.stamp, str(root))
    assert snapshot(root) == before


def _writable(root, yes: bool) -> None:
    for directory in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        directory.chmod(0o755 if yes else 0o555)


def test_a_complete_root_this_process_cannot_write_is_ensured_without_writing(tmp_path, archive):
    """A container starts as a user who may not write the image's cache root (the build's, or a read-only mount),
    and finds no stamp of its environment (the build ran unpack, or ensure with --target): ensure checks the
    entries, writes nothing when all are in place, and says that it could leave no stamp (it failed, exit 4, to
    take its lock). Triton hits there, reading only. An entry missing is one line, exit 4, and nothing written."""
    prefix = without_root_powers()
    root = tmp_path / "root"
    tritonpack.unpack(archive, root)
    plant_stale_stamps(root, KEPT_STAMPS + 2)  # more than a writable root keeps: none is pruned here
    _writable(root, False)
    before = snapshot(root)
    ensure = [*prefix, sys.executable, "-m", "tritonpack", "ensure", str(archive), "--cache-dir", str(root)]
    try:
        out = subprocess.run([*ensure, "--json"], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert (doc["status"], doc["written"], doc["usable"]) == ("present", 0, doc["entries"])
        assert doc["unstamped"] == f"{root / '.tritonpack'}: Permission denied"
        out = subprocess.run(ensure, capture_output=True, text=True)
        assert "no stamp written" in out.stderr and "already present" in out.stdout
        tests = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run([*prefix, sys.executable, "-c", COMPILER, tests, str(root)], capture_output=True,
                             text=True)
        assert out.returncode == 0, out.stderr
        if HAS_LISTENER:
            assert all(json.loads(out.stdout))
        assert snapshot(root) == before
        _writable(root, True)
        group = sorted(root.glob("*/__grp__*.json"))[0]
        group.unlink()
        _writable(root, False)
        out = subprocess.run(ensure, capture_output=True, text=True)
        assert (out.returncode, out.stderr) == (4, f"error: {root}: cannot write: Permission denied\n")
        assert not group.exists() and len(snapshot(root)) == len(before) - 1
    finally:
        _writable(root, True)


def test_a_corrupt_block_leaves_no_root_behind(tmp_path, archive):
    """The digest reads, the unpack fails on a block: ensure made the root for its lock, and left it with its
    lock, where unpack creates nothing. A root that was there stays, with what it held."""
    data = bytearray(archive.read_bytes())
    data[len(data) // 3] ^= 0xFF
    corrupt = tmp_path / "corrupt.tpack"
    corrupt.write_bytes(bytes(data))
    root = tmp_path / "made" / "for" / "it"
    with pytest.raises(tritonpack.ArchiveError):
        tritonpack.ensure(corrupt, root)
    assert not (tmp_path / "made").exists()
    (tmp_path / "there").mkdir()
    (tmp_path / "there" / "notes.txt").write_text("x")
    with pytest.raises(tritonpack.ArchiveError):
        tritonpack.ensure(corrupt, tmp_path / "there")
    assert (tmp_path / "there" / "notes.txt").exists()


def test_bad_archive_is_an_archive_error(tmp_path):
    bad = tmp_path / "bad.tpack"
    bad.write_bytes(b"\x89TPACK\r\n" + bytes(8) + b"x" * 100)
    with pytest.raises(tritonpack.ArchiveError):
        tritonpack.ensure(bad, tmp_path / "root")
    assert main(["ensure", str(tmp_path / "missing.tpack"), "--cache-dir", str(tmp_path / "root")]) == 2


def test_a_local_archive_gone_since_is_still_an_error(tmp_path, archive, capsys):
    """Only an archive behind a server may be briefly unreachable: an image without its archive file is broken."""
    root = tmp_path / "root"
    for location in (str(archive), archive.as_uri()):
        assert tritonpack.ensure(location, root).ok
    assert not list((root / ".tritonpack").glob("ensure-url-*")), "no URL record for a local file"
    archive.unlink()
    for location in (str(archive), archive.as_uri()):
        assert main(["ensure", location, "--cache-dir", str(root)]) == 2
        assert "no such archive" in capsys.readouterr().err


def test_an_archive_replaced_between_its_digest_and_its_unpack_is_not_stamped(tmp_path, archive, monkeypatch):
    """A URL served without validators (no ETag, no Last-Modified) whose archive is replaced by one of the same size
    after ensure read its digest: the stamp named the first archive's digest over the second's entries."""
    from tritonpack import api

    real = api.unpack
    monkeypatch.setattr(api, "unpack", lambda *args, **kwargs: real(*args, **kwargs)._replace(digest="0" * 64))
    root = tmp_path / "root"
    with pytest.raises(tritonpack.RemoteError, match="the archive changed on the server while it was read"):
        tritonpack.ensure(archive, root)
    assert not [p for p in (root / ".tritonpack").iterdir() if p.name.startswith("ensure-")]
