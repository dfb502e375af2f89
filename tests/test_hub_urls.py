"""hf:// URLs as huggingface_hub reads and writes them: ``hub.parse`` against its ``parse_hf_uri`` and
``HubFile.url`` against its ``hf_hub_url``, for generated names, revisions and paths."""
from __future__ import annotations

import importlib.util
from urllib.parse import quote, urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tritonpack.hub import HubFile, parse

NAME = st.from_regex(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,18}[A-Za-z0-9])?", fullmatch=True).filter(  # as the Hub's
    lambda n: "--" not in n and ".." not in n and n not in ("models", "datasets", "spaces", "kernels", "buckets"))
SEGMENT = st.text(st.characters(blacklist_categories=("Cs", "Cc"), blacklist_characters="/"), min_size=1,
                  max_size=12).filter(lambda s: s not in (".", ".."))
REVISION = st.one_of(st.just(""), st.from_regex(r"[0-9a-f]{40}", fullmatch=True),
                     st.integers(1, 9999).map(lambda n: f"refs/pr/{n}"),
                     st.lists(st.from_regex(r"[A-Za-z0-9._-]{1,10}", fullmatch=True), min_size=1, max_size=3).map(
                         "/".join).filter(lambda r: not r.startswith("refs/")))
KIND = st.sampled_from(["", "models", "datasets", "spaces", "kernels"])


def written(kind: str, namespace: str, name: str, revision: str, path: str) -> str:
    """The hf:// URL of a file, as huggingface_hub writes one: a revision's slashes as %2F but for refs/pr/N, the
    path as it is."""
    at = "" if not revision else "@" + (revision if revision.startswith("refs/pr/") else quote(revision, safe=""))
    return f"hf://{kind + '/' if kind else ''}{namespace}/{name}{at}/{path}"


@settings(max_examples=300, deadline=None)
@given(KIND, NAME, NAME, REVISION, st.lists(SEGMENT, min_size=1, max_size=3).map("/".join))
def test_a_url_names_the_file_it_was_written_for(kind, namespace, name, revision, path):
    file = parse(written(kind, namespace, name, revision, path))
    assert file == HubFile(kind or "models", f"{namespace}/{name}", revision or "main", path)


@pytest.mark.skipif(importlib.util.find_spec("huggingface_hub") is None, reason="huggingface_hub is not installed")
@settings(max_examples=300, deadline=None)
@given(KIND, NAME, NAME, REVISION, st.lists(SEGMENT, min_size=1, max_size=3).map("/".join))
def test_the_resolve_url_is_huggingface_hubs(kind, namespace, name, revision, path):
    from huggingface_hub import hf_hub_url

    file = parse(written(kind, namespace, name, revision, path))
    repo_type = {"": None, "models": None, "datasets": "dataset", "spaces": "space", "kernels": "kernel"}[kind]
    if repo_type == "kernel":
        from huggingface_hub import constants

        if "kernel" not in getattr(constants, "REPO_TYPES_WITH_KERNEL", constants.REPO_TYPES):
            return  # a huggingface_hub older than kernel repositories
    ours, theirs = file.url("https://hub.example"), hf_hub_url(f"{namespace}/{name}", path, repo_type=repo_type,
                                                               revision=revision or None)
    assert urlsplit(ours).path == urlsplit(theirs).path  # the endpoint aside: 0.2x binds its own at import


@pytest.mark.skipif(importlib.util.find_spec("huggingface_hub") is None, reason="huggingface_hub is not installed")
@settings(max_examples=300, deadline=None)
@given(KIND, NAME, NAME, REVISION, st.lists(SEGMENT, min_size=1, max_size=3).map("/".join))
def test_a_url_reads_as_huggingface_hub_reads_it(kind, namespace, name, revision, path):
    try:
        from huggingface_hub.utils import parse_hf_uri
    except ImportError:
        pytest.skip("huggingface_hub before its URI parser (1.x)")
    url = written(kind, namespace, name, revision, path)
    theirs, ours = parse_hf_uri(url), parse(url)
    assert (theirs.id, theirs.revision or "main", theirs.path_in_repo) == (ours.repo, ours.revision, ours.path)
    assert theirs.type == {"models": "model", "datasets": "dataset", "spaces": "space", "kernels": "kernel"}[ours.kind]
