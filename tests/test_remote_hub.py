"""hf:// archives, against a Hugging Face Hub on 127.0.0.1 (``servers.hugging_face_hub``) that answers ``resolve``
URLs as the Hub does: a redirect to a CDN's signed link that names the commit, errors with the Hub's codes and
messages, private repositories that answer 401 without the token."""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from conftest import pack_with_foreign_stub
from servers import forward_proxy, free_port, hugging_face_hub
from test_remote_hosting import one_line_error, same_tree

import tritonpack
from tritonpack import hub as hub_urls
from tritonpack import remote
from tritonpack.archive.format import HEADER_SIZE, TRAILER_SIZE, parse_trailer
from tritonpack.entry import main


def hub_constants():
    """huggingface_hub's constants: skip without the package (the test extra installs it); under CI, fail."""
    if os.environ.get("CI"):
        import huggingface_hub.constants
        return huggingface_hub.constants
    return pytest.importorskip("huggingface_hub.constants")


@pytest.fixture(scope="module")
def archive(compiled_root, tmp_path_factory):
    root = tmp_path_factory.mktemp("hub") / "cache"
    return pack_with_foreign_stub(compiled_root, root, root.parent / "k.tpack")


@pytest.fixture(scope="module")
def other_archive(compiled_root, tmp_path_factory):
    """Another archive: the compiled kernels for one target."""
    path = tmp_path_factory.mktemp("hub-other") / "other.tpack"
    assert main(["pack", str(compiled_root), "-o", str(path), "--arch", "cuda:90"]) == 0
    return path


def as_the_hub_is_set_up(monkeypatch, tmp_path, endpoint: str) -> None:
    """huggingface_hub pointed at ``endpoint``, with no token (its constants are read as it is imported)."""
    constants = hub_constants()
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "no-token"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for name in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture()
def hub(archive, monkeypatch, tmp_path):
    with hugging_face_hub() as running:
        as_the_hub_is_set_up(monkeypatch, tmp_path, running.endpoint)
        running.commit("team/model", {"kernels/k.tpack": archive.read_bytes()})
        yield running


def ranges(asked) -> list[str]:
    return [a[3] for a in asked]


def test_list_asks_the_hub_once_and_reads_three_ranges_from_its_cdn(archive, hub, capsys):
    url = "hf://team/model/kernels/k.tpack"
    assert main(["list", url, "--json"]) == 0
    assert main(["list", str(archive), "--json"]) == 0
    listed, local = (json.loads(doc) for doc in capsys.readouterr().out.splitlines())
    del listed["archive"], local["archive"]
    assert listed == local
    trailer = parse_trailer(archive.read_bytes()[-TRAILER_SIZE:], archive.stat().st_size, str(archive))
    index = f"bytes={trailer.index_offset}-{trailer.index_offset + trailer.index_length - 1}"
    assert [(a[0], a[2].split("?")[0]) for a in hub.by("hub")] == [("hub", "/team/model/resolve/main/kernels/k.tpack")]
    assert ranges(hub.asked) == [f"bytes=-{TRAILER_SIZE}", f"bytes=-{TRAILER_SIZE}", f"bytes=0-{HEADER_SIZE - 1}",
                                 index]
    assert not any(a[4] for a in hub.asked)  # no token found, none sent


def test_unpack_and_ensure_read_only_their_blocks_each_once(archive, hub, tmp_path, capsys):
    """An unpack fetches the blocks it writes from, each once, and asks the Hub once: fsspec's HfFileSystem read
    5 MB ahead of each range (3.6 times the archive for an unpack: bench/hub_reads.py) and asked the Hub for each."""
    url = "hf://team/model/kernels/k.tpack"
    for args in (["--arch", "90"], []):
        hub.asked.clear()
        name = "-".join(args) or "all"
        assert main(["unpack", url, "--cache-dir", str(tmp_path / f"hub{name}"), *args]) == 0
        assert main(["unpack", str(archive), "--cache-dir", str(tmp_path / f"file{name}"), *args]) == 0
        same_tree(tmp_path / f"hub{name}", tmp_path / f"file{name}")
        assert len(hub.by("hub")) == 1
        reads = ranges(hub.by("cdn"))[3:]  # after the trailer, header and index
        assert len(reads) == len(set(reads))
        fetched = sum(int(b) - int(a) + 1 for a, b in (r.removeprefix("bytes=").split("-") for r in reads))
        assert fetched <= archive.stat().st_size
    capsys.readouterr()
    root = tmp_path / "ensured"
    assert tritonpack.ensure(url, root).status == "unpacked"
    assert tritonpack.ensure(url, root).status == "present"
    shutil.rmtree(root / ".tritonpack")  # its stamps and lock
    same_tree(root, tmp_path / "fileall")


def test_a_branch_moved_while_an_archive_is_read_changes_nothing_of_that_read(archive, other_archive, hub, tmp_path,
                                                                             monkeypatch):
    """A new archive pushed to main after the first read: the signed links expire after two ranges, so the read goes
    back to the Hub several times, each time at the commit the first reply named, and unpacks the first archive
    whole. ``ensure`` likewise stamps the archive of the digest it read."""
    url = "hf://team/model/kernels/k.tpack"
    first = hub.refs["team/model", "main"]
    hub.link_uses = 2
    size = remote.FsspecSource.size

    def size_then_push(self):
        result = size(self)
        if hub.refs["team/model", "main"] == first:
            hub.commit("team/model", {"kernels/k.tpack": other_archive.read_bytes()})
        return result

    monkeypatch.setattr(remote.FsspecSource, "size", size_then_push)
    assert main(["unpack", url, "--cache-dir", str(tmp_path / "hub")]) == 0
    paths = [a[2] for a in hub.by("hub")]
    assert paths[0] == "/team/model/resolve/main/kernels/k.tpack" and len(paths) > 2
    assert set(paths[1:]) == {f"/team/model/resolve/{first}/kernels/k.tpack"}
    assert main(["unpack", str(archive), "--cache-dir", str(tmp_path / "file")]) == 0
    same_tree(tmp_path / "hub", tmp_path / "file")

    hub.commit("team/model", {"kernels/k.tpack": archive.read_bytes()})
    first = hub.refs["team/model", "main"]  # size_then_push pushes the other archive after ensure's first read
    result = tritonpack.ensure(url, tmp_path / "ensured")
    with tritonpack.open(archive) as reader:
        assert (result.status, result.digest) == ("unpacked", reader.digest)


def test_a_resolve_url_is_read_as_any_url_and_a_push_meanwhile_fails_it(archive, other_archive, hub, tmp_path,
                                                                          monkeypatch, capsys):
    """The https:// form of the same file is not pinned: once its link expires, the Hub's redirect leads to the
    new archive, which the reader refuses rather than read half from each."""
    url = f"{hub.endpoint}/team/model/resolve/main/kernels/k.tpack"
    hub.link_uses = 2
    size = remote.FsspecSource.size

    def size_then_push(self):
        result = size(self)
        hub.commit("team/model", {"kernels/k.tpack": other_archive.read_bytes()})
        return result

    monkeypatch.setattr(remote.FsspecSource, "size", size_then_push)
    assert main(["unpack", url, "--cache-dir", str(tmp_path / "root")]) == 7
    assert "the archive changed on the server while it was read" in one_line_error(capsys, url)


def test_a_private_repository_takes_the_token_to_the_hub_alone(archive, hub, monkeypatch, capsys):
    url = "hf://team/private/k.tpack"
    hub.commit("team/private", {"k.tpack": archive.read_bytes()})
    hub.private.add("team/private")
    assert main(["list", url]) == 7
    assert one_line_error(capsys, url) == ("HTTP 401 Unauthorized: Repository not found (a private or gated "
                                           "repository needs a token: set HF_TOKEN, or run hf auth login)")
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    assert main(["list", url]) == 7
    assert one_line_error(capsys, url) == "HTTP 401 Unauthorized: Invalid credentials in Authorization header"
    monkeypatch.setenv("HF_TOKEN", hub.token)
    hub.asked.clear()
    assert main(["list", url]) == 0
    assert {a[4] for a in hub.by("hub")} == {f"Bearer {hub.token}"}
    assert {a[4] for a in hub.by("cdn")} == {None}


def test_the_hub_and_its_cdn_are_reached_through_the_environments_proxy(archive, hub, monkeypatch, capsys):
    url = "hf://team/model/kernels/k.tpack"
    with forward_proxy() as proxy:
        monkeypatch.setenv("HTTPS_PROXY", proxy.url)
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        assert main(["list", url]) == 0
    assert len(proxy.asked) == len(hub.asked) == 4 and proxy.asked[0].startswith(hub.endpoint)
    assert all(sent.endswith(asked[2]) for sent, asked in zip(proxy.asked, hub.asked, strict=True))  # the Hub, its CDN


def test_ensure_of_a_commit_asks_the_hub_nothing_once_done(archive, hub, tmp_path):
    """hf:// at a commit names bytes that cannot change: once ensured, the stamp answers, with no request (a pod's
    start no longer needs the Hub); at a branch, each ensure reads the digest again."""
    commit = hub.refs["team/model", "main"]
    pinned, branch, root = f"hf://team/model@{commit}/kernels/k.tpack", "hf://team/model/kernels/k.tpack", tmp_path
    assert tritonpack.ensure(pinned, root).status == "unpacked"
    hub.asked.clear()
    result = tritonpack.ensure(pinned, root)
    assert (result.status, result.unreachable, hub.asked) == ("present", "", [])
    at_branch = tritonpack.ensure(branch, root)
    assert at_branch.status == "present" and len(hub.by("hub")) == 1
    assert at_branch.pinned == pinned and not result.pinned  # the branch's result names its commit's URL
    assert f"read at a commit: {pinned} names this archive alone" in "\n".join(at_branch.notes())
    shutil.rmtree(next(p for p in root.iterdir() if p.is_dir() and p.name != ".tritonpack"))  # a key directory
    hub.asked.clear()
    assert tritonpack.ensure(pinned, root).status == "unpacked" and hub.asked  # an entry gone: read, written again


def test_ensure_offline_trusts_its_stamp_of_the_url(hub, monkeypatch, tmp_path):
    """A pod that runs with HF_HUB_OFFLINE set, its kernels ensured when its image was built: present, as for a
    Hub that cannot be reached, and the result says why the archive was not read."""
    url, root = "hf://team/model/kernels/k.tpack", tmp_path / "root"
    assert tritonpack.ensure(url, root).status == "unpacked"
    monkeypatch.setattr(hub_constants(), "HF_HUB_OFFLINE", True)
    hub.asked.clear()
    result = tritonpack.ensure(url, root)
    assert result.status == "present" and result.unreachable.startswith("HF_HUB_OFFLINE is set")
    assert not hub.asked
    with pytest.raises(tritonpack.RemoteError, match="HF_HUB_OFFLINE is set"):
        tritonpack.ensure(url, tmp_path / "never-ensured")


def test_push_commits_the_archive_described_and_names_it_at_that_commit(archive, hub, monkeypatch, tmp_path, capsys):
    """push to a branch: one commit whose message and description say what the archive holds, the commit and
    the hf:// URL at it in the result; ensure reads what was pushed. The same archive again makes no commit
    (huggingface_hub 0.24 and later see it unchanged), and the result says whether one was made."""
    monkeypatch.setenv("HF_TOKEN", hub.token)
    url = "hf://team/model/kernels/h100.tpack"
    assert main(["push", str(archive), url]) == 0
    out, err = capsys.readouterr()
    commit = hub.refs["team/model", "main"]
    pinned = f"hf://team/model@{commit}/kernels/h100.tpack"
    assert out.startswith(f"pushed {archive} (") and out.rstrip().endswith(commit)
    assert err.splitlines() == [f"this push alone, whatever is pushed after it: {pinned}"]
    assert hub.commits[commit]["kernels/h100.tpack"] == archive.read_bytes()
    with tritonpack.open(archive) as reader:
        notes = tritonpack.oci.artifact_annotations(reader.info, reader.entries, reader.digest)
    assert hub.messages[commit] == (
        f"tritonpack: {notes['io.tritonpack.kernels']} kernels for {notes['io.tritonpack.targets']} "
        f"(Triton {notes['io.tritonpack.triton.version']})", "\n".join(f"{k}: {v}" for k, v in notes.items()))
    assert {a[4] for a in hub.by("hub") if a[1] == "POST"} == {f"Bearer {hub.token}"}
    result = tritonpack.ensure(pinned, tmp_path / "root")
    with tritonpack.open(archive) as reader:
        assert (result.status, result.digest) == ("unpacked", reader.digest)

    assert main(["push", str(archive), url, "--json"]) == 0
    again, head = json.loads(capsys.readouterr().out), hub.refs["team/model", "main"]
    assert again["digest"] == head and again["unchanged"] == (head == commit)
    assert again["pinned"] == f"hf://team/model@{head}/kernels/h100.tpack"


@pytest.mark.parametrize("url, code, message", [
    ("hf://team/model@0123456789abcdef0123456789abcdef01234567/k.tpack", 2,
     "push adds a commit to a branch: name a branch, not a commit (main by default)"),
    ("hf://buckets/team/store/k.tpack", 2,
     "push writes to a repository's branch; a bucket has none (hf buckets cp uploads to one)"),
    ("hf://team/missing/k.tpack", 7, "HTTP 404 Not Found: Repository not found"),
    ("hf://team/model@nobranch/k.tpack", 7, "HTTP 404 Not Found: Invalid rev id: nobranch"),
])
def test_push_refusals_are_one_line(archive, hub, monkeypatch, capsys, url, code, message):
    monkeypatch.setenv("HF_TOKEN", hub.token)
    assert main(["push", str(archive), url]) == code
    assert one_line_error(capsys, url).startswith(message)


def test_push_without_a_token_or_of_a_bad_archive_is_one_line(archive, hub, tmp_path, capsys):
    url = "hf://team/model/k.tpack"
    assert main(["push", str(archive), url]) == 7
    assert one_line_error(capsys, url) == ("HTTP 401 Unauthorized: Invalid credentials in Authorization header "
                                           "(push needs a token that may write: set HF_TOKEN, or run hf auth login)")
    bad = tmp_path / "bad.tpack"
    bad.write_bytes(archive.read_bytes()[:-100])
    hub.asked.clear()
    assert main(["push", str(bad), url]) == 3
    assert capsys.readouterr().err.startswith(f"error: {bad}: ") and not hub.asked  # refused before any request


@pytest.mark.parametrize("url, asked", [
    ("hf://team/model@v1/k.tpack", "/team/model/resolve/v1/k.tpack"),
    ("hf://models/team/model@v1/k.tpack", "/team/model/resolve/v1/k.tpack"),
    ("hf://team/model@refs/pr/1/k.tpack", "/team/model/resolve/refs%2Fpr%2F1/k.tpack"),
    ("hf://team/model@feature%2Fkernels/k.tpack", "/team/model/resolve/feature%2Fkernels/k.tpack"),
    ("hf://datasets/team/data/sub dir/k.tpack", "/datasets/team/data/resolve/main/sub%20dir/k.tpack"),
    ("hf://spaces/team/demo/k.tpack", "/spaces/team/demo/resolve/main/k.tpack"),
    ("hf://kernels/team/ops/k.tpack", "/kernels/team/ops/resolve/main/k.tpack"),
    ("hf://buckets/team/store/k.tpack", "/buckets/team/store/resolve/k.tpack"),
])
def test_hf_urls_name_types_revisions_and_buckets_as_the_hub_does(archive, hub, url, asked, capsys):
    data = archive.read_bytes()
    hub.commit("team/model", {"k.tpack": data}, ref="v1")
    hub.commit("team/model", {"k.tpack": data}, ref="refs/pr/1")
    hub.commit("team/model", {"k.tpack": data}, ref="feature/kernels")
    hub.commit("datasets/team/data", {"sub dir/k.tpack": data})
    hub.commit("spaces/team/demo", {"k.tpack": data})
    hub.commit("kernels/team/ops", {"k.tpack": data})
    hub.commit("team/store", {"k.tpack": data})
    assert main(["list", url]) == 0
    assert hub.by("hub")[0][2] == asked
    commit = hub.refs["team/model", "main"]
    assert main(["list", f"hf://team/model@{commit}/kernels/k.tpack"]) == 0
    assert hub.by("hub")[-1][2] == f"/team/model/resolve/{commit}/kernels/k.tpack"


@pytest.mark.parametrize("url, code, message", [
    ("hf://team/model/missing.tpack", 2, "no such archive (not found on the server: Entry not found)"),
    ("hf://team/model@nope/kernels/k.tpack", 2, "no such archive (not found on the server: Invalid rev id: nope)"),
    ("hf://team/model", 2, f"not a file on the Hugging Face Hub: {hub_urls.FORM}"),
    ("hf://team/model@/k.tpack", 2, f"an empty revision after '@': {hub_urls.FORM}"),
    ("hf://team", 2, f"not a file on the Hugging Face Hub: {hub_urls.FORM}"),
])
def test_what_the_hub_has_not_is_one_line(hub, capsys, url, code, message):
    assert main(["list", url]) == code
    assert one_line_error(capsys, url) == message


def test_hf_urls_fail_in_one_line_offline_without_huggingface_hub_or_without_a_hub(monkeypatch, tmp_path, capsys):
    url = "hf://team/models/k.tpack"
    constants = hub_constants()
    as_the_hub_is_set_up(monkeypatch, tmp_path, f"http://127.0.0.1:{free_port()}")  # nothing answers
    assert main(["list", url]) == 7
    assert one_line_error(capsys, url).startswith("cannot connect to 127.0.0.1:")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert main(["list", url]) == 7
    assert one_line_error(capsys, url).startswith("HF_HUB_OFFLINE is set, so the Hub is not asked")
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)
    assert main(["list", url]) == 2
    message = one_line_error(capsys, url)
    assert message.startswith("hf:// needs a package that is not installed") and "huggingface_hub" in message
