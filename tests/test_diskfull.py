"""A real full disk: unpack onto small tmpfs filesystems (by bytes and by inodes) in a private mount namespace.

Needs ``unshare`` and the right to mount (root, or unprivileged user namespaces); skipped with the reason
otherwise. test_faults.py covers ENOSPC and EDQUOT at every write without mounting anything.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import tritonpack

HERE = os.path.dirname(os.path.abspath(__file__))


def _unshare() -> list[str]:
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        pytest.skip("needs Linux and unshare(1) to mount a small tmpfs")
    return ["unshare", "-m"] if os.geteuid() == 0 else ["unshare", "-Urm"]


def test_unpack_onto_a_full_filesystem(tmp_path, compiled_root):
    prefix = _unshare()
    archive = tmp_path / "k.tpack"
    tritonpack.pack(compiled_root, archive)
    proc = subprocess.run([*prefix, sys.executable, os.path.join(HERE, "diskfull_child.py"), str(archive),
                           str(tmp_path / "work")], capture_output=True, text=True, timeout=300)
    if proc.returncode == 77 or (proc.returncode != 0 and "unshare" in proc.stderr):
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr
    results = [r for r in json.loads(proc.stdout) if "skipped" not in r]
    failed = [r for r in results if r["exit"] != 0]
    assert failed and [r for r in results if r["exit"] == 0], "some sizes must fail and some succeed"
    for r in results:
        assert r["precious_kept"] and not r["temp_files"] and not r["problems"], r
        if r["exit"] == 0:
            assert r["complete"], r
            continue
        lines = r["stderr"].splitlines()
        assert r["exit"] == 4 and len(lines) == 1 and lines[0].startswith("error: "), r
        assert "No space left on device" in lines[0] or "not enough free" in lines[0], r
        assert r["unchanged"], f"a failed unpack changed the filesystem: {r}"
    # the precheck refuses before writing whenever the writes themselves would have failed
    by_size = {(r["size"], r["precheck"]): r["exit"] for r in results if r["inodes"] == 10000}
    for (size, precheck), code in by_size.items():
        if not precheck and code != 0:
            assert by_size[(size, True)] == 4
    real_enospc = [r for r in failed if "No space left on device" in r["stderr"]]
    assert len(real_enospc) >= 3, "the writes themselves met ENOSPC (bytes and inodes)"


@pytest.mark.parametrize("block_size", [None, 4096], ids=["one-block", "workers"])
def test_concurrent_unpacks_need_room_for_one_copy(tmp_path, compiled_root, block_size):
    """Every rank of a job unpacks the same archive into one root, on a disk that holds one copy but not two: each
    finds what the others wrote, none fails for want of space (each once staged everything at once). Small
    blocks make the commands fork their workers, which a retry after a full disk does without."""
    from tritonpack import cacheroot
    from tritonpack.archive.writer import write_archive

    prefix = _unshare()
    archive = tmp_path / "k.tpack"
    sizes = {} if block_size is None else {"block_size": block_size}
    write_archive(str(archive), cacheroot.scan_cache(str(compiled_root)).entries,
                  tritonpack.ArchiveInfo("test", (1, 0), None, None, None), **sizes)
    proc = subprocess.run([*prefix, sys.executable, os.path.join(HERE, "concurrent_full_child.py"), str(archive),
                           str(tmp_path / "work"), "4", "3"], capture_output=True, text=True, timeout=300)
    if proc.returncode == 77 or (proc.returncode != 0 and "unshare" in proc.stderr):
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()[:200]}")
    assert proc.returncode == 0, proc.stderr
    for result in json.loads(proc.stdout)["trials"]:
        assert result["exits"] == [0, 0, 0] and not any(result["stderr"]), result
        assert not result["problems"] and not result["missing"] and not result["temp_files"], result
