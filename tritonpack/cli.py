"""The ``tritonpack`` command: a thin typer layer over the Python API. Errors become one line and an exit code.

The entry point (``entry.py``) runs plain ``list`` and ``check`` command lines without importing this module."""
from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from contextlib import contextmanager
from typing import TYPE_CHECKING

import typer

from . import __version__, api
from .archive.format import DEFAULT_LEVEL
from .commands import (
    STDOUT,
    check_output,
    json_on_failure,
    list_output,
    pack_output,
    print_error,
    reported,
    selection,
    show,
    unpack_output,
)
from .entry import closed_pipe, exit_code, interrupted
from .errors import Terminated, TpackError, UsageError

# typer bundles its own click (0.2x) or uses click's; reach the exception classes through its public BadParameter.
if TYPE_CHECKING:  # what is used of click's classes, wherever this typer keeps them

    class ClickException(Exception):
        exit_code: int

        def format_message(self) -> str: ...

    class ClickUsageError(ClickException):
        ctx: typer.Context | None
else:
    _CLICK_ERRORS = {c.__name__: c for c in typer.BadParameter.__mro__}
    ClickUsageError = _CLICK_ERRORS["UsageError"]
    ClickException = _CLICK_ERRORS["ClickException"]

app = typer.Typer(
    name="tritonpack",
    help="Portable Triton kernel caches: pack a cache into one .tpack archive, unpack it under any root.",
    add_completion=True,
    rich_markup_mode="markdown",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)


@contextmanager
def _progress(enabled: bool, label: str):
    """A progress bar on a terminal for long work; nothing otherwise. Redrawn by the updates, at most every 0.1 s,
    not by rich's refresh thread: unpack forks its worker processes only when no other thread runs."""
    if not (enabled and sys.stderr is not None and sys.stderr.isatty()):
        yield None
        return
    import time

    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn

    # on standard error, the terminal it checked: standard output may be a file (``> log``) or the archive
    with Progress(f"[bold]{label}", BarColumn(), DownloadColumn(), TimeRemainingColumn(), transient=True,
                  console=Console(stderr=True), auto_refresh=False, redirect_stdout=False,
                  redirect_stderr=False) as bar:
        task = bar.add_task(label, total=None)
        drawn = 0.0

        def update(done: int, total: int) -> None:
            nonlocal drawn
            bar.update(task, completed=done, total=total)
            now = time.monotonic()
            if now - drawn >= 0.1 or done == total:
                bar.refresh()
                drawn = now

        yield update


TARGET_HELP = ("GPU target(s) to check against instead of the visible GPUs (for image builds without a GPU): "
               "cuda:90, hip:gfx942, 90 or gfx942; repeatable, or a comma list.")
ARCH_HELP = "Only kernels for this target (cuda:90, hip:gfx942, or just 90 / gfx942); repeatable, or a comma list."
KERNEL_HELP = "Only kernels whose name matches this shell glob (e.g. 'triton_poi_*'); repeatable."
BINARY_HELP = "Groups with only their metadata json and binary (cubin/hsaco), as TRITON_STORE_BINARY_ONLY keeps."


def _emit(result, as_json: bool, quiet: bool) -> None:
    show(reported(result, as_json, quiet))


def _json_on_failure(command: Callable) -> Callable:
    """A command whose ``--json`` prints a JSON document when it fails too (``commands.json_on_failure``). Its
    signature, which typer reads, stays the command's (``functools.wraps``)."""
    @functools.wraps(command)
    def run(**params):
        with json_on_failure(params["as_json"], params.get("archive"), params.get("output")):
            return command(**params)

    return run


@app.command()
@_json_on_failure
def pack(
    cache_dir: str | None = typer.Argument(
        None, help="Cache root to pack. Default: Triton's own (TRITON_CACHE_DIR, $TRITON_HOME/.triton/cache, "
                   "~/.triton/cache)."),
    output: str = typer.Option("kernels.tpack", "-o", "--output", help="Archive to write (- for standard output)."),
    level: int = typer.Option(DEFAULT_LEVEL, "--level", help="zstd level, 1-22."),
    arch: list[str] | None = typer.Option(None, "--arch", help=ARCH_HELP),
    kernel: list[str] | None = typer.Option(None, "--kernel", help=KERNEL_HELP),
    binary_only: bool = typer.Option(False, "--binary-only", help=BINARY_HELP),
    since: str | None = typer.Option(None, "--since", help="Only entries with a file modified since then: a "
                                     "duration (12h, 7d) or a date (2026-11-01). Archives keep no file times, so "
                                     "merge has no --since."),
    splice_ptx: bool = typer.Option(False, "--splice-ptx", help="Store each cubin without the PTX text that ptxas "
                                    "embeds in it, derived from its group's .ptx at unpack (format 1.1): 12-15% "
                                    "smaller archives of CUDA caches, unpacks that spend about a fifth more CPU."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print nothing but errors."),
) -> None:
    """Pack a Triton cache into one portable archive. The cache is never modified.

    Example: tritonpack pack ~/.triton/cache -o kernels.tpack --arch cuda:90
    """
    with _progress(not (quiet or as_json), "packing") as progress:
        done = pack_output(cache_dir, output, level, arch, kernel, binary_only, since, as_json, quiet, progress,
                           splice_ptx)
    show(done)  # once the bar is gone


ARCHIVE_HELP = ("The .tpack archive: a path, a URL (https://, s3://, hf://, file://), oci://REGISTRY/REPO:TAG, or - "
                "for standard input (a pipe or a FIFO is first copied to a temp file in TMPDIR).")


@app.command()
@_json_on_failure
def unpack(
    archive: str = typer.Argument(..., help=ARCHIVE_HELP),
    cache_dir: str | None = typer.Option(
        None, "--cache-dir", help="Cache root to fill. Default: Triton's own, as for pack."),
    to_redis: str | None = typer.Option(
        None, "--to-redis", help="Write into Redis (redis://HOST:PORT) in the layout of Triton's "
                                 "RedisRemoteCacheBackend instead of a cache root."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace existing entries whose content differs, and "
                                   "a file where a key directory goes."),
    force: bool = typer.Option(False, "--force", help="Write entries the preflight says will not be used here."),
    target: list[str] | None = typer.Option(None, "--target", help=TARGET_HELP),
    arch: list[str] | None = typer.Option(None, "--arch", help=ARCH_HELP),
    kernel: list[str] | None = typer.Option(None, "--kernel", help=KERNEL_HELP),
    binary_only: bool = typer.Option(False, "--binary-only", help=BINARY_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print nothing but errors."),
) -> None:
    """Unpack an archive under a cache root, with manifests pointing into that root, so Triton hits.

    Runs the preflight first (see `check`): only entries this environment will use are written.

    Example: TRITON_CACHE_DIR=/opt/cache tritonpack unpack kernels.tpack --target cuda:90
    """
    with _progress(not (quiet or as_json), "unpacking") as progress:
        if to_redis is not None:
            if cache_dir is not None:
                raise UsageError("--to-redis and --cache-dir exclude each other")
            if arch or kernel or binary_only:
                raise UsageError("--to-redis takes the whole archive: --arch, --kernel and --binary-only are for "
                                 "unpacking into a cache directory")
            from .redis_cache import unpack_to_redis

            done = reported(unpack_to_redis(archive, to_redis, overwrite=overwrite, force=force,
                                            targets=target or None, progress=progress), as_json, quiet)
        else:
            done = unpack_output(archive, cache_dir, overwrite, force, target, arch, kernel, binary_only, as_json,
                                 quiet, progress)
    show(done)  # once the bar is gone


@app.command()
@_json_on_failure
def check(
    archive: str = typer.Argument(..., help=ARCHIVE_HELP),
    target: list[str] | None = typer.Option(None, "--target", help=TARGET_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print nothing; the exit status is the answer."),
) -> None:
    """Preflight: will this environment's Triton use the archive's entries, and if not, why. Writes nothing.

    Exit status: 0 all entries usable, 6 some are not, 5 none is.

    Example: tritonpack check kernels.tpack --target cuda:90
    """
    code = show(check_output(archive, target, as_json, quiet))
    if code:
        raise typer.Exit(code)


@app.command()
@_json_on_failure
def verify(
    cache_dir: str | None = typer.Argument(None, help="Cache root. Default: Triton's own."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print nothing but errors."),
) -> None:
    """Check that every group under a cache root resolves through Triton's own cache manager.

    Flags manifests that point into another root (copied caches), incomplete groups and unreadable manifests.
    Exit status 1 if anything is wrong.

    Example: tritonpack verify /opt/triton-cache --json
    """
    report = api.verify(cache_dir)
    _emit(report, as_json, quiet)
    if report.problems:
        raise typer.Exit(1)


@app.command()
@_json_on_failure
def relocate(
    cache_dir: str | None = typer.Argument(None, help="Cache root. Default: Triton's own."),
    as_json: bool = typer.Option(False, "--json", help="Print the report as JSON."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print nothing but errors."),
) -> None:
    """Repair in place a cache copied with cp -r, rsync or docker COPY.

    Points every manifest into its own directory, where its files exist. Atomic per manifest, idempotent.

    Example: tritonpack relocate /opt/triton-cache && tritonpack verify /opt/triton-cache
    """
    report = api.relocate(cache_dir)
    _emit(report, as_json, quiet)
    if report.not_fixed:
        raise typer.Exit(1)


@app.command("list")
@_json_on_failure
def list_(
    archive: str = typer.Argument(..., help=ARCHIVE_HELP),
    as_json: bool = typer.Option(False, "--json", help="One JSON document with an `entries` list."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print nothing; the exit status says whether the "
                                                            "archive's index is valid (0) or not (3)."),
) -> None:
    """List the kernels, autotune results and other files of an archive (reads the index only).

    Example: tritonpack list kernels.tpack --json | jq '.entries[] | select(.kind == "group") | .name'
    """
    show(list_output(archive, as_json, quiet))


PLAIN_HTTP_HELP = "Talk plain HTTP to the registry (the default for loopback registries only)."


@app.command()
@_json_on_failure
def push(
    archive: str = typer.Argument(..., help="The local .tpack archive."),
    reference: str = typer.Argument(..., help="oci://REGISTRY[:PORT]/REPOSITORY[:TAG], or "
                                              "hf://[TYPE/]NAMESPACE/NAME[@BRANCH]/PATH on the Hugging Face Hub"),
    plain_http: bool = typer.Option(False, "--plain-http", help=PLAIN_HTTP_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print nothing but errors."),
) -> None:
    """Push an archive to an OCI registry as an ORAS artifact, or to a Hugging Face Hub repository, described.

    The manifest's annotations (targets, Triton version, kernels, index digest) can be read without pulling it;
    on the Hub the same go in the commit's message and description (with huggingface_hub's token). The result
    names what this push alone is: REPOSITORY@DIGEST, or the hf:// URL at the new commit, for ensure.

    Example: tritonpack push kernels.tpack oci://registry.example:5000/triton/kernels:h100-triton3.6

    Example: tritonpack push h100.tpack hf://my-org/llama-8b/kernels/h100.tpack
    """
    from . import oci

    _emit(oci.push(archive, reference, plain_http=plain_http or None), as_json, quiet)


@app.command()
@_json_on_failure
def pull(
    reference: str = typer.Argument(..., help="oci://REGISTRY[:PORT]/REPOSITORY[:TAG|@DIGEST]"),
    output: str | None = typer.Option(None, "-o", "--output",
                                      help="File to write (- for standard output). Default: the name it was "
                                           "pushed under."),
    plain_http: bool = typer.Option(False, "--plain-http", help=PLAIN_HTTP_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print nothing but errors."),
) -> None:
    """Pull an archive from an OCI registry, checked against the manifest's digest.

    Example: tritonpack pull oci://registry.example:5000/triton/kernels:h100-triton3.6 -o kernels.tpack
    """
    from . import oci

    _emit(oci.pull(reference, output, plain_http=plain_http or None), as_json, quiet)


@app.command()
@_json_on_failure
def ensure(
    archive: str = typer.Argument(..., help="The .tpack archive: a path or a URL (https://, s3://, hf://, "
                                            "file://), or - for standard input (read whole at every run); not an "
                                            "oci:// reference: pull it once (tritonpack pull), then ensure the file."),
    cache_dir: str | None = typer.Option(
        None, "--cache-dir", help="Cache root to fill. Default: Triton's own, as for pack."),
    target: list[str] | None = typer.Option(None, "--target", help=TARGET_HELP),
    strict: bool = typer.Option(False, "--strict", help="Exit with status 5 when no entry would be used here."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print nothing but errors."),
) -> None:
    """Unpack once: about a millisecond when already done, safe when many processes run it at once.

    The first run unpacks (usable entries only, as unpack) and leaves a stamp in ROOT/.tritonpack keyed by
    the archive and the environment; later runs find it, even when a URL's server is briefly unreachable (its
    last run's stamp is trusted, and the output says so); an hf:// URL at a commit is not read at all once done.
    Concurrent runs wait for the one that unpacks. When no entry would be used here nothing is written and the
    exit status is still 0 (5 with --strict).

    Example: tritonpack ensure /models/llama/kernels.tpack && exec python serve.py

    Example: tritonpack ensure hf://my-org/llama@0123456789abcdef0123456789abcdef01234567/kernels/h100.tpack
    """
    from .ensuring import ensure as ensure_archive
    from .heap import fix_malloc_thresholds

    fix_malloc_thresholds()

    def waiting(seconds: float, holder: str, lock: str) -> None:
        if not quiet:
            print_error(f"waiting {seconds:.0f} s for {holder}, which holds {lock} (unpacking into that root)")

    _emit(ensure_archive(archive, cache_dir, targets=target or None, strict=strict, processes=True,
                         waiting=waiting), as_json, quiet)


@app.command(context_settings={"allow_interspersed_args": False, "ignore_unknown_options": True})
@_json_on_failure
def record(
    command: list[str] = typer.Argument(..., metavar="-- CMD [ARGS]...", help="The command to run, after --."),
    output: str = typer.Option("kernels.tpack", "-o", "--output", help="Archive to write (- for standard output)."),
    level: int = typer.Option(DEFAULT_LEVEL, "--level", help="zstd level, 1-22."),
    allow_failure: bool = typer.Option(False, "--allow-failure",
                                       help="Pack what the command used even if it exits with an error."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (the command's stdout then goes "
                                                       "to stderr, so that stdout is one JSON document)."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print nothing but errors."),
) -> None:
    """Run a command and pack exactly the Triton cache entries it used.

    Kernels it loaded or compiled, autotune results and launcher stubs, from whichever cache roots it used
    (TRITON_CACHE_DIR set by the command, PyTorch Inductor's own root); through shell scripts and child
    processes too. A TRITON_CACHE_MANAGER of your own keeps working (a FileCacheManager subclass is
    extended and recorded; any other is reported).

    Exit status 8 if the command fails (nothing is packed) or used no Triton cache entry.

    Example: tritonpack record -o kernels.tpack -- python warmup.py --model llama

    Example: tritonpack record -o kernels.tpack -- bash serve_smoke_test.sh
    """
    from .commands import is_standard_output
    from .recording import record as record_command

    # fd 2, stderr, where stdout is ours: the JSON, or the archive (-o -, -o /dev/stdout)
    result = record_command(command, output, level=level, allow_failure=allow_failure,
                            stdout=2 if as_json or is_standard_output(output) else None)
    _emit(result, as_json, quiet)


@app.command()
@_json_on_failure
def merge(
    archives: list[str] = typer.Argument(..., help="The archives to merge (paths or URLs, as for unpack; - for "
                                                   "standard input, once at most)."),
    output: str = typer.Option(..., "-o", "--output",
                               help="Archive to write (may be one of the inputs; - for standard output)."),
    prefer: str | None = typer.Option(None, "--prefer", metavar="first|last",
                                      help="On a conflict (same key, kind and name, different files) keep the "
                                           "entry of the first or the last archive that has it."),
    level: int = typer.Option(DEFAULT_LEVEL, "--level", help="zstd level, 1-22."),
    arch: list[str] | None = typer.Option(None, "--arch", help=ARCH_HELP),
    kernel: list[str] | None = typer.Option(None, "--kernel", help=KERNEL_HELP),
    binary_only: bool = typer.Option(False, "--binary-only", help=BINARY_HELP),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON."),
    quiet: bool = typer.Option(False, "-q", "--quiet", help="Print nothing but errors."),
) -> None:
    """Merge archives into one: every distinct entry once, identical entries stored once.

    A conflict is an error (exit status 9) naming the key, unless --prefer says which archive wins. The
    output records a packing Triton only as far as all inputs agree on it, so the preflight stays right.

    Example: tritonpack merge llama.tpack mistral.tpack -o all.tpack

    Example: tritonpack merge base.tpack hotfix.tpack --prefer last -o kernels.tpack
    """
    from .heap import fix_malloc_thresholds
    from .merging import merge as merge_archives

    fix_malloc_thresholds()
    result = merge_archives(archives, output, prefer=prefer, level=level,
                            selection=selection(arch, kernel, binary_only))
    _emit(result, as_json, quiet)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"tritonpack {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    pass


def main(argv: list[str] | None = None) -> int:
    try:
        result = app(args=argv, prog_name="tritonpack", standalone_mode=False)
        if result == 130:  # typer (0.26) turns Ctrl-C within a command into this status, and says nothing
            return interrupted(KeyboardInterrupt())
    except TpackError as e:
        print_error(f"error: {e}")
        return exit_code(e)
    except ClickUsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # the help text was printed already
            return 2
        hint = f" (see '{e.ctx.command_path} --help')" if e.ctx else ""
        if e.ctx and e.ctx.info_name in ("unpack", "ensure") and "unexpected extra argument" in e.format_message():
            hint = f" (the cache root goes after --cache-dir; see '{e.ctx.command_path} --help')"
        print_error(f"error: {e.format_message()}{hint}")
        return 2
    except ClickException as e:
        print_error(f"error: {e.format_message()}")
        return e.exit_code
    except (KeyboardInterrupt, Terminated, typer.Abort) as e:
        return interrupted(e)
    except BrokenPipeError:
        return closed_pipe()
    except OSError as e:  # typer's help or click's echo on a full or failing standard output (``> /dev/full``);
        # tritonpack's own commands raise TpackError for the files they name
        print_error(f"error: {e.filename or STDOUT}: {'' if e.filename else 'cannot write: '}{e.strerror or e}")
        return 1
    return result if isinstance(result, int) else 0
