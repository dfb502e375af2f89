"""Where the commands that write an archive put it (``archivedest.py``): a regular file is replaced atomically, a
symbolic link's target is replaced and the link kept, a device or a FIFO is written in place, a directory is
refused; a failure leaves what was there, and no temp file."""
from __future__ import annotations

import os
import stat
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, fifo_reader

import tritonpack
from tritonpack.entry import main
from tritonpack.selection import Selection


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """A cache root to pack (the real H200 cache), two archives of it to merge."""
    gpu_cache = FIXTURES / "h200-triton36" / "cache"
    where = tmp_path_factory.mktemp("inputs")
    tritonpack.pack(gpu_cache, where / "kernels.tpack", selection=Selection(kernels=("*add*",)))
    tritonpack.pack(gpu_cache, where / "rest.tpack")
    return {"root": gpu_cache, "a": where / "kernels.tpack", "b": where / "rest.tpack"}


def argv(command: str, inputs: dict[str, Path], output) -> list[str]:
    sources = [inputs["root"]] if command == "pack" else [inputs["a"], inputs["b"]]
    return [command, *map(str, sources), "-o", str(output), "-q"]


@pytest.fixture(scope="module")
def expected(inputs, tmp_path_factory) -> dict[str, bytes]:
    """Each command's archive, written to a new regular file: the bytes every other output must receive."""
    where = tmp_path_factory.mktemp("expected")
    for command in ("pack", "merge"):
        assert main(argv(command, inputs, where / command)) == 0
    return {command: (where / command).read_bytes() for command in ("pack", "merge")}


def temp_files(*directories: Path) -> list[Path]:
    return [p for d in directories for p in d.glob(".tpack-*")]


@pytest.mark.parametrize("command", ["pack", "merge"])
def test_a_device_is_written_in_place_and_stays_a_device(command, inputs, tmp_path):
    """``-o /dev/null`` as root once replaced the system's null device with a regular file."""
    null = tmp_path / "fakenull"
    try:
        os.mknod(null, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        os.close(os.open(null, os.O_WRONLY))
    except OSError as e:  # not root, or a filesystem mounted nodev
        pytest.skip(f"cannot make a null device here: {e.strerror}")
    assert main(argv(command, inputs, null)) == 0
    st = os.lstat(null)
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(1, 3)
    assert os.listdir(tmp_path) == ["fakenull"]


@pytest.mark.parametrize("command", ["pack", "merge"])
def test_a_fifo_is_written_in_place_and_its_reader_gets_the_whole_archive(command, inputs, expected, tmp_path):
    fifo = tmp_path / "pipe"
    with fifo_reader(fifo) as received:
        assert main(argv(command, inputs, fifo)) == 0
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    assert received == [expected[command]]
    (tmp_path / "got.tpack").write_bytes(received[0])
    with tritonpack.open(tmp_path / "got.tpack") as reader:
        assert reader.entries
    assert main(["list", str(tmp_path / "got.tpack"), "-q"]) == 0
    assert sorted(os.listdir(tmp_path)) == ["got.tpack", "pipe"]


@pytest.mark.parametrize("target", ["existing", "dangling"])
@pytest.mark.parametrize("command", ["pack", "merge"])
def test_a_symlink_is_followed_its_target_replaced_and_the_link_kept(command, target, inputs, expected, tmp_path):
    links, targets = tmp_path / "links", tmp_path / "targets"
    links.mkdir()
    targets.mkdir()
    if target == "existing":
        (targets / "real.tpack").write_bytes(b"the previous archive")
    (links / "hop.tpack").symlink_to("../targets/real.tpack")
    (links / "kernels.tpack").symlink_to("hop.tpack")  # a chain: the final target is replaced
    assert main(argv(command, inputs, links / "kernels.tpack")) == 0
    assert os.readlink(links / "kernels.tpack") == "hop.tpack"
    assert os.readlink(links / "hop.tpack") == "../targets/real.tpack"
    assert (targets / "real.tpack").read_bytes() == expected[command]
    assert stat.S_IMODE((targets / "real.tpack").stat().st_mode) == 0o666 & ~_umask()
    assert not temp_files(links, targets)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@pytest.mark.parametrize("command", ["pack", "merge"])
def test_a_failed_write_leaves_the_output_as_it_was(command, inputs, tmp_path, monkeypatch, capsys):
    """The write fails once its temp file exists (the files add up past a reader's limit): the link's target
    keeps the previous archive, the device stays a device."""
    (tmp_path / "real.tpack").write_bytes(b"the previous archive")
    (tmp_path / "link.tpack").symlink_to("real.tpack")
    monkeypatch.setenv("TRITONPACK_MAX_UNPACK_BYTES", "1000")
    assert main(argv(command, inputs, tmp_path / "link.tpack")) == 3
    assert capsys.readouterr().err.count("\n") == 1
    assert (tmp_path / "real.tpack").read_bytes() == b"the previous archive"
    assert os.path.islink(tmp_path / "link.tpack") and not temp_files(tmp_path)


@pytest.mark.parametrize("command", ["pack", "merge", "record"])
def test_a_directory_is_refused_in_one_line(command, inputs, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    if command == "record":  # refused before the command runs
        args = ["record", "-o", str(out), "-q", "--", sys.executable, "-c", f"open({str(tmp_path / 'ran')!r}, 'w')"]
    else:
        args = argv(command, inputs, out)
    assert main(args) == 2
    assert capsys.readouterr().err == f"error: {out}: is a directory; name the archive file to write\n"
    assert os.listdir(out) == [] and not (tmp_path / "ran").exists()
