"""One exception hierarchy; the CLI maps each class to an exit code in one place."""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .compat import CheckReport
    from .ensuring import EnsureResult


class TpackError(Exception):
    """Base of every error tritonpack raises on purpose.

    ``path`` names the file the problem is about, so the CLI can print ``error: <path>: <message>``.
    """

    def __init__(self, message: str, path: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.path = path

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class UsageError(TpackError):
    """A wrong argument or option value."""


class NotFoundError(UsageError):
    """The server holding an archive says it has none at that URL: told apart from other usage errors because
    ``ensure`` may then trust the stamp of its last ensure of that URL."""


class ArchiveError(TpackError):
    """The archive is not a valid ``.tpack`` file: wrong magic, truncated, corrupt, or hostile."""


class UnsupportedFormatError(ArchiveError):
    """A valid archive of a format major version this tritonpack cannot read."""


class ReaderLimitError(ArchiveError):
    """A valid archive past one of a reader's limits against hostile input (spec §7): refused unless the limit
    is raised where it is read; a writer refuses to write one."""


class IntegrityError(ArchiveError):
    """Stored bytes do not match their recorded sha256."""


class CacheError(TpackError):
    """A cache root cannot be read or written (missing, not a directory, permissions, disk full)."""


class SpaceError(CacheError):
    """The target filesystem lacks the free space or inodes an unpack will use (its precheck)."""


class RemoteError(TpackError):
    """A server holding an archive or a cache (HTTP, S3, OCI registry, Redis) could not be reached or did not
    answer as tritonpack needs (e.g. no byte-range support)."""


class IncompatibleError(TpackError):
    """No entry of the archive would be used by the local Triton (see ``check``). ``report``: the preflight's
    ``CheckReport`` that refused; ``result``: ``ensure``'s ``EnsureResult``, where its ``strict`` refused. The
    command's ``--json`` prints them with the error."""

    def __init__(self, message: str, path: str | None = None, *, report: CheckReport | None = None,
                 result: EnsureResult | None = None) -> None:
        super().__init__(message, path)
        self.report = report
        self.result = result


class RecordError(TpackError):
    """``record`` has nothing honest to pack: the command failed, or it used no Triton cache entry."""


class ConflictError(TpackError):
    """Archives to merge hold the same entry with different contents, and no preference was given."""


class Terminated(SystemExit):
    """A SIGTERM received while an archive was written (``archivedest.py``) or a recorded command ran, raised in
    the main thread so that temp files are removed on the way out. Not a ``TpackError``: a ``SystemExit`` with
    status 128 + the signal's number, as a shell reports a process that signal ended, which no ``except
    Exception`` takes for a failure to recover from, and which ends a program calling the API quietly, with that
    status, where nothing catches it. The CLI says so in one line."""

    def __init__(self, signal_number: int) -> None:
        super().__init__(128 + signal_number)
        self.signal_number = signal_number
