"""Where a command that writes an archive (``pack``, ``merge``, ``record``, ``pull``) puts it, and what it leaves
when it fails or is stopped.

An archive replaces a regular file atomically: it is written to a temp file ``.tpack-*.tmp`` beside the file and
renamed over it, so that a reader sees the old archive or the whole new one, never part of one. A symbolic link is
followed: the temp file goes beside the link's final target, which is replaced, and the link stays a link. An
output that exists and is not a regular file (a character device such as ``/dev/null`` or ``/dev/stdout``, a FIFO)
is written in place, from its start, as ``tar -cf`` writes one: there is nothing to replace there, and a rename
would put a regular file where the device was. ``-`` is standard output, written as it stands (``pack -o - |
ssh host tritonpack unpack -``), but never a terminal. A directory is an error.

While the temp file exists a SIGTERM, which is how pods and CI jobs are stopped, is raised as ``Terminated`` in the
main thread, as Ctrl-C raises ``KeyboardInterrupt``, so that the temp file is removed on the way out: before, each
stopped pack left one behind, and nothing ever cleaned them.
"""
from __future__ import annotations

import contextlib
import os
import signal
import stat
import tempfile
import threading
from collections.abc import Callable, Iterator
from typing import BinaryIO, NamedTuple

from .errors import CacheError, Terminated, UsageError

TEMP_PREFIX, TEMP_SUFFIX = ".tpack-", ".tmp"
STDOUT = "-"  # as an output: standard output


class Destination(NamedTuple):
    path: str  # the file an archive replaces (a link's final target), or the one it is written to in place
    in_place: bool  # an existing device or FIFO: written directly, not replaced


def destination(output: str) -> Destination:
    """Where an archive named ``output`` goes, decided once for every command that writes one."""
    if not output.strip():
        raise UsageError("the archive's path given is empty (an unset variable?)")
    if "\0" in output:
        raise UsageError("the archive's path holds a NUL character", repr(output))
    if output == STDOUT:
        if os.isatty(1):  # refused before any work, as tar refuses: it would fill the terminal with binary
            raise UsageError("standard output is a terminal: pipe the archive into a command, or redirect it", output)
        return Destination(output, True)
    output = os.path.expanduser(output)  # as a shell would, where none did (the API, -o=~/k.tpack)
    try:
        mode = os.stat(output).st_mode
    except FileNotFoundError:  # a new file, or the missing target of a dangling link: created there
        return Destination(os.path.realpath(output), False)
    except OSError as e:
        raise CacheError(f"cannot write the archive: {e.strerror}", output) from None
    if stat.S_ISDIR(mode):
        raise UsageError("is a directory; name the archive file to write", output)
    if stat.S_ISREG(mode):
        return Destination(os.path.realpath(output), False)
    return Destination(output, True)


@contextlib.contextmanager
def archive_file(output: str) -> Iterator[tuple[BinaryIO, str | None]]:
    """``(file, scratch directory)``: the file to write the archive to, sequentially, and the directory for
    scratch files (beside the archive; None, the system's temp directory, for a device or a FIFO). Moved in when
    the block ends; removed where the block raises, a SIGTERM included. Errors of the block propagate as raised."""
    target = destination(output)
    out: BinaryIO | None
    with _terminated_as_exception() as held:
        if target.in_place:
            with _standard_output() if target.path == STDOUT else _opened_in_place(target.path) as out:
                yield out, None
            return
        directory = os.path.dirname(target.path)
        out, tmp = None, None
        try:
            with held():  # a SIGTERM between the temp file's creation and its name's assignment would orphan it
                try:
                    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=directory)
                except OSError as e:
                    raise CacheError(f"cannot create the archive: {e.strerror}", output) from None
                out = os.fdopen(fd, "wb")
            yield out, directory
            out.close()
            with held():
                os.chmod(tmp, 0o666 & ~current_umask())
                os.replace(tmp, target.path)
                tmp = None
        finally:
            with held():  # the clean-up runs to its end, whatever arrives meanwhile
                if out is not None:
                    with contextlib.suppress(OSError):  # the error that brought it here says more
                        out.close()
                if tmp is not None:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(tmp)


def _standard_output() -> BinaryIO:
    """Standard output, for an archive written to a pipe or a redirect."""
    try:
        return os.fdopen(os.dup(1), "wb")
    except OSError as e:
        raise CacheError(f"cannot write the archive to standard output: {e.strerror}", STDOUT) from None


def _opened_in_place(output: str) -> BinaryIO:
    """The device or FIFO, opened for writing (a FIFO waits for its reader, as ``tar`` does); never created."""
    try:
        fd = os.open(output, os.O_WRONLY | os.O_NOCTTY)
    except OSError as e:
        raise CacheError(f"cannot write the archive: {e.strerror}", output) from None
    if stat.S_ISREG(os.fstat(fd).st_mode):  # replaced since it was looked at: never written over in place
        os.close(fd)
        raise CacheError("became a regular file while it was opened; run again", output)
    return os.fdopen(fd, "wb")


class _Termination:
    """SIGTERM as ``Terminated``, once; held back inside ``held()`` until its end."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.holding = 0
        self.pending: int | None = None
        self.raised = False

    def handle(self, signum: int, frame) -> None:
        if os.getpid() != self.pid:  # a child forked meanwhile: the default action, never the parent's clean-up
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.raised:  # a second signal while the first one's clean-up runs: let it finish
            return
        if self.holding:
            self.pending = signum
            return
        self.raised = True
        raise Terminated(signum)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self.holding += 1
        try:
            yield
        finally:
            self.holding -= 1
        self.raise_pending()

    def raise_pending(self) -> None:
        if self.pending is not None and not self.holding and not self.raised:
            self.raised = True
            raise Terminated(self.pending)


@contextlib.contextmanager
def _terminated_as_exception() -> Iterator:
    """Within the block, a SIGTERM raises ``Terminated`` in the main thread, where it would otherwise end the
    process on the spot (its default action) and leave the temp file; yields ``held``, inside which it waits.
    Only from the main thread, the one a Python handler runs in; a handler of the program's own (or SIG_IGN) is
    left alone. The previous handler is back once the block ends."""
    termination = _Termination()
    try:
        with handling_signals({signal.SIGTERM: termination.handle}):
            yield termination.held
    finally:
        termination.raise_pending()  # one held back while an error propagated: the exit still says it


@contextlib.contextmanager
def handling_signals(handlers: dict[int, Callable[[int, object], None]]) -> Iterator[None]:
    """Each handler for its signal within the block, only where that signal would end the process (its default
    action, or Python's KeyboardInterrupt for SIGINT) and only from the main thread, the one a Python handler runs
    in: a program's own handler, or SIG_IGN (``nohup``), is left alone. What was there is back once the block ends."""
    installed = {}
    if threading.current_thread() is threading.main_thread():
        for signum, handler in handlers.items():
            if signal.getsignal(signum) in (signal.SIG_DFL, signal.default_int_handler):
                installed[signum] = signal.signal(signum, handler)
    try:
        yield
    finally:
        for signum, previous in installed.items():
            signal.signal(signum, previous)


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


__all__ = ["Destination", "destination", "archive_file", "handling_signals", "current_umask", "TEMP_PREFIX",
           "TEMP_SUFFIX"]
