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


class LocalFile:
    """A local archive file, read with ``pread`` (no shared file position, so threads may read at once)."""

    def __init__(self, path: str | os.PathLike, name: str | None = None):
        """``name``: what errors call it, where that is not the path (the ``file://`` URL it was given as)."""
        path = os.fspath(path)
        self.name = path if name is None else name
        if not path.strip():
            raise UsageError("the archive's path given is empty (an unset variable?)", name)
        path = os.path.expanduser(path)  # as a shell would, where none did (the API)
        try:
            # Non-blocking, so that a FIFO named as the archive cannot hang the open; only a regular file can be
            # read by offset.
            self._fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            raise UsageError("no such archive", self.name) from None
        except IsADirectoryError:
            raise UsageError("is a directory, not an archive", self.name) from None
        except OSError as e:
            raise CacheError(f"cannot open: {e.strerror}", self.name) from None  # a filesystem's no (4), not usage
        mode = os.fstat(self._fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(self._fd)
            what = "is a directory, not an archive" if stat.S_ISDIR(mode) else "not a regular file"
            raise UsageError(what, self.name)

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
