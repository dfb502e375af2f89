"""Registries that ask for credentials, read from the docker config as ``docker login`` writes it (in a temp
``DOCKER_CONFIG``): docker-registry with htpasswd (Basic) and with token authentication (Bearer, against the
token server of ``servers.py``), credential helpers (stand-in scripts on PATH), and a stand-in registry that
answers every request of a push with a 401 once."""
from __future__ import annotations

import base64
import hashlib
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

pytest.importorskip("oras")

from servers import HTPASSWD_USER, htpasswd_registry, http_registry, registry, token_server

import tritonpack
from tritonpack.entry import main
from tritonpack.ociauth import Credentials, credentials

USER, PASSWORD, _ = HTPASSWD_USER
IDENTITY_TOKEN = "identity-token-of-alice"


def auth(user: str = USER, password: str = PASSWORD) -> dict[str, str]:
    """An ``auths`` entry as ``docker login`` writes it."""
    return {"auth": base64.b64encode(f"{user}:{password}".encode()).decode()}


@pytest.fixture()
def docker_config(tmp_path, monkeypatch) -> Callable[[dict], Path]:
    """Writes a docker config to a temp ``DOCKER_CONFIG`` and returns its path (docker's default,
    ``~/.docker/config.json``, left alone: ``HOME`` is an empty temp dir)."""
    directory = tmp_path / "docker-config"
    directory.mkdir()
    monkeypatch.setenv("DOCKER_CONFIG", str(directory))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))

    def write(config: dict) -> Path:
        (directory / "config.json").write_text(json.dumps(config))
        return directory / "config.json"

    return write


@pytest.fixture()
def helpers(tmp_path, monkeypatch) -> Callable[[str, str], Path]:
    """Writes ``docker-credential-NAME`` (a shell script) to a directory put first on PATH; returns the log of
    the servers it was asked for."""
    directory = tmp_path / "bin"
    directory.mkdir()
    monkeypatch.setenv("PATH", f"{directory}{os.pathsep}{os.environ['PATH']}")
    log = tmp_path / "helper.log"

    def write(name: str, body: str) -> Path:
        script = directory / f"docker-credential-{name}"
        script.write_text(f'#!/bin/sh\n[ "$1" = get ] || exit 9\nread server\necho "$server" >> {log}\n{body}\n')
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
        return log

    return write


def answering(user: str, secret: str) -> str:
    return f'echo \'{{"ServerURL": "\'"$server"\'", "Username": "{user}", "Secret": "{secret}"}}\''


@pytest.fixture(scope="module")
def archive(compiled_root, tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("oci-auth-archive") / "kernels.tpack"
    tritonpack.pack(compiled_root, path)
    return path


@pytest.fixture(scope="module")
def basic_host(tmp_path_factory):
    with htpasswd_registry(tmp_path_factory.mktemp("htpasswd-registry")) as address:
        yield address


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    with token_server(tmp_path_factory.mktemp("token-server"), {USER: PASSWORD}, {IDENTITY_TOKEN: USER}) as server:
        yield server


@pytest.fixture(scope="module")
def token_host(tokens, tmp_path_factory):
    with registry(tmp_path_factory.mktemp("token-registry"), tokens.auth) as address:
        yield address


def round_trip(reference: str, archive: Path, tmp_path: Path, capsys) -> None:
    """push, pull, list and unpack ``oci://``, each through the registry's authentication."""
    assert main(["push", str(archive), reference, "-q"]) == 0
    assert main(["pull", reference, "-o", str(tmp_path / "pulled.tpack"), "-q"]) == 0
    assert (tmp_path / "pulled.tpack").read_bytes() == archive.read_bytes()
    assert main(["list", reference]) == 0
    assert "add_kernel" in capsys.readouterr().out
    result = tritonpack.unpack(reference, tmp_path / "cache")
    assert result.written == result.entries > 0


def asked(requests: list[tuple[str, str | None, str]]) -> list[tuple[str, str | None, str, list[str]]]:
    """The token server's requests, each scope's actions sorted (the registry lists them in any order)."""
    return [(method, user, scope.rpartition(":")[0], sorted(scope.rpartition(":")[2].split(",")))
            for method, user, scope in requests]


@pytest.mark.parametrize("key, entry", [
    ("{host}", auth()),
    ("http://{host}", {"username": USER, "password": PASSWORD}),  # a URL key; the fields some tools write
])
def test_basic_auth_from_the_docker_config(basic_host, archive, docker_config, key, entry, tmp_path, capsys):
    """htpasswd: oras-py fetched a "token" from the realm's name as if it were a URL, and read no
    ``$DOCKER_CONFIG``."""
    docker_config({"auths": {key.format(host=basic_host): entry}})
    round_trip(f"oci://{basic_host}/triton/basic:v1", archive, tmp_path, capsys)


def test_token_auth_asks_for_a_push_scope_for_a_push(token_host, tokens, archive, docker_config, tmp_path,
                                                     capsys):
    """Bearer: the token got for the blob's HEAD grants pull; the upload's 401 asks for pull,push, and a new token
    is fetched for it (oras-py sent the pull token again, and the push failed with HTTP 401)."""
    docker_config({"auths": {token_host: auth()}})
    tokens.requests.clear()
    round_trip(f"oci://{token_host}/triton/token:v1", archive, tmp_path, capsys)
    assert asked(tokens.requests[:2]) == [("GET", USER, "repository:triton/token", ["pull"]),
                                          ("GET", USER, "repository:triton/token", ["pull", "push"])]
    assert {user for _, user, _ in tokens.requests} == {USER}


def test_an_identity_token_is_traded_for_a_token(token_host, tokens, archive, docker_config, tmp_path, capsys):
    """``identitytoken`` (as ``az acr login`` writes it) goes to the realm as an OAuth2 refresh token."""
    docker_config({"auths": {token_host: {"auth": base64.b64encode(b"00000000-0000-0000-0000-000000000000:").decode(),
                                          "identitytoken": IDENTITY_TOKEN}}})
    tokens.requests.clear()
    round_trip(f"oci://{token_host}/triton/identity:v1", archive, tmp_path, capsys)
    assert asked(tokens.requests[:2]) == [("POST", USER, "repository:triton/identity", ["pull"]),
                                          ("POST", USER, "repository:triton/identity", ["pull", "push"])]


@pytest.mark.parametrize("command", ["push", "pull", "unpack"])
@pytest.mark.parametrize("kind", ["basic", "token"])
@pytest.mark.parametrize("given", ["none", "wrong"])
def test_missing_or_wrong_credentials_are_one_line(kind, given, command, request, archive, docker_config, tmp_path,
                                                   capsys):
    """One line, exit 7, that says authentication failed and where the credentials were read."""
    host = request.getfixturevalue(f"{kind}_host")
    reference = f"oci://{host}/triton/refused:v1"
    config = docker_config({"auths": {host: auth(password="wrong")}} if given == "wrong" else {})
    argv = {"push": ["push", str(archive), reference], "pull": ["pull", reference, "-o", str(tmp_path / "x.tpack")],
            "unpack": ["unpack", reference, "--cache-dir", str(tmp_path / "cache")]}[command]
    assert main(argv) == 7
    if given == "wrong":
        who = host if kind == "basic" else f"the token server {request.getfixturevalue('tokens').realm}"
        expected = f"authentication failed: {who} refused the credentials of alice from {config}"
    else:
        scope = " (insufficient_scope: repository:triton/refused:pull)" if kind == "token" else ""
        expected = (f"authentication required: {host} asks for credentials{scope}, and there are none for {host} "
                    f"in {config} (docker login {host} writes them)")
    assert capsys.readouterr() == ("", f"error: {reference}: {expected}\n")
    assert sorted(os.listdir(tmp_path)) == ["docker-config"]


@pytest.mark.parametrize("config", [
    {"credsStore": "fake"},
    {"auths": {"{host}": {}}, "credsStore": "absent", "credHelpers": {"{host}": "fake"}},  # credHelpers first
])
def test_credential_helpers(basic_host, archive, docker_config, helpers, config, tmp_path, capsys):
    """``docker-credential-NAME get`` with the server on its standard input, as docker runs it: once a command."""
    log = helpers("fake", answering(USER, PASSWORD))
    docker_config(json.loads(json.dumps(config).replace("{host}", basic_host)))
    round_trip(f"oci://{basic_host}/triton/helper:v1", archive, tmp_path, capsys)
    assert log.read_text().splitlines() == [basic_host] * 4


@pytest.mark.parametrize("helper, body, code, message", [
    ("absent", None, 2, "error: {config}: its credsStore names docker-credential-absent, which is not on PATH"),
    ("empty", "echo 'credentials not found in native keychain'; exit 1", 7,
     "error: {ref}: authentication required: {host} asks for credentials, and there are none for {host} in "
     "docker-credential-empty (credsStore of {config}) (docker login {host} writes them)"),
    ("broken", "echo 'no AWS credentials' >&2; exit 3", 7,
     "error: {ref}: docker-credential-broken get failed (exit 3): no AWS credentials"),
    ("garbled", "echo 'not json'", 7, "error: {ref}: docker-credential-garbled get answered no JSON with Username "
                                      "and Secret"),
    ("stale", answering(USER, "expired"), 7,
     "error: {ref}: authentication failed: {host} refused the credentials of alice from docker-credential-stale "
     "(credsStore of {config})"),
])
def test_credential_helper_failures_are_one_line(basic_host, docker_config, helpers, helper, body, code, message,
                                                 tmp_path, capsys):
    """oras-py logged a missing or failing helper to nowhere and went on without credentials: the registry's 401
    was all one saw."""
    if body:
        helpers(helper, body)
    config = docker_config({"credsStore": helper})
    reference = f"oci://{basic_host}/triton/kernels:v1"
    assert main(["pull", reference, "-o", str(tmp_path / "x.tpack")]) == code
    expected = message.format(config=config, ref=reference, host=basic_host)
    assert capsys.readouterr() == ("", expected + "\n")


def test_a_registry_that_asks_for_nothing_runs_no_helper(archive, docker_config, helpers, tmp_path, capsys):
    log = helpers("fake", answering(USER, PASSWORD))
    docker_config({"credsStore": "fake"})
    with registry(tmp_path / "open-registry") as host:
        reference = f"oci://{host}/triton/open:v1"
        assert main(["push", str(archive), reference, "-q"]) == 0
        assert main(["pull", reference, "-o", str(tmp_path / "pulled.tpack"), "-q"]) == 0
    assert not log.exists()


@pytest.mark.parametrize("text, problem", [
    ("{not json", "not a docker config (not JSON: "),
    ("[]", "not a docker config (not a JSON object)"),
    ('{"auths": {"HOST": {"auth": "not base64!"}}}', "auths entry 'HOST': its auth is not base64 of USER:PASSWORD"),
    ('{"auths": {"HOST": "alice"}}', "auths entry 'HOST' is not a JSON object"),
])
def test_a_bad_docker_config_is_one_line(basic_host, docker_config, text, problem, tmp_path, capsys):
    config = docker_config({})
    config.write_text(text.replace("HOST", basic_host))
    assert main(["pull", f"oci://{basic_host}/triton/kernels:v1", "-o", str(tmp_path / "x.tpack")]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"error: {config}: {problem.replace('HOST', basic_host)}")
    assert err.count("\n") == 1


@pytest.mark.parametrize("registry_name, key, found", [
    ("registry-1.docker.io", "https://index.docker.io/v1/", True),  # where docker login keeps Docker Hub's
    ("docker.io", "https://index.docker.io/v1/", True),
    ("registry.example:5000", "https://registry.example:5000", True),
    ("registry.example:5000", "registry.example:5000/v2/", True),
    ("registry.example:5000", "registry.example", False),  # another port, another registry
    ("registry.example", "other.example", False),
])
def test_config_keys_match_as_docker_matches_them(docker_config, registry_name, key, found):
    config = docker_config({"auths": {key: auth()}})
    expected = (Credentials(USER, PASSWORD, str(config)) if found else None, str(config))
    assert credentials(registry_name, "oci://x") == expected


def test_every_request_asked_for_a_token_gets_one_and_is_sent_whole_again(archive, docker_config, capfd):
    """A 401 on any request of a push (the blob's HEAD, the upload's POST, the archive's PUT, the manifest's PUT:
    a token expired, or one that does not cover the request's scope) is answered with a token from the realm,
    fetched with the credentials, and the request is sent again with it, its body whole (the archive read again
    from its start)."""
    received: list[tuple[str, str, bytes]] = []
    realm: list[str] = []
    upload = "/v2/triton/kernels/blobs/uploads/session"

    def asking_every_time(method: str, path: str, times: int) -> tuple:
        if path.startswith("/token"):
            good = received[-1][1] == "Basic " + auth()["auth"]
            return (200, b'{"token": "renewed"}') if good else (401, b"{}")
        if path == "/v2/":
            return 200, b"{}"
        if times % 2:
            return 401, b"{}", {"Www-Authenticate": f'Bearer realm="{realm[0]}",service="stand-in",scope="x"'}
        if method == "HEAD":
            return 404, b"{}"
        return (202, b"", {"Location": upload}) if method == "POST" else (201, b"{}")

    host_config = docker_config({})
    with http_registry(asking_every_time, received) as (address, _):
        realm.append(f"http://{address}/token")
        host_config.write_text(json.dumps({"auths": {address: auth()}}))
        assert main(["push", str(archive), f"oci://{address}/triton/kernels:v1", "-q"]) == 0
    assert capfd.readouterr() == ("", "")
    asked = [r for r in received if not r[0].startswith("GET /token") and r[0] != "GET /v2/"]
    assert [r[0] for r in asked[::2]] == [r[0] for r in asked[1::2]]  # each sent twice
    assert {r[1] for r in asked[1::2]} == {"Bearer renewed"}
    methods = [r[0].split()[0] for r in asked[::2]]
    assert methods == ["HEAD", "POST", "PUT", "HEAD", "POST", "PUT", "PUT"], methods
    digest = "sha256%3A" + hashlib.sha256(archive.read_bytes()).hexdigest()
    uploads = [body for request, _, body in received if request == f"PUT {upload}?digest={digest}"]
    assert uploads == [archive.read_bytes()] * 2, [len(b) for b in uploads]


@pytest.mark.parametrize("headers, said", [
    ({}, "no WWW-Authenticate"),
    ({"Www-Authenticate": 'Negotiate realm="x"'}, "negotiate"),
])
def test_a_challenge_that_cannot_be_answered_is_one_line(headers, said, docker_config, tmp_path, capfd):
    docker_config({})
    with http_registry(lambda method, path, times: (200, b"{}") if path == "/v2/" else (401, b"{}", headers)) \
            as (address, _):
        reference = f"oci://{address}/triton/kernels:v1"
        assert main(["pull", reference, "-o", str(tmp_path / "x.tpack")]) == 7
    assert capfd.readouterr() == ("", f"error: {reference}: the registry asks for an authentication tritonpack "
                                      f"cannot answer ({said})\n")
