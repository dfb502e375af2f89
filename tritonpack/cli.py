"""The ``tritonpack`` command: a thin typer layer over the Python API. Errors become one line and an exit code."""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager

import typer

from . import __version__, api
from .archive.format import DEFAULT_LEVEL
from .errors import (
    ArchiveError,
    CacheError,
    IncompatibleError,
    TpackError,
    UsageError,
)
from .listing import check_to_dict, entry_to_dict, info_to_dict, render_check, render_table
from .safetext import printable, printable_lines

# The one place where errors become exit codes.
EXIT_CODES: list[tuple[type[TpackError], int]] = [
    (UsageError, 2),
    (ArchiveError, 3),
    (CacheError, 4),
    (IncompatibleError, 5),
    (TpackError, 1),
]

# typer bundles its own click (0.2x) or uses click's; reach the exception classes through its public BadParameter.
_CLICK_ERRORS = {c.__name__: c for c in typer.BadParameter.__mro__}
ClickUsageError = _CLICK_ERRORS["UsageError"]
ClickException = _CLICK_ERRORS["ClickException"]

app = typer.Typer(
    name="tritonpack",
    help="Portable Triton kernel caches: pack a cache into one .tpack archive, unpack it under any root.",
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


def _err(line: str) -> None:
    typer.echo(printable(line), err=True)  # names come from archives: one line, no terminal escapes


def _out(text: str) -> None:
    typer.echo(printable_lines(text))


@contextmanager
def _progress(enabled: bool, label: str):
    """A progress bar on a terminal for long work; nothing otherwise."""
    if not (enabled and sys.stderr.isatty()):
        yield None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    with Progress(f"[bold]{label}", BarColumn(), DownloadColumn(), TimeRemainingColumn(), transient=True,
                  console=None) as bar:
        task = bar.add_task(label, total=None)

        def update(done: int, total: int) -> None:
            bar.update(task, completed=done, total=total)

        yield update


def _emit(result, as_json: bool, quiet: bool) -> None:
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2, default=str))
        return
    if not quiet:
        for line in result.notes():
            _err(line)
        typer.echo(printable(result.summary()))


@app.command()
def pack(
    cache_dir: str | None = typer.Argument(
        None, help="Cache root to pack. Default: Triton's own (TRITON_CACHE_DIR, $TRITON_HOME/.triton/cache, "
                   "~/.triton/cache)."),
    output: str = typer.Option("kernels.tpack", "-o", "--output", help="Archive to write."),
    level: int = typer.Option(DEFAULT_LEVEL, "--level", help="zstd level, 1-22."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print nothing but errors."),
) -> None:
    """Pack a Triton cache into one portable archive. The cache is never modified.

    Example: tritonpack pack ~/.triton/cache -o kernels.tpack
    """
    with _progress(not (quiet or as_json), "packing") as progress:
        result = api.pack(cache_dir, output, level=level, progress=progress)
    _emit(result, as_json, quiet)


@app.command()
def unpack(
    archive: str = typer.Argument(..., help="The .tpack archive."),
    cache_dir: str | None = typer.Option(
        None, "--cache-dir", help="Cache root to fill. Default: Triton's own, as for pack."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace existing entries whose content differs."),
    force: bool = typer.Option(False, "--force", help="Write entries the preflight says will not be used here."),
    target: list[str] | None = typer.Option(None, "--target", help="GPU target(s) to check against instead of the "
                                     "visible GPUs, e.g. cuda:90 (for image builds without a GPU)."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print nothing but errors."),
) -> None:
    """Unpack an archive under a cache root, with manifests that point into that root, so Triton hits.

    Runs the preflight first (see `check`): only entries this environment will use are written.

    Example: TRITON_CACHE_DIR=/opt/cache tritonpack unpack kernels.tpack --target cuda:90
    """
    with _progress(not (quiet or as_json), "unpacking") as progress:
        result = api.unpack(archive, cache_dir, overwrite=overwrite, force=force, targets=target or None,
                            progress=progress)
    _emit(result, as_json, quiet)


@app.command()
def check(
    archive: str = typer.Argument(..., help="The .tpack archive."),
    target: list[str] | None = typer.Option(None, "--target", help="GPU target(s) to check against instead of the "
                                     "visible GPUs, e.g. cuda:90."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
) -> None:
    """Preflight: will this environment's Triton use the archive's entries, and if not, why. Writes nothing.

    Exit status: 0 all entries usable, 6 some are not, 5 none is.

    Example: tritonpack check kernels.tpack --target cuda:90
    """
    report = api.check(archive, targets=target or None)
    if as_json:
        typer.echo(json.dumps(check_to_dict(report, archive), indent=2, default=str))
    else:
        _out(render_check(report, archive))
    if report.verdicts and not report.usable:
        raise typer.Exit(5)
    if report.unusable:
        raise typer.Exit(6)


@app.command()
def verify(
    cache_dir: str | None = typer.Argument(None, help="Cache root. Default: Triton's own."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print nothing but errors."),
) -> None:
    """Check that every group under a cache root resolves through Triton's own cache manager.

    Flags manifests that point into another root (copied caches), incomplete groups and unreadable manifests.
    Exit status 1 if anything is wrong.
    """
    report = api.verify(cache_dir)
    _emit(report, as_json, quiet)
    if report.problems:
        raise typer.Exit(1)


@app.command()
def relocate(
    cache_dir: str | None = typer.Argument(None, help="Cache root. Default: Triton's own."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print nothing but errors."),
) -> None:
    """Repair in place a cache copied with cp -r, rsync or docker COPY: point every manifest into its own
    directory, where its files exist. Atomic per manifest, idempotent.

    Example: tritonpack relocate /opt/triton-cache && tritonpack verify /opt/triton-cache
    """
    report = api.relocate(cache_dir)
    _emit(report, as_json, quiet)
    if report.not_fixed:
        raise typer.Exit(1)


@app.command("list")
def list_(
    archive: str = typer.Argument(..., help="The .tpack archive."),
    as_json: bool = typer.Option(False, "--json", help="One JSON document with an `entries` list."),
) -> None:
    """List the kernels, autotune results and other files of an archive (reads the index only)."""
    with api.open(archive) as reader:
        if as_json:
            doc = {"archive": archive, **info_to_dict(reader.info, reader.digest),
                   "entries": [entry_to_dict(e) for e in reader.entries]}
            typer.echo(json.dumps(doc, indent=2))
        else:
            _out(render_table(reader.info, reader.entries, archive))


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tritonpack {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    pass


def exit_code(error: TpackError) -> int:
    return next(code for cls, code in EXIT_CODES if isinstance(error, cls))


def main(argv: list[str] | None = None) -> int:
    try:
        result = app(args=argv, prog_name="tritonpack", standalone_mode=False)
    except TpackError as e:
        _err(f"error: {e}")
        return exit_code(e)
    except ClickUsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # the help text was printed already
            return 2
        hint = f" (see '{e.ctx.command_path} --help')" if e.ctx else ""
        _err(f"error: {e.format_message()}{hint}")
        return 2
    except ClickException as e:
        _err(f"error: {e.format_message()}")
        return e.exit_code
    except (KeyboardInterrupt, typer.Abort):
        _err("error: interrupted")
        return 130
    return result if isinstance(result, int) else 0


def run() -> None:
    sys.exit(main())
