"""Archives read from a stream: ``-`` (standard input), or a path that names a pipe, a FIFO, a socket or a
character device (``/dev/stdin`` on a pipe, ``mkfifo``).

A reader needs positional reads: the index lies at the archive's end (spec §3). So a stream is first copied, 1 MiB
at a time, into a temp file in ``TMPDIR`` that has no name (``O_TMPFILE``, else unlinked as soon as it is made):
memory stays bounded, and the kernel frees the copy however the process ends, an error, SIGTERM or SIGKILL
included. Its first 16 bytes are checked as they arrive, so that a stream that is not an archive (an HTML error
page, ``/dev/zero``) is refused at once rather than copied to its end. A regular file is never copied: standard
input redirected from one (``< kernels.tpack``) is read in place.

A stream gives its bytes once. ``ensure`` opens its archive several times (the digest, the unpack, the entries it
stamps): within ``kept_streams()`` the copy made at the first opening serves the later ones.
"""
from __future__ import annotations

import contextlib
import os
import select
import stat
from collections.abc import Iterator
from contextvars import ContextVar

from .archive.format import HEADER_SIZE, parse_header
from .archive.source import LocalFile, open_local
from .errors import ArchiveError, CacheError, UsageError

STDIN = "-"
STDIN_NAME = "standard input"  # what errors call it, as ``commands.STDOUT`` names standard output
CHUNK = 1 << 20

_KEPT: ContextVar[dict[str, int] | None] = ContextVar("tritonpack_kept_streams", default=None)


def is_stdin(location: str | os.PathLike) -> bool:
    return isinstance(location, str) and location == STDIN


def local_source(location: str | os.PathLike, name: str | None = None) -> LocalFile:
    """A local path, or ``-`` for standard input, as a ``LocalFile``: a regular file read in place, a stream's
    copy. ``name``: what errors call it (default: the path; ``standard input`` for ``-``)."""
    path = os.fspath(location)
    name = (STDIN_NAME if path == STDIN else path) if name is None else name
    kept = _KEPT.get()
    if kept is not None and path in kept:
        return LocalFile.opened(os.dup(kept[path]), name)
    fd = _standard_input() if path == STDIN else open_local(path, name)
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISREG(mode) and os.lseek(fd, 0, os.SEEK_CUR) == 0:  # standard input may have been read from
            source, fd = LocalFile.opened(fd, name), -1
            return source
        if stat.S_ISBLK(mode):
            raise UsageError("not a regular file", name)
        if os.isatty(fd):
            raise UsageError("is a terminal: pipe an archive into it (cat kernels.tpack | tritonpack list -)", name)
        copy = _copied(fd, name)
    finally:
        if fd >= 0:
            os.close(fd)
    if kept is not None:
        kept[path] = os.dup(copy)
    return LocalFile.opened(copy, name)


def stream_identity(location: str) -> tuple[int, int] | None:
    """The device and inode of the stream that ``-`` or a local path names, found without reading it: ``stat``
    follows ``/dev/stdin`` and ``/proc/self/fd/N`` to the pipe itself. None for a regular file (read in place, as
    often as it is named), a directory, or what cannot be looked at (its opening will say why)."""
    if not location.strip():
        return None
    try:
        st = os.fstat(0) if location == STDIN else os.stat(os.path.expanduser(location))
    except OSError:
        return None
    if stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode):
        return None
    return st.st_dev, st.st_ino


def _standard_input() -> int:
    try:
        return os.dup(0)  # closed with the source; standard input itself stays open
    except OSError:
        raise UsageError("is closed: there is no archive to read", STDIN_NAME) from None


def _copied(fd: int, name: str) -> int:
    """A descriptor of a nameless temp file holding the rest of the stream ``fd``, its header checked."""
    import tempfile  # 3 ms: only where a stream is read

    try:
        with tempfile.TemporaryFile(prefix="tritonpack-stream-") as copy:
            head = b""
            for chunk in _chunks(fd, name):
                if len(head) < HEADER_SIZE:
                    head += chunk[:HEADER_SIZE - len(head)]
                    if len(head) == HEADER_SIZE:
                        parse_header(head, name)  # not an archive: refused before the rest is read
                copy.write(chunk)
            copy.flush()
            return os.dup(copy.fileno())
    except OSError as e:  # the temp directory's (a full disk, a quota); reading the stream raises ArchiveError
        raise _no_copy(e, name) from None


def _no_copy(error: OSError, name: str) -> CacheError:
    import tempfile

    where = tempfile.tempdir or "the temp directory"  # set once a temp directory was found
    return CacheError(f"cannot keep a copy of the archive read from it in {where}: {error.strerror or error} "
                      "(TMPDIR chooses another directory)", name)


def _chunks(fd: int, name: str) -> Iterator[bytes]:
    """The stream's bytes to its end. Waits until it can be read, then reads: a FIFO opened without blocking (see
    ``open_local``) has no data until its writer comes, and a read before then would take that for its end."""
    waiting = select.poll()
    waiting.register(fd, select.POLLIN)
    while True:
        waiting.poll()
        try:
            chunk = os.read(fd, CHUNK)
        except BlockingIOError:  # woken with nothing to read yet
            continue
        except OSError as e:
            raise ArchiveError(f"cannot read: {e.strerror}", name) from None
        if not chunk:
            return
        yield chunk


@contextlib.contextmanager
def kept_streams() -> Iterator[None]:
    """Within the block, a stream opened again is read from the copy its first opening made (a stream gives its
    bytes once); the copies are freed when the outermost block ends."""
    if _KEPT.get() is not None:
        yield
        return
    kept: dict[str, int] = {}
    token = _KEPT.set(kept)
    try:
        yield
    finally:
        _KEPT.reset(token)
        for fd in kept.values():
            os.close(fd)
