"""Archives that are not local files. ``open_source`` is the one place where an ARCHIVE argument becomes a
``ByteSource``, chosen by its scheme: a path or ``file://`` URL is read locally (``-`` is standard input; a stream
is copied first: ``streams``), ``oci://`` is pulled to a temp file, and any other URL (``https://``, ``http://``,
``s3://``, ``hf://``, ...) is read through fsspec with one range request per read, so listing fetches the header,
the trailer and the index and nothing else.
"""
from __future__ import annotations

import os
import re

from .archive.format import TRAILER_SIZE
from .archive.source import ByteSource
from .errors import NotFoundError, RemoteError, TpackError, UsageError
from .streams import local_source

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_HTTP = ("http", "https")
SERVER_TIMEOUT = (10, 60)  # seconds: to connect, and between two reads of an answer (HTTP, registries, Redis)


def scheme_of(location: str | os.PathLike) -> str:
    """The URL scheme, lower case, or ``""`` for a plain path."""
    match = _SCHEME.match(location) if isinstance(location, str) else None
    return match.group(1).lower() if match else ""


def open_source(location: str | os.PathLike) -> ByteSource:
    """The ``ByteSource`` for a path or URL. Raises ``UsageError`` for what cannot be opened as named."""
    scheme = scheme_of(location)
    if scheme == "":
        return local_source(location)
    url = os.fspath(location)
    if scheme == "file":
        return local_source(file_url_path(url), url)
    if scheme == "oci":
        from .oci import pull_to_temp

        return pull_to_temp(url)
    return FsspecSource(url)


def file_url_path(url: str) -> str:
    from urllib.parse import unquote, urlsplit  # only for URLs: a local path starts faster without it

    parts = urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise UsageError("file:// URLs must name a local file (file:///path)", url)
    return unquote(parts.path)


class _NoRanges(Exception):
    """Raised from inside the HTTP client as soon as a reply shows the server ignored the Range header, so
    that a multi-GB body is not downloaded only to be refused."""


def _asked_length(range_header: str) -> int | None:
    """Bytes asked for by ``bytes=a-b`` or ``bytes=-n``."""
    match = re.fullmatch(r"bytes=(\d*)-(\d*)", range_header.strip())
    if not match:
        return None
    first, last = match.groups()
    if not first:
        return int(last) if last else None
    return int(last) - int(first) + 1 if last else None


def _http_trace(observed: dict):
    """An aiohttp trace that records the total size from a suffix read's ``Content-Range`` and refuses a reply
    that ignores the Range header (a 200 larger than what was asked)."""
    import aiohttp

    async def on_request_end(session, context, params) -> None:
        asked = params.headers.get("Range")
        if not asked:
            return
        response = params.response
        total = response.headers.get("Content-Range", "").rpartition("/")[2]
        if asked.startswith("bytes=-") and total.isdigit():
            observed["size"] = int(total)
        if response.status == 200:
            length = response.headers.get("Content-Length")
            wanted = _asked_length(asked)
            if length is None or wanted is None or int(length) > wanted:
                raise _NoRanges("the server does not support HTTP range requests (it answered 200 with the whole "
                                "file); serve the archive from a server that does (nginx, S3, ...)")
            if asked.startswith("bytes=-"):  # the whole file is smaller than the suffix asked for
                observed["size"] = int(length)

    trace = aiohttp.TraceConfig()
    trace.on_request_end.append(on_request_end)
    return trace


def _is_timeout(error: BaseException) -> bool:
    """Before Python 3.11 the timeouts of asyncio and concurrent.futures are not the builtin ``TimeoutError``:
    fsspec's ``FSTimeoutError`` and aiohttp's ``ServerTimeoutError`` derive from asyncio's."""
    import asyncio
    import concurrent.futures

    return isinstance(error, (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError))


NO_CREDENTIALS = ("no S3 credentials found (botocore: Unable to locate credentials): set AWS_ACCESS_KEY_ID and "
                  "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE; for a public bucket, FSSPEC_S3_ANON=true")


def _describe(error: BaseException) -> str:
    """One line for a failure of the remote filesystem or its HTTP client."""
    if type(error).__name__ == "NoCredentialsError":  # botocore's: s3fs found no keys anywhere
        return NO_CREDENTIALS
    status = getattr(error, "status", None)
    if isinstance(status, int):
        return f"HTTP {status} {getattr(error, 'message', '') or ''}".rstrip()
    cause = getattr(error, "os_error", None)
    if cause is not None and getattr(cause, "strerror", None):
        host = getattr(error, "host", None)
        where = f" {host}:{getattr(error, 'port', None)}" if host else ""
        return f"cannot connect to{where}: {cause.strerror}"
    if _is_timeout(error):
        return "timed out"
    if isinstance(error, ConnectionError) and error.strerror:
        return f"cannot connect: {error.strerror}"
    text = " ".join(str(error).split()) or type(error).__name__
    return f"{type(error).__name__}: {text}" if type(error).__name__ not in text else text


class FsspecSource:
    """An archive behind a URL, read with ``fs.cat_file(path, start=, end=)``: one range request per read and no
    shared file position, so the reader's threads may read at once. (By keyword: s3fs's third positional
    parameter is a version id, and an offset given there read the object from ``end`` to its end, at each read.)

    Over HTTP the size comes with the first read, a suffix range for the trailer (its ``Content-Range`` names
    the total), and that read is kept for the reader's trailer read: listing costs exactly three requests.
    Elsewhere the size is one ``fs.size`` call.
    """

    def __init__(self, url: str):
        self.name = url
        scheme = scheme_of(url)
        if scheme in _HTTP and not _SCHEME.sub("", url).split("/", 1)[0]:
            raise UsageError("not a URL of an archive: it names no host", url)
        try:
            import fsspec
        except ImportError:
            raise UsageError("reading archives from URLs needs fsspec: pip install 'tritonpack[remote]'",
                             url) from None
        self._observed: dict[str, int] = {}
        self._tail: tuple[int, bytes] | None = None  # (offset, bytes) of the suffix read
        self._size: int | None = None
        try:
            if scheme in _HTTP:
                import aiohttp

                # aiohttp's default waits five minutes on a server that took the connection and never answers
                timeout = aiohttp.ClientTimeout(total=None, sock_connect=SERVER_TIMEOUT[0],
                                                sock_read=SERVER_TIMEOUT[1])
                self._fs, self._path = fsspec.core.url_to_fs(
                    url, client_kwargs={"trace_configs": [_http_trace(self._observed)], "timeout": timeout},
                    skip_instance_cache=True)
            else:
                self._fs, self._path = fsspec.core.url_to_fs(url)
        except ImportError as e:
            raise UsageError(f"{scheme}:// needs a package that is not installed ({' '.join(str(e).split())})",
                             url) from None
        except ValueError as e:
            if "Protocol not known" in str(e):
                raise UsageError(f"unknown URL scheme {scheme}://", url) from None
            raise UsageError(_describe(e), url) from None
        except Exception as e:  # a backend that connects as it is made (ftp://, github://) or reads a chained
            raise RemoteError(_describe(e), url) from None  # URL's container (zip://...::file://...)
        self._http = scheme in _HTTP

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TpackError:
            raise
        except FileNotFoundError:
            raise NotFoundError("no such archive (not found on the server)", self.name) from None
        except _NoRanges as e:
            raise RemoteError(str(e), self.name) from None
        except Exception as e:  # the backends' own errors (aiohttp, botocore, huggingface_hub): one line
            raise RemoteError(_describe(e), self.name) from None

    def size(self) -> int:
        if self._size is None:
            if self._http:
                tail = self._call(self._fs.cat_file, self._path, start=-TRAILER_SIZE)
                size = self._observed.get("size")
                if size is None:  # no Content-Range (e.g. an empty file): ask for the size
                    size = self._call(self._fs.size, self._path)
                self._tail = (size - len(tail), tail)
                self._size = size
            else:
                self._size = self._call(self._fs.size, self._path)
            if self._size is None:
                raise RemoteError("the server does not say how large the archive is", self.name)
        return self._size

    def read_at(self, offset: int, length: int) -> bytes:
        size = self.size()
        end = min(offset + length, size)
        if end <= offset:
            return b""
        if self._tail is not None:
            start, tail = self._tail
            if start <= offset and end <= start + len(tail):
                return tail[offset - start:end - start]
        data = self._call(self._fs.cat_file, self._path, start=offset, end=end)
        if len(data) > end - offset:
            raise RemoteError("the server does not support range requests (it sent more than the range asked)",
                              self.name)
        return data

    def close(self) -> None:
        self._fs = None
        self._tail = None
