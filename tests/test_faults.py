"""Faults around an unpack, in one process: a full disk or quota mid-write, a writer that completes a group between
plan and commit, leftovers of killed runs, and what pack and unpack may never do to the user's files."""
from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from collections import namedtuple

import pytest
from conftest import snapshot, thin
from invariants import expected_groups, group_problems, sha, temp_files, tree

import tritonpack
from tritonpack import staging
from tritonpack.cachedest import place
from tritonpack.cli import main


@pytest.fixture()
def archive(tmp_path, compiled_root):
    path = tmp_path / "k.tpack"
    tritonpack.pack(compiled_root, path)
    return path


def allowed(archive):
    """Each visible group must be exactly the archive's version."""
    return {k: [v] for k, v in expected_groups(archive).items()}


def make_differing_group(root, having="*"):
    """Change one file of one group (one that has a file matching ``having``) and return the group's directory:
    the user's own, differing content."""
    victim = sorted(p for p in root.glob("*/*.ttir") if any(p.parent.glob(having)))[0]
    victim.write_text("// the user's own build\n")
    manifest = next(victim.parent.glob("__grp__*.json"))
    children = json.loads(manifest.read_text())["child_paths"]
    assert victim.name in children
    return victim.parent


# -- disk full and quota --

@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT])
@pytest.mark.parametrize("fail_at", [0.0, 0.1, 0.5, 1.0])
def test_disk_full_mid_write_changes_nothing(tmp_path, archive, monkeypatch, capsys, code, fail_at):
    """The n-th staged write fails as a full disk or quota would: exit 4, one line, no temp file, no partial
    group, and the user's differing group (with --overwrite asked) untouched. Real ENOSPC: test_diskfull.py."""
    root = tmp_path / "root"
    tritonpack.unpack(archive, root)
    mine = make_differing_group(root)
    for manifest in sorted(root.glob("*/__grp__*.json"))[-2:]:  # two groups to write again
        if manifest.parent != mine:
            shutil.rmtree(manifest.parent)
    before = snapshot(root)
    with tritonpack.open(archive) as reader:
        plan = [place(str(root), e, reader.entry_blobs(n), True)
                for n, e in enumerate(reader.entries)]
    writes = sum(len(p.files) + p.writes_manifest for p in plan)
    assert writes > 10
    fail_at = min(int(fail_at * writes), writes - 1)  # the first, ..., the last write
    real = staging._write_all
    calls = []

    def failing(fd, data):
        calls.append(len(data))
        if len(calls) > fail_at:
            os.close(fd)
            raise OSError(code, os.strerror(code))
        real(fd, data)

    monkeypatch.setattr(staging, "_write_all", failing)
    rc = main(["unpack", str(archive), "--cache-dir", str(root), "--overwrite"])
    err = capsys.readouterr().err
    assert rc == 4 and err.count("\n") == 1 and os.strerror(code) in err, err
    assert snapshot(root) == before, "nothing visible may change"
    assert not temp_files(root)
    monkeypatch.setattr(staging, "_write_all", real)
    assert main(["unpack", str(archive), "--cache-dir", str(root), "--overwrite", "-q"]) == 0
    assert not group_problems(root, allowed(archive)) and not temp_files(root)


def test_a_short_write_is_finished(tmp_path, monkeypatch):
    """A write may take less than asked (a signal, a disk nearly full): the rest follows, and the file is whole."""
    from tritonpack import cachedest

    asked = []

    class ShortWrites:  # os, but a write takes at most 3 bytes
        def __getattr__(self, name):
            return getattr(os, name)

        @staticmethod
        def write(fd, data):
            asked.append(len(data))
            return os.write(fd, bytes(data[:3]))

    monkeypatch.setattr(cachedest, "os", ShortWrites())
    fd = os.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    staging._write_all(fd, memoryview(b"0123456789"))
    assert asked == [10, 7, 4, 1]
    assert (tmp_path / "f").read_bytes() == b"0123456789"
    with pytest.raises(OSError):
        os.fstat(fd)  # closed


def test_free_space_is_checked_before_writing(tmp_path, archive, monkeypatch, capsys):
    root = tmp_path / "root"
    real = os.statvfs
    Fake = namedtuple("Fake", "f_bsize f_frsize f_blocks f_bfree f_bavail f_files f_ffree f_favail f_flag f_namemax")

    def tiny(path, blocks=3, inodes=1000):
        st = real(path)
        return Fake(4096, 4096, st.f_blocks, blocks, blocks, 10**6, inodes, inodes, 0, 255)

    monkeypatch.setattr(os, "statvfs", tiny)
    assert main(["unpack", str(archive), "--cache-dir", str(root)]) == 4
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "not enough free space: unpacking needs " in err and "12.3 kB available" in err
    assert not root.exists()
    monkeypatch.setattr(os, "statvfs", lambda p: tiny(p, blocks=10**6, inodes=5))
    assert main(["unpack", str(archive), "--cache-dir", str(root)]) == 4
    assert "not enough free inodes" in capsys.readouterr().err
    assert not root.exists()


# -- concurrent writers between plan and commit --

def _racing_place(monkeypatch, act, archive):
    """Run ``act(root, entry)`` once, for the first group, just before its staged key directory is renamed in
    (a fresh root stages whole key directories): the rename must then fail and each entry be re-checked."""
    with tritonpack.open(archive) as reader:
        groups = {e.key: e for e in reader.entries if e.kind == "group"}
    real = staging.StageWriter.rename_in
    done = []

    def rename_in(self, stage_dir, key_dir):
        entry = groups.get(os.path.basename(key_dir))
        if not done and entry is not None:
            done.append(entry)
            act(os.path.dirname(key_dir), entry)
        return real(self, stage_dir, key_dir)

    monkeypatch.setattr(staging.StageWriter, "rename_in", rename_in)
    return done


def test_group_completed_by_another_writer_is_left_visible(tmp_path, archive, monkeypatch):
    """Planned as absent, completed meanwhile (another unpack, or Triton compiling it): its manifest is never
    unlinked or replaced, and it is counted as present."""
    full = tmp_path / "full"
    tritonpack.unpack(archive, full)
    root = tmp_path / "root"
    inode = {}

    def complete(root_dir, entry):
        shutil.copytree(full / entry.key, os.path.join(root_dir, entry.key), dirs_exist_ok=True)
        manifest = os.path.join(root_dir, entry.key, f"__grp__{entry.name}.json")
        names = json.loads((full / entry.key / f"__grp__{entry.name}.json").read_text())["child_paths"]
        with open(manifest, "w") as f:  # point into this root, as the other writer would
            f.write(json.dumps({"child_paths": {n: os.path.join(root_dir, entry.key, n) for n in names}}))
        inode[manifest] = os.stat(manifest).st_ino

    done = _racing_place(monkeypatch, complete, archive)
    result = tritonpack.unpack(archive, root)
    assert done and result.present == 1 and result.written == result.entries - 1
    ((manifest, ino),) = inode.items()
    assert os.stat(manifest).st_ino == ino, "the other writer's manifest was replaced"
    assert not group_problems(root, allowed(archive)) and not temp_files(root)


@pytest.mark.parametrize("how", ["binary-only", "thinned"])
@pytest.mark.parametrize("command", ["unpack", "ensure"])
def test_completing_a_group_triton_hits_never_hides_it(tmp_path, compiled_root, monkeypatch, how, command):
    """A group Triton hits that only gains absent files (a binary-only unpack's, or one thinned to its binaries and
    relocated) stays a hit at every step of the commit: its manifest was deleted meanwhile, and Triton processes
    reading the root missed and recompiled it (3.3 and 3.6 also raised FileNotFoundError between their
    ``has_file`` and ``open``)."""
    from invariants import triton_resolves

    from tritonpack.selection import Selection

    archive = tmp_path / "k.tpack"
    tritonpack.pack(compiled_root, archive)
    groups = list(expected_groups(archive))
    root = tmp_path / "root"
    if how == "binary-only":
        tritonpack.unpack(archive, root, selection=Selection(binary_only=True))
    else:
        shutil.copytree(compiled_root, root)
        thin(root)
        tritonpack.relocate(root)
    if triton_resolves(root, *groups[0]) is None:
        pytest.skip("no Triton to ask")
    assert all(triton_resolves(root, *g) for g in groups)
    misses = []
    real_move = staging.StageWriter.move

    def move(self, temp, final):  # Triton's own lookup, before each step of the commit
        misses.extend((g[1], os.path.basename(final)) for g in groups if not triton_resolves(root, *g))
        return real_move(self, temp, final)

    monkeypatch.setattr(staging.StageWriter, "move", move)
    getattr(tritonpack, command)(archive, root)
    assert all(triton_resolves(root, *g) for g in groups)
    assert misses == [], f"{len(misses)} moments a group Triton hit was a miss, e.g. {misses[:3]}"


def test_a_replace_hides_a_group_without_ever_removing_its_manifest(tmp_path, compiled_root, monkeypatch):
    """--overwrite hides a group whose files change, as it must; it unlinked the manifest to do so, and Triton
    3.0-3.7 open a manifest once they see it exists: a compile in between raised FileNotFoundError. The manifest
    is now replaced by one that lists no file, which every Triton misses, and the user's scan says so."""
    from invariants import triton_resolves

    from tritonpack.cacheroot import scan_cache

    archive = tmp_path / "k.tpack"
    tritonpack.pack(compiled_root, archive)
    groups = list(expected_groups(archive))
    root = tmp_path / "root"
    tritonpack.unpack(archive, root)
    for key, name in groups:
        with open(root / key / f"{name}.ttir", "ab") as f:
            f.write(b" ")
    absent, hidden = [], []
    real_move = staging.StageWriter.move

    def move(self, temp, final):
        for key, name in groups:
            manifest = root / key / f"__grp__{name}.json"
            if not manifest.exists():
                absent.append(name)
            elif json.loads(manifest.read_text()) == {"child_paths": {}}:
                hidden.append(name)
                assert triton_resolves(root, key, name) in (False, None)
        return real_move(self, temp, final)

    monkeypatch.setattr(staging.StageWriter, "move", move)
    result = tritonpack.unpack(archive, root, overwrite=True)
    assert result.replaced == len(groups) and absent == [] and hidden
    key, name = groups[0]
    (root / key / f"__grp__{name}.json").write_text('{"child_paths": {}}')  # as a kill mid-replace leaves it
    assert [s.reason for s in scan_cache(str(root)).skipped] == [  # once: its files are its own, no orphans
        "incomplete group: its manifest lists no file (an unpack --overwrite stopped while it replaced the group; the "
        "next unpack completes it)"]
    assert len(tritonpack.verify(root).problems) == 1
    monkeypatch.setattr(staging.StageWriter, "move", real_move)
    again = tritonpack.unpack(archive, root)
    assert again.written == 1 and not group_problems(root, allowed(archive))


def test_differing_group_that_appears_meanwhile_is_kept(tmp_path, archive, monkeypatch):
    full = tmp_path / "full"
    tritonpack.unpack(archive, full)
    root = tmp_path / "root"

    def complete_differently(root_dir, entry):
        shutil.copytree(full / entry.key, os.path.join(root_dir, entry.key), dirs_exist_ok=True)
        with open(os.path.join(root_dir, entry.key, f"{entry.name}.ttir"), "w") as f:
            f.write("// compiled differently\n")
        relocated = tritonpack.relocate(root_dir)
        assert relocated.fixed

    done = _racing_place(monkeypatch, complete_differently, archive)
    result = tritonpack.unpack(archive, root, overwrite=True)
    key = done[0].key
    assert result.conflicts == [f"{key}/{done[0].name}"]
    assert (root / key / f"{done[0].name}.ttir").read_text() == "// compiled differently\n"
    assert not group_problems(root) and not temp_files(root)


def test_corrupt_archive_with_overwrite_keeps_the_users_group(tmp_path, archive):
    root = tmp_path / "root"
    tritonpack.unpack(archive, root)
    make_differing_group(root)
    before = snapshot(root)
    data = bytearray(archive.read_bytes())
    with tritonpack.open(archive) as reader:
        block = reader.index.blocks[-1]
    for i in range(block.offset + block.length // 3, block.offset + 2 * block.length // 3):
        data[i] ^= 0x5A
    bad = tmp_path / "bad.tpack"
    bad.write_bytes(bytes(data))
    with pytest.raises(tritonpack.ArchiveError):
        tritonpack.unpack(bad, root, overwrite=True)
    assert snapshot(root) == before and not temp_files(root)


# -- leftovers of killed runs --

def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_leftovers_of_killed_runs_are_cleaned_and_nothing_else(tmp_path, archive):
    root = tmp_path / "root"
    tritonpack.unpack(archive, root)
    key_dir = next(root.glob("*/__grp__*.json")).parent
    other_dir = sorted(p for p in root.iterdir() if p != key_dir)[0]
    dead = _dead_pid()
    # a killed run of this version: its lock (free now) at the root, temp files in two key directories
    (root / f"tmp.tpack.{dead}.0badc0de.lock").write_bytes(b"")
    (key_dir / f"tmp.tpack.{dead}.0badc0de0001").write_bytes(b"half")
    (other_dir / f"tmp.tpack.{dead}.0badc0de0002").write_bytes(b"half")
    staged = root / f"tmp.tpack.{dead}.0badc0de0003"  # a whole key directory it was staging
    staged.mkdir()
    for name in ("k.ptx", "__grp__k.json"):
        (staged / name).write_bytes(b"half")
    # a run of tritonpack 1.0.0 (no lock) killed long ago, and one whose pid is dead
    old = key_dir / f"tmp.tpack.{os.getpid()}.aaaaaaaaaaaa"
    old.write_bytes(b"old")
    os.utime(old, (time.time() - 7200, time.time() - 7200))
    (key_dir / f"tmp.tpack.{dead}.bbbbbbbbbbbb").write_bytes(b"dead")
    (key_dir / "tmp.tpack.9999999999.bbbbbbbbbbbb").write_bytes(b"no process has such a pid")
    # what must survive: a live unpack's temp file (its lock held), a fresh unlocked one of a live pid, Triton's
    # temp dir of a live compile, look-alike names, a link named like ours
    live = root / f"tmp.tpack.{os.getpid()}.11111111.lock"
    live.write_bytes(b"")
    holder = open(live, "rb")  # noqa: SIM115
    fcntl.flock(holder, fcntl.LOCK_EX)
    keep = [key_dir / f"tmp.tpack.{os.getpid()}.111111110000", key_dir / f"tmp.tpack.{os.getpid()}.cccccccccccc",
            key_dir / "tmp.tpack.note", key_dir / f"tmp.tpack.{dead}.ABCDEFABCDEF"]
    for path in keep:
        path.write_bytes(b"keep")
    live_staged = root / f"tmp.tpack.{os.getpid()}.111111110001"
    live_staged.mkdir()
    (live_staged / "k.ptx").write_bytes(b"being written")
    (key_dir / f"tmp.pid_{os.getpid()}_0d1b").mkdir()
    (key_dir / f"tmp.pid_{os.getpid()}_0d1b" / "x.ptx").write_text("in flight")
    (key_dir / f"tmp.tpack.{dead}.dddddddddddd").symlink_to(key_dir / "tmp.tpack.note")
    elsewhere = tmp_path / "elsewhere"  # what a key directory that is a link points to: never written, nor cleaned
    elsewhere.mkdir()
    (elsewhere / f"tmp.tpack.{dead}.0badc0de0004").write_bytes(b"not the root's")
    (root / ("L" * 52)).symlink_to(elsewhere)
    try:
        result = tritonpack.unpack(archive, root)
    finally:
        holder.close()
    assert result.present == result.entries
    left = sorted(p.name for p in key_dir.iterdir() if p.name.startswith("tmp."))
    assert left == sorted([p.name for p in keep] + [f"tmp.pid_{os.getpid()}_0d1b", f"tmp.tpack.{dead}.dddddddddddd"])
    assert not list(other_dir.glob("tmp.*")), "a dead run's files in any key directory go"
    assert sorted(p.name for p in root.glob("tmp.*")) == sorted([live.name, live_staged.name])
    assert (live_staged / "k.ptx").read_bytes() == b"being written"
    assert (elsewhere / f"tmp.tpack.{dead}.0badc0de0004").read_bytes() == b"not the root's"


def test_a_completed_run_leaves_no_temp_files(tmp_path, archive):
    root = tmp_path / "root"
    for overwrite in (False, True):
        tritonpack.unpack(archive, root, overwrite=overwrite)
        assert not temp_files(root)
    make_differing_group(root)
    assert tritonpack.unpack(archive, root).conflicts
    assert not temp_files(root)
    assert tritonpack.unpack(archive, root, overwrite=True).replaced == 1
    assert not temp_files(root) and not group_problems(root, allowed(archive))


def test_what_a_rename_cannot_replace_is_kept_and_named(tmp_path, archive, capsys):
    """A directory where the archive has a file cannot be replaced by a rename (spec §8.1): that group is kept
    whole, even with --overwrite (which once hid its manifest and replaced its other files first). A file where a
    key directory goes is kept without --overwrite and replaced with it. The other entries are unpacked."""
    root = tmp_path / "root"
    tritonpack.unpack(archive, root)
    key_dir = make_differing_group(root, "*.cubin")  # its .ttir: to be replaced, files in manifest order
    cubin = next(key_dir.glob("*.cubin"))  # after the .ttir in that order
    cubin.unlink()
    cubin.mkdir()
    (cubin / "mine").write_text("a directory of the user's")
    other = sorted(p for p in root.iterdir() if p.is_dir() and p != key_dir)[0]
    shutil.rmtree(other)
    other.write_text("a file of the user's")
    blocked = tree(key_dir), snapshot(key_dir)
    before, listing = snapshot(root), tree(root)
    result = tritonpack.unpack(archive, root)
    assert [c.split("/")[0] for c in result.file_is_directory] == [key_dir.name]
    assert [c.split("/")[0] for c in result.key_not_directory] == [other.name] and result.written == 0
    assert snapshot(root) == before and tree(root) == listing
    assert main(["unpack", str(archive), "--cache-dir", str(root), "--overwrite", "--json"]) == 0
    done = json.loads(capsys.readouterr().out)
    assert [c.split("/")[0] for c in done["file_is_directory"]] == [key_dir.name] and done["replaced"] == 1
    assert (tree(key_dir), snapshot(key_dir)) == blocked
    assert other.is_dir() and next(other.glob("__grp__*.json")).exists()
    assert not temp_files(root)


# -- pack never changes its source --

def test_pack_never_changes_its_source(tmp_path, compiled_root, capsys, monkeypatch):
    source = tmp_path / "cache"
    shutil.copytree(compiled_root, source)
    before, listing = snapshot(source), tree(source)
    modes = {p: os.stat(source / p).st_mode for p in listing}
    assert main(["pack", str(source), "-o", str(tmp_path / "k.tpack"), "-q"]) == 0
    assert snapshot(source) == before and tree(source) == listing
    assert {p: os.stat(source / p).st_mode for p in listing} == modes
    for inside in (source / "k.tpack", next(source.iterdir()) / "k.tpack"):
        assert main(["pack", str(source), "-o", str(inside)]) == 2
        assert "inside the cache it packs" in capsys.readouterr().err
    assert tree(source) == listing

    def no_scan(*args, **kwargs):
        raise AssertionError("scanned a root whose archive has nowhere to go")

    monkeypatch.setattr("tritonpack.cacheroot.scan_cache", no_scan)  # refused first: a large root's scan is long
    assert main(["pack", str(source), "-o", str(tmp_path / "missing" / "k.tpack")]) == 4
    assert capsys.readouterr().err == (f"error: {tmp_path / 'missing' / 'k.tpack'}: cannot write the archive: "
                                       f"{tmp_path / 'missing'} is not a directory\n")


# -- permissions --

def test_modes_follow_the_umask_and_the_archive_carries_none(tmp_path, compiled_root):
    source = tmp_path / "cache"
    shutil.copytree(compiled_root, source)
    group = next(source.glob("*/__grp__*.json")).parent
    for path in group.iterdir():
        os.chmod(path, 0o6755)  # set-uid and set-gid, executable: none of it may travel
    archive = tmp_path / "k.tpack"
    tritonpack.pack(source, archive)
    for umask, mode in ((0o022, 0o644), (0o077, 0o600), (0o000, 0o666)):
        root = tmp_path / f"root-{umask:o}" / "cache"
        old = os.umask(umask)
        try:
            result = tritonpack.unpack(archive, root)
        finally:
            os.umask(old)
        files = [p for p in root.rglob("*") if not p.is_dir()]
        assert files and {stat.S_IMODE(os.lstat(p).st_mode) for p in files} == {mode}
        directories = [root.parent, root, *(p for p in root.rglob("*") if p.is_dir())]  # the parent it made too
        assert {stat.S_IMODE(os.lstat(p).st_mode) for p in directories} == {0o777 & ~umask}
        assert not [p for p in root.rglob("*") if p.is_symlink()]
        hidden = umask == 0o077 and os.geteuid() == 0
        assert result.root_only == ("umask 077: files 0600, directories 0700" if hidden else "")


@pytest.mark.skipif(os.geteuid() != 0, reason="root only: an image build writing what its service cannot read")
def test_root_writing_what_no_other_user_can_read_says_so(tmp_path, compiled_root, capsys):
    """An image built as root with umask 077: the service, another user, can read none of the kernels, and its
    Triton fails where it misses (it cannot write there). Triton writes so too; unpack and ensure say it when
    they write, and only then."""
    from tritonpack.cli import main

    archive = tmp_path / "k.tpack"
    tritonpack.pack(compiled_root, archive)
    note = ("written as root with umask 077: files 0600, directories 0700: a Triton running as another user can "
            "read none of it (umask 022 before unpacking lets every user read it)")
    old = os.umask(0o077)
    try:
        for command in ("unpack", "ensure"):
            for notes in ([note], []):  # the second run writes nothing
                assert main([command, str(archive), "--cache-dir", str(tmp_path / command)]) == 0
                assert [n for n in capsys.readouterr().err.splitlines() if n.startswith("written as")] == notes
    finally:
        os.umask(old)


def test_links_in_the_source_are_never_followed_into_the_archive(tmp_path, compiled_root):
    source = tmp_path / "cache"
    shutil.copytree(compiled_root, source)
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the archive " * 10)
    group = next(source.glob("*/__grp__*.json")).parent
    victim = next(p for p in group.iterdir() if p.suffix == ".ttir")
    victim.unlink()
    victim.symlink_to(secret)
    (source / "ZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZZ").symlink_to(tmp_path)
    archive = tmp_path / "k.tpack"
    result = tritonpack.pack(source, archive)
    reasons = {s.reason for s in result.skipped}
    assert "symbolic link (never followed)" in reasons and any(r.startswith("incomplete group") for r in reasons)
    import hashlib

    digest = hashlib.sha256(secret.read_bytes()).digest()
    with tritonpack.open(archive) as reader:
        assert all(f.sha256 != digest for e in reader.entries for f in e.files)
        assert group.name not in {e.key for e in reader.entries if e.kind == "group"}


# -- a kill at every step of the commit, deterministically --

def _killed_at(step: int, archive, root, overwrite: bool, where: str) -> int:
    """Fork; the child unpacks and dies like kill -9 (no clean-up runs) just before its ``step``-th rename
    (``where="move"``) or staged write (``where="write"``). Returns how many such steps the child reached."""
    counter = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        try:
            os.close(counter[0])
            calls = [0]
            real = staging.StageWriter.move if where == "move" else staging._write_all

            def dying(*args):
                if calls[0] == step:
                    os.write(counter[1], str(calls[0]).encode())
                    os._exit(137)
                calls[0] += 1
                return real(*args)

            if where == "move":
                staging.StageWriter.move = dying
            else:
                staging._write_all = dying
            tritonpack.unpack(archive, root, overwrite=overwrite)
            os.write(counter[1], str(calls[0]).encode())
            os._exit(0)
        except BaseException:
            os._exit(1)
    os.close(counter[1])
    _, status = os.waitpid(pid, 0)
    reached = os.read(counter[0], 64)
    os.close(counter[0])
    assert os.WEXITSTATUS(status) in (0, 137), status
    return int(reached or b"-1")


@pytest.mark.parametrize("where", ["move", "write"])
def test_killed_at_every_step_of_an_overwrite(fast_tmp, compiled_root, where):
    """A root whose every group differs from the archive in three files, unpacked with --overwrite and killed
    before each rename of the commit (or each staged write): every visible group is wholly the user's or wholly
    the archive's, and a re-run completes with no temp file left."""
    tmp_path = fast_tmp
    source = tmp_path / "source"
    shutil.copytree(compiled_root, source)
    for manifest in sorted(source.glob("*/__grp__*.json"))[3:]:
        shutil.rmtree(manifest.parent)
    archive = tmp_path / "three.tpack"
    tritonpack.pack(source, archive)
    base = tmp_path / "base"
    tritonpack.unpack(archive, base)
    for manifest in base.glob("*/__grp__*.json"):
        name = manifest.name[7:-5]
        for suffix in (".json", ".ttir", ".llir"):
            with open(manifest.parent / f"{name}{suffix}", "ab") as f:
                f.write(b" ")
    users = {}
    for manifest in base.glob("*/__grp__*.json"):
        children = json.loads(manifest.read_text())["child_paths"]
        users[(manifest.parent.name, manifest.name[7:-5])] = {c: sha(p) for c, p in children.items()}
    versions = {k: [v, users[k]] for k, v in expected_groups(archive).items()}
    step, seen = 0, set()
    while True:
        root = tmp_path / f"root-{where}-{step}"
        shutil.copytree(base, root, symlinks=True)
        # the copy's manifests still point into base: make them the user's own, in place
        for manifest in root.glob("*/__grp__*.json"):
            children = json.loads(manifest.read_text())["child_paths"]
            manifest.write_text(json.dumps({"child_paths": {c: str(manifest.parent / c) for c in children}}))
        reached = _killed_at(step, archive, root, True, where)
        problems = group_problems(root, versions)
        assert not problems, (where, step, problems)
        seen.add(sum(1 for m in root.glob("*/__grp__*.json") if json.loads(m.read_text())["child_paths"]))
        assert main(["unpack", str(archive), "--cache-dir", str(root), "--overwrite", "-q"]) == 0
        assert not temp_files(root) and not group_problems(root, allowed(archive))
        shutil.rmtree(root)
        if reached < step:  # the child finished without reaching this step: every step was covered
            break
        step += 1
    assert step >= 12
    if where == "move":
        assert min(seen) < max(seen), "some kills must land while groups are hidden"


def test_a_filesystem_without_flock_still_unpacks(tmp_path, archive, monkeypatch):
    """Some network filesystems refuse flock (ENOLCK): the unpack goes on, and cleaners treat such a run's
    temp files as live (they cannot tell), so nothing of it is removed while it runs."""
    def no_flock(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(fcntl, "flock", no_flock)
    root = tmp_path / "root"
    result = tritonpack.unpack(archive, root)
    assert result.written == result.entries and not temp_files(root)
    assert not group_problems(root, allowed(archive))
