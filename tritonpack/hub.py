"""Archives on the Hugging Face Hub: ``hf://[TYPE/]NAMESPACE/NAME[@REVISION]/PATH`` read as the file's ``resolve``
URL over HTTP, by the reader ``remote`` has for any URL, with the Hub's credentials sent to the Hub alone.

Not through fsspec's ``HfFileSystem``: its files read ahead 5 MB past every range (an unpack of the benchmark's
8.9 MB archive fetched 32 MB: ``bench/hub_reads.py``), and each of its reads asks the Hub's ``resolve`` endpoint
again, where the HTTP reader follows the redirect once and reads from the CDN it leads to, as a fleet's pods
must to stay under the Hub's rate limits. The first reply names the commit the revision is at
(``X-Repo-Commit``): every later request to the Hub names that commit, so a branch moved while an archive is read
(a new archive pushed to ``main``) changes nothing of what this read gets.
"""
from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING
from urllib.parse import quote, unquote

from .errors import RemoteError, UsageError

if TYPE_CHECKING:
    from .oci import PushResult

FORM = "hf://[TYPE/]NAMESPACE/NAME[@REVISION]/PATH"
_PREFIXES = {"models": "", "datasets": "datasets/", "spaces": "spaces/", "kernels": "kernels/"}
# revisions written with their slashes in an hf:// URL (others say a slash as %2F)
_SPECIAL_REF = re.compile(r"refs/(?:pr/\d+|convert/[\w.-]+)")
COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class HubFile:
    """A file of a repository or bucket on the Hub, as an ``hf://`` URL names it."""

    kind: str  # a key of _PREFIXES, or "buckets"
    repo: str  # NAMESPACE/NAME
    revision: str  # a branch, tag or commit; "" for a bucket, which has none
    path: str  # within the repository, as written

    def uri(self, commit: str) -> str:
        """The file's hf:// URL at ``commit``: it names these bytes alone."""
        return f"hf://{'' if self.kind == 'models' else self.kind + '/'}{self.repo}@{commit}/{self.path}"

    def url(self, endpoint: str, commit: str = "") -> str:
        """The file's ``resolve`` URL under ``endpoint``, at ``commit`` where one is given: as ``huggingface_hub``'s
        ``hf_hub_url`` writes it (the revision one segment, ``refs%2Fpr%2F1``)."""
        if self.kind == "buckets":
            return f"{endpoint}/buckets/{self.repo}/resolve/{quote(self.path)}"
        revision = quote(commit or self.revision, safe="")
        return f"{endpoint}/{_PREFIXES[self.kind]}{self.repo}/resolve/{revision}/{quote(self.path)}"


def parse(url: str) -> HubFile:
    """The file an ``hf://`` URL names, as ``huggingface_hub`` reads its URIs: the revision percent-decoded (a
    branch's slash as ``%2F``; ``main`` by default), the path as written. Raises ``UsageError`` for a URL that
    names no file."""
    body = url.split("://", 1)[1]
    first, _, rest = body.partition("/")
    kind = first if first in _PREFIXES or first == "buckets" else "models"
    if kind != first:
        rest = body
    namespace, _, rest = rest.partition("/")
    name, _, path = rest.partition("/")
    revision = ""
    if "@" in name and kind != "buckets":
        name, _, revision = (name + "/" + path).partition("@")
        special = _SPECIAL_REF.match(revision)
        cut = special.end() if special else (revision.find("/") if "/" in revision else len(revision))
        revision, path = unquote(revision[:cut]), revision[cut + 1:]
        if not revision:
            raise UsageError(f"an empty revision after '@': {FORM}", url)
    if not namespace or not name or not path or "" in path.split("/"):
        raise UsageError(f"not a file on the Hugging Face Hub: {FORM}", url)
    return HubFile(kind, f"{namespace}/{name}", revision or ("" if kind == "buckets" else "main"), path)


@dataclass(frozen=True)
class HubAccess:
    """Where the Hub is and what it is sent: its endpoint (``HF_ENDPOINT``), the token ``huggingface_hub`` finds
    (``HF_TOKEN``, a login's; none with ``HF_HUB_DISABLE_IMPLICIT_TOKEN``) and a User-Agent naming tritonpack.
    Not ``build_hf_headers``: where it finds an AI agent's variables it asks the Hub for a registry of them."""

    endpoint: str
    headers: dict[str, str]

    @property
    def authorized(self) -> bool:
        return "Authorization" in self.headers


def access(url: str) -> HubAccess:
    """The Hub's endpoint and headers, as ``huggingface_hub`` is set up. Raises ``UsageError`` where it is not
    installed, and ``RemoteError`` where ``HF_HUB_OFFLINE`` tells it not to ask the Hub."""
    from . import __version__

    try:
        import huggingface_hub
    except ImportError as e:
        raise UsageError(f"hf:// needs a package that is not installed ({' '.join(str(e).split())}): "
                         "pip install huggingface_hub", url) from None
    try:
        from huggingface_hub import constants, get_token
    except ImportError as e:  # before 0.20, or a dependency of it missing
        raise UsageError(f"hf:// needs huggingface_hub 0.20 or later and its dependencies, and "
                         f"{huggingface_hub.__version__} cannot give its token ({' '.join(str(e).split())}): "
                         "pip install -U huggingface_hub", url) from None
    if constants.HF_HUB_OFFLINE:  # unreachable by choice: ensure trusts its stamp of the URL, as when offline
        raise RemoteError("HF_HUB_OFFLINE is set, so the Hub is not asked: unset it, or unpack a downloaded copy "
                          "of the archive", url)
    headers = {"User-Agent": f"tritonpack/{__version__}"}
    token = None if constants.HF_HUB_DISABLE_IMPLICIT_TOKEN else get_token()
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return HubAccess(constants.ENDPOINT.rstrip("/"), headers)


_REPO_TYPES = {"models": None, "datasets": "dataset", "spaces": "space", "kernels": "kernel"}


def push(archive: str | os.PathLike, url: str) -> PushResult:
    """Upload a local archive to a branch of a repository on the Hub, as one commit that describes it (its
    message: kernels, targets and Triton; its description: what ``oci.artifact_annotations`` gives an OCI
    manifest), with ``huggingface_hub``'s ``upload_file`` and token. The result names the commit, and the hf:// URL
    of the archive at that commit (``pinned``), which ``ensure`` reads once. An archive the branch holds already
    makes no commit (``unchanged``): the branch's commit is the answer."""
    from .oci import PushResult, described

    start = time.perf_counter()
    file = parse(url)
    if file.kind == "buckets":
        raise UsageError("push writes to a repository's branch; a bucket has none (hf buckets cp uploads to one)", url)
    if COMMIT.fullmatch(file.revision):
        raise UsageError("push adds a commit to a branch: name a branch, not a commit (main by default)", url)
    hub = access(url)
    path, notes, digest, size = described(archive)
    message = "tritonpack: {} kernels for {} (Triton {})".format(
        notes["io.tritonpack.kernels"], notes["io.tritonpack.targets"] or "no target",
        notes["io.tritonpack.triton.version"] or "unknown")
    from huggingface_hub import HfApi

    from . import __version__

    api = HfApi(endpoint=hub.endpoint, library_name="tritonpack", library_version=__version__)
    where = {"repo_id": file.repo, "repo_type": _REPO_TYPES[file.kind], "revision": file.revision}
    library = logging.getLogger("huggingface_hub")
    level = library.level
    library.setLevel(logging.ERROR)  # its warning of an unchanged file: said here, in a note
    try:
        before = api.repo_info(**where).sha
        commit = api.upload_file(path_or_fileobj=path, path_in_repo=file.path, commit_message=message,
                                 commit_description="\n".join(f"{k}: {v}" for k, v in notes.items()), **where).oid
    except Exception as e:  # huggingface_hub's HTTP errors, with what the Hub said; a connection's
        refusal = _refusal(e)
        if refusal.startswith(("HTTP 401", "HTTP 403")) and not hub.authorized:
            refusal += " (push needs a token that may write: set HF_TOKEN, or run hf auth login)"
        raise RemoteError(refusal, url) from None
    finally:
        library.setLevel(level)
    return PushResult(archive=path, reference=url, digest=commit, archive_digest=digest, size=size,
                      annotations=notes, seconds=time.perf_counter() - start, pinned=file.uri(commit),
                      unchanged=commit == before)


def _refusal(error: Exception) -> str:
    """One line for a failure of ``huggingface_hub``'s client: an HTTP error as the HTTP reader says one (``HTTP
    404 Not Found: Repository not found``, the Hub's own message after the colon), anything else as it is."""
    from .remote import describe_failure

    response = getattr(error, "response", None)
    status = getattr(response, "status_code", None)
    if not isinstance(status, int):
        return describe_failure(error)
    reason = getattr(response, "reason_phrase", None) or getattr(response, "reason", None) or ""
    said = " ".join(str(getattr(error, "server_message", None) or "").split())[:200]
    return f"HTTP {status} {reason}".rstrip() + (f": {said}" if said else "")
