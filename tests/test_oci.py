"""Archives as OCI artifacts, against a real registry (Debian's docker-registry) on 127.0.0.1: push, annotations
read back through oras' own manifest API, pull byte-identical, and unpack straight from the registry."""
from __future__ import annotations

import hashlib
import json
import os

import pytest

pytest.importorskip("oras")

from conftest import fifo_reader, snapshot
from servers import free_port, http_registry, registry

import tritonpack
from tritonpack.entry import main
from tritonpack.oci import ARTIFACT_TYPE, LAYER_MEDIA_TYPE, TITLE, Reference, parse_reference


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    with registry(tmp_path_factory.mktemp("registry")) as address:
        yield address


@pytest.fixture(scope="module")
def archive(compiled_root, tmp_path_factory):
    path = tmp_path_factory.mktemp("oci-archive") / "kernels.tpack"
    tritonpack.pack(compiled_root, path)
    return path


@pytest.fixture(scope="module")
def pushed(host, archive):
    """The archive pushed once, by the command line, as oci://HOST/triton/kernels:v1."""
    reference = f"oci://{host}/triton/kernels:v1"
    assert main(["push", str(archive), reference, "-q"]) == 0
    return reference


def test_manifest_annotations_describe_the_archive_without_pulling_it(host, archive, pushed):
    import oras.client
    from kernels import TRITON_VERSION, targets

    manifest = oras.client.OrasClient(hostname=host, insecure=True).get_manifest(f"{host}/triton/kernels:v1")
    assert manifest["artifactType"] == ARTIFACT_TYPE
    [layer] = manifest["layers"]
    assert layer["mediaType"] == LAYER_MEDIA_TYPE and layer["size"] == archive.stat().st_size
    assert layer["annotations"][TITLE] == "kernels.tpack"
    notes = manifest["annotations"]
    with tritonpack.open(archive) as reader:
        digest, kernels = reader.digest, sum(e.kind == "group" for e in reader.entries)
    expected_targets = sorted(f"{t.backend}:{t.arch}" for t in targets())
    assert notes["io.tritonpack.targets"] == ",".join(expected_targets)
    assert notes["io.tritonpack.kernels"] == str(kernels) and kernels == 3 * len(targets())
    assert notes["io.tritonpack.index.sha256"] == digest
    assert notes["io.tritonpack.triton.version"].startswith("{}.{}".format(*TRITON_VERSION))
    assert notes["io.tritonpack.format"] == "1.0"
    assert tritonpack.oci.fetch_manifest(pushed)["annotations"] == notes  # the same, from tritonpack's API


def test_pull_is_byte_identical(pushed, archive, tmp_path, monkeypatch, capsys):
    out = tmp_path / "pulled.tpack"
    assert main(["pull", pushed, "-o", str(out)]) == 0
    assert out.read_bytes() == archive.read_bytes()
    assert capsys.readouterr().out.startswith(f"pulled {pushed} (")
    monkeypatch.chdir(tmp_path)
    result = tritonpack.pull(pushed)  # no output: the name it was pushed under, here
    assert result.output == "kernels.tpack" and (tmp_path / "kernels.tpack").read_bytes() == archive.read_bytes()
    assert result.annotations["io.tritonpack.kernels"]


def test_pull_follows_a_symlink_and_writes_a_fifo_in_place(pushed, archive, tmp_path):
    """The same output rules as pack's (``test_archive_output.py``): the link's target replaced, the link kept;
    a FIFO's reader gets the archive; no temp file left."""
    (tmp_path / "real.tpack").write_bytes(b"the previous archive")
    (tmp_path / "link.tpack").symlink_to("real.tpack")
    assert main(["pull", pushed, "-o", str(tmp_path / "link.tpack"), "-q"]) == 0
    assert os.readlink(tmp_path / "link.tpack") == "real.tpack"
    assert (tmp_path / "real.tpack").read_bytes() == archive.read_bytes()
    with fifo_reader(tmp_path / "pipe") as received:
        assert main(["pull", pushed, "-o", str(tmp_path / "pipe"), "-q"]) == 0
    assert received == [archive.read_bytes()]
    assert sorted(os.listdir(tmp_path)) == ["link.tpack", "pipe", "real.tpack"]


def test_unpack_and_list_from_the_registry(pushed, tmp_path, capsys):
    from kernels import HAS_LISTENER, compile_all

    assert main(["list", pushed]) == 0
    assert "add_kernel" in capsys.readouterr().out
    root = tmp_path / "cache"
    result = tritonpack.unpack(pushed, root)
    assert result.archive == pushed and result.written == result.entries > 0
    before = snapshot(root)
    hits = compile_all(root)
    if HAS_LISTENER:
        assert hits and all(hits), hits
    assert snapshot(root) == before
    assert not list(tmp_path.glob("tritonpack-oci-*"))


def test_errors_are_one_line(host, archive, tmp_path, capsys):
    missing = f"oci://{host}/triton/kernels:nope"
    assert main(["pull", missing, "-o", str(tmp_path / "x.tpack")]) == 2
    assert capsys.readouterr().err == f"error: {missing}: no such artifact in the registry\n"
    down = f"oci://127.0.0.1:{free_port()}/triton/kernels:v1"
    assert main(["push", str(archive), down]) == 7
    err = capsys.readouterr().err
    assert err.startswith(f"error: {down}: cannot connect to registry 127.0.0.1:") and err.count("\n") == 1
    bad = tmp_path / "bad.tpack"
    bad.write_bytes(b"not an archive at all")
    assert main(["push", str(bad), f"oci://{host}/triton/bad:v1"]) == 3  # refused before anything is sent
    assert "bad magic" in capsys.readouterr().err
    assert main(["pull", f"oci://{host}/triton/bad:v1", "-o", str(tmp_path / "y.tpack")]) == 2
    assert not (tmp_path / "y.tpack").exists()


def test_other_artifacts_are_refused(host, tmp_path, monkeypatch, capsys):
    import oras.client

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes.txt").write_text("not kernels")
    oras.client.OrasClient(hostname=host, insecure=True).push(f"{host}/other/thing:v1", files=["notes.txt"],
                                                              quiet=True)
    assert main(["pull", f"oci://{host}/other/thing:v1"]) == 2
    assert "not a tritonpack artifact" in capsys.readouterr().err


def test_push_and_pull_report_the_same_manifest_digest_and_either_pulls(host, archive, tmp_path, capsys):
    """``digest`` is the manifest's in both results (what ``@DIGEST`` pulls); ``archive_digest`` the file's."""
    tagged = f"oci://{host}/triton/digests:v1"
    pushed = tritonpack.push(archive, tagged)
    archive_digest = "sha256:" + hashlib.sha256(archive.read_bytes()).hexdigest()
    assert pushed.archive_digest == archive_digest and pushed.digest != archive_digest
    assert pushed.pinned == f"oci://{host}/triton/digests@{pushed.digest}"  # what pulls this push alone
    assert main(["pull", tagged, "-o", str(tmp_path / "tag.tpack"), "--json"]) == 0
    by_tag = json.loads(capsys.readouterr().out)
    assert (by_tag["digest"], by_tag["archive_digest"]) == (pushed.digest, archive_digest)
    for name, digest in (("pull", by_tag["digest"]), ("push", pushed.digest)):
        pinned = f"oci://{host}/triton/digests@{digest}"
        out = tmp_path / f"{name}.tpack"
        assert main(["pull", pinned, "-o", str(out)]) == 0
        assert capsys.readouterr().out.rstrip().endswith(f": {digest}")
        assert out.read_bytes() == archive.read_bytes()
    assert tritonpack.pull(f"oci://{host}/triton/digests@{pushed.digest}", tmp_path / "api.tpack").digest == \
        pushed.digest
    layer = f"oci://{host}/triton/digests@{archive_digest}"  # not a manifest's digest: refused in one line
    assert main(["pull", layer, "-o", str(tmp_path / "layer.tpack")]) != 0
    err = capsys.readouterr().err
    assert err.startswith(f"error: {layer}: ") and err.count("\n") == 1
    assert not (tmp_path / "layer.tpack").exists()


UNKNOWN = json.dumps({"errors": [{"code": "UNKNOWN", "message": "unknown error"}]}).encode()


def broken(method: str, path: str, times: int) -> tuple[int, bytes]:
    return 500, UNKNOWN


def broken_but_v2(method: str, path: str, times: int) -> tuple[int, bytes]:
    return (200, b"{}") if path == "/v2/" else (500, UNKNOWN)


@pytest.mark.parametrize("answer", [broken, broken_but_v2])
@pytest.mark.parametrize("command", [["pull", "-q"], ["pull"], ["list"], ["unpack", "--cache-dir"]])
def test_a_registry_answering_500_gets_one_error_line_and_one_retry(answer, command, tmp_path, capfd):
    """Not oras' five retries, 2+3^n s apart (over two minutes), nor its log lines on standard error."""
    with http_registry(answer) as (address, seen):
        reference = f"oci://{address}/triton/kernels@sha256:{'1' * 64}"
        argv = [command[0], reference, *command[1:]]
        argv += [str(tmp_path / "cache")] if command[0] == "unpack" else []
        argv += ["-o", str(tmp_path / "z.tpack")] if command[0] == "pull" else []
        assert main(argv) == 7
    out, err = capfd.readouterr()
    what = "reading the manifest" if answer is broken_but_v2 else "GET /v2/"
    assert (out, err) == ("", f"error: {reference}: {what}: HTTP 500 Internal Server Error (unknown error)\n")
    assert max(seen.count(request) for request in seen) == 2, seen  # one quick retry
    assert sorted(os.listdir(tmp_path)) == []


def test_a_registry_that_never_answers_times_out_in_one_line(tmp_path, monkeypatch, capfd):
    """oras sets no timeout: a registry that took the connection and never answered hung a pod's start."""
    import time

    from tritonpack import remote

    monkeypatch.setattr(remote, "SERVER_TIMEOUT", (5, 0.3))

    def silent(method: str, path: str, times: int) -> tuple[int, bytes]:
        if path != "/v2/":
            time.sleep(1.5)
        return 200, b"{}"

    with http_registry(silent) as (address, seen):
        reference = f"oci://{address}/triton/kernels:v1"
        assert main(["pull", reference, "-o", str(tmp_path / "z.tpack")]) == 7
    out, err = capfd.readouterr()
    assert out == "" and err.startswith(f"error: {reference}: ") and "timed out" in err and err.count("\n") == 1
    assert seen == ["GET /v2/", "GET /v2/triton/kernels/manifests/v1"] and os.listdir(tmp_path) == []


def test_a_transient_5xx_is_retried_once(tmp_path, capfd):
    def flaky(method: str, path: str, times: int) -> tuple[int, bytes]:
        if times == 1:
            return 503, b"{}"
        unknown = json.dumps({"errors": [{"code": "MANIFEST_UNKNOWN", "message": "manifest unknown"}]}).encode()
        return (200, b"{}") if path == "/v2/" else (404, unknown)

    with http_registry(flaky) as (address, seen):
        reference = f"oci://{address}/triton/kernels:v1"
        assert main(["pull", reference, "-o", str(tmp_path / "z.tpack")]) == 2
    assert capfd.readouterr() == ("", f"error: {reference}: no such artifact in the registry\n")
    assert seen == ["GET /v2/"] * 2 + ["GET /v2/triton/kernels/manifests/v1"] * 2


def test_a_write_answered_500_is_not_retried(archive, capfd):
    with http_registry(broken_but_v2) as (address, seen):
        reference = f"oci://{address}/triton/kernels:v1"
        assert main(["push", str(archive), reference, "-q"]) == 7
    out, err = capfd.readouterr()
    assert out == "" and err.startswith(f"error: {reference}: ") and err.count("\n") == 1, err
    assert [r for r in seen if not r.startswith(("GET ", "HEAD "))] == ["POST /v2/triton/kernels/blobs/uploads/"]


def test_push_sends_the_archive_from_disk_a_mib_at_a_time(host, compiled_root, tmp_path):
    """oras' upload_blob reads the whole file into memory (a 4 GB archive took 4 GB): push streams it instead, and
    the registry gets every byte."""
    import base64
    import shutil
    import tracemalloc

    root = tmp_path / "cache"
    shutil.copytree(compiled_root, root)
    key = base64.b32encode(hashlib.sha256(b"large stub").digest()).decode().rstrip("=")
    (root / key).mkdir()
    (root / key / "cuda_utils.cpython-311-x86_64-linux-gnu.so").write_bytes(os.urandom(48 << 20))
    archive = tmp_path / "large.tpack"
    tritonpack.pack(root, archive, level=1)
    size = archive.stat().st_size
    reference = f"oci://{host}/triton/large:v1"
    tracemalloc.start()
    try:
        pushed = tritonpack.push(archive, reference)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert size > 48 << 20 and peak < 8 << 20, (size, peak)
    pulled = tritonpack.pull(reference, tmp_path / "pulled.tpack")
    digest = f"sha256:{hashlib.sha256(archive.read_bytes()).hexdigest()}"
    assert pulled.archive_digest == pushed.archive_digest == digest
    assert (tmp_path / "pulled.tpack").read_bytes() == archive.read_bytes()


DIGEST = "sha256:" + "0" * 64


@pytest.mark.parametrize("url, expected, text, loopback", [
    ("oci://127.0.0.1:5000/triton/kernels:v1", Reference("127.0.0.1:5000", "triton/kernels", "v1"),
     "oci://127.0.0.1:5000/triton/kernels:v1", True),
    ("oci://localhost:5000/kernels", Reference("localhost:5000", "kernels", "latest"),
     "oci://localhost:5000/kernels:latest", True),
    ("oci://[::1]:5000/kernels:a.b", Reference("[::1]:5000", "kernels", "a.b"), "oci://[::1]:5000/kernels:a.b", True),
    (f"oci://registry.example/a/b@{DIGEST}", Reference("registry.example", "a/b", None, DIGEST),
     f"oci://registry.example/a/b@{DIGEST}", False),
    ("oci://docker.io/team/kernels:v2", Reference("registry-1.docker.io", "team/kernels", "v2"),
     "oci://registry-1.docker.io/team/kernels:v2", False),  # as docker reads Docker Hub's names
    ("oci://index.docker.io/kernels", Reference("registry-1.docker.io", "library/kernels", "latest"),
     "oci://registry-1.docker.io/library/kernels:latest", False),
])
def test_references(url, expected, text, loopback):
    ref = parse_reference(url)
    assert ref == expected and str(ref) == text and ref.loopback == loopback


@pytest.mark.parametrize("url", ["oci://", "oci://host", "oci://host/UPPER:v1", "oci://host/r:bad tag"])
def test_bad_references(url):
    with pytest.raises(tritonpack.UsageError):
        parse_reference(url)
