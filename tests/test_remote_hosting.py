"""Archives by URL as they are hosted next to model checkpoints, against real servers on 127.0.0.1: S3 itself
(moto's server)."""
from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import os
import shutil
import sys

import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from conftest import snapshot
from servers import free_port, running

import tritonpack
from tritonpack import remote
from tritonpack.archive.writer import BLOCK_SIZE
from tritonpack.entry import main

FOREIGN_STUB = "cuda_utils.cpython-38-x86_64-linux-gnu.so"  # another Python's launcher: the preflight skips it
STUB_BYTES = BLOCK_SIZE + (1 << 20)  # > the writer's block target: the stub gets a block of its own


@pytest.fixture(scope="module")
def archive(compiled_root, tmp_path_factory):
    """The compiled kernels plus a launcher stub for another Python in a block of its own."""
    root = tmp_path_factory.mktemp("hosted") / "cache"
    shutil.copytree(compiled_root, root)
    key = base64.b32encode(hashlib.sha256(b"foreign stub").digest()).decode().rstrip("=")
    (root / key).mkdir()
    (root / key / FOREIGN_STUB).write_bytes(os.urandom(STUB_BYTES))
    path = root.parent / "k.tpack"
    tritonpack.pack(root, path)
    return path


def listing(location: str, capsys) -> dict:
    assert main(["list", location, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    del doc["archive"]
    return doc


def one_line_error(capsys, url: str) -> str:
    err = capsys.readouterr().err
    assert err.startswith(f"error: {url}: ") and err.count("\n") == 1, err
    return err.removeprefix(f"error: {url}: ").rstrip("\n")


def same_tree(a, b) -> None:
    """Two roots unpacked from the same archive hold the same files (manifests naming their own root)."""
    files_a, files_b = snapshot(a), snapshot(b)
    assert files_a.keys() == files_b.keys() and files_a
    for rel in files_a:
        if "__grp__" in rel:
            assert (a / rel).read_text().replace(str(a), str(b)) == (b / rel).read_text()
        else:
            assert files_a[rel][2] == files_b[rel][2], rel


# -- S3, against moto's server --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """moto's S3 server (the test extra installs moto; without it these tests skip, under CI they fail): its URL
    and its log, a line per request."""
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("s3fs") is None:
        reason = "moto and s3fs are not installed (pip install '.[test]')"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    port = free_port()
    directory = tmp_path_factory.mktemp("moto")
    with running([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port,
                 directory / "moto.log"):
        yield f"http://127.0.0.1:{port}", directory / "moto.log"


@pytest.fixture()
def s3(s3_endpoint, monkeypatch, tmp_path):
    """A bucket on moto, reached as a user reaches MinIO or R2: ``AWS_ENDPOINT_URL_S3`` and keys in the
    environment, no AWS configuration files."""
    import boto3
    import s3fs

    endpoint, log = s3_endpoint
    for name in [n for n in os.environ if n.startswith(("AWS_", "FSSPEC_S3"))]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "tritonpack")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "tritonpack-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance metadata to wait for
    s3fs.S3FileSystem.clear_instance_cache()  # made with another test's environment
    client = boto3.client("s3", endpoint_url=endpoint)
    bucket = f"models-{tmp_path.name.lower().replace('_', '-')}"[:63].rstrip("-")
    client.create_bucket(Bucket=bucket)
    yield client, bucket, log
    s3fs.S3FileSystem.clear_instance_cache()


def test_s3_archives_list_unpack_and_ensure_by_ranges(archive, s3, tmp_path, capsys):
    client, bucket, log = s3
    client.upload_file(str(archive), bucket, "k.tpack")
    url = f"s3://{bucket}/k.tpack"
    assert listing(url, capsys) == listing(str(archive), capsys)
    assert main(["unpack", url, "--cache-dir", str(tmp_path / "url"), "--arch", "90"]) == 0
    assert main(["unpack", str(archive), "--cache-dir", str(tmp_path / "file"), "--arch", "90"]) == 0
    capsys.readouterr()
    same_tree(tmp_path / "url", tmp_path / "file")
    reads = [line for line in log.read_text().splitlines() if f"GET /{bucket}/k.tpack " in line]
    assert len(reads) >= 6 and all(line.endswith(" 206 -") for line in reads), reads  # ranges, never all of it

    root = tmp_path / "ensured"
    first = tritonpack.ensure(url, root)
    assert first.status == "unpacked" and tritonpack.ensure(url, root).status == "present"
    client.delete_object(Bucket=bucket, Key="k.tpack")
    trusted = tritonpack.ensure(url, root)
    assert (trusted.status, trusted.digest) == ("present", first.digest)
    assert trusted.unreachable == "no such archive (not found on the server)"
    assert main(["list", url]) == 2
    assert one_line_error(capsys, url) == "no such archive (not found on the server)"


def test_s3_without_credentials_is_one_line(archive, s3, monkeypatch, capsys):
    import s3fs

    client, bucket, _ = s3
    client.upload_file(str(archive), bucket, "k.tpack")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    s3fs.S3FileSystem.clear_instance_cache()
    url = f"s3://{bucket}/k.tpack"
    assert main(["list", url]) == 7
    assert one_line_error(capsys, url) == remote.NO_CREDENTIALS
