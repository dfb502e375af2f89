"""Archives from a stream: ``-`` (standard input), ``/dev/stdin`` on a pipe, a FIFO. Each run is a real process
fed through a real pipe, with a ``TMPDIR`` of its own: the copy that a stream needs (``tritonpack/streams.py``) must
leave nothing there, however the run ends."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading

import pytest
from conftest import snapshot

import tritonpack


@pytest.fixture()
def archive(tmp_path, compiled_root):
    path = tmp_path / "k.tpack"
    tritonpack.pack(compiled_root, path)
    return path


@pytest.fixture()
def tmpdir_(tmp_path):
    """The TMPDIR of the runs: empty after each of them."""
    path = tmp_path / "tmp"
    path.mkdir()
    yield path
    assert os.listdir(path) == []


def tritonpack_process(tmpdir, *args, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tritonpack", *map(str, args)], env={**os.environ,
                            "TMPDIR": str(tmpdir)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def run(tmpdir, *args, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    """The command with ``stdin`` written to a pipe that is its standard input."""
    child = tritonpack_process(tmpdir, *args, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL)
    out, err = child.communicate(stdin, timeout=120)
    return subprocess.CompletedProcess(child.args, child.returncode, out.decode(), err.decode())


def test_list_and_check_read_standard_input_as_they_read_the_file(archive, tmpdir_):
    data = archive.read_bytes()
    for command in (["list"], ["list", "--json"], ["check", "--target", "cuda:90"], ["check", "--json"]):
        piped = run(tmpdir_, *command, "-", stdin=data)
        named = run(tmpdir_, *command, archive)
        assert piped.returncode == named.returncode and piped.stderr == named.stderr == "", piped.stderr
        assert piped.stdout == named.stdout.replace(json.dumps(str(archive)), '"-"').replace(str(archive), "-")


def assert_triton_hits(root) -> None:
    """Triton compiles every test kernel from the root as a hit: the listener says so where there is one, and a
    hit writes nothing under the root."""
    from kernels import HAS_LISTENER, compile_all

    before = snapshot(root)
    hits = compile_all(root)
    if HAS_LISTENER:
        assert all(hits)
    assert snapshot(root) == before, "a cache hit writes nothing under the root"


def test_unpack_from_a_pipe_gives_a_root_that_triton_hits(archive, tmpdir_, tmp_path):
    root = tmp_path / "root"
    done = run(tmpdir_, "unpack", "-", "--cache-dir", root, "--json", stdin=archive.read_bytes())
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    with tritonpack.open(archive) as reader:
        assert doc["archive"] == "-" and doc["written"] == doc["entries"] == len(reader.entries)
    assert_triton_hits(root)


def test_pack_to_standard_output_piped_into_unpack_gives_a_root_that_triton_hits(compiled_root, tmpdir_, tmp_path):
    """``tritonpack pack -o - | ssh host tritonpack unpack -``: no archive file on either side."""
    root = tmp_path / "root"
    pipeline = (f"{sys.executable} -m tritonpack pack {compiled_root} -o - -q | "
                f"{sys.executable} -m tritonpack unpack - --cache-dir {root} -q")
    done = subprocess.run(["bash", "-o", "pipefail", "-c", pipeline], capture_output=True,
                          env={**os.environ, "TMPDIR": str(tmpdir_)})
    assert done.returncode == 0 and not done.stdout, done.stderr
    assert_triton_hits(root)


def test_dev_stdin_on_a_pipe_and_a_fifo_are_streams_too(archive, tmpdir_, tmp_path):
    data = archive.read_bytes()
    expected = run(tmpdir_, "list", "--json", archive).stdout.replace(str(archive), "NAME")
    assert run(tmpdir_, "list", "--json", "/dev/stdin", stdin=data).stdout.replace("/dev/stdin", "NAME") == expected
    fifo = tmp_path / "k.fifo"
    os.mkfifo(fifo)
    reader = tritonpack_process(tmpdir_, "list", "--json", fifo)  # waits for the FIFO's writer, as cat does

    def write() -> None:
        with open(fifo, "wb") as f:
            f.write(data)

    writer = threading.Thread(target=write)
    writer.start()
    out, err = reader.communicate(timeout=120)
    writer.join()
    assert (reader.returncode, err) == (0, b"")
    assert out.decode().replace(str(fifo), "NAME") == expected


@pytest.mark.parametrize("cut", ["empty", "garbage", "half", "no last byte", "flipped index byte"])
def test_a_bad_stream_is_the_error_of_a_bad_file(cut, archive, tmpdir_, tmp_path):
    data = archive.read_bytes()
    content = {"empty": b"", "garbage": b"<html><body>404 Not Found</body></html>\n", "half": data[:len(data) // 2],
               "no last byte": data[:-1], "flipped index byte": data[:-80] + bytes([data[-80] ^ 1]) + data[-79:]}[cut]
    bad = tmp_path / "bad.tpack"
    bad.write_bytes(content)
    root = tmp_path / "root"
    named = run(tmpdir_, "unpack", bad, "--cache-dir", root)
    piped = run(tmpdir_, "unpack", "-", "--cache-dir", root, stdin=content)
    assert piped.returncode == named.returncode == 3
    assert piped.stderr == named.stderr.replace(str(bad), "standard input")
    assert piped.stderr.count("\n") == 1 and piped.stdout == ""
    assert not root.exists()


def test_a_stream_that_is_not_an_archive_is_refused_at_its_first_bytes(tmpdir_, tmp_path):
    """Not read to its end (an endless stream would fill TMPDIR): the run ends while the pipe is still open."""
    child = tritonpack_process(tmpdir_, "unpack", "-", "--cache-dir", tmp_path / "root", stdin=subprocess.PIPE)
    child.stdin.write(b"\0" * 4096)
    child.stdin.flush()
    assert child.wait(timeout=60) == 3
    assert child.stderr.read() == b"error: standard input: not a tpack archive (bad magic)\n"
    child.stdin.close()
    child.stdout.close()
    child.stderr.close()


def test_a_terminal_on_standard_input_is_refused_in_words(tmpdir_):
    import pty

    leader, follower = pty.openpty()
    try:
        child = tritonpack_process(tmpdir_, "list", "-", stdin=follower)
        out, err = child.communicate(timeout=60)
    finally:
        os.close(follower)
        os.close(leader)
    assert (child.returncode, out) == (2, b"")
    assert err == (b"error: standard input: is a terminal: pipe an archive into it "
                   b"(cat kernels.tpack | tritonpack list -)\n")


def test_sigterm_while_the_stream_is_copied_leaves_nothing(archive, tmpdir_, tmp_path):
    """The copy has no name in TMPDIR even while it is written, so that however the run ends (SIGTERM's default
    action here) nothing is left to clean."""
    child = tritonpack_process(tmpdir_, "unpack", "-", "--cache-dir", tmp_path / "root", stdin=subprocess.PIPE)
    child.stdin.write(archive.read_bytes()[:16] + bytes(4 << 20))  # returns once the child has read most of it
    child.stdin.flush()
    assert os.listdir(tmpdir_) == []
    child.send_signal(signal.SIGTERM)
    assert child.wait(timeout=60) == -signal.SIGTERM
    for stream in (child.stdin, child.stdout, child.stderr):
        stream.close()
    assert not (tmp_path / "root").exists()


def test_ensure_reads_a_pipe_once_a_run_and_finds_its_stamp(archive, tmpdir_, tmp_path):
    """ensure opens its archive several times (digest, unpack, the entries it stamps): the pipe's copy serves them."""
    data, root = archive.read_bytes(), tmp_path / "root"
    first = run(tmpdir_, "ensure", "-", "--cache-dir", root, "--json", stdin=data)
    assert first.returncode == 0, first.stderr
    doc = json.loads(first.stdout)
    assert (doc["status"], doc["written"], doc["archive"]) == ("unpacked", doc["entries"], "-")
    again = json.loads(run(tmpdir_, "ensure", "-", "--cache-dir", root, "--json", stdin=data).stdout)
    assert (again["status"], again["digest"]) == ("present", doc["digest"])
    assert json.loads(run(tmpdir_, "ensure", archive, "--cache-dir", root, "--json").stdout)["status"] == "present"


def test_merge_takes_standard_input_once_and_push_wants_a_file(archive, tmpdir_, tmp_path, gpu_cache):
    other = tmp_path / "other.tpack"
    tritonpack.pack(gpu_cache, other)
    piped = run(tmpdir_, "merge", "-", other, "-o", tmp_path / "piped.tpack", stdin=archive.read_bytes())
    assert piped.returncode == 0, piped.stderr
    assert run(tmpdir_, "merge", archive, other, "-o", tmp_path / "named.tpack").returncode == 0
    assert (tmp_path / "piped.tpack").read_bytes() == (tmp_path / "named.tpack").read_bytes()
    twice = run(tmpdir_, "merge", "-", "-", "-o", tmp_path / "twice.tpack", stdin=b"")
    assert (twice.returncode, twice.stderr) == (2, "error: standard input: named twice (inputs 1 and 2): standard "
                                                   "input gives one archive, so - can be one input at most\n")
    push = run(tmpdir_, "push", "-", "oci://127.0.0.1:1/triton/kernels:x", stdin=archive.read_bytes())
    assert (push.returncode, push.stderr) == (2, "error: standard input: push uploads an archive file, not a "
                                                 "stream: save it to one first\n")
    assert not (tmp_path / "twice.tpack").exists()


ONCE = "a stream (a pipe, a FIFO) gives its bytes once, so it can be one input at most"


@pytest.mark.parametrize(("inputs", "error"), [
    (["-", "/dev/stdin"], f"/dev/stdin: the same stream as input 1 (-): {ONCE}"),
    (["/dev/stdin", "OTHER", "-"], f"standard input: the same stream as input 1 (/dev/stdin): {ONCE}"),
    (["/dev/stdin", "/proc/self/fd/0"], f"/proc/self/fd/0: the same stream as input 1 (/dev/stdin): {ONCE}"),
    (["-", "OTHER", "-"], "standard input: named twice (inputs 1 and 3): standard input gives one archive, so - can "
                          "be one input at most"),
])
def test_merge_refuses_a_pipe_named_twice_before_reading_it(inputs, error, archive, tmpdir_, tmp_path):
    """The second name of a pipe read it empty, an error that blamed the archive. Refused before anything is read:
    the run ends while the pipe, open, has given nothing."""
    inputs = [str(archive) if name == "OTHER" else name for name in inputs]
    child = tritonpack_process(tmpdir_, "merge", *inputs, "-o", tmp_path / "out.tpack", stdin=subprocess.PIPE)
    assert child.wait(timeout=60) == 2
    assert (child.stdout.read(), child.stderr.read().decode()) == (b"", f"error: {error}\n")
    for stream in (child.stdin, child.stdout, child.stderr):
        stream.close()
    assert not (tmp_path / "out.tpack").exists()


def test_merge_refuses_a_fifo_named_twice_and_reads_a_file_named_twice(archive, tmpdir_, tmp_path):
    """A FIFO named twice waited forever for a second writer; no writer comes here. A regular file named twice, or
    by ``-`` and ``/dev/stdin`` when standard input is that file, is read twice and its entries stored once."""
    fifo, link = tmp_path / "k.fifo", tmp_path / "link.fifo"
    os.mkfifo(fifo)
    link.symlink_to(fifo)
    for inputs, error in ([[fifo, archive, fifo], f"{fifo}: named twice (inputs 1 and 3): {ONCE}"],
                          [[fifo, link.as_uri()], f"{link.as_uri()}: the same stream as input 1 ({fifo}): {ONCE}"]):
        done = run(tmpdir_, "merge", *inputs, "-o", tmp_path / "out.tpack")
        assert (done.returncode, done.stdout, done.stderr) == (2, "", f"error: {error}\n")
    assert not (tmp_path / "out.tpack").exists()
    assert run(tmpdir_, "merge", archive, "-o", tmp_path / "once.tpack").returncode == 0
    twice = run(tmpdir_, "merge", archive, archive, "-o", tmp_path / "twice.tpack", "--json")
    with tritonpack.open(archive) as reader:
        assert json.loads(twice.stdout)["identical"] == len(reader.entries)
    with open(archive, "rb") as stdin:
        child = tritonpack_process(tmpdir_, "merge", "-", "/dev/stdin", "-o", tmp_path / "stdin.tpack", stdin=stdin)
        assert child.communicate(timeout=120)[1] == b"" and child.returncode == 0
    once = (tmp_path / "once.tpack").read_bytes()
    assert (tmp_path / "twice.tpack").read_bytes() == (tmp_path / "stdin.tpack").read_bytes() == once


@pytest.mark.parametrize("command", [["unpack", "URL", "--cache-dir", "ROOT"], ["merge", "URL", "ARCHIVE", "-o", "OUT"],
                                     ["list", "URL"]])
def test_a_file_url_that_decodes_to_a_nul_is_a_one_line_error(command, archive, tmpdir_, tmp_path):
    """``%00`` in a ``file://`` URL decodes to a byte no path holds: a traceback (ValueError from the opening, or
    from merge's look for a stream named twice), where every other unopenable path is one line."""
    url = f"{archive.as_uri()}%00x"
    names = {"URL": url, "ARCHIVE": str(archive), "ROOT": str(tmp_path / "root"), "OUT": str(tmp_path / "out.tpack")}
    done = run(tmpdir_, *(names.get(word, word) for word in command))
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == f"error: {url}: a file:// URL's path holds no NUL character (%00)\n"
    assert not (tmp_path / "root").exists() and not (tmp_path / "out.tpack").exists()
