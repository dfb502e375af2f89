"""Archives by URL, against a real nginx on 127.0.0.1: listing costs three range requests and a few kB of a
multi-MB archive, unpacking fetches only the blocks it writes, and the result hits like a local unpack."""
from __future__ import annotations

import json
import shutil

import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from conftest import FOREIGN_STUB, pack_with_foreign_stub, snapshot
from conftest import FOREIGN_STUB_BYTES as STUB_BYTES
from servers import free_port, nginx

import tritonpack
from tritonpack.archive.format import HEADER_SIZE, TRAILER_SIZE, parse_trailer
from tritonpack.entry import main


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with nginx(tmp_path_factory.mktemp("nginx")) as running:
        yield running


@pytest.fixture(scope="module")
def big(server, compiled_root, tmp_path_factory):
    """The compiled kernels plus a launcher stub larger than a block built for another Python, served by nginx."""
    root = tmp_path_factory.mktemp("big") / "cache"
    return pack_with_foreign_stub(compiled_root, root, server.www / "big.tpack")


@pytest.fixture()
def log(server):
    server.reset_log()
    return server


def test_list_fetches_header_trailer_and_index_only(big, log, capsys):
    url = f"{log.url}/big.tpack"
    assert main(["list", url, "--json"]) == 0
    remote = json.loads(capsys.readouterr().out)
    assert main(["list", str(big), "--json"]) == 0
    local = json.loads(capsys.readouterr().out)
    assert remote["archive"] == url
    assert {k: v for k, v in remote.items() if k != "archive"} == {k: v for k, v in local.items() if k != "archive"}

    size = big.stat().st_size
    trailer = parse_trailer(big.read_bytes()[-TRAILER_SIZE:], size, str(big))
    requests = log.requests()
    assert [(m, s) for m, _, s, _, _ in requests] == [("GET", 206)] * 3, requests
    ranges = [r for *_, r in requests]
    assert ranges[:2] == [f"bytes=-{TRAILER_SIZE}", f"bytes=0-{HEADER_SIZE - 1}"]
    assert ranges[2] == f"bytes={trailer.index_offset}-{trailer.index_offset + trailer.index_length - 1}"
    fetched = sum(sent for _, _, _, sent, _ in requests)
    assert fetched == HEADER_SIZE + TRAILER_SIZE + trailer.index_length
    assert size > STUB_BYTES and fetched < 16_000, (fetched, size)


def test_check_fetches_the_index_only(big, log):
    report = tritonpack.check(f"{log.url}/big.tpack")
    assert len(report.unusable) == 1 and report.unusable[0].entry.name == FOREIGN_STUB
    assert len(log.requests()) == 3 and sum(r[3] for r in log.requests()) < 16_000


def test_unpack_from_url_fetches_needed_blocks_and_hits_like_local(big, log, tmp_path):
    from kernels import HAS_LISTENER, compile_all

    from_url, from_file = tmp_path / "url" / "cache", tmp_path / "file" / "cache"
    result = tritonpack.unpack(f"{log.url}/big.tpack", from_url)
    assert result.written == result.entries - 1 and result.not_used_entries == 1
    requests = log.requests()
    with tritonpack.open(big) as reader:
        blocks = reader.index.blocks
        stub_blob = {e.name: reader.blob_of(n, 0) for n, e in enumerate(reader.entries)}[FOREIGN_STUB]
        stub_block = reader.index.blobs[stub_blob].block
    assert len(blocks) == 3 and stub_block == 1  # kernels, the stub alone, kernels
    wanted = {f"bytes={b.offset}-{b.offset + b.length - 1}" for n, b in enumerate(blocks) if n != stub_block}
    assert len(requests) == 3 + len(wanted) and {r for *_, r in requests[3:]} == wanted, requests
    assert all(status == 206 for _, _, status, _, _ in requests)
    assert sum(r[3] for r in requests) < big.stat().st_size - STUB_BYTES

    tritonpack.unpack(big, from_file)
    url_files, file_files = snapshot(from_url), snapshot(from_file)
    assert url_files.keys() == file_files.keys()
    for rel, (_, _, digest) in url_files.items():
        if "__grp__" in rel:  # the same manifest, naming its own root
            text = (from_url / rel).read_text().replace(str(from_url), str(from_file))
            assert text == (from_file / rel).read_text()
        else:
            assert digest == file_files[rel][2]

    before = snapshot(from_url)
    hits = compile_all(from_url)
    if HAS_LISTENER:
        assert hits and all(hits), hits
    assert snapshot(from_url) == before, "a cache hit writes nothing"


def test_ensure_from_a_url_reads_two_ranges_once_done(big, log, tmp_path, capsys):
    """As for a path: the first call unpacks; a later one reads the header and the trailer, and the stamp."""
    url, root = f"{log.url}/big.tpack", tmp_path / "cache"
    first = tritonpack.ensure(url, root)
    assert first.status == "unpacked" and first.written == first.entries - 1
    log.reset_log()
    again = tritonpack.ensure(url, root)
    assert (again.status, again.digest) == ("present", first.digest)
    assert [r for *_, r in log.requests()] == [f"bytes=-{TRAILER_SIZE}", f"bytes=0-{HEADER_SIZE - 1}"]
    assert main(["ensure", "oci://localhost:5000/kernels:v1", "--cache-dir", str(root)]) == 2
    assert "pull it once (tritonpack pull), then ensure the file" in capsys.readouterr().err


def test_file_url_reads_locally(big, capsys):
    assert main(["list", big.as_uri()]) == 0
    assert FOREIGN_STUB in capsys.readouterr().out


@pytest.mark.parametrize("path, code, message", [
    ("/missing.tpack", 2, "no such archive (not found on the server)"),
    ("/no-ranges/big.tpack", 7, "does not support HTTP range requests"),
])
def test_server_errors_are_one_line_with_the_url(big, server, tmp_path, capsys, path, code, message):
    url = f"{server.url}{path}"
    assert main(["unpack", url, "--cache-dir", str(tmp_path / "root")]) == code
    err = capsys.readouterr().err
    assert err.startswith(f"error: {url}: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "root").exists()


def test_connection_refused_is_one_line(capsys):
    url = f"http://127.0.0.1:{free_port()}/kernels.tpack"
    assert main(["list", url]) == 7
    err = capsys.readouterr().err
    assert err.startswith(f"error: {url}: cannot connect to 127.0.0.1:") and err.count("\n") == 1, err


def test_backends_that_fail_as_they_are_made_are_one_line(big, capsys):
    """fsspec's ftp:// connects, and a chained zip:// reads its container, before the first read."""
    for url, message in [(f"ftp://127.0.0.1:{free_port()}/k.tpack", "cannot connect: Connection refused"),
                         (f"zip://k.tpack::file://{big}", "BadZipFile: File is not a zip file")]:
        assert main(["list", url]) == 7
        assert capsys.readouterr().err == f"error: {url}: {message}\n"


def test_a_server_that_never_answers_times_out_in_one_line(monkeypatch, capsys):
    """A server that takes the connection and sends nothing: aiohttp's default would wait five minutes."""
    import http.server
    import threading
    import time

    from tritonpack import remote

    monkeypatch.setattr(remote, "SERVER_TIMEOUT", (5, 0.3))

    class Silent(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            time.sleep(1.5)

        def log_message(self, *args) -> None:
            pass

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = False  # closing waits for the silent answer: nothing of it reaches a later test

    server = Server(("127.0.0.1", 0), Silent)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/k.tpack"
    try:
        assert main(["list", url]) == 7
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
    err = capsys.readouterr().err
    assert err == (f"error: {url}: timed out (no answer within 5 s of connecting, or 0.3 s between two reads, or a "
                   "reply slower than 64 KiB/s past its first minute)\n"), err


def test_every_timeout_of_the_http_stack_is_said_timed_out():
    """Which one the silent server above raises depends on timing (aiohttp's read timeout or fsspec's); on
    Python 3.10 neither is the builtin TimeoutError, and fsspec's was said as 'FSTimeoutError'."""
    import asyncio
    import concurrent.futures

    import aiohttp
    from fsspec.exceptions import FSTimeoutError

    from tritonpack.remote import describe_failure

    for error in (FSTimeoutError(), aiohttp.ServerTimeoutError("Timeout on reading data from socket"),
                  asyncio.TimeoutError(), concurrent.futures.TimeoutError(), TimeoutError()):
        assert describe_failure(error) == "timed out", repr(error)


def test_unknown_schemes_and_missing_backends_are_usage_errors(capsys):
    assert main(["list", "nosuchscheme://x/k.tpack"]) == 2
    assert "unknown URL scheme nosuchscheme://" in capsys.readouterr().err
    for url in ("http://", "https:///k.tpack"):
        assert main(["list", url]) == 2
        assert capsys.readouterr().err == f"error: {url}: not a URL of an archive: it names no host\n"
    for url, said in (("http://127.0.0.1:99999/k.tpack", "Port out of range 0-65535"),
                      ("http://127.0.0.1:abc/k.tpack", "port can't be converted to integer")):
        assert main(["list", url]) == 2  # a typo in the URL, not a server that cannot be reached (7)
        assert said in capsys.readouterr().err
    assert main(["list", "file:///no/such.tpack"]) == 2  # named as given
    assert capsys.readouterr().err == "error: file:///no/such.tpack: no such archive\n"
    try:
        import s3fs  # noqa: F401
    except ImportError:
        assert main(["list", "s3://bucket/k.tpack"]) == 2  # fails before any network access
        err = capsys.readouterr().err
        assert err.startswith("error: s3://bucket/k.tpack: s3:// needs a package") and "s3fs" in err


UNREACHABLE_NOTE = "trusted the stamp of the last ensure of this URL"


def test_ensure_trusts_the_last_stamp_of_a_url_the_server_no_longer_has(big, server, tmp_path, capsys, monkeypatch):
    """A registry or bucket briefly without the archive does not stop a model from loading: ensure answers from
    the stamp its last ensure of that URL left, in that environment, if every entry is still there."""
    served = server.www / f"{tmp_path.name}.tpack"
    url, root = f"{server.url}/{served.name}", tmp_path / "cache"
    shutil.copyfile(big, served)
    first = tritonpack.ensure(url, root)
    assert first.status == "unpacked" and not first.unreachable
    served.rename(served.with_suffix(".gone"))

    trusted = tritonpack.ensure(url, root)
    assert (trusted.status, trusted.digest, trusted.written) == ("present", first.digest, 0)
    assert trusted.unreachable == "no such archive (not found on the server)" and trusted.stamp == first.stamp
    assert f"archive not reachable: no such archive (not found on the server); {UNREACHABLE_NOTE}" in trusted.notes()
    assert main(["ensure", url, "--cache-dir", str(root)]) == 0
    out, err = capsys.readouterr()
    assert "already present" in out and UNREACHABLE_NOTE in err, (out, err)
    assert main(["ensure", url, "--cache-dir", str(root), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["status"], doc["unreachable"]) == ("present", "no such archive (not found on the server)")

    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")  # another environment: its stamp was never made
    assert main(["ensure", url, "--cache-dir", str(root)]) == 2
    assert "no such archive (not found on the server)" in capsys.readouterr().err
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION")
    assert main(["ensure", f"{url}?again", "--cache-dir", str(root)]) == 2  # another URL: no stamp of its own
    capsys.readouterr()
    next(root.glob("*/__grp__*.json")).unlink()  # an entry gone since: the stamp no longer holds
    with pytest.raises(tritonpack.UsageError, match="not found on the server"):
        tritonpack.ensure(url, root)


def test_ensure_trusts_the_stamp_of_the_archive_a_url_had_last(big, server, compiled_root, tmp_path):
    """The URL's last ensure names the stamp, not its first: a repeat ensure that found its stamp records it too."""
    served = server.www / f"{tmp_path.name}.tpack"
    url, root = f"{server.url}/{served.name}", tmp_path / "cache"
    small = tmp_path / "small.tpack"
    tritonpack.pack(compiled_root, small)
    shutil.copyfile(big, served)
    first = tritonpack.ensure(url, root)
    shutil.copyfile(small, served)
    second = tritonpack.ensure(url, root)
    assert second.digest != first.digest
    served.unlink()
    assert tritonpack.ensure(url, root).digest == second.digest
    shutil.copyfile(big, served)
    assert tritonpack.ensure(url, root).digest == first.digest
    served.unlink()
    trusted = tritonpack.ensure(url, root)
    assert (trusted.status, trusted.digest) == ("present", first.digest) and trusted.unreachable


def test_ensure_trusts_the_last_stamp_when_the_server_is_down(big, tmp_path, capsys):
    with nginx(tmp_path / "nginx") as brief:
        shutil.copyfile(big, brief.www / "big.tpack")
        url, root = f"{brief.url}/big.tpack", tmp_path / "cache"
        first = tritonpack.ensure(url, root)
    trusted = tritonpack.ensure(url, root)
    assert (trusted.status, trusted.digest) == ("present", first.digest)
    assert trusted.unreachable.startswith(f"cannot connect to 127.0.0.1:{brief.port}")
    assert main(["ensure", url, "--cache-dir", str(root)]) == 0
    assert UNREACHABLE_NOTE in capsys.readouterr().err
    assert main(["ensure", url, "--cache-dir", str(tmp_path / "elsewhere")]) == 7  # no stamp there
    assert capsys.readouterr().err.startswith(f"error: {url}: cannot connect to 127.0.0.1:")


@pytest.mark.parametrize(("first", "then", "same"), [
    ({"ETag": '"5f-1"'}, {"ETag": 'W/"5f-1"'}, True),  # made weak by a proxy that compresses, or nginx's gzip
    ({"ETag": '"a"', "Last-Modified": "Tue, 01 Dec 2026 07:00:00 GMT"},
     {"ETag": '"b"', "Last-Modified": "Tue, 01 Dec 2026 07:00:00 GMT"}, True),  # two servers, one file
    ({"ETag": '"a"', "Last-Modified": "Tue, 01 Dec 2026 07:00:00 GMT"},
     {"ETag": '"b"', "Last-Modified": "Tue, 01 Dec 2026 08:00:00 GMT"}, False),
    ({"ETag": '"a"'}, {"ETag": '"b"'}, False),
])
def test_validators_compare_as_a_weak_comparison_does(first, then, same):
    """Each later reply must be of the first reply's archive; where validators differ only as proxies and
    deployments make them differ, "try again" would never succeed."""
    from tritonpack.remote import _Refused, _Served

    served = _Served()
    served.same_archive(100, first)
    if same:
        served.same_archive(100, then)
    else:
        with pytest.raises(_Refused, match="the archive changed on the server while it was read"):
            served.same_archive(100, then)
