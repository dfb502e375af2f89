"""A registry's credentials, read where ``docker login`` writes them, and its authentication handshake, answered as
docker answers it.

oras-py (0.2.43) reads only ``~/.docker/config.json`` (not ``$DOCKER_CONFIG``), answers a ``Basic`` challenge
(htpasswd) by fetching a token from the realm's name as if it were a URL, sends the pull token it got first with a
push that needs another, and says nothing when a credential helper is missing: each ended in an error line that
did not say authentication was the problem. Here every request goes out with the ``Authorization`` that last
worked; a 401 is answered once, by its challenge, and a second 401 is an error line that says whose credentials
were refused and where they were read.
"""
from __future__ import annotations

import base64
import binascii
import json
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from . import remote
from .errors import RemoteError, UsageError

if TYPE_CHECKING:
    import requests

HUB_SERVER = "https://index.docker.io/v1/"  # the key docker keeps Docker Hub's credentials under
# Docker Hub: the names docker gives it, and the host its registry answers at
HUB_NAMES, HUB_REGISTRY = frozenset({"docker.io", "index.docker.io"}), "registry-1.docker.io"
HUB_HOSTS = HUB_NAMES | {HUB_REGISTRY}
IDENTITY_USER = "<token>"  # a helper's Username for a Secret that is an identity (refresh) token
HELPER_NOT_FOUND = "credentials not found in native keychain"  # the helper protocol's answer for none
_PARAMETER = re.compile(r'(\w+)="([^"]*)"')


def config_path() -> str:
    """Where ``docker login`` writes: ``$DOCKER_CONFIG/config.json``, else ``~/.docker/config.json``."""
    directory = os.environ.get("DOCKER_CONFIG") or os.path.join(os.path.expanduser("~"), ".docker")
    return os.path.join(directory, "config.json")


@dataclass(frozen=True)
class Credentials:
    username: str
    secret: str  # a password, or an identity token when ``identity``
    source: str  # where they were read, for the line that says they were refused
    identity: bool = False  # ``identitytoken`` (``az acr login``): traded for a token as an OAuth2 refresh token

    @property
    def basic(self) -> str:
        return "Basic " + base64.b64encode(f"{self.username}:{self.secret}".encode()).decode()

    def __str__(self) -> str:
        return f"the identity token from {self.source}" if self.identity else \
            f"the credentials of {self.username} from {self.source}"


def _hostname(key: str) -> str:
    """A config key as docker compares it: ``https://host:port/v1/`` is ``host:port``."""
    return re.sub(r"^https?://", "", key).split("/", 1)[0]


def _read_config(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise UsageError(f"cannot read the docker config: {e.strerror}", path) from None
    except ValueError as e:
        raise UsageError(f"not a docker config (not JSON: {e})", path) from None
    if not isinstance(config, dict):
        raise UsageError("not a docker config (not a JSON object)", path)
    return config


def _matching(table: object, host: str) -> tuple[str, object] | None:
    """The key and value of a config table (``auths``, ``credHelpers``) for ``host``."""
    if not isinstance(table, Mapping):
        return None
    return next(((key, value) for key, value in table.items() if _hostname(key) == host), None)


def _from_entry(key: str, entry: object, path: str) -> Credentials | None:
    """An ``auths`` entry as ``docker login`` writes it (``auth``: base64 of ``USER:PASSWORD``; or ``username`` and
    ``password``; ``identitytoken``); None for the empty entry it writes where a helper keeps the secret."""
    if not isinstance(entry, Mapping):
        raise UsageError(f"auths entry {key!r} is not a JSON object", path)
    username, password = entry.get("username") or "", entry.get("password") or ""
    if entry.get("auth"):
        try:
            username, colon, password = base64.b64decode(entry["auth"], validate=True).decode().partition(":")
        except (binascii.Error, UnicodeDecodeError, TypeError):
            colon = ""
        if not colon:
            raise UsageError(f"auths entry {key!r}: its auth is not base64 of USER:PASSWORD", path)
    if entry.get("identitytoken"):
        return Credentials(username, str(entry["identitytoken"]), path, identity=True)
    return Credentials(username, password, path) if username or password else None


def _from_helper(name: str, role: str, server: str, reference: str) -> Credentials | None:
    """``docker-credential-NAME get``, the server on its standard input, as docker runs it; None when the helper
    has nothing for that server. ``role`` says which setting of the config named it."""
    program, path = f"docker-credential-{name}", config_path()
    try:
        done = subprocess.run([program, "get"], input=server.encode(), capture_output=True,
                              timeout=remote.SERVER_TIMEOUT[1])
    except FileNotFoundError:
        raise UsageError(f"its {role} names {program}, which is not on PATH", path) from None
    except subprocess.TimeoutExpired:
        raise RemoteError(f"{program} get gave no credentials in {remote.SERVER_TIMEOUT[1]} s", reference) from None
    if done.returncode != 0:
        if done.stdout.decode(errors="replace").strip() == HELPER_NOT_FOUND:
            return None
        said = " ".join((done.stderr or done.stdout).decode(errors="replace").split())
        raise RemoteError(f"{program} get failed (exit {done.returncode}): {said or 'no message'}", reference)
    try:
        answer = json.loads(done.stdout)
        username, secret = str(answer["Username"]), str(answer["Secret"])
    except (ValueError, KeyError, TypeError):
        raise RemoteError(f"{program} get answered no JSON with Username and Secret", reference) from None
    return Credentials(username, secret, f"{program} ({role} of {path})", identity=username == IDENTITY_USER)


def credentials(registry: str, reference: str) -> tuple[Credentials | None, str]:
    """The registry's credentials as docker finds them, and where they were looked for: its ``auths`` entry, else
    the helper that ``credHelpers`` names for it, else the ``credsStore`` helper."""
    path = config_path()
    config = _read_config(path)
    server = HUB_SERVER if registry in HUB_HOSTS else registry
    host = _hostname(server)
    entry = _matching(config.get("auths"), host)
    found = _from_entry(*entry, path) if entry else None
    if found:
        return found, path
    helper = _matching(config.get("credHelpers"), host)
    role, name = (f"credHelpers entry {helper[0]!r}", helper[1]) if helper else ("credsStore", config.get("credsStore"))
    if not name:
        return None, path
    return _from_helper(str(name), role, server, reference), f"docker-credential-{name} ({role} of {path})"


def _challenge(response: requests.Response) -> tuple[str, dict[str, str]]:
    """The scheme (lowercase) and parameters of a 401's ``WWW-Authenticate``."""
    header = response.headers.get("WWW-Authenticate", "")
    scheme, _, parameters = header.strip().partition(" ")
    return scheme.lower(), dict(_PARAMETER.findall(parameters))


class Authenticator:
    """Sends a registry's requests with the ``Authorization`` that last worked, and answers a 401 once: ``Basic``
    with the credentials, ``Bearer`` with a token from its realm for the scope it names (a push's scope covers
    the pulls after it). Credentials are read at the first challenge: a registry that asks for none never runs a
    credential helper."""

    def __init__(self, session: requests.Session, registry: str, reference: str):
        self.session = session
        self.registry = registry
        self.reference = reference
        self.authorization: str | None = None
        self._found: tuple[Credentials | None, str] | None = None

    def send(self, method: str, url: str, headers: dict | None = None, **kwargs) -> requests.Response:
        response = self._request(method, url, headers, kwargs)
        if response.status_code != 401:
            return response
        response.close()
        self.authorization = self._answer(*_challenge(response))
        response = self._request(method, url, headers, kwargs)  # a body that is a _FileBody is read again, whole
        if response.status_code == 401:
            response.close()
            raise self._refused(self.registry, _challenge(response)[1])
        return response

    def _request(self, method: str, url: str, headers: dict | None, kwargs: dict) -> requests.Response:
        headers = dict(headers or {})
        if self.authorization:
            headers["Authorization"] = self.authorization
        return self.session.request(method, url, headers=headers, **kwargs)

    def _credentials(self) -> tuple[Credentials | None, str]:
        if self._found is None:
            self._found = credentials(self.registry, self.reference)
        return self._found

    def _answer(self, scheme: str, parameters: dict[str, str]) -> str:
        """The ``Authorization`` that answers a challenge."""
        if scheme == "bearer" and parameters.get("realm"):
            return "Bearer " + self._token(self._credentials()[0], parameters)
        if scheme != "basic":
            raise RemoteError("the registry asks for an authentication tritonpack cannot answer "
                              f"({scheme or 'no WWW-Authenticate'})", self.reference)
        found = self._credentials()[0]
        if found is None:
            raise self._refused(self.registry, {})
        if found.identity:
            raise RemoteError(f"authentication failed: {self.registry} asks for a password, and {found} is none",
                              self.reference)
        return found.basic

    def _token(self, found: Credentials | None, challenge: dict[str, str]) -> str:
        """A token from the realm, as the distribution token spec asks for one: by GET with the credentials as
        Basic (none: anonymous), or by an OAuth2 POST for an identity token."""
        realm = challenge["realm"]
        wanted = {key: challenge[key] for key in ("service", "scope") if key in challenge}
        if found and found.identity:
            response = self.session.post(realm, data={"grant_type": "refresh_token", "refresh_token": found.secret,  # type: ignore[misc]  # str to str: mypy cannot infer it against requests' union for data
                                                      "client_id": "tritonpack", **wanted})
        else:
            response = self.session.get(realm, params=wanted,
                                        headers={"Authorization": found.basic} if found else {})
        with response:
            if response.status_code in (401, 403):
                raise self._refused(f"the token server {realm}", {})
            if response.status_code != 200:
                raise RemoteError(f"the token server {realm} answered HTTP {response.status_code} "
                                  f"{response.reason}", self.reference)
            try:
                answer = response.json()
                return str(answer.get("token") or answer["access_token"])
            except (ValueError, KeyError, AttributeError):
                raise RemoteError(f"the token server {realm} answered no token", self.reference) from None

    def _refused(self, who: str, challenge: dict[str, str]) -> RemoteError:
        """The one line for a 401 that credentials did not answer: whose, and where they were looked for."""
        found, where = self._credentials()
        why = f" ({challenge['error']}: {challenge.get('scope', '')})" if challenge.get("error") else ""
        if found is None:
            return RemoteError(f"authentication required: {who} asks for credentials{why}, and there are none for "
                               f"{self.registry} in {where} (docker login {self.registry} writes them)",
                               self.reference)
        return RemoteError(f"authentication failed: {who} refused {found}{why}", self.reference)
