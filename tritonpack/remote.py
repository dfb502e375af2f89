"""Archives that are not local files. ``open_source`` is the one place where an ARCHIVE argument becomes a
``ByteSource``, chosen by its scheme: a path or ``file://`` URL is read locally (``-`` is standard input; a stream
is copied first: ``streams``), ``oci://`` is pulled to a temp file, and any other URL (``https://``, ``http://``,
``s3://``, ``hf://``, ...) is read through fsspec with one range request per read, so listing fetches the header,
the trailer and the index and nothing else. An ``hf://`` URL is read as its ``resolve`` URL over HTTP (``hub``).
"""
from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Iterator
from contextvars import ContextVar
from typing import TYPE_CHECKING

from .archive.format import TRAILER_SIZE
from .archive.source import ByteSource
from .errors import NotFoundError, RemoteError, TpackError, UsageError
from .streams import local_source

if TYPE_CHECKING:
    from . import hub

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
_HTTP = ("http", "https")
SERVER_TIMEOUT = (10, 60)  # seconds: to connect, and between two reads of an answer (HTTP, registries, Redis)
MIN_RATE = 64 * 1024  # bytes a second: a range's reply slower than this, past its first minute, times out (HTTP)
S3_ATTEMPTS = 3  # botocore's standard retries: throttling, 5xx, timeouts; s3fs's own loop is not added on top
HTTP_ATTEMPTS = 3  # the same over HTTP: a 429 or 5xx reply, or a connection the server dropped, is asked again
RETRY_AFTER_LIMIT = 20  # seconds: a reply that asks to wait longer (Retry-After) fails at once
_RETRIED = (429, 500, 502, 503, 504)


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
    path = unquote(parts.path)
    if "\0" in path:  # no path holds one: os.open and os.stat raise ValueError, a traceback
        raise UsageError("a file:// URL's path holds no NUL character (%00)", url)
    return path


# What a URL may hold as it is: the reserved characters, and '%' (its escapes are left as written)
_URL_CHARACTERS = "!#$%&'()*+,/:;=?@[]~"


def wire_url(url: str) -> str:
    """The URL as it is sent: as given, byte for byte, but for the characters no URL may hold (spaces, non-ASCII),
    percent-encoded. A signed URL (S3 presigned, the CDN a Hugging Face or GitHub download redirects to) is signed
    as it is written: the normalisation aiohttp applies by default (``%2F`` to ``/``, ``%7E`` to ``~``) makes its
    server refuse it."""
    from urllib.parse import quote, urlsplit, urlunsplit

    parts = urlsplit(url)
    return urlunsplit(parts._replace(path=quote(parts.path, safe=_URL_CHARACTERS),
                                     query=quote(parts.query, safe=_URL_CHARACTERS)))


class _Refused(Exception):
    """Raised from inside the HTTP client as soon as a reply's headers show its bytes are not the archive's asked
    for (the whole file, a compressed body, another range, another archive), before its body is read: a multi-GB
    body is not downloaded only to be refused."""


def _asked(range_header: str) -> tuple[int | None, int | None] | None:
    """``(first, last)`` of ``bytes=first-last``, ``(None, n)`` of a suffix ``bytes=-n``; None for anything else."""
    match = re.fullmatch(r"bytes=(\d*)-(\d*)", range_header.strip())
    if not match or not any(match.groups()):
        return None
    first, last = (int(v) if v else None for v in match.groups())
    return first, last


def _asked_length(asked: tuple[int | None, int | None]) -> int | None:
    """Bytes asked for by ``bytes=a-b`` or ``bytes=-n``."""
    first, last = asked
    if first is None:
        return last
    return None if last is None else last - first + 1


def _expected_range(asked: tuple[int | None, int | None], total: int) -> tuple[int, int]:
    """The ``(first, last)`` a ``206`` must answer to what was ``asked`` of a file of ``total`` bytes."""
    first, last = asked
    if first is None:  # the last ``last`` bytes
        return max(0, total - (last or 0)), total - 1
    return first, total - 1 if last is None else min(last, total - 1)


NO_RANGES = ("the server does not support HTTP range requests (it answered 200 with the whole file): serve the "
             "archive from one that does (nginx, S3, ...), or stream it in: curl -fsSL URL | tritonpack unpack -")

NO_CREDENTIALS = ("no S3 credentials found (botocore: Unable to locate credentials): set AWS_ACCESS_KEY_ID and "
                  "AWS_SECRET_ACCESS_KEY, or AWS_PROFILE; for a public bucket, FSSPEC_S3_ANON=true")


class _Served:
    """What the HTTP replies said of the archive behind one URL: its size and its validators (``ETag``, else
    ``Last-Modified``), taken from the first reply, to which each later reply must answer the same. Replaced by a
    new upload under the same URL between two reads, the archive is refused rather than read half from each.
    Only touched from fsspec's event loop thread, where the HTTP client's callbacks run, and, for other backends,
    where ``fs.info`` is read at each opening (``same_archives``)."""

    def __init__(self) -> None:
        self.size: int | None = None
        self.validators: dict[str, str] = {}
        # where the last request's failed reply came from, when a redirect led there (cleared as each request starts:
        # a later failure without a redirect, a refused connection, must not name an old one)
        self.redirected_to = ""
        # where the redirects of a range request led, the reply good: later reads go there first (a signed query
        # with it, held in memory only)
        self.location = ""
        # what the server said of the last request's failure (the Hub's ``X-Error-Message``), cleared as above
        self.said = ""
        # the commit the first reply names (the Hub's ``X-Repo-Commit``): later requests name it (``hub``)
        self.commit = ""

    def forget(self, location: str) -> None:
        """The redirect target ``location`` answers no more (a signed link expired): reads go through the URL
        again, unless another read has found a newer one meanwhile."""
        if self.location == location:
            self.location = ""

    def same_archive(self, total: int | None, headers) -> None:
        if total is not None:
            if self.size is not None and total != self.size:
                raise _Refused(self.changed(f"its size went from {self.size} to {total} bytes"))
            self.size = total
        seen = {name: headers[name] for name in ("ETag", "Last-Modified") if headers.get(name)}
        if not self.validators:
            self.validators = seen
            return
        # The first both replies have: an ETag says more than a date. One that changes where Last-Modified does not
        # (servers of one deployment, each naming the file by its own inode) is the same file: each block is
        # checked against its sha256 all the same, and "try again" would never succeed there.
        for name in ("ETag", "Last-Modified"):
            if name in seen and name in self.validators:
                if _weak(seen[name]) != _weak(self.validators[name]) and not (
                        name == "ETag" and seen.get("Last-Modified") and
                        seen.get("Last-Modified") == self.validators.get("Last-Modified")):
                    raise _Refused(self.changed(f"{name} {self.validators[name]} became {seen[name]}"))
                return

    @staticmethod
    def changed(how: str) -> str:
        return f"the archive changed on the server while it was read ({how}): try again"


def _weak(validator: str) -> str:
    """A validator as a weak comparison reads it (RFC 9110): ``W/"x"`` is ``"x"``, as a proxy that compresses, or
    nginx's ``gzip``, turns one into the other."""
    return validator.removeprefix("W/")


def _http_trace(served: _Served):
    """An aiohttp trace that checks each range reply (after its redirects) before its body is read: the range asked
    for, not the whole file (a server that ignores ``Range``), not compressed, and of the same archive as the replies
    before it (``_Served``), which records the total size for ``FsspecSource.size``; and where a failed reply came
    from, when a redirect led there (its query left out: a signed URL's is a credential)."""
    import aiohttp

    from .hub import COMMIT

    async def on_request_end(session, context, params) -> None:
        asked = _asked(params.headers.get("Range") or "")
        if asked is None:
            return
        response = params.response
        if not served.commit:
            served.commit = next((c for r in (*response.history, response)
                                  if COMMIT.fullmatch(c := r.headers.get("X-Repo-Commit", ""))), "")
        if response.status >= 300:  # said by fsspec's or the client's error; where it came from, said here
            if response.history:
                served.redirected_to = _public(response.url)
            served.said = " ".join(response.headers.get("X-Error-Message", "").split())[:200]
            return
        encoding = response.headers.get("Content-Encoding", "")
        if encoding.strip().lower() not in ("", "identity"):
            raise _Refused(f"the server sent the archive compressed (Content-Encoding: {encoding}), so the bytes of "
                           "its replies are not the archive's: serve it without a Content-Encoding")
        if response.status == 200:
            length, wanted = response.headers.get("Content-Length"), _asked_length(asked)
            if length is None or not length.isdigit() or wanted is None or int(length) > wanted:
                raise _Refused(NO_RANGES)
            served.same_archive(int(length), response.headers)  # the whole file is no larger than the range
        else:
            span, _, total_text = response.headers.get("Content-Range", "").removeprefix("bytes ").partition("/")
            first, _, last = span.partition("-")
            total = int(total_text) if total_text.isdigit() else served.size
            if total is not None and first.isdigit() and last.isdigit() and \
                    (int(first), int(last)) != _expected_range(asked, total):
                raise _Refused(f"the server answered bytes {span} where {params.headers['Range']} was asked")
            served.same_archive(int(total_text) if total_text.isdigit() else None, response.headers)
            length = response.headers.get("Content-Length", "")
            if first.isdigit() and last.isdigit() and length.isdigit() and int(length) != int(last) - int(first) + 1:
                raise _Refused(f"the server answered bytes {span} in a body of {length} bytes")
        if response.history:  # a good reply where redirects led: later reads go there
            served.location = str(response.url)

    trace = aiohttp.TraceConfig()
    async def on_request_start(session, context, params) -> None:  # a failure names its own redirect, or none
        served.redirected_to = served.said = ""

    trace.on_request_start.append(on_request_start)
    trace.on_request_end.append(on_request_end)
    return trace


def _is_timeout(error: BaseException) -> bool:
    """Before Python 3.11 the timeouts of asyncio and concurrent.futures are not the builtin ``TimeoutError``:
    fsspec's ``FSTimeoutError`` and aiohttp's ``ServerTimeoutError`` derive from asyncio's."""
    import asyncio
    import concurrent.futures

    return isinstance(error, (TimeoutError, asyncio.TimeoutError, concurrent.futures.TimeoutError))


def describe_failure(error: BaseException) -> str:
    """One line for a failure of the remote filesystem or its HTTP client."""
    if type(error).__name__ == "NoCredentialsError":  # botocore's: s3fs found no keys anywhere
        return NO_CREDENTIALS
    if type(error).__name__ == "TooManyRedirects":  # aiohttp's, its status 0
        return f"too many redirects ({len(getattr(error, 'history', ()))} in a row): a redirect loop?"
    status = getattr(error, "status", None)
    if isinstance(status, int):
        return f"HTTP {status} {getattr(error, 'message', '') or ''}".rstrip()
    cause = getattr(error, "os_error", None)
    if cause is not None and getattr(cause, "strerror", None):
        host = getattr(error, "host", None)
        where = f" {host}:{getattr(error, 'port', None)}" if host else ""
        if type(error).__name__ == "ClientProxyConnectionError":  # aiohttp's, of HTTPS_PROXY or HTTP_PROXY
            where = f" the proxy{where} (HTTPS_PROXY, HTTP_PROXY; NO_PROXY names the hosts reached without it)"
        return f"cannot connect to{where}: {cause.strerror}"
    if type(error).__name__ == "ClientPayloadError":  # aiohttp's: the body ended before its Content-Length
        return "the server dropped the connection within its reply"
    if _is_timeout(error):
        return "timed out"
    if type(error).__name__ in ("ReadTimeoutError", "ConnectTimeoutError"):  # botocore's, after its retries
        return f"timed out ({' '.join(str(error).split())})"
    if isinstance(error, ConnectionError) and error.strerror:
        return f"cannot connect: {error.strerror}"
    text = " ".join(str(error).split()) or type(error).__name__
    return f"{type(error).__name__}: {text}" if type(error).__name__ not in text else text


@contextlib.contextmanager
def same_archives() -> Iterator[None]:
    """Within the block, a URL opened again must still hold the archive its first opening read (its size and
    validators: over HTTP ``ETag`` or ``Last-Modified``, elsewhere what ``fs.info`` names, S3's ``ETag``...), or
    its reading fails: ``ensure`` reads the digest, then unpacks, then lists the entries it stamps, each an opening,
    and a stamp must not name the entries of another archive than its digest's."""
    if _SAME.get() is not None:
        yield
        return
    token = _SAME.set({})
    try:
        yield
    finally:
        _SAME.reset(token)


_SAME: ContextVar[dict[str, _Served] | None] = ContextVar("tritonpack_same_archives", default=None)


def commit_read(url: str) -> str:
    """The commit the Hub's replies named for ``url`` within ``same_archives``, else ""."""
    kept = _SAME.get()
    served = kept.get(url) if kept is not None else None
    return served.commit if served is not None else ""


def _served(url: str) -> _Served:
    """What the replies said of ``url`` so far: shared by every opening within ``same_archives``."""
    kept = _SAME.get()
    if kept is None:
        return _Served()
    return kept.setdefault(url, _Served())


def _refused_link(error: Exception) -> bool:
    """Whether a redirect target answered that it serves the archive no more: 404 (fsspec's FileNotFoundError), or
    another 4xx (aiohttp's ``ClientResponseError``: an expired signature's 403, a 410)."""
    return isinstance(error, FileNotFoundError) or 400 <= (getattr(error, "status", 0) or 0) < 500


def shown(location: str) -> str:
    """A location as output may show it: an http(s) URL without its user, password and query (a signed URL's query
    is a credential), which errors, summaries, ``--json`` and ``ensure``'s records on disk would otherwise carry;
    anything else as it is."""
    if scheme_of(location) not in _HTTP or not _SCHEME.sub("", location).split("/", 1)[0]:
        return location  # not a URL of a host: nothing to hide, and nothing yarl would keep
    try:
        return _public(location)
    except ValueError:  # not a URL yarl can read (a bad port): its scheme and host alone
        scheme, rest = location.split("://", 1)
        return f"{scheme}://{rest.split('/', 1)[0].rpartition('@')[2]}"


def _public(url) -> str:
    """A URL (a ``yarl.URL``, or its text as sent) as an error may name it: without its query (a signed URL's is a
    credential) and its user."""
    import yarl

    url = url if isinstance(url, yarl.URL) else yarl.URL(url, encoded=True)
    return str(url.with_query(None).with_user(None))


def _http_session(served: _Served) -> dict:
    """The aiohttp session's settings: the trace that checks each reply; ``Accept-Encoding: identity`` and no
    decompression, since a compressed reply's bytes are not the range asked for (nginx's ``gzip on`` answers a
    ``Range`` with the whole file, compressed; a proxy may compress the range itself); redirects followed as their
    ``Location`` is written (a CDN's signed query); timeouts: aiohttp's default waits five minutes on a server
    that took the connection and never answers; and the environment's proxies (``HTTPS_PROXY``, ``HTTP_PROXY``,
    ``NO_PROXY``, as curl, requests, botocore and huggingface_hub take them), which aiohttp ignores by default: where
    the only way out is a proxy, every read failed to connect."""
    import aiohttp

    timeout = aiohttp.ClientTimeout(total=None, sock_connect=SERVER_TIMEOUT[0], sock_read=SERVER_TIMEOUT[1])
    return {"trace_configs": [_http_trace(served)], "timeout": timeout, "headers": {"Accept-Encoding": "identity"},
            "auto_decompress": False, "requote_redirect_url": False, "trust_env": True}


_S3 = ("s3", "s3a")


def _s3_settings() -> dict:
    """s3fs's options: botocore's standard retries, 3 attempts, where the user set no retries of their own, and
    ``tritonpack/<version>`` in the User-Agent (as a bucket's access log shows it). s3fs retries each call 5 times
    around botocore's own 5 attempts (its ``legacy`` mode): an endpoint that takes the connection and never answers
    held a ``list`` 25 attempts of s3fs's 15 s read timeout, over 6 minutes, and a pod's ``ensure`` with it. The
    caller sets s3fs's loop to one try, so that botocore's is the only one, and a silent endpoint fails in under a
    minute. The user's retries win: in fsspec's ``config_kwargs`` (``FSSPEC_S3='{"config_kwargs": {"retries":
    ...}}'``), or botocore's (``AWS_MAX_ATTEMPTS``, ``AWS_RETRY_MODE``, ``max_attempts`` or ``retry_mode`` in the
    profile). The User-Agent also keeps the filesystem apart in fsspec's instance cache: the loop set to one try
    is never that of a filesystem the program made itself."""
    import fsspec.config

    from . import __version__

    try:
        import botocore.session
    except ImportError:  # no s3fs either: fsspec names it
        return {}
    config = dict(fsspec.config.conf.get("s3", {}).get("config_kwargs") or {})
    config["user_agent_extra"] = f"{config.get('user_agent_extra') or ''} tritonpack/{__version__}".lstrip()
    try:
        profile = botocore.session.Session().get_scoped_config()
    except Exception:  # a profile named but not found: s3fs's own call says so
        profile = {}
    if not ("retries" in config or any(os.environ.get(f"AWS_{name.upper()}") or name in profile
                                       for name in ("max_attempts", "retry_mode"))):
        config["retries"] = {"mode": "standard", "total_max_attempts": S3_ATTEMPTS}
    return {"config_kwargs": config}


def _again_in(error: Exception, attempt: int) -> float | None:
    """Seconds to wait before a range asked over HTTP is asked again after ``error`` (``attempt`` from 0), or None:
    a 429 or a 5xx a server gives while busy or restarting (a fleet's pods starting at once, a load balancer
    between two backends) after the ``Retry-After`` it names, else 0.5 s then 1 s; a connection it dropped
    likewise. Not a timeout (each is already a minute long) nor a refused connection."""
    status = getattr(error, "status", None)
    if status in _RETRIED:
        after = str((getattr(error, "headers", None) or {}).get("Retry-After", "")).strip()
        if after.isdigit():
            return float(after) if int(after) <= RETRY_AFTER_LIMIT else None
    elif type(error).__name__ not in ("ServerDisconnectedError", "ClientPayloadError"):  # aiohttp's: dropped, before
        return None  # its reply or within its body
    return 0.5 * 2 ** attempt


def _deadline(start: int | None, end: int | None):
    """A range's whole time: its reply may take a minute, and a second more every ``MIN_RATE`` bytes of it. The
    session's timeouts bound the wait between two reads, which a server that sends a byte now and then never
    reaches: it held a read, and a pod's ensure, for as long as it went on."""
    import aiohttp

    length = end - start if start is not None and end is not None and start >= 0 else TRAILER_SIZE
    return aiohttp.ClientTimeout(total=SERVER_TIMEOUT[1] + length / MIN_RATE, sock_connect=SERVER_TIMEOUT[0],
                                 sock_read=SERVER_TIMEOUT[1])


async def _cat_range(fs, url: str, start: int | None = None, end: int | None = None, **kwargs) -> bytes:
    """fsspec's HTTP ``_cat_file`` of bytes ``start`` to ``end`` (negative ``start``: the last ``-start``), its
    body read no further than the range's length: a 206 of no Content-Length (a proxy that streams it chunked)
    that never ended was read into memory until the range's deadline, at the server's rate."""
    options = {**fs.kwargs, **kwargs}
    headers = dict(options.pop("headers", None) or {})
    if start is not None and start < 0:
        headers["Range"] = f"bytes={start}"
    elif start is not None or end is not None:
        headers["Range"] = f"bytes={start or 0}-{'' if end is None else end - 1}"
    asked = _asked(headers.get("Range", ""))
    limit = None if asked is None else _asked_length(asked)
    session = await fs.set_session()
    async with session.get(fs.encode_url(url), headers=headers, **options) as response:
        fs._raise_not_found_for_status(response, url)
        if limit is None:
            return await response.read()
        body = bytearray()
        async for chunk in response.content.iter_chunked(1 << 20):
            body += chunk
            if len(body) > limit:
                raise _Refused(f"the server sent more than the {limit} bytes asked for in one reply (a body that "
                               "does not end, or not the range asked)")
        return bytes(body)


def _asked_again(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, asked up to ``HTTP_ATTEMPTS`` times where ``_again_in`` says so."""
    for attempt in range(HTTP_ATTEMPTS):
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            wait = _again_in(e, attempt) if attempt < HTTP_ATTEMPTS - 1 else None
            if wait is None:
                raise
            time.sleep(wait)


class FsspecSource:
    """An archive behind a URL, read with ``fs.cat_file(path, start=, end=)``: one range request per read and no
    shared file position, so the reader's threads may read at once. (By keyword: s3fs's third positional
    parameter is a version id, and an offset given there read the object from ``end`` to its end, at each read.)

    Over HTTP the size comes with the first read, a suffix range for the trailer (its ``Content-Range`` names
    the total), and that read is kept for the reader's trailer read: listing costs exactly three requests. Each
    reply is checked before its body is read (``_http_trace``). Where the URL redirects, later reads go where the
    redirects led while it answers (``_cat``). Elsewhere the size is one ``fs.info`` call.
    """

    def __init__(self, url: str):
        self.name = shown(url)
        scheme = scheme_of(url)
        if scheme in _HTTP and not _SCHEME.sub("", url).split("/", 1)[0]:
            raise UsageError("not a URL of an archive: it names no host", self.name)
        if scheme in _HTTP:
            import yarl

            try:
                yarl.URL(url, encoded=True).port  # noqa: B018 (read for its checks: a port out of range, not a number)
            except ValueError as e:
                raise UsageError(f"not a URL: {e}", self.name) from None
        try:
            import fsspec
        except ImportError:
            more = " huggingface_hub" if scheme == "hf" else ""  # the packages of the remote extra (and hf://'s)
            raise UsageError(f"reading archives from URLs needs fsspec: pip install fsspec aiohttp{more}",
                             self.name) from None
        self._served = _served(url)
        self._tail: tuple[int, bytes] | None = None  # (offset, bytes) of the suffix read
        self._size: int | None = None
        # an hf:// URL: the file, and the Hub's endpoint and headers (its token: sent to the Hub, never where it
        # redirects, which aiohttp drops it for, nor to the link kept, which ``_cat`` asks without it)
        self._hub: tuple[hub.HubFile, hub.HubAccess] | None = None
        self._headers: dict[str, str] = {}
        self._reading: set = set()  # the reads in flight (``_fetch``), for ``abort``
        if scheme == "hf":
            from . import hub

            file, access = hub.parse(url), hub.access(url)
            self._hub, self._headers = (file, access), access.headers
        try:
            if scheme in _HTTP or self._hub:
                origin = self._hub[0].url(self._hub[1].endpoint) if self._hub else url
                self._fs, self._path = fsspec.core.url_to_fs(wire_url(origin), encoded=True,
                                                             skip_instance_cache=True,
                                                             client_kwargs=_http_session(self._served))
            elif scheme in _S3:
                self._fs, self._path = fsspec.core.url_to_fs(url, **_s3_settings())
                self._fs.retries = 1
            else:
                self._fs, self._path = fsspec.core.url_to_fs(url)
        except ImportError as e:
            raise UsageError(f"{scheme}:// needs a package that is not installed ({' '.join(str(e).split())})",
                             self.name) from None
        except ValueError as e:
            if "Protocol not known" in str(e):
                raise UsageError(f"unknown URL scheme {scheme}://", self.name) from None
            raise UsageError(describe_failure(e), self.name) from None
        except Exception as e:  # a backend that connects as it is made (ftp://, github://) or reads a chained
            raise RemoteError(describe_failure(e), self.name) from None  # URL's container (zip://...::file://...)
        self._http = scheme in _HTTP or self._hub is not None

    def _call(self, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except TpackError:
            raise
        except Exception as e:  # the backends' own errors (aiohttp, botocore, huggingface_hub): one line
            raise self._error(e, self._served.redirected_to) from None

    def _error(self, error: Exception, where: str) -> TpackError:
        """The one-line error for a backend's failure; ``where``: the server a redirect led to, if it failed."""
        said = f": {self._served.said}" if self._served.said else ""
        if isinstance(error, FileNotFoundError):
            found = f"not found on the server it redirects to, {where}" if where else "not found on the server"
            return NotFoundError(f"no such archive ({found}{said})", self.name)
        if isinstance(error, _Refused):
            return RemoteError(str(error), self.name)
        described = f"{describe_failure(error)}{said}"
        if self._http and _is_timeout(error):
            described = (f"timed out (no answer within {SERVER_TIMEOUT[0]} s of connecting, or {SERVER_TIMEOUT[1]} s "
                         f"between two reads, or a reply slower than {MIN_RATE // 1024} KiB/s past its first minute)")
        if self._hub and getattr(error, "status", None) in (401, 403) and not self._hub[1].authorized:
            described += " (a private or gated repository needs a token: set HF_TOKEN, or run hf auth login)"
        return RemoteError(f"{described} (from {where}, where it redirects)" if where else described, self.name)

    def _origin(self) -> str:
        """The URL asked when no kept link answers: on the Hub, at the commit the first reply named."""
        if self._hub and self._served.commit:
            file, access = self._hub
            return wire_url(file.url(access.endpoint, self._served.commit))
        return self._path

    def _cat(self, **where) -> bytes:
        """A range of the archive over HTTP: from where the URL's redirects led, while that answers, else through
        the URL, whose redirects then lead anew. Hugging Face's ``resolve/main/`` and GitHub's release assets
        answer each request with a redirect to a CDN's signed link (good for minutes or hours): without this, every
        read of every pod of a fleet cost a round trip to that origin, which rate-limits by client. A link that
        answers 4xx (expired, revoked) is dropped, and the read goes through the URL again."""
        location = self._served.location
        if location:
            try:
                return _asked_again(self._fetch, location, **where)
            except TpackError:
                raise
            except Exception as e:
                if not _refused_link(e):
                    raise self._error(e, _public(location)) from None
                self._served.forget(location)
        return self._call(_asked_again, self._fetch, self._origin(), headers=self._headers, **where)

    def _fetch(self, url: str, **where) -> bytes:
        """``fs.cat_file`` with the range's deadline (``_deadline``) given to aiohttp: fsspec's synchronous call
        takes a ``timeout`` of its own, which leaves the request running past it."""
        import asyncio

        deadline = _deadline(where.get("start"), where.get("end"))
        future = asyncio.run_coroutine_threadsafe(_cat_range(self._fs, url, timeout=deadline, **where), self._fs.loop)
        self._reading.add(future)
        try:
            return future.result()
        finally:
            self._reading.discard(future)

    def abort(self) -> None:
        """Cancel the reads in flight (the reader's threads'): an interrupted unpack waited for each, up to its
        deadline, before it could end."""
        for future in list(self._reading):
            future.cancel()

    def size(self) -> int:
        if self._size is None:
            if self._http:
                tail = self._cat(start=-TRAILER_SIZE)
                size = self._served.size
                if size is None:  # no total in its Content-Range (``bytes 0-63/*``): ask for the size
                    size = self._call(self._fs.info, self._origin(), headers=self._headers).get("size")
                self._tail = (size - len(tail), tail)
                self._size = size
            else:
                self._size = self._stored_size()
            if self._size is None:
                raise RemoteError("the server does not say how large the archive is", self.name)
        return self._size

    def _stored_size(self) -> int | None:
        """The size ``fs.info`` gives, checked within ``same_archives`` against the first opening's, with the
        validator it names (S3's ``ETag``, a Hugging Face file's blob id) where it names one."""
        info = self._call(self._fs.info, self._path)
        validator = next((str(info[k]) for k in ("ETag", "etag", "blob_id") if info.get(k)), None)
        size = info.get("size")
        try:
            self._served.same_archive(size, {"ETag": validator} if validator else {})
        except _Refused as e:
            raise RemoteError(str(e), self.name) from None
        return size

    def read_at(self, offset: int, length: int) -> bytes:
        size = self.size()
        end = min(offset + length, size)
        if end <= offset:
            return b""
        if self._tail is not None:
            start, tail = self._tail
            if start <= offset and end <= start + len(tail):
                return tail[offset - start:end - start]
        data = self._cat(start=offset, end=end) if self._http else \
            self._call(self._fs.cat_file, self._path, start=offset, end=end)
        if len(data) > end - offset:
            raise RemoteError("the server does not support range requests (it sent more than the range asked)",
                              self.name)
        if len(data) < end - offset:  # a body cut short: the server's fault, not the archive's
            raise RemoteError(f"the server sent {len(data)} bytes where {end - offset} were asked (from byte "
                              f"{offset}): try again", self.name)
        return data

    def close(self) -> None:
        self._fs = None
        self._tail = None
