"""Real servers for the tests (Debian's nginx, docker-registry, redis-server), each started on 127.0.0.1 on a free
port with its files in a temp dir, and stopped at teardown, and the token server that docker-registry's token
authentication points at. Absent binaries skip the tests with the reason, except under CI, which installs them
(.ci/run) and must not pass by skipping."""
from __future__ import annotations

import base64
import contextlib
import http.server
import itertools
import json
import os
import re
import shutil
import socket
import subprocess
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

PACKAGES = {"nginx": "nginx", "docker-registry": "docker-registry", "redis-server": "redis-server",
            "openssl": "openssl"}


def binary(name: str) -> str:
    """The server binary's path; skip (fail under CI) when it is not installed."""
    path = shutil.which(name) or next((p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)),
                                      None)
    if path is None:
        reason = f"{name} is not installed (apt-get install {PACKAGES[name]}); .ci/run installs it"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    return path


def asked_span(range_header: str | None, size: int) -> tuple[int, int] | None:
    """The ``(start, end)`` of a file of ``size`` bytes that ``Range: bytes=a-b``, ``bytes=a-`` or ``bytes=-n`` asks
    for, as the servers below answer it; None for no range."""
    match = re.fullmatch(r"bytes=(\d*)-(\d*)", range_header or "")
    if not match or not any(match.groups()):
        return None
    first, last = match.groups()
    start = size - int(last) if not first else int(first)
    end = size if not first or not last else min(int(last) + 1, size)
    return start, end


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running(argv: list[str], port: int, log: Path, timeout: float = 20.0) -> Iterator[subprocess.Popen]:
    """Start a server, wait until it accepts connections on 127.0.0.1:port, stop it at the end."""
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{argv[0]} exited with {proc.returncode}: {log.read_text()[-2000:]}")
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.5):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"{argv[0]} did not listen on 127.0.0.1:{port}: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


NGINX_CONF = """\
daemon off;
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log;
events {{ worker_connections 64; }}
http {{
  log_format requests '$request_method $uri $status $body_bytes_sent "$http_range" $server_port';
  access_log {d}/access.log requests;
  client_body_temp_path {d}/tmp-body;
  proxy_temp_path {d}/tmp-proxy;
  fastcgi_temp_path {d}/tmp-fastcgi;
  uwsgi_temp_path {d}/tmp-uwsgi;
  scgi_temp_path {d}/tmp-scgi;
  default_type application/octet-stream;
  server {{
    listen 127.0.0.1:{port};
    root {d}/www;
    location /no-ranges/ {{ alias {d}/www/; max_ranges 0; }}
    # compresses what it may (a 200, never a 206: a request with Range gets the whole file, gzipped, chunked)
    location /gzip/ {{ alias {d}/www/; gzip on; gzip_types *; gzip_min_length 0; }}
    location /no-etag/ {{ alias {d}/www/; etag off; }}  # Last-Modified only
    # redirects, as archive hosts answer: to another host (port), Hugging Face's resolve/main/ and GitHub's
    # release assets (302 to a CDN with a signed query), 301/307/308, a relative Location, two in a row, a loop
    location ~ ^/302/(.*)$ {{ return 302 http://127.0.0.1:{cdn_port}/$1$is_args$args; }}
    location ~ ^/301/(.*)$ {{ return 301 http://127.0.0.1:{cdn_port}/$1$is_args$args; }}
    location ~ ^/307/(.*)$ {{ return 307 http://127.0.0.1:{cdn_port}/$1$is_args$args; }}
    location ~ ^/308/(.*)$ {{ return 308 http://127.0.0.1:{cdn_port}/$1$is_args$args; }}
    location ~ ^/relative/(.*)$ {{ absolute_redirect off; return 302 /$1; }}
    location ~ ^/twice/(.*)$ {{ absolute_redirect off; return 302 /302/$1$is_args$args; }}
    location ~ ^/loop/(.*)$ {{ absolute_redirect off; return 302 /loop/$1; }}
    location ~ ^/resolve/main/(.*)$ {{ return 302 http://127.0.0.1:{cdn_port}/signed/$1?{signed}; }}
  }}
  server {{
    listen 127.0.0.1:{cdn_port};
    root {d}/www;
    # a signed URL's query is passed on as it was given, byte for byte, or refused
    location /signed/ {{ alias {d}/www/; if ($args != "{signed}") {{ return 403; }} }}
  }}
}}
"""
# A signed query as S3, GitHub's and Hugging Face's CDNs give them: percent-encoded '/', '+', '=' that a client
# must send as they are written.
SIGNED_QUERY = ("X-Amz-Algorithm=AWS4-HMAC-SHA256&X-Amz-Credential=AKIAEXAMPLE%2F20260101%2Fus-east-1%2Fs3%2F"
                "aws4_request&X-Amz-Signature=ab%2Bcd%2Fef%3D&response-content-disposition=attachment%3B%20"
                "filename%3Dk.tpack")


class Nginx:
    """nginx serving ``www`` (with range support; ``/no-ranges/`` without; the other locations of ``NGINX_CONF``
    redirect, compress or send no ETag), logging every request."""

    def __init__(self, directory: Path, port: int, cdn_port: int):
        self.dir = directory
        self.www = directory / "www"
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.cdn_port = cdn_port  # the second server, the "CDN" that redirects lead to (another host: port)
        self._mark: str | None = None  # the request that reset_log sent last: the log starts after it

    def requests(self) -> list[tuple[str, str, int, int, str]]:
        """(method, path, status, body bytes sent, Range header) per request since ``reset_log``, in order."""
        return [row for _, row in self.requests_by_port()]

    def requests_by_port(self) -> list[tuple[int, tuple[str, str, int, int, str]]]:
        """``requests``, each with the port it was sent to: ``port``, or ``cdn_port`` for the second server."""
        rows = []
        for line in self._lines():
            fields, _, port = line.rpartition(" ")
            method, path, status, sent, rng = fields.split(" ", 4)
            rows.append((int(port), (method, path, int(status), int(sent), rng.strip('"'))))
        return rows

    def _lines(self) -> list[str]:
        lines = (self.dir / "access.log").read_text().splitlines()
        if self._mark is None:
            return lines
        return lines[next(i for i, line in enumerate(lines) if f" {self._mark} " in line) + 1:]

    def reset_log(self) -> None:
        """Forget the requests so far. nginx logs a request once it has sent the answer, a moment after its client
        may have read it, so truncating the log could miss a line still to come: a marker request, which its one
        worker logs after every request before it, says where the log starts again."""
        import urllib.error
        import urllib.request

        self._mark = f"/mark-{uuid.uuid4().hex}"
        with contextlib.suppress(urllib.error.HTTPError):  # 404: the marker names no file
            urllib.request.urlopen(self.url + self._mark, timeout=10).close()
        deadline = time.monotonic() + 10
        while not any(f" {self._mark} " in line for line in (self.dir / "access.log").read_text().splitlines()):
            assert time.monotonic() < deadline, "nginx never logged the marker request"
            time.sleep(0.01)


@contextlib.contextmanager
def nginx(directory: Path) -> Iterator[Nginx]:
    exe = binary("nginx")
    port = cdn_port = free_port()
    while cdn_port == port:
        cdn_port = free_port()
    (directory / "www").mkdir(parents=True)
    conf = directory / "nginx.conf"
    conf.write_text(NGINX_CONF.format(d=directory, port=port, cdn_port=cdn_port, signed=SIGNED_QUERY))
    # one process, no privilege drop: it reads pytest's private temp dirs even when the tests run as root
    with running([exe, "-p", str(directory), "-c", str(conf), "-e", str(directory / "error.log")], port,
                 directory / "stdout.log"):
        server = Nginx(directory, port, cdn_port)
        server.reset_log()
        yield server


REGISTRY_CONF = """\
version: 0.1
log:
  level: error
storage:
  filesystem:
    rootdirectory: {d}/data
http:
  addr: 127.0.0.1:{port}
  secret: tritonpack-tests
"""
# USER PASSWORD and the bcrypt hash of the password (cost 4, as crypt.crypt made it), which htpasswd asks for
HTPASSWD_USER = ("alice", "s3cret", "$2b$04$Iy7bWgn.TK8QRvNeeTBIyeoGXeUe0FrX7LOLMUztsd5tYfDPjEoQO")
HTPASSWD_AUTH = """\
auth:
  htpasswd:
    realm: tritonpack-tests
    path: {d}/htpasswd
"""
TOKEN_AUTH = """\
auth:
  token:
    realm: {realm}
    service: {service}
    issuer: {issuer}
    rootcertbundle: {cert}
"""


@contextlib.contextmanager
def registry(directory: Path, auth: str = "") -> Iterator[str]:
    """Debian's docker-registry (distribution 2.x) with filesystem storage, and the ``auth:`` section given (none:
    open to all); yields ``host:port``."""
    exe = binary("docker-registry")
    port = free_port()
    directory.mkdir(parents=True, exist_ok=True)
    conf = directory / "config.yml"
    conf.write_text(REGISTRY_CONF.format(d=directory, port=port) + auth)
    with running([exe, "serve", str(conf)], port, directory / "registry.log"):
        yield f"127.0.0.1:{port}"


@contextlib.contextmanager
def htpasswd_registry(directory: Path) -> Iterator[str]:
    """docker-registry asking for Basic credentials (htpasswd: ``HTPASSWD_USER``), in plain HTTP, which it allows."""
    directory.mkdir(parents=True, exist_ok=True)
    user, _, hashed = HTPASSWD_USER
    (directory / "htpasswd").write_text(f"{user}:{hashed}\n")
    with registry(directory, HTPASSWD_AUTH.format(d=directory)) as address:
        yield address



class QuietHandler(http.server.BaseHTTPRequestHandler):
    """A handler that logs nothing: the tests' output stays theirs."""

    def log_message(self, *args) -> None:
        pass


@contextlib.contextmanager
def serving(handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[int]:
    """A threaded HTTP server on 127.0.0.1 answering with ``handler``; yields its port."""

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = False  # closing waits for every answer: none is left to fail in a later test's output

        def handle_error(self, request, client_address) -> None:
            pass  # a client that gave up (a timeout) before its answer was written

    server = Server(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@dataclass
class TokenServer:
    """A distribution token server (the protocol of docker's ``auth/token``) for docker-registry's ``auth: token``:
    ``GET`` with Basic credentials, or an OAuth2 ``POST`` with an identity token as refresh token, gets a JWT
    (RS256, signed by ``openssl dgst``, its certificate in ``x5c``) granting every action asked for in
    ``scope``; no credentials get a token granting none; wrong ones a 401. ``requests`` records ``(method, user
    or None, scope)`` per request."""

    directory: Path
    users: dict[str, str]  # user -> password
    identity_tokens: dict[str, str]  # token -> user
    realm: str = ""
    service: str = "tritonpack-tests"
    issuer: str = "tritonpack-token-server"
    requests: list[tuple[str, str | None, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.openssl = binary("openssl")
        self.key, self.cert = self.directory / "token.key", self.directory / "token.crt"
        subprocess.run([self.openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj",
                        "/CN=tritonpack-token-server", "-keyout", str(self.key), "-out", str(self.cert)],
                       check=True, capture_output=True)
        self.x5c = "".join(line for line in self.cert.read_text().splitlines() if not line.startswith("-----"))

    @property
    def auth(self) -> str:
        """docker-registry's ``auth:`` section for this server."""
        return TOKEN_AUTH.format(realm=self.realm, service=self.service, issuer=self.issuer, cert=self.cert)

    def user(self, method: str, headers, form: dict[str, str]) -> str | None:
        """Whose request this is; None: anonymous; raises ``PermissionError`` for wrong credentials."""
        if method == "POST":
            if form.get("grant_type") != "refresh_token" or form.get("refresh_token") not in self.identity_tokens:
                raise PermissionError
            return self.identity_tokens[form["refresh_token"]]
        scheme, _, value = (headers.get("Authorization") or "").partition(" ")
        if not value:
            return None
        user, _, password = base64.b64decode(value).decode().partition(":")
        if scheme != "Basic" or self.users.get(user) != password:
            raise PermissionError
        return user

    def token(self, user: str | None, scopes: list[str]) -> str:
        access = []
        for scope in scopes:
            kind, name_actions = scope.split(":", 1)
            name, _, actions = name_actions.rpartition(":")
            access.append({"type": kind, "name": name, "actions": actions.split(",") if user else []})
        now = int(time.time())
        claims = {"iss": self.issuer, "sub": user or "", "aud": self.service, "exp": now + 300, "nbf": now - 10,
                  "iat": now, "jti": uuid.uuid4().hex, "access": access}
        header = {"typ": "JWT", "alg": "RS256", "x5c": [self.x5c]}
        signed = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        signature = subprocess.run([self.openssl, "dgst", "-sha256", "-sign", str(self.key)], input=signed.encode(),
                                   check=True, capture_output=True).stdout
        return f"{signed}.{_b64url(signature)}"


@contextlib.contextmanager
def token_server(directory: Path, users: dict[str, str], identity_tokens: dict[str, str] | None = None,
                 ) -> Iterator[TokenServer]:
    """A ``TokenServer`` on 127.0.0.1; its ``realm`` is set once it listens."""
    directory.mkdir(parents=True, exist_ok=True)
    tokens = TokenServer(directory, users, identity_tokens or {})

    class Handler(QuietHandler):
        def answer(self) -> None:
            url = urllib.parse.urlsplit(self.path)
            query = urllib.parse.parse_qs(url.query)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0)).decode()
            form = dict(urllib.parse.parse_qsl(body))
            scopes = query.get("scope", []) + form.get("scope", "").split()
            try:
                user = tokens.user(self.command, self.headers, form)
            except PermissionError:
                tokens.requests.append((self.command, "refused", " ".join(scopes)))
                self.reply(401, {"errors": [{"code": "UNAUTHORIZED", "message": "bad credentials"}]})
                return
            tokens.requests.append((self.command, user, " ".join(scopes)))
            token = tokens.token(user, scopes)
            self.reply(200, {"token": token, "access_token": token, "expires_in": 300} if self.command == "GET"
                       else {"access_token": token, "expires_in": 300})

        def reply(self, status: int, answer: dict) -> None:
            body = json.dumps(answer).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = answer

    with serving(Handler) as port:
        tokens.realm = f"http://127.0.0.1:{port}/token"
        yield tokens


@contextlib.contextmanager
def http_registry(answer: Callable[[str, str, int], tuple],
                  received: list[tuple[str, str, bytes]] | None = None) -> Iterator[tuple[str, list[str]]]:
    """A stand-in registry on 127.0.0.1 that answers ``answer(method, path, times_seen)``: a status, a body and
    optionally headers; yields its address and the requests it got (``METHOD PATH``), and adds to ``received``
    each request's ``(METHOD PATH, Authorization, body)``, when one is given."""
    seen: list[str] = []

    class Handler(QuietHandler):
        def handle_one(self) -> None:
            request = f"{self.command} {self.path}"
            seen.append(request)
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            if received is not None:
                received.append((request, self.headers.get("Authorization") or "", body))
            status, answer_body, *headers = answer(self.command, self.path, seen.count(request))
            self.send_response(status)
            for name, value in (headers[0] if headers else {}).items():
                self.send_header(name, value)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(answer_body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(answer_body)

        do_GET = do_HEAD = do_PUT = do_POST = do_PATCH = handle_one

    with serving(Handler) as port:
        yield f"127.0.0.1:{port}", seen


FILE_SERVER_MODES = {
    "chunked": "ignores Range: 200 with the whole file, chunked, no Content-Length",
    "chunked-ranges": "206 for each range asked, chunked, no Content-Length (a proxy that streams)",
    "gzip-ranges": "206 for each range asked, gzipped (Content-Encoding: gzip) whatever Accept-Encoding says",
    "wrong-range": "206 with the file's first bytes, whatever range was asked",
    "unsaid-total": "206 for each range asked, its total unsaid (Content-Range: bytes 0-63/*); HEAD says the size",
    "long-body": "206 with the Content-Range asked, and a body 64 MB longer (a server that sends whole files)",
    "short-body": "206 with the Content-Range asked, and a body of half of it",
    "dropped-once": "206 as asked, but the first reply of each range ends halfway, its connection closed",
    "silent-blocks": "206 for the trailer, header and index (the first three requests); then silent until closed",
    "endless-ranges": "206 with the Content-Range asked, chunked, and a body that never ends (64 KiB chunks)",
}


@contextlib.contextmanager
def file_server(path: Path, mode: str) -> Iterator[str]:
    """A server on 127.0.0.1 that serves the file at ``path`` under any name, misbehaving as servers and proxies
    found in the wild do (``FILE_SERVER_MODES``); yields its URL."""
    import gzip

    dropped: dict[tuple[int, int], int] = {}  # "dropped-once": the ranges whose first reply was cut
    asked = itertools.count()  # "silent-blocks": the requests so far
    closing = threading.Event()  # "silent-blocks": the silent answers end as the server closes

    class Handler(QuietHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            data = path.read_bytes()
            span = asked_span(self.headers.get("Range"), len(data))
            if mode == "chunked" or span is None:
                return self.answer(200, data, chunked=True)
            start, end = span
            if mode == "silent-blocks" and next(asked) >= 3:
                closing.wait(120)
                self.close_connection = True
                return
            if mode == "wrong-range":
                start, end = 0, end - start
            headers = {"Content-Range": f"bytes {start}-{end - 1}/{'*' if mode == 'unsaid-total' else len(data)}"}
            body = data[start:end]
            if mode == "long-body":
                body += bytes(64 << 20)
            elif mode == "short-body":
                body = body[:len(body) // 2]
            elif mode == "dropped-once" and dropped.setdefault(span, 0) == 0:
                dropped[span] = 1
                self.send_response(206)
                self.send_header("Content-Range", headers["Content-Range"])
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body[:len(body) // 2])
                self.close_connection = True
                return
            if mode == "endless-ranges":
                return self.endless(headers)
            if mode == "gzip-ranges":
                body, headers["Content-Encoding"] = gzip.compress(body), "gzip"
            self.answer(206, body, chunked=mode == "chunked-ranges", headers=headers)

        def do_HEAD(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", str(path.stat().st_size))
            self.end_headers()

        def endless(self, headers: dict[str, str]) -> None:
            self.send_response(206)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            chunk = b"%x\r\n%s\r\n" % (1 << 16, bytes(1 << 16))
            try:
                while not closing.is_set():
                    self.wfile.write(chunk)
            except (BrokenPipeError, ConnectionResetError):
                pass
            self.close_connection = True

        def answer(self, status: int, body: bytes, chunked: bool, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Transfer-Encoding" if chunked else "Content-Length", "chunked" if chunked else
                             str(len(body)))
            self.end_headers()
            try:
                if not chunked:
                    self.wfile.write(body)
                    return
                for at in range(0, len(body), 1 << 16):
                    chunk = body[at:at + (1 << 16)]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                self.wfile.write(b"0\r\n\r\n")
            except (BrokenPipeError, ConnectionResetError):
                self.close_connection = True  # the client refused the answer as soon as its headers came

    with serving(Handler) as port:
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            closing.set()  # before the server waits for its answers


@dataclass
class SignedLinks:
    """``signed_links``: its URL, and what its two servers were asked, in order: ``("origin", path)`` for each
    redirect, ``("cdn", link, status)`` for each range asked of the CDN (``link``: the link's number)."""

    url: str
    asked: list[tuple] = field(default_factory=list)


@contextlib.contextmanager
def signed_links(path: Path, uses: int, failure: int = 403) -> Iterator[SignedLinks]:
    """An origin that answers each request with a redirect to a new signed link on a CDN (another port), as Hugging
    Face's ``resolve/main/`` and GitHub's release assets do, and a CDN that serves the file at ``path`` by ranges
    through each link ``uses`` times, then answers ``failure`` (403: the signature expired; 500: the CDN fails)."""

    # Each answer closes its connection: the client's pool holds an idle one 15 s, and the servers' shutdown waits
    served: dict[int, int] = {}  # link -> ranges served through it
    made = iter(range(1, 1 << 30))
    links = SignedLinks("")
    lock = threading.Lock()

    class Cdn(QuietHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            link = int(urllib.parse.parse_qs(urllib.parse.urlsplit(self.path).query)["Signature"][0])
            with lock:
                fresh = served.get(link, 0) < uses
                served[link] = served.get(link, 0) + fresh
            data = path.read_bytes()
            span = asked_span(self.headers.get("Range"), len(data))
            status = 206 if fresh and span else failure
            links.asked.append(("cdn", link, status))
            self.close_connection = True
            if status != 206:
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.send_header("Connection", "close")
                self.end_headers()
                return
            start, end = span
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
            self.send_header("ETag", '"one-archive"')
            self.send_header("Content-Length", str(end - start))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data[start:end])

    with serving(Cdn) as cdn_port:
        class Origin(QuietHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                with lock:
                    link = next(made)
                links.asked.append(("origin", self.path))
                self.send_response(302)
                self.send_header("Location", f"http://127.0.0.1:{cdn_port}/k.tpack?Expires=1&Signature={link}")
                self.send_header("Content-Length", "0")
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True

        with serving(Origin) as port:
            links.url = f"http://127.0.0.1:{port}/resolve/main/k.tpack"
            yield links


@contextlib.contextmanager
def redis_server(directory: Path) -> Iterator[int]:
    """redis-server without persistence; yields its port."""
    exe = binary("redis-server")
    port = free_port()
    directory.mkdir(parents=True, exist_ok=True)
    argv = [exe, "--bind", "127.0.0.1", "--port", str(port), "--dir", str(directory), "--save", "",
            "--appendonly", "no", "--protected-mode", "yes", "--daemonize", "no"]
    with running(argv, port, directory / "redis.log"):
        yield port


@dataclass
class Hub:
    """``hugging_face_hub``: its endpoint (``HF_ENDPOINT``), what its two servers were asked, in order
    (``(server, method, path, Range, Authorization)``, server ``"hub"`` or ``"cdn"``), and its repositories'
    branches and commits, which ``commit`` adds to (as a push does)."""

    endpoint: str
    token: str
    asked: list[tuple] = field(default_factory=list)
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)  # commit -> {path: bytes}
    refs: dict[tuple[str, str], str] = field(default_factory=dict)  # (repo, branch or tag) -> commit
    private: set[str] = field(default_factory=set)  # repos that answer only to the token
    messages: dict[str, tuple[str, str]] = field(default_factory=dict)  # commit -> (summary, description) pushed
    link_uses: int = 0  # ranges the CDN serves through one signed link before it answers 403 (0: no end)

    def commit(self, repo: str, files: dict[str, bytes], ref: str = "main") -> str:
        """Push ``files`` (path -> bytes, added to the ref's last commit's) to ``repo``'s ``ref``; its commit."""
        import hashlib

        before = self.commits.get(self.refs.get((repo, ref), ""), {})
        sha = hashlib.sha1(f"{repo} {ref} {len(self.commits)}".encode()).hexdigest()
        self.commits[sha] = {**before, **files}
        self.refs[repo, ref] = sha
        return sha

    def by(self, server: str) -> list[tuple]:
        return [a for a in self.asked if a[0] == server]


@contextlib.contextmanager
def hugging_face_hub() -> Iterator[Hub]:
    """A Hugging Face Hub as ``huggingface_hub`` and the ``resolve`` URLs meet it: ``/{[datasets/|spaces/]}
    {repo}/resolve/{revision}/{path}`` answers 302 to a CDN with a new signed link, naming the commit
    (``X-Repo-Commit``) and the file (``X-Linked-Etag``, ``X-Linked-Size``), as the Hub does for LFS and Xet files;
    a revision is a branch, a tag or a commit; ``/buckets/{id}/resolve/{path}`` answers 302 with no commit. A private
    repository answers 401 ``RepoNotFound`` without the token (as the Hub does, not to say whether it exists), and
    each error says why in ``X-Error-Code`` and ``X-Error-Message``. The CDN serves a file by its sha256, by
    ranges, with that as its ``ETag``. Beside ``resolve``, the API routes ``HfFileSystem`` reads a file by (a
    revision's commit, a folder's files) and those ``upload_file`` commits one by (preupload, commit)."""
    import hashlib

    lock = threading.Lock()
    blobs: dict[str, bytes] = {}
    served: dict[str, int] = {}  # signed link -> ranges asked through it
    hub = Hub("", token="hf_" + uuid.uuid4().hex)
    links = iter(range(1, 1 << 30))

    def answer(handler, status: int, headers: dict[str, str], body: bytes = b"") -> None:
        handler.send_response(status)
        for name, value in {**headers, "Content-Length": str(len(body)), "Connection": "close"}.items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.close_connection = True
        if handler.command != "HEAD":
            handler.wfile.write(body)

    class Cdn(QuietHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            hub.asked.append(("cdn", self.command, self.path, self.headers.get("Range"),
                              self.headers.get("Authorization")))
            where = urllib.parse.urlsplit(self.path)
            data = blobs.get(where.path.strip("/"))
            if data is None:
                return answer(self, 404, {})
            with lock:
                link = where.query
                served[link] = served.get(link, 0) + 1
                if hub.link_uses and served[link] > hub.link_uses:
                    return answer(self, 403, {})  # the signature expired
            etag = {"ETag": f'"{hashlib.sha256(data).hexdigest()}"', "Accept-Ranges": "bytes"}
            span = asked_span(self.headers.get("Range"), len(data))
            if span is None:
                return answer(self, 200, etag, data)
            start, end = span
            answer(self, 206, {**etag, "Content-Range": f"bytes {start}-{end - 1}/{len(data)}"}, data[start:end])

        do_HEAD = do_GET

    with serving(Cdn) as cdn_port:
        class Origin(QuietHandler):
            protocol_version = "HTTP/1.1"

            def refuse(self, status: int, code: str, message: str) -> None:
                answer(self, status, {"X-Error-Code": code, "X-Error-Message": message})

            def do_GET(self) -> None:
                auth = self.headers.get("Authorization")
                hub.asked.append(("hub", self.command, self.path, self.headers.get("Range"), auth))
                path = urllib.parse.urlsplit(self.path).path  # quoted: a revision's slash is %2F
                api = re.fullmatch(r"/api/(models|datasets|spaces)/([^/]+/[^/]+)(?:/(revision|tree)/([^/]+)(/.*)?)?",
                                   path)
                if api:
                    return self.api(*api.groups())
                bucket = re.fullmatch(r"/buckets/([^/]+/[^/]+)/resolve/(.+)", path)
                repo = re.fullmatch(r"/((?:datasets/|spaces/|kernels/)?[^/]+/[^/]+)/resolve/"
                                    r"(refs/pr/\d+|[^/]+)/(.+)", path)
                match = bucket or repo
                if not match:
                    return self.refuse(404, "RepoNotFound", "Repository not found")
                name = urllib.parse.unquote(match.group(1))
                if auth and auth != f"Bearer {hub.token}":
                    return self.refuse(401, "", "Invalid credentials in Authorization header")
                if name in hub.private and not auth:
                    return self.refuse(401, "RepoNotFound", "Repository not found")
                revision, file = ("main", match.group(2)) if bucket else (match.group(2), match.group(3))
                revision, file = urllib.parse.unquote(revision), urllib.parse.unquote(file)
                with lock:
                    commit = hub.refs.get((name, revision), revision if revision in hub.commits else None)
                    if commit is None:
                        return self.refuse(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                    data = hub.commits[commit].get(file)
                    link = next(links)
                if data is None:
                    return self.refuse(404, "EntryNotFound", "Entry not found")
                digest = hashlib.sha256(data).hexdigest()
                blobs[digest] = data
                headers = {"Location": f"http://127.0.0.1:{cdn_port}/{digest}?Expires=1&Signature={link}",
                           "ETag": f'"{digest}"', "X-Linked-Etag": f'"{digest}"', "X-Linked-Size": str(len(data))}
                answer(self, 302, headers if bucket else {**headers, "X-Repo-Commit": commit})

            def do_POST(self) -> None:
                """The two routes ``huggingface_hub``'s ``upload_file`` takes for a file the Hub keeps in git
                (``uploadMode: regular``): which files to send and how, then the commit, as NDJSON lines."""
                import base64

                auth = self.headers.get("Authorization")
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                hub.asked.append(("hub", self.command, self.path, None, auth))
                route = re.fullmatch(r"/api/(models|datasets|spaces|kernels)/([^/]+/[^/]+)/(preupload|commit)/([^/?]+)",
                                     urllib.parse.urlsplit(self.path).path)
                if not route:
                    return self.refuse(404, "RepoNotFound", "Repository not found")
                kind, repo, action, revision = route.groups()
                name, revision = repo if kind == "models" else f"{kind}/{repo}", urllib.parse.unquote(revision)
                if auth != f"Bearer {hub.token}":
                    return self.refuse(401, "RepoNotFound", "Invalid credentials in Authorization header")
                if not any(n == name for n, _ in hub.refs):
                    return self.refuse(404, "RepoNotFound", "Repository not found")
                files = hub.commits.get(hub.refs.get((name, revision), ""), {})
                if action == "preupload":
                    asked = json.loads(body)["files"]
                    out = [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False,
                            "oid": hashlib.sha1(b"blob %d\0" % len(files[f["path"]]) + files[f["path"]]).hexdigest()
                            if f["path"] in files else None} for f in asked]
                    return answer(self, 200, {"Content-Type": "application/json"}, json.dumps({"files": out}).encode())
                lines = [json.loads(line) for line in body.splitlines() if line.strip()]
                header = next(line["value"] for line in lines if line["key"] == "header")
                added = {line["value"]["path"]: base64.b64decode(line["value"]["content"])
                         for line in lines if line["key"] == "file"}
                with lock:
                    commit = hub.commit(name, added, ref=revision)
                hub.messages[commit] = (header["summary"], header.get("description", ""))
                answer(self, 200, {"Content-Type": "application/json"}, json.dumps(
                    {"commitUrl": f"{hub.endpoint}/{repo}/commit/{commit}", "commitOid": commit,
                     "pullRequestUrl": None}).encode())

            def api(self, kind: str, repo: str, route: str | None, revision: str | None, folder: str | None) -> None:
                """The two routes of the Hub's API that fsspec's ``HfFileSystem`` reads a file by (the
                benchmark's baseline, ``bench/hub_reads.py``): a repository's commit at a revision, and a
                folder's files."""
                name = repo if kind == "models" else f"{kind}/{repo}"
                revision = urllib.parse.unquote(revision or "main")
                if not any(n == name for n, _ in hub.refs):
                    return self.refuse(404, "RepoNotFound", "Repository not found")
                commit = hub.refs.get((name, revision), revision if revision in hub.commits else None)
                if commit is None:
                    return self.refuse(404, "RevisionNotFound", f"Invalid rev id: {revision}")
                files = hub.commits[commit]
                if route == "tree":
                    folder = urllib.parse.unquote(folder or "/").strip("/")
                    body = [{"type": "file", "path": path, "size": len(data), "oid": hashlib.sha1(data).hexdigest()}
                            for path, data in files.items() if path.rpartition("/")[0] == folder]
                else:
                    body = {"id": repo, "sha": commit, "private": name in hub.private, "downloads": 0, "likes": 0,
                            "tags": [], "siblings": [{"rfilename": path} for path in files]}
                answer(self, 200, {"Content-Type": "application/json"}, json.dumps(body).encode())

            do_HEAD = do_GET

        with serving(Origin) as port:
            hub.endpoint = f"http://127.0.0.1:{port}"
            yield hub


@dataclass
class Proxy:
    """``forward_proxy``: its URL, and the absolute URL of each request sent through it, in order."""

    url: str
    asked: list[str] = field(default_factory=list)


@contextlib.contextmanager
def forward_proxy() -> Iterator[Proxy]:
    """An HTTP forward proxy, as a network whose only way out is a proxy has: each request (its line holds the
    absolute URL) is sent on to its server with its headers (``Range`` and all), and the answer comes back as it
    came, redirects not followed."""
    import http.client

    proxy = Proxy("")

    class Handler(QuietHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            proxy.asked.append(self.path)
            target = urllib.parse.urlsplit(self.path)
            hop = ("connection", "proxy-connection", "keep-alive", "transfer-encoding", "content-length")
            connection = http.client.HTTPConnection(target.hostname, target.port or 80, timeout=30)
            try:
                connection.request(self.command, target.path + (f"?{target.query}" if target.query else ""),
                                   headers={k: v for k, v in self.headers.items() if k.lower() not in hop})
                answer = connection.getresponse()
                body = answer.read()
            finally:
                connection.close()
            self.send_response(answer.status)
            for name, value in answer.getheaders():
                if name.lower() not in (*hop, "server", "date"):
                    self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.close_connection = True
            if self.command != "HEAD":
                self.wfile.write(body)

        do_HEAD = do_GET

    with serving(Handler) as port:
        proxy.url = f"http://127.0.0.1:{port}"
        yield proxy


@contextlib.contextmanager
def busy_server(path: Path, answers: list[tuple[int, dict[str, str]]]) -> Iterator[tuple[str, list[int]]]:
    """A server busy at first, as one restarting or rate-limiting a fleet's pods is: it gives ``answers`` (a status
    and headers, with no body), one a request, then serves the file at ``path`` by ranges. Yields its URL and the
    status of each answer it gave, in order; a status of 0 in ``answers`` closes the connection unanswered."""

    given: list[int] = []
    pending = list(answers)
    lock = threading.Lock()

    class Handler(QuietHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            with lock:
                status, headers = pending.pop(0) if pending else (206, {})
                given.append(status)
            self.close_connection = True
            if status == 0:
                return
            data = path.read_bytes()
            body = b""
            if status == 206:
                start, end = asked_span(self.headers["Range"], len(data))
                headers, body = {"Content-Range": f"bytes {start}-{end - 1}/{len(data)}"}, data[start:end]
            self.send_response(status)
            for name, value in {**headers, "Content-Length": str(len(body)), "Connection": "close"}.items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)

    with serving(Handler) as port:
        yield f"http://127.0.0.1:{port}/k.tpack", given
