"""Unpack semantics: idempotent, never replaces differing content unless asked, never a partial group."""
from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from conftest import snapshot

import tritonpack
from tritonpack.model import manifest_name


@pytest.fixture()
def archive(tmp_path, compiled_root):
    path = tmp_path / "k.tpack"
    tritonpack.pack(compiled_root, path)
    return path


@pytest.mark.parametrize("command", ["unpack", "ensure", "verify", "relocate"])
def test_a_root_under_a_file_is_named_with_that_file(tmp_path, archive, capsys, command):
    """``--cache-dir model.py/cache``: the error names the root and the file in its way, where it named a key
    directory under it that could not be read, or ensure's lock."""
    (tmp_path / "model.py").write_text("x")
    root = tmp_path / "model.py" / "cache"
    code, _, err = cli(capsys, command, *([str(archive), "--cache-dir"] if command in ("unpack", "ensure") else []),
                       str(root))
    assert (code, err) == (4, f"error: {root}: cache directory is not a directory ({tmp_path / 'model.py'} is not "
                              "a directory)\n")


def test_another_user_s_key_directory_in_a_shared_root_is_kept_and_the_rest_written(tmp_path, archive,
                                                                                     compiled_root):
    """A root every user writes (mode 1777) where another user copied a group: this user may not write its key
    directory, whose manifest needs relinking. That entry is kept, said with its reason, and every other one
    written (the unpack failed whole, exit 4, naming the directory)."""
    from conftest import without_root_powers

    prefix = without_root_powers()
    root = shutil.copytree(compiled_root, tmp_path / "shared")  # manifests name the compiled root: relinked
    os.chmod(root, 0o1777)
    theirs = sorted(p for p in root.iterdir())[0]
    for path in (theirs, *theirs.iterdir()):
        os.chown(path, 1000, 1000)
    os.chmod(theirs, 0o755)
    before = snapshot(theirs)
    out = subprocess.run([*prefix, sys.executable, "-m", "tritonpack", "unpack", str(archive), "--cache-dir",
                          str(root)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "1 kept (key directory not writable)" in out.stdout
    assert "kept 1 entry whose key directory needs writing and is not writable by this user" in out.stderr
    assert snapshot(theirs) == before
    assert [g.path.split("/")[0] for g in tritonpack.verify(root).problems] == [theirs.name]


def test_rerun_is_idempotent(tmp_path, archive):
    root = tmp_path / "root"
    first = tritonpack.unpack(archive, root)
    assert first.written == first.entries and first.files_written > 0
    before = snapshot(root)
    again = tritonpack.unpack(archive, root)
    assert again.present == again.entries and again.written == 0 and again.files_written == 0
    assert snapshot(root) == before


def test_differing_group_is_kept_unless_overwrite(tmp_path, archive):
    root = tmp_path / "root"
    tritonpack.unpack(archive, root)
    victim = next(root.glob("*/*.ptx")) if list(root.glob("*/*.ptx")) else next(root.glob("*/*.llir"))
    victim.write_text("// locally different\n")
    kept = tritonpack.unpack(archive, root)
    assert kept.conflicts == [f"{victim.parent.name}/{victim.stem}"]
    assert victim.read_text() == "// locally different\n"
    assert "--overwrite" in kept.notes()[0]
    replaced = tritonpack.unpack(archive, root, overwrite=True)
    assert replaced.replaced == 1 and replaced.conflicts == []
    assert victim.read_text() != "// locally different\n"


def cli(capsys, *args) -> tuple[int, str, str]:
    """The ``tritonpack`` command, in this process: exit status, standard output and error."""
    from tritonpack.entry import main

    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def unpack_json(capsys, archive, root, *args) -> dict:
    code, out, err = cli(capsys, "unpack", archive, "--cache-dir", root, "--json", *args)
    assert code == 0, err
    return json.loads(out)


def first_group(archive) -> tritonpack.Entry:
    with tritonpack.open(archive) as reader:
        return next(e for e in reader.entries if e.kind == "group")


def test_force_counts_what_it_wrote_and_names_what_was_there(tmp_path, archive, capsys):
    """--force: ``forced`` counts the entries the preflight says will not be used that this run wrote;
    those it found in place are said to be present, not written."""
    from kernels import SOURCES, targets

    root = tmp_path / "root"
    unusable = len(SOURCES) * (len(targets()) - 1)  # all but cuda:80
    first = unpack_json(capsys, archive, root, "--target", "cuda:80", "--force")
    assert (first["written"], first["forced"], first["forced_present"]) == (first["entries"], unusable, 0)
    code, out, err = cli(capsys, "unpack", archive, "--cache-dir", root, "--target", "cuda:80", "--force")
    assert code == 0 and f"0 written, {first['entries']} already present;" in out
    assert "wrote" not in err, err
    assert f"--force: {unusable} entries that the preflight says will not be used here were already present" in err
    again = unpack_json(capsys, archive, root, "--target", "cuda:80", "--force")
    assert (again["written"], again["forced"], again["forced_present"]) == (0, 0, unusable)
    gone = next(m for m in root.glob("*/__grp__*.json") if '"arch": 80' not in (m.parent / m.name[7:]).read_text())
    gone.unlink()
    code, out, err = cli(capsys, "unpack", archive, "--cache-dir", root, "--target", "cuda:80", "--force")
    assert code == 0 and "1 written" in out
    assert "--force: wrote 1 entry that the preflight says will not be used here" in err
    assert f"--force: {unusable - 1} entries that the preflight says will not be used here were already present" \
        in err


def test_a_symlinked_key_directory_is_kept_for_that_reason(tmp_path, archive, capsys):
    group = first_group(archive)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "root"
    root.mkdir()
    (root / group.key).symlink_to(elsewhere)
    for overwrite in ([], ["--overwrite"]):
        doc = unpack_json(capsys, archive, root, *overwrite)
        assert doc["linked"] == [f"{group.key}/{group.name}"] and doc["conflicts"] == [], doc
        assert doc["written"] + doc["present"] == doc["entries"] - 1 and doc["replaced"] == 0
        assert (root / group.key).is_symlink() and list(elsewhere.iterdir()) == []
        code, out, err = cli(capsys, "unpack", archive, "--cache-dir", root, *overwrite)
        assert code == 0 and "1 kept (key directory is a symbolic link)" in out and "differ" not in out
        assert "kept 1 entry whose key directory is a symbolic link (never written through" in err
        assert "content differs" not in err


def test_a_file_where_a_key_directory_goes_is_kept_unless_overwrite(tmp_path, archive, capsys):
    """A file in the key directory's place is counted and named, the other entries are unpacked; --overwrite
    replaces it with the archive's key directory (the user asked for the archive's content there)."""
    from kernels import HAS_LISTENER, compile_all

    group = first_group(archive)
    root = tmp_path / "root"
    root.mkdir()
    (root / group.key).write_text("in the way")
    code, out, err = cli(capsys, "unpack", archive, "--cache-dir", root)
    assert code == 0 and "1 kept (key directory is not a directory)" in out, (out, err)
    assert f"whose key directory is taken by a file, or anything else but a directory (--overwrite replaces it): " \
           f"{group.key}/{group.name}" in err
    assert (root / group.key).read_text() == "in the way"
    doc = unpack_json(capsys, archive, root)
    assert doc["key_not_directory"] == [f"{group.key}/{group.name}"] and doc["conflicts"] == []
    assert doc["present"] == doc["entries"] - 1
    code, out, err = cli(capsys, "unpack", archive, "--cache-dir", root, "--overwrite")
    assert code == 0 and "1 replaced" in out and "kept" not in out, (out, err)
    assert (root / group.key / manifest_name(group.name)).is_file()
    assert cli(capsys, "verify", root)[0] == 0
    before = snapshot(root)
    hits = compile_all(root)
    if HAS_LISTENER:
        assert all(hits)
    assert snapshot(root) == before


def test_a_directory_where_a_file_goes_is_kept_even_with_overwrite(tmp_path, archive, capsys):
    root = tmp_path / "root"
    tritonpack.unpack(archive, root)
    group = first_group(archive)
    victim = root / group.key / group.files[0].name
    victim.unlink()
    victim.mkdir()
    (victim / "user data").write_text("kept")
    manifest = root / group.key / manifest_name(group.name)
    listed = manifest.read_bytes()
    for overwrite in ([], ["--overwrite"]):
        code, out, err = cli(capsys, "unpack", archive, "--cache-dir", root, *overwrite)
        assert code == 0 and "1 kept (a file is a directory)" in out, (out, err)
        assert f"with a directory where one of its files goes (never removed, not even with --overwrite): " \
               f"{group.key}/{group.name}" in err
        assert (victim / "user data").read_text() == "kept" and manifest.read_bytes() == listed
    assert unpack_json(capsys, archive, root, "--overwrite")["file_is_directory"] == [f"{group.key}/{group.name}"]
    assert not list(root.rglob("tmp.tpack.*"))


def test_a_fifo_in_the_root_is_never_opened_for_reading(tmp_path, archive):
    """A FIFO where a manifest goes would block a reader for ever: it is replaced (unreadable, as the spec says)."""
    import subprocess
    import sys

    root = tmp_path / "root"
    tritonpack.unpack(archive, root)
    group = first_group(archive)
    manifest = root / group.key / manifest_name(group.name)
    manifest.unlink()
    os.mkfifo(manifest)
    done = subprocess.run([sys.executable, "-m", "tritonpack", "unpack", str(archive), "--cache-dir", str(root)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "1 relinked" in done.stdout, done
    assert manifest.is_file() and json.loads(manifest.read_text())["child_paths"]


def test_stale_manifest_with_identical_files_is_relinked(tmp_path, archive):
    root = tmp_path / "root"
    tritonpack.unpack(archive, root)
    manifest = next(root.glob("*/__grp__*.json"))
    children = json.loads(manifest.read_text())["child_paths"]
    manifest.write_text(json.dumps({"child_paths": {n: f"/gone/{n}" for n in children}}))
    result = tritonpack.unpack(archive, root)
    assert result.relinked == 1
    assert json.loads(manifest.read_text())["child_paths"] == children


def test_leftovers_of_an_interrupted_unpack_are_completed(tmp_path, archive):
    root = tmp_path / "root"
    tritonpack.unpack(archive, root)
    group = next(root.glob("*/__grp__*.json")).parent
    next(group.glob("__grp__*.json")).unlink()
    next(p for p in group.iterdir() if p.suffix == ".json").write_text("half")
    result = tritonpack.unpack(archive, root)
    assert result.written == 1
    assert next(group.glob("__grp__*.json")).exists()


def test_corrupt_block_leaves_no_visible_partial_group(tmp_path, archive):
    data = bytearray(archive.read_bytes())
    with tritonpack.open(archive) as reader:
        block = reader.index.blocks[-1]
    data[block.offset + block.length // 2] ^= 0xFF
    bad = tmp_path / "bad.tpack"
    bad.write_bytes(bytes(data))
    root = tmp_path / "root"
    with pytest.raises(tritonpack.ArchiveError):
        tritonpack.unpack(bad, root)
    assert not list(root.glob("*/__grp__*.json")), "no manifest may be written when the archive is corrupt"
    assert not [p for p in root.rglob("tmp.*")], "no temp files left behind"


def test_a_block_that_expands_past_any_fixed_ratio_is_unpacked(tmp_path, compiled_root):
    """Near-duplicate files compress past any fixed ratio (ten copies of the real cache, each file a few bytes
    apart, made a block of 1,192x), so the reader sets no limit on a block's ratio: it takes what the writer makes.
    Earlier, a block above 1 MiB that expanded more than 1000x was refused as a bomb."""
    root = tmp_path / "cache"
    shutil.copytree(compiled_root, root)
    source = next(root.glob("*/*.ttir"))  # what every Triton version writes
    padded = source.read_bytes() + b"// the same comment, line after line\n" * (40 << 20 >> 5)
    source.write_bytes(padded)  # larger than a block: a block of its own
    archive = tmp_path / "k.tpack"
    tritonpack.pack(root, archive)
    with tritonpack.open(archive) as reader:
        ratios = [block.size / block.length for block in reader.index.blocks if block.size > 1 << 20]
    assert max(ratios) > 1000
    out = tmp_path / "out"
    tritonpack.unpack(archive, out, force=True)
    assert (out / source.relative_to(root)).read_bytes() == padded

    def contents(where):  # manifests name their root: the files they list must be the same bytes
        return {k: v[::2] for k, v in snapshot(where).items() if "__grp__" not in k}

    assert contents(out) == contents(root)

def test_default_root_is_tritons(tmp_path, archive, monkeypatch):
    """``$TRITON_HOME/.triton/cache``, but in Triton 3.0-3.1, which know no ``TRITON_HOME``: ``~/.triton/cache``."""
    from kernels import TRITON_VERSION

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("TRITON_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    expected = tmp_path / ("user" if TRITON_VERSION < (3, 2) else "home") / ".triton" / "cache"
    result = tritonpack.unpack(archive)
    assert result.cache_dir == str(expected)
    assert list(expected.glob("*/__grp__*.json"))


@pytest.mark.parametrize("environ", [{"TRITON_HOME": ""}, {"TRITON_HOME": "rel"}, {"TRITON_HOME": "~/t"},
                                     {"TRITON_HOME": " /tmp/h "}, {"TRITON_HOME": "/tmp/h"},
                                     {"TRITON_CACHE_DIR": " /tmp/x "}, {"TRITON_CACHE_DIR": "rel/c"},
                                     {"TRITON_CACHE_DIR": ""}, {}],
                         ids=["empty-home", "relative-home", "tilde-home", "spaced-home", "home", "spaced-dir",
                              "relative-dir", "empty-dir", "none"])
def test_the_default_root_is_the_one_triton_resolves(environ, tmp_path, monkeypatch):
    """Compared with the root the installed Triton's own cache manager takes, in a process of that environment (the
    rule changed across releases: ``triton_env.default_cache_dir``); where Triton cannot take one, it is refused."""
    from tritonpack.errors import UsageError
    from tritonpack.triton_env import default_cache_dir

    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_HOME", "TRITON_CACHE_DIR")}
    env = {**env, **environ, "HOME": str(tmp_path / "user")}
    monkeypatch.setenv("HOME", env["HOME"])
    try:
        ours = default_cache_dir(env)
    except UsageError:
        ours = None
    code = "import os; from triton.runtime.cache import FileCacheManager as M; print(M('K' * 52).cache_dir, end='')"
    theirs = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert ours == (os.path.dirname(theirs.stdout) if theirs.returncode == 0 else None), theirs.stderr[-300:]


@pytest.mark.parametrize(("version", "environ", "expected"), [
    ("3.0.0", {"TRITON_HOME": "/h"}, "~/.triton/cache"),
    ("3.1.0", {"TRITON_CACHE_DIR": " /c "}, "/c"),
    ("3.2.0", {"TRITON_HOME": " /h "}, " /h /.triton/cache"),
    ("3.3.1", {"TRITON_CACHE_DIR": " ", "TRITON_HOME": "/h"}, "/h/.triton/cache"),
    ("3.4.0", {"TRITON_HOME": " /h "}, "/h/.triton/cache"),
    ("3.4.0", {"TRITON_CACHE_DIR": " "}, None),
    ("3.5.1", {"TRITON_HOME": " /h "}, " /h /.triton/cache"),
    ("3.5.1", {"TRITON_CACHE_DIR": ""}, None),
    (None, {"TRITON_HOME": ""}, ".triton/cache"),
], ids=["3.0-no-home", "3.1-strips-dir", "3.2-home-as-is", "3.3-empty-dir-unset", "3.4-strips-home",
        "3.4-empty-dir", "3.5-as-is", "3.5-empty-dir", "no-triton"])
def test_the_default_root_follows_each_releases_rule(version, environ, expected, monkeypatch):
    """The rules of the releases the suite does not run (checked against each one's cache manager by hand)."""
    from tritonpack.errors import UsageError
    from tritonpack.triton_env import default_cache_dir

    monkeypatch.setattr("tritonpack.fingerprint.installed_version", lambda: version)
    if expected is None:
        with pytest.raises(UsageError, match="TRITON_CACHE_DIR is set but empty"):
            default_cache_dir(environ)
    else:
        assert default_cache_dir(environ) == os.path.expanduser(expected)


def test_an_empty_cache_dir_variable_is_refused(monkeypatch, tmp_path, capsys):
    """Triton 3.4+ cannot compile with it; a pack or unpack by it would go where no Triton looks (3.0-3.3 take it
    for unset: their default root)."""
    from kernels import TRITON_VERSION

    from tritonpack.cli import main

    monkeypatch.setenv("TRITON_CACHE_DIR", "")
    monkeypatch.setenv("HOME", str(tmp_path / "user"))
    monkeypatch.chdir(tmp_path)
    if TRITON_VERSION < (3, 4):
        assert main(["verify"]) == 4
        assert f"{tmp_path}/user/.triton/cache: cache directory does not exist" in capsys.readouterr().err
        return
    assert main(["verify"]) == 2
    assert "TRITON_CACHE_DIR is set but empty" in capsys.readouterr().err and os.listdir(tmp_path) == []


def test_files_get_normal_modes(tmp_path, archive):
    root = tmp_path / "root"
    old = os.umask(0o022)
    try:
        tritonpack.unpack(archive, root)
    finally:
        os.umask(old)
    modes = {p.stat().st_mode & 0o7777 for p in root.rglob("*") if p.is_file()}
    assert modes == {0o644}


def test_pack_is_deterministic(tmp_path, compiled_root, monkeypatch):
    monkeypatch.delenv("SOURCE_DATE_EPOCH", raising=False)
    tritonpack.pack(compiled_root, tmp_path / "1.tpack")
    copy = tmp_path / "copy"
    shutil.copytree(compiled_root, copy)
    tritonpack.pack(copy, tmp_path / "2.tpack")
    assert (tmp_path / "1.tpack").read_bytes() == (tmp_path / "2.tpack").read_bytes()
    monkeypatch.setenv("SOURCE_DATE_EPOCH", "1700000000")
    tritonpack.pack(compiled_root, tmp_path / "3.tpack")
    with tritonpack.open(tmp_path / "3.tpack") as reader:
        assert reader.info.created == 1700000000


def test_small_blocks_with_duplicates_round_trip_whatever_the_threads(tmp_path, compiled_root, monkeypatch):
    """Dedupe moves later contents up inside a block; blocks of duplicates only are not written. Same bytes with
    1, 2 or 16 threads (one compressing and a read ahead; two and a read ahead; four compressing and no read
    ahead), and every file comes back."""
    from tritonpack.archive import writer
    from tritonpack.archive.writer import write_archive
    from tritonpack.cacheroot import scan_cache

    monkeypatch.setattr(writer, "HELD", 5 * 4096)

    root = tmp_path / "cache"
    shutil.copytree(compiled_root, root)
    twin = next(p for p in root.iterdir() if p.is_dir())
    (root / ("D" * 52)).mkdir()
    for i, name in enumerate(("a.so", "b.so", "c.so")):  # the same bytes three times, and an empty file
        (root / ("D" * 52) / name).write_bytes(b"" if i == 2 else (twin / next(twin.glob("*.json")).name).read_bytes())
    scan = scan_cache(str(root))
    info = tritonpack.ArchiveInfo("test", (1, 0), None, None, None)
    for threads in (1, 2, 16):
        write_archive(str(tmp_path / f"{threads}.tpack"), scan.entries, info, block_size=4096, threads=threads)
    assert (tmp_path / "1.tpack").read_bytes() == (tmp_path / "2.tpack").read_bytes() == \
           (tmp_path / "16.tpack").read_bytes()
    with tritonpack.open(tmp_path / "1.tpack") as reader:
        assert len(reader.index.blocks) > 3 and len(reader.index.blobs) < sum(len(e.files) for e in reader.entries)
    tritonpack.unpack(tmp_path / "1.tpack", tmp_path / "out", force=True)
    src, out = snapshot(root), snapshot(tmp_path / "out")
    assert {k: v[2] for k, v in src.items() if "__grp__" not in k} == \
           {k: v[2] for k, v in out.items() if "__grp__" not in k}


def test_files_are_laid_out_by_type_configuration_size_then_target(tmp_path, compiled_root):
    """spec §6.3: blobs lie in the order of (rank, type, launch configuration, size, target) of the first file that
    holds them, the configuration for machine code and assembly only, so that a kernel's files for several targets
    sit side by side instead of a target's files of one type in one run."""
    from tritonpack.archive.writer import BY_CONFIG, SLOW_FIRST

    tritonpack.pack(compiled_root, tmp_path / "k.tpack")
    with tritonpack.open(tmp_path / "k.tpack") as reader:
        first: dict[int, tuple] = {}
        for n, entry in enumerate(reader.entries):
            for f, blob in zip(entry.files, reader.entry_blobs(n), strict=True):
                _, dot, ext = f.name.rpartition(".")
                ext = "autotune.json" if f.name.endswith(".autotune.json") else ext if dot else ""
                rank = SLOW_FIRST.index(ext) if ext in SLOW_FIRST else len(SLOW_FIRST)
                k = entry.kernel
                config = (k.num_warps or 0, k.num_stages or 0, k.shared or 0) if k and ext in BY_CONFIG else (0, 0, 0)
                key = (rank, ext, config, f.size, entry.target or "")
                first[blob] = min(first.get(blob, key), key)
        refs = reader.index.blobs
        assert [(refs[b].block, refs[b].offset) for b in sorted(first)] == sorted((r.block, r.offset) for r in refs)
        keys = [first[b] for b in sorted(first)]
    assert keys == sorted(keys)
    assert len({k[4] for k in keys if k[4]}) >= 2  # several targets, interleaved by size


def test_blocks_that_finish_out_of_order_are_written_in_order(tmp_path, compiled_root, monkeypatch):
    """A slow block must not hold back the next ones (their buffers are reused at once), yet the file keeps block
    order: same bytes as one thread, and finished outputs that wait for a slow one stay bounded."""
    from tritonpack.archive import writer
    from tritonpack.cacheroot import scan_cache

    scan = scan_cache(str(compiled_root))
    info = tritonpack.ArchiveInfo("test", (1, 0), None, None, None)
    writer.write_archive(str(tmp_path / "serial.tpack"), scan.entries, info, block_size=4096, threads=1)
    real, calls = writer.compress_block, itertools.count()

    def every_fifth_slow(data, level):
        if next(calls) % 5 == 0:
            time.sleep(0.05)
        return real(data, level)

    monkeypatch.setattr(writer, "compress_block", every_fifth_slow)
    writer.write_archive(str(tmp_path / "parallel.tpack"), scan.entries, info, block_size=4096, threads=4)
    assert next(calls) > 10
    assert (tmp_path / "parallel.tpack").read_bytes() == (tmp_path / "serial.tpack").read_bytes()


@pytest.mark.parametrize(("threads", "most", "many_files"), [(2, 2, False), (16, 4, False), (16, 1, True)])
def test_compressions_at_once_fit_the_held_buffers(tmp_path, compiled_root, monkeypatch, threads, most, many_files):
    """Five block buffers whatever the cores: with few, two compress and one is read ahead; with many, four
    compress and none is read ahead. Never more at once, and as many where there are blocks for them. Files
    past ``FILES_HELD`` take buffers' places, down to two (one filled while the other compresses): the same
    archive, in less memory."""
    import threading

    from tritonpack.archive import writer
    from tritonpack.cacheroot import scan_cache

    monkeypatch.setattr(writer, "HELD", 5 * 4096)
    if many_files:  # each file past none "holds" a block: as in a cache of hundreds of thousands of files
        monkeypatch.setattr(writer, "FILES_HELD", 0)
        monkeypatch.setattr(writer, "FILE_HELD", 4096)
    real, lock, running, peak = writer.compress_block, threading.Lock(), [0], [0]

    def counted(data, level):
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.02)
        try:
            return real(data, level)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(writer, "compress_block", counted)
    scan = scan_cache(str(compiled_root))
    info = tritonpack.ArchiveInfo("test", (1, 0), None, None, None)
    writer.write_archive(str(tmp_path / "a.tpack"), scan.entries, info, block_size=4096, threads=threads)
    assert peak[0] == most
    monkeypatch.undo()
    writer.write_archive(str(tmp_path / "b.tpack"), scan.entries, info, block_size=4096, threads=threads)
    assert (tmp_path / "a.tpack").read_bytes() == (tmp_path / "b.tpack").read_bytes()


@pytest.mark.parametrize("splice_ptx", [False, True])
def test_an_index_made_after_the_last_block_is_the_same_index(tmp_path, compiled_root, monkeypatch, splice_ptx):
    """Where the files have taken the buffers down to their fewest, the index is made once every block is written
    and checked with the real block table: the same archive, which reads and unpacks the same."""
    from tritonpack.archive import writer

    tritonpack.pack(compiled_root, tmp_path / "early.tpack", splice_ptx=splice_ptx)
    monkeypatch.setattr(writer, "held_buffers", lambda files, block_size=writer.BLOCK_SIZE: writer.FEWEST_BUFFERS)
    checked = []  # the block table each check read
    real = writer.check_index

    def recorded(parts, *args):
        checked.append(bytes(parts[1]))
        return real(parts, *args)

    monkeypatch.setattr(writer, "check_index", recorded)
    tritonpack.pack(compiled_root, tmp_path / "late.tpack", splice_ptx=splice_ptx)
    assert (tmp_path / "late.tpack").read_bytes() == (tmp_path / "early.tpack").read_bytes()
    with tritonpack.open(tmp_path / "late.tpack") as reader:
        assert checked == [writer.block_table(reader.index.blocks)]


def test_held_buffers_make_room_for_the_files():
    from tritonpack.archive.writer import BLOCK_SIZE, FILE_HELD, held_buffers

    assert held_buffers(0) == held_buffers(10_000) == 5
    assert held_buffers(10_001) == 4  # a file's share past ten thousand: a buffer's place
    assert held_buffers(10_000 + BLOCK_SIZE // FILE_HELD) == 4
    assert held_buffers(10_001 + BLOCK_SIZE // FILE_HELD) == 3
    assert held_buffers(54_610) == 4  # ten copies of the real cache's files (manifests aside)
    assert held_buffers(120_000) == 3
    assert held_buffers(163_830) == held_buffers(10**7) == 2  # thirty copies


def test_a_block_that_finishes_between_two_looks_is_still_written(tmp_path, compiled_root, monkeypatch):
    """Every compression here has finished, but the first ``late`` looks at it say not yet: each moment a block
    can finish between two looks of the writer. Under load one such moment once left the last block unwritten
    (an empty block table); whatever the moment, the archive must be the usual one."""
    from concurrent.futures import Future

    from tritonpack.archive import writer
    from tritonpack.cacheroot import scan_cache

    class InlinePool:  # runs each task at once; its futures say "not yet" ``late`` times first
        late = 0

        def __init__(self, *args, **kwargs):
            pass

        def submit(self, fn, *args):
            future, looks = Future(), iter(range(self.late))
            future.done = lambda: next(looks, None) is None and Future.done(future)
            future.set_result(fn(*args))
            return future

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

    scan = scan_cache(str(compiled_root))
    info = tritonpack.ArchiveInfo("test", (1, 0), None, None, None)
    for block_size in (writer.BLOCK_SIZE, 4096):
        writer.write_archive(str(tmp_path / "usual.tpack"), scan.entries, info, block_size=block_size)
        usual = (tmp_path / "usual.tpack").read_bytes()
        with monkeypatch.context() as patch:
            patch.setattr(writer, "ThreadPoolExecutor", InlinePool)
            for late in range(6):
                InlinePool.late = late
                writer.write_archive(str(tmp_path / "late.tpack"), scan.entries, info, block_size=block_size)
                assert (tmp_path / "late.tpack").read_bytes() == usual, (block_size, late)


def test_the_index_is_one_msgpack_map_as_packb_writes_it(archive):
    """The writer encodes the index but for its block table while blocks compress, and adds the table last: the
    bytes must still be those of one msgpack.packb of the whole map, keys in the order spec §4 shows."""
    import msgpack
    import zstandard

    from tritonpack.archive.format import TRAILER_SIZE, parse_trailer

    data = archive.read_bytes()
    trailer = parse_trailer(data[-TRAILER_SIZE:], len(data), str(archive))
    start = trailer.index_offset
    raw = zstandard.ZstdDecompressor().decompress(data[start:start + trailer.index_length])
    doc = msgpack.unpackb(raw, raw=False)
    assert list(doc)[-3:] == ["blocks", "blobs", "entries"] and doc["blocks"]
    assert msgpack.packb(doc, use_bin_type=True) == raw


def test_pack_refuses_an_index_a_reader_would_reject(tmp_path, compiled_root):
    """The writer checks its index (with a stand-in block table) before the archive exists: a duplicate entry
    fails the pack, and neither the archive nor a temp file is left."""
    from tritonpack.archive.writer import write_archive
    from tritonpack.cacheroot import scan_cache

    scan = scan_cache(str(compiled_root))
    info = tritonpack.ArchiveInfo("test", (1, 0), None, None, None)
    with pytest.raises(tritonpack.ArchiveError, match="duplicate entry"):
        write_archive(str(tmp_path / "k.tpack"), [*scan.entries, scan.entries[0]], info, block_size=4096)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("helpers", [False, True])
def test_a_file_that_changes_size_during_pack_is_an_error_and_no_archive(tmp_path, compiled_root, monkeypatch,
                                                                        helpers):
    """Also where forked helpers read the files (as on 8 cores): the helper that meets it leaves the read to the
    writer, which raises the same error; no child is left."""
    from conftest import no_child_left

    from tritonpack import cacheroot
    from tritonpack.archive import writer

    if helpers:
        monkeypatch.setattr(writer, "cores", lambda: 8)
        monkeypatch.setattr(writer, "fork_safe", lambda: True)  # in the full suite an earlier test leaves a thread

    root = tmp_path / "cache"
    shutil.copytree(compiled_root, root)
    real = cacheroot.scan_cache

    def scan_then_grow(path, processes=False):
        scan = real(path, processes)
        with open(scan.entries[0].files[0].path, "ab") as f:
            f.write(b"// appended after the scan\n")
        return scan

    monkeypatch.setattr(cacheroot, "scan_cache", scan_then_grow)
    with pytest.raises(tritonpack.CacheError, match="changed while being packed"):
        tritonpack.pack(root, tmp_path / "k.tpack", processes=helpers)
    assert not list(tmp_path.glob("*.tpack")) and not list(tmp_path.glob(".tpack-*"))
    assert no_child_left()


def test_fresh_key_directories_appear_whole_and_existing_ones_are_completed(tmp_path, archive):
    """A key directory the root lacks is staged aside and renamed in; an empty one (Triton makes the directory
    on a lookup) is filled in place; either way no temp file or staging directory is left."""
    root = tmp_path / "root"
    with tritonpack.open(archive) as reader:
        keys = sorted({e.key for e in reader.entries})
    (root / keys[0]).mkdir(parents=True)
    result = tritonpack.unpack(archive, root)
    assert result.written == result.entries
    assert sorted(p.name for p in root.iterdir()) == keys
    again = tritonpack.unpack(archive, root)
    assert again.present == again.entries


@pytest.mark.parametrize("processes", [False, True])
def test_keys_past_the_staging_names_of_a_token_are_staged_under_another(tmp_path, archive, monkeypatch, processes):
    """One run token has 65,536 temp names: past them its staging directories' names would repeat (two keys in one
    directory: "File exists" at 70,000 keys). The run then takes another token, with a lock of its own. Here one
    token a staging directory: the same files as a plain unpack, every key staged (no file under a temp name in a
    key directory), nothing else left at the root, and a second run finds all present."""
    from tritonpack import staging, tempfiles

    plain = tmp_path / "plain"
    tritonpack.unpack(archive, plain)
    monkeypatch.setattr(staging, "STAGE_DIRS_A_TOKEN", 1)
    tokens, in_place = set(), []
    real_acquire, real_create = tempfiles.RunLock._acquire, tempfiles.RunLock.create

    def acquire(self):
        real_acquire(self)
        tokens.add(self.token)

    def create(self, directory):
        in_place.append(directory)
        return real_create(self, directory)

    monkeypatch.setattr(tempfiles.RunLock, "_acquire", acquire)
    monkeypatch.setattr(tempfiles.RunLock, "create", create)
    root = tmp_path / "root"
    result = tritonpack.unpack(archive, root, processes=processes)
    keys = {e.key for e in tritonpack.open(archive).entries}
    assert result.written == result.entries and {p.name for p in root.iterdir()} == keys
    assert len(tokens) == len(keys) > 2 and not in_place

    def contents(where):  # every file's path and bytes, a manifest's paths as if under one root
        return {str(p.relative_to(where)): p.read_bytes().replace(str(where).encode(), b"ROOT")
                for p in where.rglob("*") if p.is_file()}

    assert contents(root) == contents(plain)
    assert tritonpack.unpack(archive, root).present == result.entries


def test_a_token_names_as_many_staging_directories_as_it_has_distinct_names(tmp_path):
    from tritonpack import staging, tempfiles

    lock = tempfiles.RunLock(str(tmp_path))
    try:
        names = {lock.temp_name() for _ in range(staging.STAGE_DIRS_A_TOKEN)}
    finally:
        lock.release()
    assert len(names) == staging.STAGE_DIRS_A_TOKEN == tempfiles.NAMES_A_RUN


def test_a_root_removed_by_a_failing_concurrent_unpack_as_the_lock_is_made_is_made_again(tmp_path, monkeypatch):
    """Another unpack into the same new root failed, and removed the root, empty, between this run's making of it
    and the creation of its lock file there (seen once as ``cannot write: No such file or directory`` on the root,
    in the disk-full test of ranks unpacking at once): the root is made again, and the lock taken."""
    from tritonpack import tempfiles

    root = tmp_path / "root"
    real_open = os.open
    removed = []

    def open_after_a_removal(path, flags, *args):
        if not removed and flags & os.O_EXCL and os.path.dirname(path) == str(root):
            os.rmdir(root)
            removed.append(path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(tempfiles.os, "open", open_after_a_removal)
    lock = tempfiles.RunLock(str(root))
    try:
        lock.acquire()
        assert removed and os.path.exists(lock.path)
    finally:
        lock.release()


def test_the_free_space_check_counts_each_manifest_exactly(tmp_path):
    """``manifest_size`` counts without building the bytes where every path is plain ASCII, and builds them
    otherwise: both are the length of what unpack writes."""
    from tritonpack.cachedest import manifest_bytes, manifest_size
    from tritonpack.model import GROUP, Entry, StoredFile

    for names in (["k.json", "k.cubin", "k.ptx"], ["k.json"], ["k é.json"], ['k"q.json', "k\\b.json"],
                  ["k\x01.json", "k.json"]):
        entry = Entry(GROUP, "A" * 52, "k", tuple(StoredFile(n, 1, bytes(32)) for n in names), None, None, None)
        for root in (str(tmp_path), str(tmp_path / "ü"), str(tmp_path / 'a"b')):
            assert manifest_size(root, entry) == len(manifest_bytes(root, entry)), (root, names)


def test_only_an_absent_or_empty_root_is_planned_without_a_look_at_each_key(tmp_path, archive):
    """A fresh root (absent, or empty as a new volume is) skips the look at each key directory; anything in it,
    even a stray file, and each key is looked at. The commit compares again either way (tests/test_faults.py)."""
    from tritonpack.cachedest import holds_nothing

    root = tmp_path / "root"
    assert holds_nothing(str(root))
    root.mkdir()
    assert holds_nothing(str(root))
    (root / "notes.txt").write_text("not a key\n")
    assert not holds_nothing(str(root))
    result = tritonpack.unpack(archive, root)
    assert result.written == result.entries and (root / "notes.txt").read_text() == "not a key\n"
    assert tritonpack.unpack(archive, root).present == result.entries


@pytest.mark.parametrize("blob_blocks", [[0, 0, 1, 1, 2, 3], [2, 0, 1, 0, 3, 1]], ids=["writer-order", "shuffled"])
def test_the_files_to_stage_come_in_block_order_then_blob_entry_and_file(blob_blocks):
    """``Targets`` places each file by a counting sort on its blob's place in block order: the order of sorting
    (block, blob, entry, file), whether the blob table is in block order (a writer's) or not."""
    from types import SimpleNamespace

    from tritonpack.staging import Targets

    placements = [SimpleNamespace(blobs=(5, 0, 3), files=(0, 1, 2)), SimpleNamespace(blobs=(1, 1), files=(1,)),
                  SimpleNamespace(blobs=(2, 0, 5, 4), files=(0, 1, 2, 3)), SimpleNamespace(blobs=(3,), files=(0,))]
    active = [2, 0, 3, 1]  # in any order
    targets = Targets(placements, active, blob_blocks, lambda n: (f"d{n}", None))
    expected = sorted((blob_blocks[p.blobs[i]], p.blobs[i], n, i) for n in active for p in [placements[n]]
                      for i in p.files)
    placed = list(zip(targets.blobs, targets.entries, targets.files, strict=True))
    assert placed == [(b, n, i) for _, b, n, i in expected]
    blocks = [block for block, _, _, _ in expected]
    assert targets.blocks == {block: (blocks.index(block), len(blocks) - blocks[::-1].index(block))
                              for block in sorted(set(blocks))}
    assert targets.distinct_blobs() == list(dict.fromkeys(b for _, b, _, _ in expected))


def test_a_root_that_cannot_be_written_is_named_not_the_run_lock(tmp_path, archive, monkeypatch, capsys):
    """What a read-only root gives a user who is not root: the root, not ``tmp.tpack.<pid>.<token>.lock``."""
    import errno

    from tritonpack import tempfiles
    from tritonpack.cli import main

    root = tmp_path / "root"
    root.mkdir()

    def refused(self):
        path = os.path.join(self.root, "tmp.tpack.1.0123abcd.lock")
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)

    monkeypatch.setattr(tempfiles.RunLock, "_acquire", refused)
    assert main(["unpack", str(archive), "--cache-dir", str(root), "--force"]) == 4
    assert capsys.readouterr().err == f"error: {root}: cannot write: Permission denied\n"
