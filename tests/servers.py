"""Real servers for the tests (Debian's nginx, docker-registry, redis-server), each started on 127.0.0.1 on a free
port with its files in a temp dir, and stopped at teardown. Absent binaries skip the tests with the reason, except
under CI, which installs them (.ci/run) and must not pass by skipping."""
from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGES = {"nginx": "nginx", "docker-registry": "docker-registry", "redis-server": "redis-server"}


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

    def requests(self) -> list[tuple[str, str, int, int, str]]:
        """(method, path, status, body bytes sent, Range header) per request, in order."""
        rows = []
        for line in (self.dir / "access.log").read_text().splitlines():
            method, path, status, sent, rng = line.split(" ", 4)
            rows.append((method, path, int(status), int(sent), rng.strip('"')))
        return rows

    def reset_log(self) -> None:
        (self.dir / "access.log").write_text("")


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


@contextlib.contextmanager
def registry(directory: Path) -> Iterator[str]:
    """Debian's docker-registry (distribution 2.x) with filesystem storage; yields ``host:port``."""
    exe = binary("docker-registry")
    port = free_port()
    directory.mkdir(parents=True, exist_ok=True)
    conf = directory / "config.yml"
    conf.write_text(REGISTRY_CONF.format(d=directory, port=port))
    with running([exe, "serve", str(conf)], port, directory / "registry.log"):
        yield f"127.0.0.1:{port}"


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
