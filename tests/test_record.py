"""record: run a real program under the tracking cache manager and pack exactly the entries it used."""
from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from conftest import snapshot  # noqa: E402
from kernels import SOURCES, targets  # noqa: E402

import tritonpack  # noqa: E402
from tritonpack.cli import main  # noqa: E402
from tritonpack.recording import CHAIN_ENV, HOOK_SPEC, LOG_ENV, hook_environment, parse_log  # noqa: E402

TESTS = str(Path(__file__).resolve().parent)

# Compiles the kernels of SOURCES named by number (argv[1], e.g. "0,1") for cuda:90, as a user program would.
COMPILE = textwrap.dedent(f"""
    import sys
    sys.path.insert(0, {TESTS!r})
    import triton
    from triton.backends.compiler import GPUTarget
    from kernels import SOURCES, source
    for i in map(int, sys.argv[1].split(",")):
        triton.compile(source(*SOURCES[i]), target=GPUTarget("cuda", 90, 32))
    print("compiled", sys.argv[1])
    sys.exit(int(sys.argv[2]) if len(sys.argv) > 2 else 0)
""")

# Stores an autotune result the way Triton's Autotuner does (get_file, then put), under a made-up tuning key.
AUTOTUNE = textwrap.dedent("""
    import hashlib, json
    from triton.runtime.cache import get_cache_manager
    cache = get_cache_manager(hashlib.sha256(b"my_matmul-autotune").hexdigest())
    if cache.get_file("my_matmul.autotune.json") is None:
        cache.put(json.dumps({"key": [1024], "configs_timings": [[{"kwargs": {"BLOCK": 64}, "num_warps": 4},
                                                                   [0.5]]]}), "my_matmul.autotune.json")
""")

# Removes the cuda:90 softmax group's manifest, as a cache cleaner would while the run goes on.
CLEAN_SOFTMAX_CUDA90 = textwrap.dedent("""
    import glob, os
    for manifest in glob.glob(os.path.join(os.environ["TRITON_CACHE_DIR"], "*", "__grp__softmax_kernel.json")):
        if '"cuda", "arch": 90' in open(manifest.replace("__grp__", "")).read():
            os.unlink(manifest)
""")


def groups_of(archive) -> set[tuple[str, str]]:
    with tritonpack.open(archive) as reader:
        return {(e.name, e.target) for e in reader.entries if e.kind == "group"}


@pytest.fixture()
def full_root(tmp_path, compiled_root) -> Path:
    """A root holding every test kernel for every target, manifests pointing into it."""
    root = tmp_path / "full" / "cache"
    shutil.copytree(compiled_root, root)
    tritonpack.relocate(root)
    return root


def test_python_program_archive_holds_exactly_the_kernels_it_used(tmp_path, full_root, monkeypatch):
    script = tmp_path / "use_two.py"
    script.write_text(COMPILE)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(full_root))
    before = snapshot(full_root)
    result = tritonpack.record([sys.executable, str(script), "0,1"], tmp_path / "two.tpack")
    assert snapshot(full_root) == before, "hits only: the run wrote nothing"
    assert len(list(full_root.glob("*/__grp__*.json"))) == len(SOURCES) * len(targets()) > 2
    assert groups_of(tmp_path / "two.tpack") == {("add_kernel", "cuda:90"), ("softmax_kernel", "cuda:90")}
    assert result.roots == [str(full_root)] and result.processes == 1
    assert [(r.kind, r.hits, r.writes) for r in result.recorded] == [("group", 1, 0)] * 2
    assert result.not_packed == [] and result.compiled == 0
    # The recording describes the Triton the program ran: here the same installation, so its build key.
    with tritonpack.open(tmp_path / "two.tpack") as reader:
        assert reader.info.triton.version == triton.__version__ and reader.info.triton.key_sha256
        assert set(reader.info.triton.backend_hashes) <= {"cuda:90"}
    assert not tritonpack.check(tmp_path / "two.tpack").unusable


def test_shell_script_with_its_own_root_and_parallel_pythons(tmp_path, monkeypatch, capfd):
    (tmp_path / "compile.py").write_text(COMPILE)
    (tmp_path / "autotune.py").write_text(AUTOTUNE)
    script = tmp_path / "run.sh"
    script.write_text(textwrap.dedent(f"""\
        #!/bin/sh
        set -e
        export TRITON_CACHE_DIR=shellroot
        cd {tmp_path}
        {sys.executable} compile.py 2 &
        {sys.executable} autotune.py &
        wait
        """))
    script.chmod(0o755)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "unused"))
    out = tmp_path / "shell.tpack"
    assert main(["record", "-o", str(out), "--json", "--", str(script)]) == 0
    captured = capfd.readouterr()
    doc = json.loads(captured.out)  # stdout is the JSON document alone; the program's output went to stderr
    assert "compiled 2" in captured.err
    root = str(tmp_path / "shellroot")
    assert doc["roots"] == [root] and doc["processes"] == 2
    assert doc["entries"] == {"group": 1, "autotune": 1, "file": 0}
    assert {(r["kind"], r["name"], r["writes"]) for r in doc["recorded"]} == {
        ("group", "scale_kernel", 1), ("autotune", "my_matmul.autotune.json", 1)}
    assert groups_of(out) == {("scale_kernel", "cuda:90")}
    assert not (tmp_path / "unused").exists()
    # Unpacked elsewhere, the kernel is a hit for the real Triton.
    again = tmp_path / "again"
    tritonpack.unpack(out, again)
    before = snapshot(again)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(again))
    subprocess.run([sys.executable, str(tmp_path / "compile.py"), "2"], check=True, capture_output=True)
    assert snapshot(again) == before


def test_failing_command_packs_nothing_unless_allowed(tmp_path, full_root, monkeypatch, capsys):
    script = tmp_path / "fails.py"
    script.write_text(COMPILE)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(full_root))
    out = tmp_path / "k.tpack"
    assert main(["record", "-o", str(out), "-q", "--", sys.executable, str(script), "1", "3"]) == 8
    assert "exited with status 3; nothing was packed" in capsys.readouterr().err
    assert not out.exists()
    result = tritonpack.record([sys.executable, str(script), "1", "3"], out, allow_failure=True)
    assert result.returncode == 3 and groups_of(out) == {("softmax_kernel", "cuda:90")}
    assert "status 3" in result.notes()[0]
    assert main(["record", "-o", str(out), "--", sys.executable, "-c", "pass"]) == 8
    assert "used no Triton cache entry" in capsys.readouterr().err
    assert main(["record", "-o", str(out), "--", str(tmp_path / "no-such-program")]) == 2
    marker = tmp_path / "ran"
    assert main(["record", "-o", str(tmp_path / "no" / "dir.tpack"), "--", "touch", str(marker)]) == 4  # as pack
    assert not marker.exists(), "an output that cannot be written is refused before the command runs"


def test_an_output_inside_a_root_the_command_uses_is_refused_as_pack_refuses_it(tmp_path, full_root, monkeypatch,
                                                                                   capsys):
    """Known up front (TRITON_CACHE_DIR, else Triton's default): refused before the command runs. Chosen by the
    command itself: refused once it has run, before anything is written."""
    script = tmp_path / "use_one.py"
    script.write_text(COMPILE)
    before = snapshot(full_root)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(full_root))
    marker = tmp_path / "ran"
    for inside in (full_root / "k.tpack", next(full_root.iterdir()) / "k.tpack"):
        assert main(["record", "-o", str(inside), "--", "touch", str(marker)]) == 2
        assert capsys.readouterr().err == (f"error: {inside}: the archive would be written inside Triton's cache "
                                           f"root {full_root}, which the command uses unless it sets another; "
                                           "choose another -o\n")
    assert not marker.exists(), "refused before the command runs"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "unused"))
    inside = full_root / "k.tpack"
    argv = ["record", "-o", str(inside), "--", "env", f"TRITON_CACHE_DIR={full_root}", sys.executable, str(script)]
    assert main([*argv, "0"]) == 2
    assert capsys.readouterr().err.endswith(
        f"error: {inside}: the archive would be written inside {full_root}, a cache root the command used (nothing "
        "was packed); choose another -o\n")
    assert snapshot(full_root) == before, "no archive, no temp file"
    monkeypatch.setenv("TRITON_CACHE_DIR", "")  # the command sets the root Triton 3.4+ needs: checked once it ran
    assert main([*argv, "0"]) == 2
    assert "a cache root the command used (nothing was packed)" in capsys.readouterr().err
    assert snapshot(full_root) == before


def test_what_was_used_but_cannot_be_packed_is_reported(tmp_path, full_root, monkeypatch, capsys):
    script = tmp_path / "use_then_clean.py"
    script.write_text(COMPILE.replace("sys.exit(", CLEAN_SOFTMAX_CUDA90 + "sys.exit("))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(full_root))
    out = tmp_path / "k.tpack"
    assert main(["record", "-o", str(out), "--", sys.executable, str(script), "0,1"]) == 0
    err = capsys.readouterr().err
    assert "used but not packed, 1: incomplete group: no manifest for" in err and "softmax_kernel" in err
    assert groups_of(out) == {("add_kernel", "cuda:90")}


def test_users_own_cache_manager_is_extended_or_reported(tmp_path, full_root, monkeypatch):
    (tmp_path / "use_one.py").write_text(COMPILE)
    (tmp_path / "my_managers.py").write_text(textwrap.dedent("""
        import os
        from triton.runtime.cache import CacheManager, FileCacheManager

        class Auditing(FileCacheManager):  # a user's own file manager: keeps working under record
            def get_group(self, filename):
                with open(os.environ["AUDIT_LOG"], "a") as f:
                    f.write(filename + "\\n")
                return super().get_group(filename)

        class Elsewhere(CacheManager):  # delegates, so not Triton's file layout as far as record can tell
            def __init__(self, key, override=False, dump=False):
                self.inner = FileCacheManager(key, override=override, dump=dump)
            def get_file(self, filename): return self.inner.get_file(filename)
            def put(self, data, filename, binary=True): return self.inner.put(data, filename, binary)
            def get_group(self, filename): return self.inner.get_group(filename)
            def put_group(self, filename, group): return self.inner.put_group(filename, group)
        """))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(full_root))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setenv("AUDIT_LOG", str(tmp_path / "audit.log"))
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "my_managers:Auditing")
    tritonpack.record([sys.executable, str(tmp_path / "use_one.py"), "0"], tmp_path / "a.tpack")
    assert groups_of(tmp_path / "a.tpack") == {("add_kernel", "cuda:90")}
    assert (tmp_path / "audit.log").read_text() == "add_kernel.json\n"
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "my_managers:Elsewhere")
    with pytest.raises(tritonpack.RecordError, match="TRITON_CACHE_MANAGER=my_managers:Elsewhere keeps kernels"):
        tritonpack.record([sys.executable, str(tmp_path / "use_one.py"), "0"], tmp_path / "b.tpack")


def test_hook_environment_chains_and_nests():
    env = hook_environment({"PYTHONPATH": "/app", "TRITON_CACHE_MANAGER": "mine:Manager"}, "/hook", "/log1")
    assert env["TRITON_CACHE_MANAGER"] == HOOK_SPEC and env[CHAIN_ENV] == "mine:Manager"
    assert env["PYTHONPATH"] == os.pathsep.join(["/hook", "/app"]) and env[LOG_ENV] == "/log1"
    inner = hook_environment(env, "/hook2", "/log2")  # record inside record: both logs see everything
    assert inner[LOG_ENV] == os.pathsep.join(["/log2", "/log1"]) and inner[CHAIN_ENV] == "mine:Manager"
    assert CHAIN_ENV not in hook_environment({}, "/h", "/l")


def test_parse_log_counts_uses_and_survives_torn_lines():
    lines = [
        '{"op":"process","pid":7,"triton_version":"3.9.0","triton_dir":"/t"}\n',
        '{"op":"hit","what":"group","dir":"/r/KEY","name":"add_kernel","pid":7}\n',
        '{"op":"hit","what":"group","dir":"/r/KEY","name":"add_kernel","pid":7}\n',
        '{"op":"write","what":"file","dir":"/r/KEY","name":"add_kernel.json","pid":7}\n',
        '{"op":"key","pid":7,"key_sha256":"ab"}\n',
        '{"op":"hit","what":"gro',
    ]
    log = parse_log(lines)
    assert log.bad_lines == 1 and log.processes[7]["key_sha256"] == "ab"
    assert [(u.root, u.key, u.what, u.name, c) for u, c in log.uses.items()] == [
        ("/r", "KEY", "group", "add_kernel", [2, 0]), ("/r", "KEY", "file", "add_kernel.json", [0, 1])]


@pytest.mark.parametrize(("signum", "shell"), [(signal.SIGTERM, False), (signal.SIGTERM, True),
                                            (signal.SIGHUP, True), (signal.SIGINT, True)])
def test_a_signal_reaches_every_process_of_the_recorded_command_and_packs_nothing(tmp_path, signum, shell,
                                                                                  interruptible):
    """A SIGTERM (a pod's end), a SIGHUP, or a SIGINT sent to tritonpack alone (``kill -INT``, a container's stop
    signal; no terminal here) reaches the command, and the Python a shell script runs under it: the shell alone was
    told, or none for SIGINT, and the Python went on on its own."""
    import time

    started = tmp_path / "started"
    program = (f"import os, pathlib, signal, sys, time\n"
               f"signal.signal({int(signum)}, lambda *a: sys.exit(7))\n"
               f"pathlib.Path({str(started)!r}).write_text(str(os.getpid()))\n"
               f"time.sleep(60)\n")
    command = [sys.executable, "-c", program]
    if shell:
        command = ["bash", "-c", f"{shlex.join(command)}; echo after"]
    out = tmp_path / "k.tpack"
    proc = subprocess.Popen([sys.executable, "-m", "tritonpack", "record", "-o", str(out), "--", *command],
                            stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (started.exists() and started.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    python = int(started.read_text())
    proc.send_signal(signum)
    assert proc.wait(timeout=30) == 128 + signum
    said = "interrupted" if signum == signal.SIGINT else f"interrupted by {signal.Signals(signum).name}"
    assert proc.stderr.read().endswith(f"error: {said}\n")
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{python}") and time.monotonic() < deadline:  # a grandchild: reaped by init
        time.sleep(0.05)
    assert not os.path.exists(f"/proc/{python}")
    assert not out.exists() and os.listdir(tmp_path) == ["started"]


def test_what_ran_past_the_recording_or_beside_it_is_said_and_does_not_break(tmp_path, full_root, monkeypatch):
    """A process that compiled without the tracking manager (its environment cleared) wrote a key directory the
    recording cannot attribute: it is said, where it was left out without a word. One the command left running
    compiles after record has ended: it found the tracking manager's module gone (ModuleNotFoundError). A forked
    child is a process of its own."""
    import time

    root = tmp_path / "root"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(root))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    (tmp_path / "compile.py").write_text(COMPILE)
    later = tmp_path / "later.log"
    program = textwrap.dedent(f"""
        import multiprocessing, os, subprocess, sys
        compile_py = {str(tmp_path / "compile.py")!r}
        subprocess.run([sys.executable, compile_py, "0"], check=True)
        bare = {{k: v for k, v in os.environ.items() if k not in ("TRITON_CACHE_MANAGER", "PYTHONPATH")}}
        subprocess.run([sys.executable, compile_py, "1"], env=bare, check=True)
        def child():
            subprocess.run([sys.executable, compile_py, "0"], check=True)  # a hit: a use of its own
            import runpy; sys.argv = [compile_py, "2"]; runpy.run_path(compile_py)
        ctx = multiprocessing.get_context("fork"); p = ctx.Process(target=child); p.start(); p.join()
        with open({str(later)!r}, "w") as log:
            subprocess.Popen(["bash", "-c", f"sleep 2; {{sys.executable}} {{compile_py}} 1"], stdout=log, stderr=log,
                             start_new_session=True)
    """)
    result = tritonpack.record([sys.executable, "-c", program], tmp_path / "k.tpack")
    assert len(result.untracked) == 1 and result.untracked[0].startswith(str(root))
    assert any("key directories written while the command ran by no process the recording tracked" in line
               for line in result.notes())
    assert {name for name, _ in groups_of(tmp_path / "k.tpack")} == {SOURCES[0][0].fn.__name__,
                                                                      SOURCES[2][0].fn.__name__}
    assert result.processes >= 3  # the program, its first compile's Python, the forked child
    deadline = time.monotonic() + 60
    while "compiled 1" not in (later.read_text() if later.exists() else "") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "compiled 1" in later.read_text() and "Error" not in later.read_text()


@pytest.mark.parametrize("output", ["-", "/dev/stdout"])
def test_record_to_standard_output_keeps_the_command_s_output_out_of_the_archive(tmp_path, output):
    """``record -o - -- CMD | ...``: standard output is the archive's, so the command's own goes to stderr; and
    with ``-o /dev/stdout`` (it went into the archive, which no reader could then read)."""
    (tmp_path / "compile.py").write_text(COMPILE)
    done = subprocess.run([sys.executable, "-m", "tritonpack", "record", "-o", output, "--", sys.executable,
                           "compile.py", "1"], cwd=tmp_path, capture_output=True,
                          env={**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "root")})
    assert done.returncode == 0, done.stderr
    assert b"compiled 1" in done.stderr and f" -> {output}\n".encode() in done.stderr
    (tmp_path / "got.tpack").write_bytes(done.stdout)
    assert groups_of(tmp_path / "got.tpack") == {("softmax_kernel", "cuda:90")}
