"""The command line: summaries, listing, and one-line errors with distinct exit codes, never a traceback."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import tritonpack
from tritonpack.cli import main


def run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "tritonpack", *map(str, args)], capture_output=True, text=True,
                          env=env)


@pytest.fixture()
def archive(tmp_path, gpu_cache):
    path = tmp_path / "gpu.tpack"
    tritonpack.pack(gpu_cache, path)
    return path


def test_pack_and_unpack_print_one_summary_line(tmp_path, gpu_cache):
    out = run("pack", gpu_cache, "-o", tmp_path / "k.tpack")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\n") == 1
    assert out.stdout.startswith("packed 9 entries (5 kernels, 1 autotune result, 3 files)")
    assert "x) in " in out.stdout
    out = run("unpack", tmp_path / "k.tpack", "--cache-dir", tmp_path / "root", "--force")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("unpacked 9 entries") and "9 written" in out.stdout


def test_an_archive_and_a_cache_taken_for_each_other_are_said_so(tmp_path, archive, gpu_cache, capsys):
    """The mistakes of a first use: each error says what to type instead."""
    cases = [
        (["unpack", str(archive), str(tmp_path / "root")], 2,
         "(the cache root goes after --cache-dir; see 'tritonpack unpack --help')"),
        (["pack", str(archive), "-o", str(tmp_path / "k.tpack")], 4,
         f"{archive}: not a directory (an archive: tritonpack unpack writes it into a cache directory)"),
        (["unpack", str(gpu_cache)], 2,
         f"{gpu_cache}: is a directory, not an archive (tritonpack pack makes one of a cache directory)"),
        (["push", str(archive), "https://registry.example/kernels"], 2,
         "push takes oci://REGISTRY[:PORT]/REPOSITORY[:TAG] or hf://ORG/REPO[@BRANCH]/PATH"),
    ]
    for argv, code, said in cases:
        assert main(argv) == code
        assert said in capsys.readouterr().err
    assert not (tmp_path / "root").exists() and not (tmp_path / "k.tpack").exists()


def test_list_table_reads_kernels_autotune_and_files(archive, capsys):
    assert main(["list", str(archive)]) == 0
    text = capsys.readouterr().out
    assert "kernels (5)" in text and "autotune results (1)" in text and "other files (3)" in text
    assert "scaled_add_kernel" in text and "cuda:90" in text and "BLOCK_SIZE=2048, num_warps=8" in text


def test_list_json(archive, capsys):
    assert main(["list", str(archive), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    kinds = [e["kind"] for e in doc["entries"]]
    assert sorted(set(kinds)) == ["autotune", "file", "group"]
    group = next(e for e in doc["entries"] if e["kind"] == "group")
    assert group["target"] == "cuda:90" and group["num_warps"] in (2, 4, 8) and group["files"]


@pytest.mark.parametrize("content, code, message", [
    (None, 2, "no such archive"),
    (b"", 3, "not a tpack archive"),
    (b"PK\x03\x04 definitely a zip file, not ours", 3, "bad magic"),
])
def test_bad_archives_give_one_line(tmp_path, content, code, message):
    path = tmp_path / "x.tpack"
    if content is not None:
        path.write_bytes(content)
    out = run("unpack", path, "--cache-dir", tmp_path / "root")
    assert out.returncode == code
    assert out.stderr.strip() == f"error: {path}: {message}" or message in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr
    assert not (tmp_path / "root").exists()


def test_truncated_and_flipped_archives(tmp_path, archive, capsys):
    data = archive.read_bytes()
    cases = {"truncated": data[: len(data) // 2], "flipped": data[:-80] + bytes([data[-80] ^ 1]) + data[-79:]}
    for name, content in cases.items():
        bad = tmp_path / f"{name}.tpack"
        bad.write_bytes(content)
        assert main(["unpack", str(bad), "--cache-dir", str(tmp_path / name)]) == 3
        err = capsys.readouterr().err
        assert err.startswith(f"error: {bad}: ") and err.count("\n") == 1
        assert not list((tmp_path / name).glob("*/__grp__*.json"))


def test_wrong_arguments(tmp_path, capsys):
    assert main(["unpack"]) == 2
    assert "Missing argument" in capsys.readouterr().err
    assert main(["pack", str(tmp_path / "missing")]) == 4
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'missing'}: cache directory does not exist"
    assert main(["pack", "--level", "99"]) == 2
    assert main(["frobnicate"]) == 2


def test_version():
    out = run("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"tritonpack {tritonpack.__version__}"


def _commands():
    import typer

    from tritonpack.cli import app

    return typer.main.get_command(app).commands


def test_every_command_reports_as_json_or_quietly_and_has_an_example():
    commands = _commands()
    assert set(commands) == {"pack", "unpack", "check", "verify", "relocate", "list", "ensure", "record", "merge",
                             "push", "pull"}
    for name, command in commands.items():
        options = {opt for param in command.params for opt in param.opts}
        assert {"--json", "-q", "--quiet"} <= options, name
        assert "Example: " in command.help and f"tritonpack {name}" in command.help, name
        assert "\n" not in command.help.split("\n\n")[0], f"{name}: the summary is one line"


def test_quiet_check_and_list_answer_by_exit_status(archive, tmp_path, capsys):
    assert main(["check", str(archive), "-q", "--target", "cuda:80"]) in (5, 6)  # its kernels are for cuda:90
    assert main(["list", str(archive), "-q"]) == 0
    assert capsys.readouterr().out == ""
    assert main(["list", str(archive), "-q", "--json"]) == 0  # JSON asked for is printed, as by every command
    assert json.loads(capsys.readouterr().out)["entries"]
    (tmp_path / "bad.tpack").write_bytes(b"nope")
    assert main(["list", str(tmp_path / "bad.tpack"), "-q"]) == 3


QUICK_FORMS = [
    ["list", "{a}"], ["list", "{a}", "--json"], ["list", "-q", "{a}"], ["list", "--quiet", "{bad}"],
    ["list", "{missing}"], ["check", "{a}"], ["check", "{a}", "--target", "cuda:90", "--json"],
    ["check", "--target=cuda:80", "--target", "hip:gfx942", "{a}"], ["check", "-q", "{bad}"],
    ["unpack", "{bad}", "--cache-dir", "{out}"], ["unpack", "{a}", "--cache-dir={out}", "--arch", "90", "--json",
                                                  "--target", "cuda:80"],
    ["pack", "{missing}", "-o", "{out}/k.tpack"], ["pack", "{a}", "--level", "0", "-o", "{out}/k.tpack"],
    ["pack", "{a}", "--since", "soon", "-o", "{out}/k.tpack"], ["pack", "{bad}", "--level", "1_0"],
    ["list", "{bad}", "--json"], ["check", "--json", "{missing}"], ["pack", "{missing}", "--json", "-q"],
]
TYPER_FORMS = [
    ["list"], ["list", "--help"], ["list", "{a}", "{a}"], ["list", "{a}", "--json=yes"], ["list", "{a}", "-qq"],
    ["check", "{a}", "--target"], ["check", "{a}", "--target", "--json"], ["check", "{a}", "--arch", "90"],
    ["list", "--", "{a}"], ["verify", "{a}"], ["unpack", "{a}", "--to-redis", "redis://localhost:1"],
    ["pack", "{a}", "--level", "high"], ["unpack"], ["pack", "-o{out}"],
]
PARSED_FORMS = [
    ["pack"], ["pack", "{a}", "-o", "x.tpack", "--level", "3", "--arch", "90", "--arch=gfx942", "--kernel", "t*",
               "--binary-only", "--since", "12h", "--json", "-q"], ["pack", "--output=y", "--level=+5", "--quiet"],
    ["pack", "{a}", "--splice-ptx", "-o", "x.tpack"],
    ["unpack", "{a}"], ["unpack", "--force", "{a}", "--overwrite", "--target", "cuda:90", "--cache-dir", "/r",
                        "--kernel", "a", "--kernel", "b", "--binary-only", "--json"],
    ["check", "{a}", "--target", "cuda:90", "--target=hip:gfx942", "--quiet"], ["list", "--json", "{a}"],
    ["list", "-"], ["unpack", "-", "--json", "--cache-dir", "/r"],
]


def _fill(form, archive, tmp_path, out="out"):
    return [w.format(a=archive, bad=tmp_path / "bad.tpack", missing=tmp_path / "none.tpack", out=tmp_path / out)
            for w in form]


def _same_run(code, captured, tmp_path, out):
    """What a run printed, with its own output directory and its timing masked."""
    def mask(text):
        return re.sub(r'("seconds": |in )[0-9.e-]+', r"\1T", text.replace(str(tmp_path / out), "OUT"))

    return code, mask(captured.out), mask(captured.err)


@pytest.mark.parametrize("form", QUICK_FORMS + TYPER_FORMS, ids=" ".join)
def test_the_quick_path_and_typer_print_the_same(form, archive, tmp_path, capsys):
    """The entry point answers plain list/check/pack/unpack forms itself; everything else, and the same forms
    through typer, give the same output, errors and exit status."""
    from tritonpack import entry

    (tmp_path / "bad.tpack").write_bytes(b"nope")
    argv = _fill(form, archive, tmp_path, "quick")
    assert (entry.parse_quick(argv) is not None) == (form in QUICK_FORMS)
    quick = _same_run(entry.main(argv), capsys.readouterr(), tmp_path, "quick")
    full = _same_run(main(_fill(form, archive, tmp_path, "typer")), capsys.readouterr(), tmp_path, "typer")
    assert quick == full


@pytest.mark.parametrize("form", PARSED_FORMS, ids=" ".join)
def test_the_quick_path_parses_as_typer_does(form, archive, tmp_path):
    """Every parameter the quick path hands to a command body is what typer's parser makes of the same line."""
    import inspect

    import typer

    from tritonpack import commands, entry
    from tritonpack.cli import app

    argv = _fill(form, archive, tmp_path)
    command, params = entry.parse_quick(argv)
    parsed = typer.main.get_command(app).commands[command].make_context(command, argv[1:]).params
    body = getattr(commands, f"{command}_output")
    call = inspect.signature(body).bind(**params)
    call.apply_defaults()
    for name, value in parsed.items():
        if name == "to_redis":
            continue
        mine, value = call.arguments[name], list(value) if isinstance(value, tuple) else value  # click: tuples
        assert (mine or None, name) == (value or None, name) or (name, mine, value) == ("level", None, 8)


@pytest.mark.parametrize("command", ["list", "check", "unpack"])
def test_plain_commands_import_neither_typer_nor_dataclasses(command, archive, tmp_path):
    """What a start costs: typer takes 0.1 s to import, dataclasses (with inspect) 17 ms and 2 ms a class. Run
    twice: the first run may fingerprint the local Triton (importing it), as the first check on a machine does."""
    argv = [command, str(archive)] + (["--cache-dir", str(tmp_path / "root"), "--force"] if command == "unpack" else [])
    code = ("import sys; from tritonpack.entry import main; assert main(sys.argv[1:]) in (0, 5, 6); "
            "heavy = {'typer', 'dataclasses', 'inspect'} & {m.split('.')[0] for m in sys.modules}; "
            "assert not heavy, heavy")
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("form", [["list", "{a}"], ["list", "--", "{a}"]], ids=["quick", "typer"])
def test_a_reader_that_leaves_early_ends_the_listing_without_a_traceback(form):
    """``tritonpack list big.tpack | head``: exit 1 (click's choice, which the quick path follows) and nothing on
    stderr. The pipe's reader is closed before the child starts to write (it takes 40 ms to start)."""
    archive = Path(__file__).parent.parent / "fixtures" / "torch-max-autotune-h200-triton36.tpack"
    argv = [word.format(a=archive) for word in form]
    child = subprocess.Popen([sys.executable, "-m", "tritonpack", *argv], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    child.stdout.close()
    err = child.stderr.read().decode()
    assert (child.wait(), err) == (1, "")


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
@pytest.mark.parametrize("form", [["list", "{a}"], ["list", "--", "{a}"], ["--help"]], ids=["quick", "typer", "help"])
def test_a_full_standard_output_is_one_line_of_error(form):
    archive = Path(__file__).parent.parent / "fixtures" / "torch-max-autotune-h200-triton36.tpack"
    with open("/dev/full", "w") as full:
        out = subprocess.run([sys.executable, "-m", "tritonpack", *[w.format(a=archive) for w in form]],
                             stdout=full, stderr=subprocess.PIPE, text=True)
    assert (out.returncode, out.stderr) == (1, "error: standard output: cannot write: No space left on device\n")


def test_closed_standard_streams_change_no_answer(archive, tmp_path):
    """Started with standard output or error closed (``>&-``, ``2>&-``): what was not asked for is not missed;
    output that was asked for is an error, on whatever is left."""
    def run_closed(fds, *args):
        closing = lambda: [os.close(fd) for fd in fds]  # noqa: E731
        return subprocess.run([sys.executable, "-m", "tritonpack", *map(str, args)], preexec_fn=closing,
                              stdout=None if 1 in fds else subprocess.PIPE,
                              stderr=None if 2 in fds else subprocess.PIPE, text=True)

    assert run_closed([1], "list", archive, "-q").returncode == 0
    verdict = run("check", archive, "--target", "cuda:75", "-q").returncode
    assert verdict != 0 and run_closed([1], "check", archive, "--target", "cuda:75", "-q").returncode == verdict
    assert run_closed([2], "unpack", archive, "--cache-dir", tmp_path / "r", "--force").returncode == 0
    assert run_closed([1, 2], "pack", tmp_path / "r", "-o", tmp_path / "k.tpack", "-q").returncode == 0
    out = run_closed([1], "list", archive)
    assert (out.returncode, out.stderr) == (1, "error: standard output: cannot write: it is closed\n")


@pytest.mark.parametrize("argv", [["pack", ""], ["unpack", "{a}", "--cache-dir", ""], ["verify", ""],
                                  ["relocate", ""], ["ensure", "{a}", "--cache-dir", ""], ["list", ""],
                                  ["merge", "{a}", "-o", ""], ["pack", "{a}", "-o", ""]],
                         ids=["pack", "unpack", "verify", "relocate", "ensure", "list", "merge-o", "pack-o"])
def test_an_empty_path_is_refused_not_taken_as_the_current_directory(argv, archive, tmp_path, monkeypatch, capsys):
    """What ``--cache-dir "$ROOT"`` gives when ROOT is unset: never the current directory."""
    monkeypatch.chdir(tmp_path)
    assert main([word.format(a=archive) for word in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: the ") and "is empty (an unset variable?)" in err and err.count("\n") == 1, err
    assert sorted(os.listdir(tmp_path)) == ["gpu.tpack"]


@pytest.mark.parametrize("argv", [["list", "{a}"], ["verify", "{root}"]], ids=["quick", "typer"])
def test_ctrl_c_is_one_line_and_130_on_both_paths(argv, archive, tmp_path, monkeypatch, capsys):
    from tritonpack import api, entry

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(api, "open", interrupted)
    monkeypatch.setattr(api, "verify", interrupted)
    assert entry.main([word.format(a=archive, root=tmp_path) for word in argv]) == 130
    assert capsys.readouterr().err == "error: interrupted\n"


def test_the_progress_bar_keeps_to_the_terminal_and_out_of_redirected_output(tmp_path, gpu_cache):
    """``tritonpack pack ... > log`` at a terminal: the bar (drawn on standard error, the terminal) puts nothing into
    the log, which gets the summary alone."""
    import pty

    leader, follower = pty.openpty()
    log = tmp_path / "log"
    with open(log, "w") as out:
        done = subprocess.run([sys.executable, "-m", "tritonpack", "pack", str(gpu_cache), "-o",
                               str(tmp_path / "k.tpack")], stdout=out, stderr=follower)
    os.close(follower)
    os.close(leader)
    assert done.returncode == 0
    assert re.fullmatch(r"packed 9 entries [^\n]* -> \S+k\.tpack\n", log.read_text()), log.read_text()


def test_the_api_expands_a_home_directory_as_a_shell_would(tmp_path, gpu_cache, monkeypatch):
    """README's ``tritonpack.pack("~/.triton/cache", ...)``: ``~`` is the home directory, never a directory named
    ``~`` in the current one (unpack and ensure made one)."""
    import shutil

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    shutil.copytree(gpu_cache, tmp_path / "home" / "cache")
    tritonpack.pack("~/cache", "~/k.tpack")
    assert tritonpack.unpack("~/k.tpack", "~/root", force=True).written
    assert tritonpack.ensure("~/k.tpack", "~/root2").cache_dir == str(tmp_path / "home" / "root2")
    with tritonpack.open("~/k.tpack") as reader:
        assert reader.entries
    assert main(["unpack", "~/k.tpack", "--cache-dir=~/root3", "--force", "-q"]) == 0
    assert sorted(os.listdir(tmp_path / "home")) == ["cache", "k.tpack", "root", "root2", "root3"]
    assert os.listdir(tmp_path) == ["home"]


def test_a_string_where_the_api_takes_a_list_is_one_value_or_refused(archive, tmp_path):
    """Not one value a character: ``check(a, targets="cuda:90")`` is one target; a merge of ``"k.tpack"`` or a
    record of ``"python train.py"`` is refused in words."""
    assert tritonpack.check(archive, targets="cuda:90,cuda:80").environment.targets == \
        tritonpack.check(archive, targets=["cuda:90", "cuda:80"]).environment.targets
    with pytest.raises(tritonpack.UsageError, match="a list of archives"):
        tritonpack.merge(str(archive), tmp_path / "m.tpack")
    with pytest.raises(tritonpack.UsageError, match="a list of words"):
        tritonpack.record("python train.py", tmp_path / "r.tpack")
    assert os.listdir(tmp_path) == ["gpu.tpack"]


def test_an_archive_the_filesystem_will_not_open_is_exit_4(archive, monkeypatch, capsys):
    """Permission denied, too many open files: the filesystem's no (4), as for a cache root; a missing archive
    stays a usage error (2)."""
    import errno

    from tritonpack.archive import source

    opening = os.open

    def refused(path, *args, **kwargs):
        if os.fspath(path) == str(archive):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return opening(path, *args, **kwargs)

    monkeypatch.setattr(source.os, "open", refused)
    assert main(["list", str(archive)]) == 4
    assert capsys.readouterr().err == f"error: {archive}: cannot open: Permission denied\n"
    assert main(["list", str(archive) + ".gone"]) == 2


def test_shell_completion(tmp_path):
    help_text = run("--help").stdout
    assert "--install-completion" in help_text and "--show-completion" in help_text
    env = {**os.environ, "_TRITONPACK_COMPLETE": "complete_bash", "COMP_WORDS": "tritonpack me", "COMP_CWORD": "1"}
    out = run(env=env)
    assert out.returncode == 0 and out.stdout.split() == ["merge"]
    env.update(COMP_WORDS="tritonpack merge --pr", COMP_CWORD="2")
    assert run(env=env).stdout.split() == ["--prefer"]


def test_skipped_paths_are_objects_in_json():
    """Records are named tuples: the JSON of what was skipped still names its fields."""
    from tritonpack.cacheroot import Skipped
    from tritonpack.recording import RecordResult
    from tritonpack.report import PackResult

    skipped = [Skipped("k/x.tmp.1", "temporary file of an unfinished write")]
    pack = PackResult("a.tpack", "/root", {"group": 0}, 0, 0, 0, 0, 0.0, skipped, 0, 0, 0, None)
    record = RecordResult("a.tpack", ["true"], 0, [], {"group": 0}, [], skipped, 0, 0, 0, 0, 0.0, 0.0, 0)
    expected = [{"path": "k/x.tmp.1", "reason": "temporary file of an unfinished write"}]
    assert json.loads(json.dumps(pack.to_dict()))["skipped"] == expected
    assert json.loads(json.dumps(record.to_dict()))["not_packed"] == expected


def _one_json_document(text: str) -> dict:
    assert text.endswith("\n") and text.count("\n") == 1, text
    return json.loads(text)


def _error_line(error: dict) -> str:
    return f"error: {error['path']}: {error['message']}\n" if error["path"] else f"error: {error['message']}\n"


FAILING = {  # each command with --json, failing: its arguments, exit status and error class
    "pack": (["{missing}", "-o", "{out}/k.tpack"], 4, "CacheError"),
    "unpack": (["{missing}", "--cache-dir", "{out}"], 2, "UsageError"),
    "check": (["{bad}"], 3, "ArchiveError"),
    "list": (["{bad}", "-q"], 3, "ArchiveError"),
    "verify": (["{missing}"], 4, "CacheError"),
    "relocate": (["{missing}"], 4, "CacheError"),
    "ensure": (["{bad}", "--cache-dir", "{out}"], 3, "ArchiveError"),
    "merge": (["{a}", "{missing}", "-o", "{out}/m.tpack"], 2, "UsageError"),
    "push": (["{missing}", "oci://127.0.0.1:1/triton/kernels:x"], 2, "UsageError"),
    "pull": (["https://example.invalid/k.tpack", "-o", "{out}/k.tpack"], 2, "UsageError"),
    "record": (["-o", "{a}.recorded", "--", sys.executable, "-c", "raise SystemExit(3)"], 8, "RecordError"),
}


def test_every_command_with_json_that_fails_prints_one_json_document_and_its_error_line(archive, tmp_path, capsys):
    """A CI script that parses standard output gets the error there too; standard error and the exit status are
    what they are without --json. Through the entry point: the quick path for list, check, pack and unpack."""
    from tritonpack import entry

    assert set(FAILING) == set(_commands())
    (tmp_path / "bad.tpack").write_bytes(b"nope")
    for command, (args, code, kind) in FAILING.items():
        assert entry.main([command, "--json", *_fill(args, archive, tmp_path)]) == code, command
        out, err = capsys.readouterr()
        doc = _one_json_document(out)
        assert list(doc) == ["error"] and doc["error"]["kind"] == kind and doc["error"]["exit_code"] == code
        assert err == _error_line(doc["error"]), command
    assert sorted(os.listdir(tmp_path)) == ["bad.tpack", "gpu.tpack"]


@pytest.fixture()
def kernels_archive(tmp_path, compiled_root):
    """Kernels alone (no autotune result, no launcher stub), so that a --target other than theirs refuses all."""
    path = tmp_path / "kernels.tpack"
    tritonpack.pack(compiled_root, path)
    return path


@pytest.mark.parametrize("path", ["quick", "typer"])
def test_a_refused_unpack_prints_the_preflight_as_check_json_does(path, kernels_archive, tmp_path, capsys):
    from tritonpack import entry

    root = tmp_path / "root"
    argv = ["unpack", str(kernels_archive), "--cache-dir", str(root), "--target", "cuda:75", "--json"]
    assert (entry.main if path == "quick" else main)(argv) == 5
    out, err = capsys.readouterr()
    doc = _one_json_document(out)
    assert doc["error"] == {"message": doc["error"]["message"], "path": str(kernels_archive), "exit_code": 5,
                            "kind": "IncompatibleError"}
    assert doc["error"]["message"].startswith("none of the ") and err == _error_line(doc["error"])
    assert main(["check", str(kernels_archive), "--target", "cuda:75", "--json"]) == 5
    assert doc["preflight"] == json.loads(capsys.readouterr().out)
    assert doc["preflight"]["usable"] == 0 and doc["preflight"]["reasons"]
    others = len(doc["preflight"]["reasons"]) - 1  # the message gives the first, and counts the others
    assert (f"and {others} other reason" in doc["error"]["message"]) == (others > 0)
    assert not root.exists()


def test_a_refused_strict_ensure_prints_its_result(kernels_archive, tmp_path, capsys):
    argv = ["ensure", str(kernels_archive), "--cache-dir", str(tmp_path / "root"), "--target", "cuda:75", "--json"]
    assert main(argv) == 0
    unusable = json.loads(capsys.readouterr().out)
    assert main([*argv, "--strict"]) == 5  # from the stamp the first run left
    out, err = capsys.readouterr()
    doc = _one_json_document(out)
    assert doc["error"]["kind"] == "IncompatibleError" and err == _error_line(doc["error"])
    assert {**doc["result"], "seconds": 0} == {**unusable, "seconds": 0, "status": "unusable"}


@pytest.mark.parametrize("cut", ["truncated", "flipped"])
def test_a_corrupt_archive_is_a_json_error_too(cut, kernels_archive, tmp_path, capsys):
    data = kernels_archive.read_bytes()
    bad = tmp_path / "bad.tpack"
    bad.write_bytes(data[:len(data) // 2] if cut == "truncated" else data[:-80] + bytes([data[-80] ^ 1]) + data[-79:])
    assert main(["unpack", str(bad), "--cache-dir", str(tmp_path / "root"), "--json"]) == 3
    out, err = capsys.readouterr()
    doc = _one_json_document(out)
    assert doc["error"]["kind"] == ("ArchiveError" if cut == "truncated" else "IntegrityError")
    assert doc["error"]["path"] == str(bad) and err == _error_line(doc["error"])
    assert not (tmp_path / "root").exists()


def test_a_command_line_click_refuses_prints_no_json(archive, capsys):
    """As README says: usage errors of the command line itself are the error line alone."""
    assert main(["list", str(archive), "--json", "--bogus"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("error: No such option: --bogus")
