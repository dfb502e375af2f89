"""One input through everything a user can run on an archive, and what must hold afterwards.

Shared by the hypothesis property test (tests/test_fuzz_property.py), the atheris fuzz target (fuzz/) and the
regression tests of what fuzzing found (tests/regressions/). ``run_one`` raises ``Crash`` when anything but a
``TpackError`` escapes (the CLI turns those into one line and an exit code) or when an invariant fails.
"""
from __future__ import annotations

import contextlib
import io
import os
import shutil

from invariants import group_problems, temp_files, tree

from tritonpack.archive.reader import ArchiveReader
from tritonpack.entry import main
from tritonpack.errors import TpackError

COMMANDS = (["list"], ["list", "--json"], ["check", "--target", "cuda:90"])


class Crash(AssertionError):
    pass


def _quiet(argv: list[str]) -> tuple[int, str]:
    """The command as users run it (``tritonpack.entry``: these plain forms never reach typer)."""
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, err.getvalue()


def _expected(archive: str) -> dict:
    try:
        with ArchiveReader(archive) as reader:
            return {(e.key, e.name): [{f.name: f.sha256.hex() for f in e.files}] for e in reader.entries
                    if e.kind == "group"}
    except TpackError:
        return {}


def run_one(data: bytes, work: str) -> str:
    """Feed ``data`` as an archive to list, check and unpack (into a fresh root under ``work``); return
    ``"refused"`` or ``"unpacked"``. ``work`` must hold nothing else; it is left empty."""
    archive = os.path.join(work, "input.tpack")
    root = os.path.join(work, "root")
    with open(archive, "wb") as f:
        f.write(data)
    try:
        for command in COMMANDS:
            code, err = _quiet([*command, archive])
            if code not in (0, 5, 6) and err.count("\n") != 1:
                raise Crash(f"{command}: exit {code} with {err!r}")
        code, err = _quiet(["unpack", archive, "--cache-dir", root, "--force"])
        if code != 0:
            if err.count("\n") != 1 or not err.startswith("error: "):
                raise Crash(f"unpack: exit {code} with {err!r}")
            if os.path.exists(root):
                raise Crash(f"a refused unpack left {sorted(tree(root))[:5]}")
        else:
            problems = group_problems(root, _expected(archive))
            if problems:
                raise Crash(f"partial groups: {problems[:3]}")
            if temp_files(root):
                raise Crash(f"temp files left: {temp_files(root)[:3]}")
        outside = set(os.listdir(work)) - {"input.tpack", "root"}
        if outside:
            raise Crash(f"written outside the root: {sorted(outside)}")
        return "unpacked" if code == 0 else "refused"
    except Crash:
        raise
    except Exception as e:  # anything the CLI let escape is a crash (a TpackError included: main catches those)
        raise Crash(f"{type(e).__name__}: {e}") from e
    finally:
        shutil.rmtree(root, ignore_errors=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(archive)
