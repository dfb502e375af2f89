"""The ``tritonpack`` command's entry point, and the one place where errors become exit codes.

``list`` and ``check`` read only an archive's index, and scripts run them in loops and at every pod start; importing
typer was a third of their time (0.1 s of 0.3 s on 2 cores). Their plain forms (an archive and the options in
``QUICK``) run here without it; anything else (help, an option not listed, other commands) goes to the typer CLI
(``cli.py``), whose ``list`` and ``check`` call the same bodies below, so both print the same.
"""
from __future__ import annotations

import gc
import json
import sys

from .errors import (
    ArchiveError,
    CacheError,
    ConflictError,
    IncompatibleError,
    RecordError,
    RemoteError,
    TpackError,
    UsageError,
)
from .safetext import printable, printable_lines

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


def to_json(doc) -> str:
    """One line of JSON: the C encoder (an indented dump is ten times slower on large archives); pipe to jq."""
    return json.dumps(doc, default=str)


def list_output(archive: str, as_json: bool, quiet: bool) -> str | None:
    """What ``tritonpack list`` prints (None: nothing); a bad archive raises."""
    from . import api
    from .listing import entry_to_dict, info_to_dict, render_table

    with api.open(archive) as reader:
        if quiet:
            return None
        if as_json:
            return to_json({"archive": archive, **info_to_dict(reader.info, reader.digest),
                            "entries": [entry_to_dict(e) for e in reader.entries]})
        return printable_lines(render_table(reader.info, reader.entries, archive))


def check_output(archive: str, targets: list[str], as_json: bool, quiet: bool) -> tuple[str | None, int]:
    """What ``tritonpack check`` prints, and its exit status: 0 all entries usable, 6 some are not, 5 none is."""
    from . import api
    from .listing import check_to_dict, render_check

    report = api.check(archive, targets=targets or None)
    text = to_json(check_to_dict(report, archive)) if as_json else \
        None if quiet else printable_lines(render_check(report, archive))
    code = 5 if report.verdicts and not report.usable else 6 if report.unusable else 0
    return text, code


# command -> option -> (parameter, takes a value)
QUICK: dict[str, dict[str, tuple[str, bool]]] = {
    "list": {"--json": ("as_json", False), "-q": ("quiet", False), "--quiet": ("quiet", False)},
    "check": {"--json": ("as_json", False), "-q": ("quiet", False), "--quiet": ("quiet", False),
              "--target": ("targets", True)},
}


def parse_quick(argv: list[str]) -> tuple[str, dict] | None:
    """``(command, parameters)`` for a plain ``list`` or ``check`` command line; None for anything else."""
    if not argv or argv[0] not in QUICK:
        return None
    options = QUICK[argv[0]]
    params: dict = {"archive": None, "as_json": False, "quiet": False, "targets": []}
    rest = argv[1:]
    while rest:
        word = rest.pop(0)
        name, _, value = word.partition("=") if word.startswith("--") else (word, "", "")
        if name in options:
            param, takes_value = options[name]
            if not takes_value:
                if value or "=" in word:
                    return None
                params[param] = True
            elif "=" in word:
                params[param].append(value)
            elif rest and not rest[0].startswith("-"):
                params[param].append(rest.pop(0))
            else:
                return None
        elif word.startswith("-") or params["archive"] is not None:
            return None  # help, another option, a second argument: the typer CLI says what is wrong
        else:
            params["archive"] = word
    if params["archive"] is None:
        return None
    if argv[0] == "list":
        del params["targets"]
    return argv[0], params


def run_quick(argv: list[str]) -> int | None:
    """Run a plain ``list`` or ``check``; None when ``argv`` is not one."""
    parsed = parse_quick(argv)
    if parsed is None:
        return None
    command, params = parsed
    gc.disable()  # one index read in a short-lived process: nothing it makes is cyclic
    try:
        if command == "list":
            text, code = list_output(**params), 0
        else:
            text, code = check_output(**params)
    except TpackError as e:
        print_error(f"error: {e}")
        return exit_code(e)
    except KeyboardInterrupt:
        print_error("error: interrupted")
        return 130
    finally:
        gc.enable()
    if text is not None:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    return code


def print_error(line: str) -> None:
    """One line on stderr: names come from archives, so no line breaks and no terminal escapes."""
    sys.stderr.write(printable(line) + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    code = run_quick(argv)
    if code is None:
        from .cli import main as typer_main

        code = typer_main(argv)
    return code


def run() -> None:
    sys.exit(main())
