"""Run inside a private mount namespace (``unshare -m``) by tests/test_diskfull.py: unpack onto small real tmpfs
filesystems, full by bytes or by inodes, and report what happened as JSON on stdout.

Usage: unshare -m python tests/diskfull_child.py ARCHIVE WORKDIR [STEPS]   (exit 77: mounting is not possible)
STEPS (default 10) filesystem sizes from 1/8 to 3/2 of what the archive needs, each with and without the free-space
precheck, and as many inode limits. A summary goes to stderr.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import snapshot
from invariants import expected_groups, group_problems, sha, temp_files

import tritonpack
from tritonpack import staging
from tritonpack.entry import main

KiB = 1024


def mount(point: str, size: int, inodes: int) -> None:
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},nr_inodes={inodes},mode=755", "tmpfs", point],
                   check=True, capture_output=True)


def umount(point: str) -> None:
    subprocess.run(["umount", point], check=True, capture_output=True)


def populate(archive: str, mnt: str) -> dict:
    """The user's data on the small filesystem: a root holding the archive's first group as the user's own build
    (differing in one file), an unrelated cache entry, and a file beside the root. Returns the allowed group
    versions (the user's and the archive's)."""
    root = os.path.join(mnt, "cache")
    expected = expected_groups(archive)
    key, name = sorted(expected)[0]
    os.makedirs(os.path.join(root, key))
    with tritonpack.open(archive) as reader:
        number = next(n for n, e in enumerate(reader.entries) if (e.key, e.name) == (key, name))
        entry = reader.entries[number]
        wanted = {reader.blob_of(number, i): f.name for i, f in enumerate(entry.files)}
        for blob, content in reader.iter_blobs(wanted):
            with open(os.path.join(root, key, wanted[blob]), "wb") as f:
                f.write(bytes(content) + (b" " if wanted[blob].endswith(".json") else b""))
    with open(os.path.join(root, key, f"__grp__{name}.json"), "w") as f:
        json.dump({"child_paths": {n: os.path.join(root, key, n) for n in wanted.values()}}, f)
    users = {n: sha(os.path.join(root, key, n)) for n in wanted.values()}
    os.makedirs(os.path.join(root, "U" * 52))
    with open(os.path.join(root, "U" * 52, "mine.autotune.json"), "w") as f:
        f.write('{"key": [1], "configs_timings": []}')
    with open(os.path.join(mnt, "precious.txt"), "w") as f:
        f.write("the user's file beside the cache\n")
    versions = {k: [v] for k, v in expected.items()}
    versions[(key, name)].append(users)
    return versions


def attempt(archive: str, mnt: str, size: int, inodes: int, precheck: bool) -> dict:
    mount(mnt, size, inodes)
    try:
        try:
            versions = populate(archive, mnt)
        except OSError:
            return {"size": size, "inodes": inodes, "precheck": precheck, "skipped": "user data does not fit"}
        root = os.path.join(mnt, "cache")
        before = snapshot(mnt)
        err = io.StringIO()
        real = staging.check_space
        if not precheck:  # let the writes meet the full disk themselves
            staging.check_space = lambda *a, **k: None
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                code = main(["unpack", archive, "--cache-dir", root, "--overwrite", "--force"])
        finally:
            staging.check_space = real
        after = snapshot(mnt)
        st = os.statvfs(mnt)
        return {
            "size": size, "inodes": inodes, "precheck": precheck, "exit": code, "stderr": err.getvalue(),
            "unchanged": before == after,
            "precious_kept": os.path.exists(os.path.join(mnt, "precious.txt")),
            "temp_files": temp_files(root),
            "problems": group_problems(root, versions),
            "complete": code == 0 and not group_problems(root, {k: v[:1] for k, v in versions.items()})
            and len([1 for _ in os.scandir(root)]) == len({k for k, _ in versions}) + 1,
            "free_after": st.f_bavail * st.f_frsize,
        }
    finally:
        umount(mnt)


def main_child() -> None:
    archive, work = sys.argv[1], sys.argv[2]
    mnt = os.path.join(work, "mnt")
    os.makedirs(mnt, exist_ok=True)
    try:
        mount(mnt, 64 * KiB, 100)
        umount(mnt)
    except (subprocess.CalledProcessError, OSError) as e:
        print(f"cannot mount a tmpfs here: {getattr(e, 'stderr', b'') or e}", file=sys.stderr)
        sys.exit(77)
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 10
    results = []
    with tritonpack.open(archive) as reader:
        need = sum(-(-f.size // 4096) * 4096 for e in reader.entries for f in e.files)
        files = sum(len(e.files) + 1 for e in reader.entries)
    sizes = sorted({max(64 * KiB, need // 8 + (need * 3 // 2 - need // 8) * k // steps) for k in range(steps)}
                   | {need * 2})
    for precheck in (False, True):
        for size in sizes:
            results.append(attempt(archive, mnt, size, 10000, precheck))
    for inodes in sorted({max(4, files * k // steps) for k in range(1, steps + 1)} | {files * 3}):
        results.append(attempt(archive, mnt, need * 3, inodes, False))
    shutil.rmtree(mnt, ignore_errors=True)
    done = [r for r in results if "skipped" not in r]
    failed = [r for r in done if r["exit"] != 0]
    print(f"{len(done)} unpacks onto full filesystems: {len(done) - len(failed)} complete, {len(failed)} refused "
          f"({sum('No space left' in r['stderr'] for r in failed)} by ENOSPC mid-write, "
          f"{sum('not enough free' in r['stderr'] for r in failed)} by the precheck); changed the filesystem "
          f"when refused: {sum(not r['unchanged'] for r in failed)}; temp files left: "
          f"{sum(bool(r['temp_files']) for r in done)}; partial groups: {sum(bool(r['problems']) for r in done)}",
          file=sys.stderr)
    print(json.dumps(results))


if __name__ == "__main__":
    main_child()
