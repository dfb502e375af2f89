"""Real servers for the tests (Debian's nginx, docker-registry, redis-server), each started on 127.0.0.1 on a free
port with its files in a temp dir, and stopped at teardown, and the token server that docker-registry's token
authentication points at. Absent binaries skip the tests with the reason, except under CI, which installs them
(.ci/run) and must not pass by skipping."""
from __future__ import annotations

import base64
import contextlib
import http.server
import json
import os
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
  log_format requests '$request_method $uri $status $body_bytes_sent "$http_range"';
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
  }}
}}
"""


class Nginx:
    """nginx serving ``www`` (with range support; ``/no-ranges/`` without), logging every request."""

    def __init__(self, directory: Path, port: int):
        self.dir = directory
        self.www = directory / "www"
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self._mark: str | None = None  # the request that reset_log sent last: the log starts after it

    def requests(self) -> list[tuple[str, str, int, int, str]]:
        """(method, path, status, body bytes sent, Range header) per request since ``reset_log``, in order."""
        rows = []
        for line in self._lines():
            method, path, status, sent, rng = line.split(" ", 4)
            rows.append((method, path, int(status), int(sent), rng.strip('"')))
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
    port = free_port()
    (directory / "www").mkdir(parents=True)
    conf = directory / "nginx.conf"
    conf.write_text(NGINX_CONF.format(d=directory, port=port))
    # one process, no privilege drop: it reads pytest's private temp dirs even when the tests run as root
    with running([exe, "-p", str(directory), "-c", str(conf), "-e", str(directory / "error.log")], port,
                 directory / "stdout.log"):
        server = Nginx(directory, port)
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

    class Handler(http.server.BaseHTTPRequestHandler):
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

        def log_message(self, *args) -> None:
            pass

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

    class Handler(http.server.BaseHTTPRequestHandler):
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

        def log_message(self, *args) -> None:
            pass

    with serving(Handler) as port:
        yield f"127.0.0.1:{port}", seen


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
