"""Where archive bytes come from. The reader needs only a size and positional reads, so that a local file, and
later a remote object read by HTTP range requests, are the same to it."""
from __future__ import annotations

import os
import stat
from typing import Protocol

from ..errors import ArchiveError, CacheError, UsageError


class ByteSource(Protocol):
    name: str

    def size(self) -> int: ...

    def read_at(self, offset: int, length: int) -> bytes:
        """Exactly ``length`` bytes at ``offset``, or fewer at the end; safe to call from several threads."""
        ...

    def close(self) -> None: ...


_A_DIRECTORY = "is a directory, not an archive (tritonpack pack makes one of a cache directory)"


def open_local(path: str, name: str | None = None) -> int:
    """A descriptor of the archive at ``path``, opened without blocking (so that a FIFO's open never waits for a
    writer); anything but a directory. Errors name ``name`` (the path by default): a missing path or a directory
    is a usage error (2), a filesystem's no (permissions, too many open files) a cache error (4)."""
    if not path.strip():
        raise UsageError("the archive's path given is empty (an unset variable?)", name)
    if "\0" in path:
        raise UsageError("the archive's path holds a NUL character", repr(path))
    name = path if name is None else name
    path = os.path.expanduser(path)  # as a shell would, where none did (the API)
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise UsageError("no such archive", name) from None
    except IsADirectoryError:
        raise UsageError(_A_DIRECTORY, name) from None
    except OSError as e:
        raise CacheError(f"cannot open: {e.strerror}", name) from None  # a filesystem's no (4), not usage
    if stat.S_ISDIR(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(_A_DIRECTORY, name)
    return fd


class LocalFile:
    """A local archive file, read with ``pread`` (no shared file position, so threads may read at once)."""

    def __init__(self, path: str | os.PathLike, name: str | None = None):
        """``name``: what errors call it, where that is not the path (the ``file://`` URL it was given as). Only a
        regular file can be read by offset: anything else is refused (``streams`` copies a stream first)."""
        path = os.fspath(path)
        self.name = path if name is None else name
        fd = open_local(path, name)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise UsageError("not a regular file", self.name)
        self._fd = fd

    @classmethod
    def opened(cls, fd: int, name: str) -> LocalFile:
        """The regular file already open as ``fd`` (standard input, a stream's copy); closed with the source."""
        source = cls.__new__(cls)
        source._fd, source.name = fd, name
        return source

    def size(self) -> int:
        return os.fstat(self._fd).st_size

    def read_at(self, offset: int, length: int) -> bytes:
        try:
            return os.pread(self._fd, length, offset)
        except OSError as e:
            raise ArchiveError(f"cannot read: {e.strerror}", self.name) from None

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
