"""What the core commands print, shared by the typer CLI (``cli.py``) and the entry point's quick path
(``entry.py``), so that both print exactly the same. No typer here: importing it costs 0.1 s."""
from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

from .errors import IncompatibleError, TpackError, UsageError
from .safetext import printable
from .selection import Selection, parse_since

Progress = Callable[[int, int], None]


class Output(NamedTuple):
    out: str | Iterable[str] | None = None  # standard output: one write, or lines written as they are made
    err: tuple[str, ...] = ()  # notes for people, on standard error before it
    code: int = 0


def show(output: Output) -> int:
    for line in output.err:
        print_error(line)
    if output.out is not None:
        stdout = sys.stdout
        if stdout is None:  # started with standard output closed (``>&-``)
            raise TpackError("cannot write: it is closed", STDOUT)
        write = stdout.write
        try:
            for line in (output.out,) if isinstance(output.out, str) else output.out:
                write(line + "\n")
            stdout.flush()
        except BrokenPipeError:  # its reader has gone: the entry point ends quietly
            raise
        except OSError as e:  # a full disk (``> /dev/full``), a quota, an I/O error
            raise TpackError(f"cannot write: {e.strerror or e}", STDOUT) from None
    return output.code


STDOUT = "standard output"


def print_error(line: str) -> None:
    """One line on stderr: names come from archives, so no line breaks and no terminal escapes. Nowhere to
    write when standard error was closed (``2>&-``), or cannot be written: the exit status still says it."""
    stderr = sys.stderr
    if stderr is None:
        return
    with contextlib.suppress(OSError):
        stderr.write(printable(line) + "\n")
        stderr.flush()


def to_json(doc) -> str:
    """One line of JSON: the C encoder (an indented dump is ten times slower on large archives); pipe to jq.
    Imported here: a plain ``list`` does not pay for it."""
    import json

    return json.dumps(doc, default=str)


def failure_document(error: TpackError, archive: str | None = None) -> dict:
    """What ``--json`` prints for a command that failed: the error as its line on standard error says it, with the
    exit status and the error's class; a preflight's refusal adds its verdicts (``preflight``, as ``check --json``
    gives them for ``archive``), ``ensure --strict``'s its result (``result``, as ``ensure --json`` gives it)."""
    from .entry import exit_code

    doc: dict = {"error": {"message": error.message, "path": error.path, "exit_code": exit_code(error),
                           "kind": type(error).__name__}}
    if isinstance(error, IncompatibleError) and error.report is not None:
        from .listing import check_to_dict
        from .remote import shown

        doc["preflight"] = check_to_dict(error.report, error.path if archive is None else shown(archive))
    if isinstance(error, IncompatibleError) and error.result is not None:
        doc["result"] = error.result.to_dict()
    return doc


@contextlib.contextmanager
def json_on_failure(as_json: bool, archive: str | None = None, output: str | None = None) -> Iterator[None]:
    """With ``--json``, a command that fails still prints one JSON document on standard output
    (``failure_document``), for scripts that parse it; on standard error where the archive it writes
    (``output``) is standard output. The error goes on as raised, to its line on standard error and its exit
    status."""
    try:
        yield
    except TpackError as e:
        if as_json:
            document = to_json(failure_document(e, archive))
            try:
                show(Output(err=(document,)) if is_standard_output(output) else Output(document))
            except TpackError:  # standard output cannot take it: the error's own line still tells
                pass
            except BrokenPipeError:
                from .entry import closed_pipe

                closed_pipe()
        raise


def reported(result, as_json: bool, quiet: bool) -> Output:
    """A result as JSON, or its notes and one-line summary (nothing but errors when quiet). On standard error
    where the archive written is standard output (``pack -o /dev/stdout | ...``): not into the archive."""
    if as_json:
        text, notes = to_json(result.to_dict()), ()
    elif quiet:
        return Output()
    else:
        text, notes = printable(result.summary()), tuple(result.notes())
    if is_standard_output(getattr(result, "written_archive", None)):
        return Output(None, (*notes, text))
    return Output(text, notes)


def is_standard_output(path: str | None) -> bool:
    from .archivedest import STDOUT as ARCHIVE_TO_STDOUT

    if path == ARCHIVE_TO_STDOUT:
        return True
    try:
        return path is not None and sys.stdout is not None and os.path.samestat(os.stat(path),
                                                                                os.fstat(sys.stdout.fileno()))
    except (OSError, ValueError):
        return False


def selection(arch: list[str] | None, kernel: list[str] | None, binary_only: bool) -> Selection:
    return Selection(archs=tuple(arch or ()), kernels=tuple(kernel or ()), binary_only=binary_only).checked()


def since_time(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return parse_since(text)
    except ValueError as e:
        raise UsageError(str(e)) from None


def list_output(archive: str, as_json: bool = False, quiet: bool = False) -> Output:
    from . import api
    from .listing import entry_to_dict, info_to_dict, table_lines
    from .remote import shown

    with api.open(archive) as reader:
        if as_json:  # before quiet, as every command's JSON is (``reported``)
            return Output(to_json({"archive": shown(archive), **info_to_dict(reader.info, reader.digest),
                                   "entries": [entry_to_dict(e) for e in reader.entries]}))
        if quiet:
            return Output()
        return Output(table_lines(reader.info, reader.entries, shown(archive)))  # escaped there, cell by cell


def check_output(archive: str, target: list[str] | None = None, as_json: bool = False,
                 quiet: bool = False) -> Output:
    """Exit status: 0 all entries usable, 6 some are not, 5 none is."""
    from . import api
    from .listing import check_lines, check_to_dict
    from .remote import shown

    report = api.check(archive, targets=target or None)
    archive = shown(archive)
    code = 5 if report.verdicts and not report.usable_count else 6 if report.unusable_count else 0
    if as_json:
        return Output(to_json(check_to_dict(report, archive)), code=code)
    return Output(None if quiet else check_lines(report, archive), code=code)


def pack_output(cache_dir: str | None = None, output: str = "kernels.tpack", level: int | None = None,
                arch: list[str] | None = None, kernel: list[str] | None = None, binary_only: bool = False,
                since: str | None = None, as_json: bool = False, quiet: bool = False,
                progress: Progress | None = None, splice_ptx: bool = False) -> Output:
    from . import api
    from .archive.format import DEFAULT_LEVEL
    from .heap import fix_malloc_thresholds

    fix_malloc_thresholds()
    result = api.pack(cache_dir, output, level=DEFAULT_LEVEL if level is None else level,
                      selection=selection(arch, kernel, binary_only), since=since_time(since), progress=progress,
                      processes=True, splice_ptx=splice_ptx)
    return reported(result, as_json, quiet)


def unpack_output(archive: str, cache_dir: str | None = None, overwrite: bool = False, force: bool = False,
                  target: list[str] | None = None, arch: list[str] | None = None, kernel: list[str] | None = None,
                  binary_only: bool = False, as_json: bool = False, quiet: bool = False,
                  progress: Progress | None = None) -> Output:
    from . import api
    from .heap import fix_malloc_thresholds

    fix_malloc_thresholds()
    result = api.unpack(archive, cache_dir, overwrite=overwrite, force=force, targets=target or None,
                        selection=selection(arch, kernel, binary_only), progress=progress, processes=True)
    return reported(result, as_json, quiet)
