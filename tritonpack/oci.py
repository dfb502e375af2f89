"""Archives as OCI artifacts in any container registry, by ORAS conventions (through the ``oras`` package).

One artifact holds one ``.tpack`` as its single layer. The manifest carries ``artifactType``, an empty config
(OCI 1.1, as ``oras push`` writes it) and annotations that describe the archive, so that a cluster can choose
an artifact (targets, Triton version, index digest) from the manifest alone, without pulling it.
"""
from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import logging
import os
import re
import shutil
import tempfile
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from . import remote
from .archive.reader import ArchiveReader
from .archive.source import LocalFile
from .archivedest import archive_file
from .errors import RemoteError, TpackError, UsageError
from .model import GROUP, ArchiveInfo, Entry
from .ociauth import HUB_NAMES, HUB_REGISTRY, Authenticator
from .remote import scheme_of
from .report import human_bytes
from .streams import STDIN_NAME, is_stdin

if TYPE_CHECKING:
    import requests

ARTIFACT_TYPE = "application/vnd.tritonpack.archive.v1"
LAYER_MEDIA_TYPE = "application/vnd.tritonpack.archive.layer.v1.tpack"
MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
EMPTY_CONFIG = {"mediaType": "application/vnd.oci.empty.v1+json",
                "digest": "sha256:44136fa355b3678a1146ad16f7e8649e94fb4fc21fe77e8310c060f61caaff8a", "size": 2}
TITLE = "org.opencontainers.image.title"
PREFIX = "io.tritonpack."
DEFAULT_NAME = "kernels.tpack"
TRANSIENT_STATUSES = frozenset({500, 502, 503, 504})
RETRY_PAUSE_S = 0.5

# distribution's reference grammar: lowercase path components, tag, digest
_REPOSITORY = re.compile(r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*(?:/[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*)*")
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class Reference:
    """``oci://REGISTRY/REPOSITORY[:TAG|@DIGEST]``; the tag defaults to ``latest``."""

    registry: str  # host[:port]
    repository: str
    tag: str | None
    digest: str | None = None

    @property
    def target(self) -> str:
        """The reference as oras and docker write it, without the scheme."""
        suffix = f"@{self.digest}" if self.digest else f":{self.tag}"
        return f"{self.registry}/{self.repository}{suffix}"

    @property
    def loopback(self) -> bool:
        host = self.registry.rsplit(":", 1)[0] if not self.registry.startswith("[") else self.registry[1:].split("]")[0]
        if host == "localhost":
            return True
        try:
            return ipaddress.ip_address(host).is_loopback
        except ValueError:
            return False

    def __str__(self) -> str:
        return f"oci://{self.target}"


def parse_reference(url: str) -> Reference:
    if not url.lower().startswith("oci://"):
        raise UsageError("an OCI reference looks like oci://REGISTRY[:PORT]/REPOSITORY[:TAG]", url)
    registry, _, rest = url[len("oci://"):].partition("/")
    if not registry or not rest:
        raise UsageError("an OCI reference looks like oci://REGISTRY[:PORT]/REPOSITORY[:TAG]", url)
    repository, _, digest = rest.partition("@")
    tag = None
    if digest:
        if not _DIGEST.fullmatch(digest):
            raise UsageError(f"not a sha256 digest: {digest!r}", url)
    else:
        head, colon, last = repository.rpartition(":")
        if colon and "/" not in last:
            repository, tag = head, last
        tag = tag or "latest"
        if not _TAG.fullmatch(tag):
            raise UsageError(f"not a valid tag: {tag!r}", url)
    if not _REPOSITORY.fullmatch(repository):
        raise UsageError(f"not a valid repository name (lowercase, / separated): {repository!r}", url)
    if registry.lower() in HUB_NAMES:  # as docker reads them; a one-part name is an official image's, under library/
        registry, repository = HUB_REGISTRY, repository if "/" in repository else f"library/{repository}"
    return Reference(registry, repository, tag, digest or None)


def artifact_annotations(info: ArchiveInfo, entries: tuple[Entry, ...], digest: str) -> dict[str, str]:
    """What a scheduler needs to choose an artifact, all from the archive's index."""
    groups = [e for e in entries if e.kind == GROUP]
    targets = sorted({e.kernel.target for e in groups if e.kernel and e.kernel.backend})
    versions = sorted({e.kernel.triton_version for e in groups if e.kernel and e.kernel.triton_version})
    if not versions and info.triton:
        versions = [info.triton.version]
    result = {
        PREFIX + "format": "{}.{}".format(*info.format_version),
        PREFIX + "targets": ",".join(targets),
        PREFIX + "triton.version": ",".join(versions),
        PREFIX + "kernels": str(len(groups)),
        PREFIX + "entries": str(len(entries)),
        PREFIX + "index.sha256": digest,
    }
    if info.triton and info.triton.key_sha256:
        result[PREFIX + "triton.key-sha256"] = info.triton.key_sha256
    if info.python:
        result[PREFIX + "python"] = info.python.cache_tag or f"{info.python.implementation}-{info.python.version}"
    return result


@dataclass
class PushResult:
    archive: str
    reference: str
    digest: str  # the manifest's: what oci://REGISTRY/REPOSITORY@DIGEST pulls (on the Hub: the commit)
    archive_digest: str  # the layer's: the archive file's sha256
    size: int
    annotations: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0
    pinned: str = ""  # the reference to this push alone, whatever is pushed after it: REFERENCE@DIGEST
    unchanged: bool = False  # the Hub's branch held this archive already: no commit was made

    def summary(self) -> str:
        return (f"pushed {self.archive} ({human_bytes(self.size)}) to {self.reference} in {self.seconds:.2f} s: "
                f"{self.digest}")

    def notes(self) -> list[str]:
        lines = ["the branch holds this archive already: no commit was made"] if self.unchanged else []
        return lines + ([f"this push alone, whatever is pushed after it: {self.pinned}"] if self.pinned else [])

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class PullResult:
    reference: str
    output: str
    digest: str  # the manifest's, as push reports it: what oci://REGISTRY/REPOSITORY@DIGEST pulls
    archive_digest: str  # the layer's: the archive file's sha256
    size: int
    annotations: dict[str, str] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def written_archive(self) -> str:
        """The archive this command wrote: where it is standard output, the summary goes to standard error."""
        return self.output

    def summary(self) -> str:
        return (f"pulled {self.reference} ({human_bytes(self.size)}) in {self.seconds:.2f} s -> {self.output}: "
                f"{self.digest}")

    def notes(self) -> list[str]:
        return []

    def to_dict(self) -> dict:
        return asdict(self)


def _client(ref: Reference, plain_http: bool | None):
    """An oras client; plain HTTP when asked, and by default for loopback registries only (as docker does).

    Every request of its (blobs, uploads, manifests) goes through ``ociauth.Authenticator`` (credentials and the
    401 handshake as docker reads and answers them) and ``_once_more_if_transient``, not through oras'
    ``do_request``, its ``@retry`` (five tries, 2+3^n s apart: over two minutes before a registry that answers
    500 gets its error line) nor its authentication; its log records get a ``NullHandler``, so that they never
    reach standard error through logging's last-resort handler (our one error line already carries the
    registry's messages)."""
    try:
        import oras.client
        import oras.logger
    except ImportError:
        raise UsageError("OCI registries need the oras package: pip install oras", str(ref)) from None
    oras_logging = oras.logger.logger.logger
    if not any(isinstance(h, logging.NullHandler) for h in oras_logging.handlers):
        oras_logging.addHandler(logging.NullHandler())
    client = oras.client.OrasClient(hostname=ref.registry,
                                    insecure=ref.loopback if plain_http is None else plain_http)
    for scheme in ("http://", "https://"):
        client.session.mount(scheme, _adapter_with_timeout())
    auth = Authenticator(client.session, ref.registry, str(ref))

    def do_request(url: str, method: str = "GET", data: _FileBody | bytes | None = None, headers: dict | None = None,
                   stream: bool = False) -> requests.Response:
        return _once_more_if_transient(lambda: auth.send(method, url, headers, data=data, stream=stream), method)

    client.do_request = do_request  # as oras calls it: get_blob, blob_exists; and _upload_blob, _manifest, push
    return client


def _adapter_with_timeout():
    """requests' adapter, with a timeout where none is given (oras gives none): a registry that takes the
    connection and never answers must not hang a pod's start. The read timeout is per read of the socket, so a
    large archive downloading slowly is not cut short."""
    from requests.adapters import HTTPAdapter

    class TimedAdapter(HTTPAdapter):
        def send(self, request, timeout=None, **kwargs):  # type: ignore[override]  # Session.send passes them by keyword
            return super().send(request, timeout=remote.SERVER_TIMEOUT if timeout is None else timeout, **kwargs)

    return TimedAdapter()


def _once_more_if_transient(send: Callable[[], requests.Response], method: str) -> requests.Response:
    """A read answered with a 5xx is sent once more, half a second later (a registry or its proxy restarting while
    pods start); a write, or a second 5xx, is answered at once, for the caller's one error line."""
    response = send()
    if method in ("GET", "HEAD") and response.status_code in TRANSIENT_STATUSES:
        response.close()
        time.sleep(RETRY_PAUSE_S)
        response = send()
    return response


@contextlib.contextmanager
def _remote(ref: Reference) -> Iterator[None]:
    """The registry's and the HTTP client's errors as one ``RemoteError`` line naming the reference."""
    import requests

    try:
        yield
    except TpackError:
        raise
    except requests.exceptions.SSLError as e:
        raise RemoteError(f"TLS error talking to {ref.registry} ({type(e).__name__}); a registry that speaks "
                          "plain HTTP needs --plain-http", str(ref)) from None
    except requests.exceptions.ConnectionError as e:
        reason = e.args[0] if e.args else e
        reason = getattr(reason, "reason", reason)
        raise RemoteError(f"cannot connect to registry {ref.registry}: {' '.join(str(reason).split())}",
                          str(ref)) from None
    except (requests.exceptions.RequestException, ValueError) as e:
        raise RemoteError(" ".join(str(e).split()), str(ref)) from None
    except OSError as e:  # writing the pulled file
        raise UsageError(f"cannot write: {e.strerror}", e.filename or str(ref)) from None
    except Exception as e:  # anything else oras raises
        raise RemoteError(f"{type(e).__name__}: {' '.join(str(e).split())}", str(ref)) from None


def _status(response, ref: Reference, what: str) -> None:
    if response.status_code in (200, 201, 202):
        return
    try:
        errors = "; ".join(str(e.get("message", "")) for e in response.json().get("errors", []))
    except (ValueError, AttributeError, TypeError):  # not JSON, or not distribution's {"errors": [{...}]}
        errors = ""
    raise RemoteError(f"{what}: HTTP {response.status_code} {response.reason}" + (f" ({errors})" if errors else ""),
                      str(ref))


def _ping(client, ref: Reference) -> None:
    """``GET /v2/`` (straight through the session: a 401 is an answer here, not a request to log in), so that an
    unreachable registry fails at once."""
    response = _once_more_if_transient(
        lambda: client.session.get(f"{client.prefix}://{ref.registry}/v2/", timeout=30), "GET")
    if response.status_code >= 500:
        _status(response, ref, "GET /v2/")
    if response.status_code not in (200, 401):
        raise RemoteError(f"not an OCI registry (GET /v2/ answered HTTP {response.status_code})", str(ref))


def _manifest_digest(body: bytes) -> str:
    return "sha256:" + hashlib.sha256(body).hexdigest()


def _sha256_file(path: str) -> tuple[str, int]:
    digest, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
            size += len(chunk)
    return "sha256:" + digest.hexdigest(), size


class _FileBody:
    """A file as a request body that requests sends with its ``Content-Length``, read a MiB at a time: memory stays
    bounded whatever the archive's size. Each send reads it from its start, so that a request sent again (after
    a 401 answered with credentials or a token) sends it whole."""

    def __init__(self, path: str, size: int):
        self.path = path
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __iter__(self) -> Iterator[bytes]:
        with open(self.path, "rb") as f:
            yield from iter(lambda: f.read(1 << 20), b"")


def _upload_blob(client, container, ref: Reference, blob: dict, body: _FileBody | bytes, what: str) -> None:
    """Upload a blob the registry lacks, as the OCI distribution spec's monolithic upload: a POST opens a session,
    one PUT with the digest sends the bytes. oras' ``upload_blob`` does the same with the whole file read into
    memory (pushing a 419 MB archive peaked at 446 MB); its chunked upload, which does not, is not taken by every
    registry."""
    import oras.utils

    if client.blob_exists(blob, container):
        return
    response = client.do_request(f"{client.prefix}://{container.upload_blob_url()}", "POST",
                                 headers={"Content-Type": "application/octet-stream", **client.headers})
    _status(response, ref, what)
    location = response.headers.get("Location")
    if not location:
        raise RemoteError(f"{what}: the registry opened no upload session (no Location in its answer)", str(ref))
    session = urllib.parse.urljoin(f"{client.prefix}://{ref.registry}/", location)
    response = client.do_request(oras.utils.append_url_params(session, {"digest": blob["digest"]}), "PUT",
                                 data=body, headers={"Content-Type": "application/octet-stream", **client.headers})
    _status(response, ref, what)


def described(archive: str | os.PathLike) -> tuple[str, dict[str, str], str, int]:
    """A local archive to push: its path, what describes it (``artifact_annotations``, from its index, read first
    so that a bad archive is never pushed), its sha256 and its size."""
    path = os.fspath(archive)
    if scheme_of(path):
        raise UsageError("push needs a local archive file", path)
    if is_stdin(path):
        raise UsageError("push uploads an archive file, not a stream: save it to one first", STDIN_NAME)
    with ArchiveReader(path) as reader:
        notes = artifact_annotations(reader.info, reader.entries, reader.digest)
    return (path, notes, *_sha256_file(path))


def push(archive: str | os.PathLike, reference: str, *, plain_http: bool | None = None) -> PushResult:
    """Push a local archive as an OCI artifact, its manifest annotated (``artifact_annotations``); to the Hugging
    Face Hub where ``reference`` is an hf:// URL (``hub.push``)."""
    if scheme_of(reference) == "hf":
        if plain_http:
            raise UsageError("--plain-http is for OCI registries (an hf:// URL's endpoint says its scheme)", reference)
        from .hub import push as push_to_hub

        return push_to_hub(archive, reference)
    start = time.perf_counter()
    if scheme_of(reference) != "oci":
        raise UsageError("push takes oci://REGISTRY[:PORT]/REPOSITORY[:TAG] or hf://ORG/REPO[@BRANCH]/PATH", reference)
    ref = parse_reference(reference)
    path, notes, digest, size = described(archive)
    layer = {"mediaType": LAYER_MEDIA_TYPE, "digest": digest, "size": size,
             "annotations": {TITLE: os.path.basename(path)}}
    manifest = {"schemaVersion": 2, "mediaType": MANIFEST_MEDIA_TYPE, "artifactType": ARTIFACT_TYPE,
                "config": EMPTY_CONFIG, "layers": [layer], "annotations": notes}
    client = _client(ref, plain_http)
    with _remote(ref):
        container = client.get_container(ref.target)
        _ping(client, ref)
        _upload_blob(client, container, ref, layer, _FileBody(path, size), "uploading the archive")
        _upload_blob(client, container, ref, EMPTY_CONFIG, b"{}", "uploading the empty config")
        body = json.dumps(manifest).encode()  # sent as these bytes, so that their sha256 is the manifest's digest
        response = client.do_request(f"{client.prefix}://{container.manifest_url()}", "PUT", data=body,
                                     headers={"Content-Type": MANIFEST_MEDIA_TYPE})
        _status(response, ref, "uploading the manifest")
    manifest_digest = _manifest_digest(body)
    return PushResult(archive=path, reference=str(ref), digest=manifest_digest, archive_digest=digest, size=size,
                      annotations=notes, seconds=time.perf_counter() - start,
                      pinned=f"oci://{ref.registry}/{ref.repository}@{manifest_digest}")


def fetch_manifest(reference: str, *, plain_http: bool | None = None) -> dict:
    """The artifact's manifest (annotations included), without pulling the archive."""
    ref = parse_reference(reference)
    client = _client(ref, plain_http)
    with _remote(ref):
        return _manifest(client, ref)[0]


def _manifest(client, ref: Reference) -> tuple[dict, str]:
    """The manifest and its digest; one asked for by digest is checked against it."""
    container = client.get_container(ref.target)
    _ping(client, ref)
    response = client.do_request(f"{client.prefix}://{container.manifest_url()}", "GET",
                                 headers={"Accept": MANIFEST_MEDIA_TYPE})
    if response.status_code == 404:
        raise UsageError("no such artifact in the registry", str(ref))
    _status(response, ref, "reading the manifest")
    digest = _manifest_digest(response.content)
    if ref.digest and digest != ref.digest:
        raise RemoteError(f"the registry's manifest has digest {digest}, not the one asked for", str(ref))
    return response.json(), digest


def _archive_layer(manifest: dict, ref: Reference) -> dict:
    layers = [layer for layer in manifest.get("layers") or [] if layer.get("mediaType") == LAYER_MEDIA_TYPE]
    if len(layers) != 1:
        kind = manifest.get("artifactType") or (manifest.get("config") or {}).get("mediaType") or "unknown"
        raise UsageError(f"not a tritonpack artifact (artifact type {kind}, {len(layers)} archive layers)",
                         str(ref))
    layer = layers[0]
    if not _DIGEST.fullmatch(str(layer.get("digest"))) or not isinstance(layer.get("size"), int):
        raise RemoteError("the manifest's archive layer has no valid sha256 digest and size", str(ref))
    return layer


def _default_output(layer: dict) -> str:
    title = os.path.basename(str((layer.get("annotations") or {}).get(TITLE) or ""))
    return title if title not in ("", ".", "..") and not title.startswith(".") else DEFAULT_NAME


def _download(client, ref: Reference, layer: dict, output: str) -> None:
    """Stream the layer to ``output`` (``archivedest``: through a temp file, moved in once its sha256 and size
    match the manifest's)."""
    with archive_file(output) as (f, _), client.get_blob(client.get_container(ref.target), layer["digest"],
                                                           stream=True) as response:
        _status(response, ref, "downloading the archive")
        digest, size = hashlib.sha256(), 0
        for chunk in response.iter_content(chunk_size=1 << 20):
            digest.update(chunk)
            size += len(chunk)
            f.write(chunk)
        if "sha256:" + digest.hexdigest() != layer["digest"] or size != layer["size"]:
            raise RemoteError("the downloaded archive does not match the manifest's digest", str(ref))


def pull(reference: str, output: str | os.PathLike | None = None, *, plain_http: bool | None = None) -> PullResult:
    """Pull an archive artifact to ``output`` (default: the name it was pushed under, in the current directory),
    checked against the manifest's digest and written atomically."""
    start = time.perf_counter()
    ref = parse_reference(reference)
    client = _client(ref, plain_http)
    with _remote(ref):
        manifest, digest = _manifest(client, ref)
        layer = _archive_layer(manifest, ref)
        path = os.fspath(output) if output is not None else _default_output(layer)
        _download(client, ref, layer, path)
    return PullResult(reference=str(ref), output=path, digest=digest, archive_digest=layer["digest"],
                      size=layer["size"], annotations=manifest.get("annotations") or {},
                      seconds=time.perf_counter() - start)


class _PulledFile(LocalFile):
    """An archive pulled into a private temp directory, removed on close."""

    def __init__(self, path: str, directory: str, name: str):
        super().__init__(path)
        self._directory = directory
        self.name = name

    def close(self) -> None:
        super().close()
        shutil.rmtree(self._directory, ignore_errors=True)


def pull_to_temp(reference: str) -> LocalFile:
    """Pull to a temp file for reading (``unpack``/``list``/``check oci://...``); gone when the source closes."""
    directory = tempfile.mkdtemp(prefix="tritonpack-oci-")
    try:
        result = pull(reference, os.path.join(directory, DEFAULT_NAME))
        return _PulledFile(result.output, directory, result.reference)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
