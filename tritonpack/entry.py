"""The ``tritonpack`` command's entry point, and the one place where errors become exit codes.

Importing typer takes 0.1 s: a third of a ``list`` on 2 cores, a tenth of an unpack at a pod start. The plain forms
of ``list``, ``check``, ``pack`` and ``unpack`` (the options in ``QUICK``) run here without it; anything else (help,
an option not listed, a value that is not plain, other commands) goes to the typer CLI (``cli.py``). Both call the
same bodies (``commands.py``), so both print the same.
"""
from __future__ import annotations

import gc
import sys
from typing import TYPE_CHECKING

from .errors import (
    ArchiveError,
    CacheError,
    ConflictError,
    IncompatibleError,
    RecordError,
    RemoteError,
    Terminated,
    TpackError,
    UsageError,
)

if TYPE_CHECKING:
    from collections.abc import Callable

EXIT_CODES: list[tuple[type[TpackError], int]] = [
    (UsageError, 2),
    (ArchiveError, 3),
    (CacheError, 4),
    (IncompatibleError, 5),
    (RemoteError, 7),
    (RecordError, 8),
    (ConflictError, 9),
    (TpackError, 1),
]


def exit_code(error: TpackError) -> int:
    return next(code for cls, code in EXIT_CODES if isinstance(error, cls))


def interrupted(error: BaseException) -> int:
    """Say that the command was stopped (Ctrl-C, or ``Terminated``), in one line; the exit status a shell gives a
    process ended by that signal: 130, or 143 for SIGTERM."""
    import signal

    from .commands import print_error

    number = error.signal_number if isinstance(error, Terminated) else signal.SIGINT
    print_error("error: interrupted" if number == signal.SIGINT else
                f"error: interrupted by {signal.Signals(number).name}")
    return 128 + number


def closed_pipe() -> int:
    """Standard output's reader has gone (``tritonpack list big.tpack | head``): the rest is not wanted, and no
    traceback is. Standard output now points at the null device, so the last flush cannot raise again. Exit 1, as
    click exits in the typer CLI when a command's output meets a closed pipe."""
    import os

    with open(os.devnull, "wb") as devnull:
        os.dup2(devnull.fileno(), sys.stdout.fileno())
    return 1


FLAG, VALUE, VALUES, INT = "flag", "value", "values", "int"
_OUTPUT = {"--json": ("as_json", FLAG), "-q": ("quiet", FLAG), "--quiet": ("quiet", FLAG)}
_SELECT = {"--arch": ("arch", VALUES), "--kernel": ("kernel", VALUES), "--binary-only": ("binary_only", FLAG)}
# command -> (its one argument, whether it is required, its options: option -> (parameter, kind))
QUICK: dict[str, tuple[str, bool, dict[str, tuple[str, str]]]] = {
    "list": ("archive", True, _OUTPUT),
    "check": ("archive", True, {**_OUTPUT, "--target": ("target", VALUES)}),
    "pack": ("cache_dir", False, {**_OUTPUT, **_SELECT, "-o": ("output", VALUE), "--output": ("output", VALUE),
                                  "--level": ("level", INT), "--since": ("since", VALUE),
                                  "--splice-ptx": ("splice_ptx", FLAG)}),
    "unpack": ("archive", True, {**_OUTPUT, **_SELECT, "--cache-dir": ("cache_dir", VALUE),
                                 "--overwrite": ("overwrite", FLAG), "--force": ("force", FLAG),
                                 "--target": ("target", VALUES)}),
}


def parse_quick(argv: list[str]) -> tuple[str, dict] | None:
    """``(command, parameters)`` for a plain command line of ``QUICK``; None for anything else."""
    if not argv or argv[0] not in QUICK:
        return None
    argument, required, options = QUICK[argv[0]]
    params: dict = {}
    rest = argv[1:]
    while rest:
        word = rest.pop(0)
        name, equals, value = word.partition("=") if word.startswith("--") else (word, "", "")
        if name not in options:
            if (word.startswith("-") and word != "-") or argument in params:  # ``-``: standard input, for click too
                return None  # help, another option, a second argument: the typer CLI says what is wrong
            params[argument] = word
            continue
        param, kind = options[name]
        if kind == FLAG:
            if equals:
                return None
            params[param] = True
            continue
        if not equals:
            if not rest or rest[0].startswith("-"):
                return None
            value = rest.pop(0)
        if kind == INT:
            try:
                params[param] = int(value)  # as click converts it
            except ValueError:
                return None
        elif kind == VALUES:
            params.setdefault(param, []).append(value)
        else:
            params[param] = value
    if required and argument not in params:
        return None
    return argv[0], params


def run_quick(argv: list[str]) -> int | None:
    """Run a plain ``list``, ``check``, ``pack`` or ``unpack``; None when ``argv`` is not one, or when a progress
    bar would show (a terminal: the typer CLI draws it)."""
    from . import commands

    parsed = parse_quick(argv)
    if parsed is None:
        return None
    command, params = parsed
    terminal = sys.stderr is not None and sys.stderr.isatty()  # None: started with standard error closed
    if command in ("pack", "unpack") and terminal and not (params.get("quiet") or params.get("as_json")):
        return None
    bodies: dict[str, Callable[..., commands.Output]] = {
        "list": commands.list_output, "check": commands.check_output, "pack": commands.pack_output,
        "unpack": commands.unpack_output}
    body = bodies[command]
    collecting = gc.isenabled()
    gc.disable()  # a short-lived run that makes no cycles: even with the decode's own pause, a list collected 39 times
    try:
        with commands.json_on_failure(params.get("as_json", False), params.get("archive"), params.get("output")):
            return commands.show(body(**params))
    except TpackError as e:
        commands.print_error(f"error: {e}")
        return exit_code(e)
    except BrokenPipeError:
        return closed_pipe()
    except (KeyboardInterrupt, Terminated) as e:
        return interrupted(e)
    finally:
        if collecting:
            gc.enable()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    code = run_quick(argv)
    if code is None:
        from .cli import main as typer_main

        code = typer_main(argv)
    return code


def run() -> None:
    """The console script. A plain command ends with ``os._exit`` once its output is flushed: the interpreter's
    teardown frees every object of the index one by one (16 ms of a 0.23 s ``list`` on 2 cores), for a process that
    ends anyway. The typer CLI exits normally: ``record`` runs a program in this process, whose exit hooks run."""
    argv = sys.argv[1:]
    code = run_quick(argv)
    if code is None:
        from .cli import main as typer_main

        sys.exit(typer_main(argv))
    import contextlib
    import os

    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError, AttributeError):  # a closed pipe or stream (None when
            stream.flush()  # it was closed at start): its output is lost either way
    os._exit(code)
