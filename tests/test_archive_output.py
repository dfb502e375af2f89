"""Where the commands that write an archive put it (``archivedest.py``): a regular file is replaced atomically, a
symbolic link's target is replaced and the link kept, a device or a FIFO is written in place, a directory is
refused; a failure or a SIGTERM leaves what was there, and no temp file."""
from __future__ import annotations

import contextlib
import json
import os
import pty
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from conftest import FIXTURES, fifo_reader

import tritonpack
from tritonpack.entry import main
from tritonpack.errors import Terminated
from tritonpack.selection import Selection

BIG_ARCHIVE = FIXTURES / "torch-max-autotune-h200-triton36.tpack"  # 210 MB of kernels in 5,461 files
# The CLI with helpers forked whatever the machine's cores (they fork where there are four or more)
WITH_HELPERS = ("import sys; from tritonpack.archive import writer; writer.cores = lambda: 8; "
                "from tritonpack.entry import run; sys.argv[0] = 'tritonpack'; run()")


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


@pytest.mark.parametrize("output", ["/dev/stdout", "-"])
@pytest.mark.parametrize("as_json", [False, True], ids=["summary", "json"])
@pytest.mark.parametrize("command", ["pack", "merge"])
def test_an_archive_written_to_standard_output_gets_no_summary_in_it(command, as_json, output, inputs, expected):
    """``pack -o - | aws s3 cp - ...``: the summary (or JSON) goes to standard error instead."""
    words = [w for w in argv(command, inputs, output) if w != "-q"] + (["--json"] if as_json else [])
    out = subprocess.run([sys.executable, "-m", "tritonpack", *words], capture_output=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout == expected[command]
    assert (f'"archive": "{output}"' if as_json else f" -> {output}\n").encode() in out.stderr


def test_standard_output_on_a_terminal_gets_no_archive(inputs, tmp_path):
    """As tar refuses: the terminal would fill with binary. Refused before any work, nothing written."""
    leader, follower = pty.openpty()
    try:
        out = subprocess.run([sys.executable, "-m", "tritonpack", *argv("pack", inputs, "-")], stdout=follower,
                             stderr=subprocess.PIPE, cwd=tmp_path)
    finally:
        os.close(follower)
        os.close(leader)
    assert out.returncode == 2
    assert out.stderr.decode().splitlines()[-1] == ("error: -: standard output is a terminal: pipe the archive "
                                                    "into a command, or redirect it")
    assert os.listdir(tmp_path) == []


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


def test_sigterm_is_handled_only_during_the_write_and_only_where_it_would_kill(inputs, tmp_path):
    """The handler is installed for the write from the main thread where SIGTERM's action is the default, and
    removed after it; a program's own handler, or a write from another thread, is left alone."""
    seen: list = []

    def progress(done: int, total: int) -> None:
        seen.append(signal.getsignal(signal.SIGTERM))

    def own(signum, frame) -> None:
        raise AssertionError("not sent")

    tritonpack.pack(inputs["root"], tmp_path / "a.tpack", progress=progress)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
    assert seen and all(callable(h) and h not in (own, signal.SIG_DFL) for h in seen)
    previous = signal.signal(signal.SIGTERM, own)
    try:
        seen.clear()
        tritonpack.pack(inputs["root"], tmp_path / "b.tpack", progress=progress)
        assert seen and set(seen) == {own} and signal.getsignal(signal.SIGTERM) == own
    finally:
        signal.signal(signal.SIGTERM, previous)
    seen.clear()
    other = threading.Thread(target=tritonpack.pack, args=(inputs["root"], tmp_path / "c.tpack"),
                             kwargs={"progress": progress})
    other.start()
    other.join()
    assert seen and set(seen) == {signal.SIG_DFL}
    assert (tmp_path / "a.tpack").read_bytes() == (tmp_path / "b.tpack").read_bytes() \
        == (tmp_path / "c.tpack").read_bytes()


def test_sigterm_during_the_write_raises_terminated_and_removes_the_temp_file(inputs, tmp_path):
    (tmp_path / "kernels.tpack").write_bytes(b"the previous archive")

    def progress(done: int, total: int) -> None:
        assert temp_files(tmp_path)
        os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Terminated) as raised:
        tritonpack.pack(inputs["root"], tmp_path / "kernels.tpack", progress=progress)
    assert raised.value.signal_number == signal.SIGTERM
    assert (tmp_path / "kernels.tpack").read_bytes() == b"the previous archive" and not temp_files(tmp_path)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def handled_here() -> None:
    """A Python call: the interpreter runs a pending signal's handler as it enters one."""


@pytest.mark.parametrize("step", ["creating", "moving in"])
def test_sigterm_while_the_temp_file_is_created_or_moved_in_waits_for_the_step(step, inputs, tmp_path, monkeypatch):
    """Raised in the middle of either step, the exception would leave a temp file no code names: it comes once the
    step is done. Created: the temp file is removed, the previous archive kept. Moved in: the archive is whole."""
    (tmp_path / "kernels.tpack").write_bytes(b"the previous archive")
    real_mkstemp, real_replace = tempfile.mkstemp, os.replace

    def mkstemp(*args, **kwargs):  # the signal comes once the file exists, before its name is returned
        made = real_mkstemp(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        handled_here()
        return made

    def replace(source, *args, **kwargs):
        if os.path.basename(source).startswith(".tpack-"):
            os.kill(os.getpid(), signal.SIGTERM)
            handled_here()
        return real_replace(source, *args, **kwargs)

    if step == "creating":
        monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    else:
        monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(Terminated):
        tritonpack.pack(inputs["root"], tmp_path / "kernels.tpack")
    assert not temp_files(tmp_path)
    if step == "creating":
        assert (tmp_path / "kernels.tpack").read_bytes() == b"the previous archive"
    else:
        with tritonpack.open(tmp_path / "kernels.tpack") as reader:
            assert reader.entries


@pytest.fixture(scope="module")
def big_root(tmp_path_factory) -> Path:
    """A cache that takes a while to pack (0.5 s on 2 cores): the real max-autotune cache, unpacked on a tmpfs
    where there is one (0.7 s, where a disk took 8)."""
    shm = os.access("/dev/shm", os.W_OK)
    where = Path(tempfile.mkdtemp(prefix="tritonpack-test-", dir="/dev/shm")) if shm else tmp_path_factory.mktemp("big")
    assert main(["unpack", str(BIG_ARCHIVE), "--force", "--cache-dir", str(where / "cache"), "-q"]) == 0
    yield where / "cache"
    if shm:
        shutil.rmtree(where, ignore_errors=True)


def children_of(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        with contextlib.suppress(OSError, ValueError):
            if name.isdigit() and int(Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(name))
    return found


def alive(pid: int) -> bool:
    """Whether the process runs (a zombie does not: pid 1 of a container may never reap one)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("command", ["pack", "merge", "api"])
def test_sigterm_stops_a_write_with_exit_143_and_leaves_nothing_behind(command, big_root, tmp_path):
    """A real pack (with its forked helpers) or merge, stopped by SIGTERM while its temp file exists: exit 143 and
    one line, no temp file, no process of it left, the previous archive intact. The process is stopped (SIGSTOP)
    while the signal is sent, so that it is mid-write when the signal arrives, however fast the machine."""
    out = tmp_path / "out"
    out.mkdir()
    shutil.copyfile(FIXTURES / "archives" / "triton-3.9.0.tpack", out / "kernels.tpack")
    previous = (out / "kernels.tpack").read_bytes()
    if command == "api":  # a program of the user's that packs: it ends quietly with 143, as the signal would
        argv = [sys.executable, "-c", "import sys, tritonpack; tritonpack.pack(sys.argv[1], sys.argv[2])",
                str(big_root), str(out / "kernels.tpack")]
    else:
        head = [sys.executable, "-c", WITH_HELPERS] if command == "pack" else [sys.executable, "-m", "tritonpack"]
        source = big_root if command == "pack" else BIG_ARCHIVE
        argv = [*head, command, str(source), "-o", str(out / "kernels.tpack"), "-q"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while not temp_files(out):
            assert proc.poll() is None, proc.communicate()
        os.kill(proc.pid, signal.SIGSTOP)
        assert temp_files(out), "the write ended before the process stopped"
        children = children_of(proc.pid)
        os.kill(proc.pid, signal.SIGTERM)
        os.kill(proc.pid, signal.SIGCONT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    said = "" if command == "api" else "error: interrupted by SIGTERM\n"
    assert (proc.returncode, stdout, stderr) == (143, "", said)
    assert not temp_files(out) and os.listdir(out) == ["kernels.tpack"]
    assert (out / "kernels.tpack").read_bytes() == previous
    assert bool(children) == (command == "pack")  # the helpers
    assert not [pid for pid in children if alive(pid)]


@pytest.mark.parametrize("quick", [True, False], ids=["entry", "typer"])
def test_a_failure_s_json_stays_out_of_an_archive_written_to_standard_output(quick, tmp_path):
    """``pack -o - --json | ...``: the failure's JSON document goes to standard error, not down the pipe."""
    module = "entry" if quick else "cli"
    out = subprocess.run([sys.executable, "-c", f"import sys; from tritonpack.{module} import main; "
                          "sys.exit(main(sys.argv[1:]))", "pack", str(tmp_path / "missing"), "-o", "-", "--json"],
                         capture_output=True)
    assert out.returncode != 0 and out.stdout == b""
    document = next(line for line in out.stderr.decode().splitlines() if line.startswith("{"))
    assert json.loads(document)["error"]["path"] == str(tmp_path / "missing")
