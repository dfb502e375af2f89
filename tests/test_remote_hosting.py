"""Archives by URL as they are hosted next to model checkpoints, against real servers on 127.0.0.1: redirects as
Hugging Face, GitHub releases and S3 presigned URLs answer them, servers and proxies that ignore Range, stream or
compress, an archive replaced under its URL while it is read, and S3 itself (moto's server)."""
from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import sys
import time

import pytest

pytest.importorskip("fsspec")
pytest.importorskip("aiohttp")

from conftest import FOREIGN_STUB_BYTES as STUB_BYTES
from conftest import pack_with_foreign_stub, snapshot
from invariants import temp_files
from servers import (
    FILE_SERVER_MODES,
    SIGNED_QUERY,
    busy_server,
    file_server,
    forward_proxy,
    free_port,
    nginx,
    running,
    signed_links,
)

import tritonpack
from tritonpack import remote
from tritonpack.archive.format import HEADER_SIZE, TRAILER_SIZE, parse_trailer
from tritonpack.entry import main

CHANGED = "the archive changed on the server while it was read"


@pytest.fixture(scope="module")
def archive(compiled_root, tmp_path_factory):
    """The compiled kernels plus a launcher stub for another Python in a block of its own."""
    root = tmp_path_factory.mktemp("hosted") / "cache"
    return pack_with_foreign_stub(compiled_root, root, root.parent / "k.tpack")


@pytest.fixture(scope="module")
def server(archive, tmp_path_factory):
    """nginx, serving ``archive`` as k.tpack."""
    with nginx(tmp_path_factory.mktemp("nginx")) as running_nginx:
        shutil.copyfile(archive, running_nginx.www / "k.tpack")
        yield running_nginx


@pytest.fixture()
def log(server):
    server.reset_log()
    return server


def listing(location: str, capsys) -> dict:
    assert main(["list", location, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    del doc["archive"]
    return doc


def one_line_error(capsys, url: str) -> str:
    """The one error line, said of the URL as output shows it (no signed query, no password)."""
    err = capsys.readouterr().err
    url = url.split("?")[0]
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


REDIRECTS = [  # (path on the first server, the server that answers the ranges: "cdn" or "origin")
    ("/302/k.tpack", "cdn"), ("/301/k.tpack", "cdn"), ("/307/k.tpack", "cdn"), ("/308/k.tpack", "cdn"),
    ("/relative/k.tpack", "origin"), ("/twice/k.tpack", "cdn"),
    ("/resolve/main/k.tpack", "cdn"),  # Hugging Face: 302 to its CDN, with a signed query
    (f"/302/signed/k.tpack?{SIGNED_QUERY}", "cdn"),  # a GitHub release asset, an S3 presigned URL: signed as given
]


@pytest.mark.parametrize("path, answered_by", REDIRECTS)
def test_every_range_request_follows_the_redirects(archive, log, capsys, path, answered_by):
    url = log.url + path
    assert listing(url, capsys) == listing(str(archive), capsys)
    rows = log.requests_by_port()
    reads = [(port, r) for port, r in rows if r[2] == 206]
    trailer = parse_trailer(archive.read_bytes()[-TRAILER_SIZE:], archive.stat().st_size, str(archive))
    index = f"bytes={trailer.index_offset}-{trailer.index_offset + trailer.index_length - 1}"
    assert [rng for _, (*_, rng) in reads] == [f"bytes=-{TRAILER_SIZE}", f"bytes=0-{HEADER_SIZE - 1}", index]
    assert {port for port, _ in reads} == {log.cdn_port if answered_by == "cdn" else log.port}
    assert all(status in (301, 302, 307, 308) for _, (_, _, status, _, _) in rows if status != 206), rows
    # the first read follows the redirects; the later ones go where they led, the signed query as it was given
    hops = 2 if path.startswith("/twice/") else 1
    assert len(rows) == hops + 3 and all(rng for _, (*_, rng) in rows)
    assert all(status == 206 for _, (_, _, status, _, _) in rows[hops:])


@pytest.mark.parametrize("path", ["/resolve/main/k.tpack", f"/302/signed/k.tpack?{SIGNED_QUERY}"])
def test_unpack_and_ensure_through_a_cdn_redirect_fetch_only_their_blocks(archive, log, tmp_path, capsys, path):
    """unpack --arch reads the blocks of the kernels it takes, each through the redirect; ensure's repeat reads
    two ranges through it; once the CDN has the archive no more, ensure trusts its stamp and names the CDN, not
    the signed query."""
    url = log.url + path
    args = ["--arch", "90"]
    assert main(["unpack", url, "--cache-dir", str(tmp_path / "url"), *args]) == 0
    assert main(["unpack", str(archive), "--cache-dir", str(tmp_path / "file"), *args]) == 0
    capsys.readouterr()
    same_tree(tmp_path / "url", tmp_path / "file")
    fetched = [(port, r) for port, r in log.requests_by_port() if r[2] == 206]
    assert {port for port, _ in fetched} == {log.cdn_port}
    fetched_ranges = [r for _, r in fetched]
    with tritonpack.open(archive) as reader:
        blocks = {f"bytes={b.offset}-{b.offset + b.length - 1}" for b in reader.index.blocks}
    assert {rng for *_, rng in fetched_ranges[3:]} < blocks  # not the stub's block: never every block
    assert sum(sent for _, _, _, sent, _ in fetched_ranges) < archive.stat().st_size - STUB_BYTES

    root = tmp_path / "ensured"
    first = tritonpack.ensure(url, root)
    assert first.status == "unpacked"
    log.reset_log()
    assert tritonpack.ensure(url, root).status == "present"
    assert [r[4] for r in log.requests() if r[2] == 206] == [f"bytes=-{TRAILER_SIZE}", f"bytes=0-{HEADER_SIZE - 1}"]
    served, moved = log.www / "k.tpack", log.www / "k.moved"
    served.rename(moved)
    try:
        trusted = tritonpack.ensure(url, root)
    finally:
        moved.rename(served)
    assert (trusted.status, trusted.digest) == ("present", first.digest)
    cdn = f"http://127.0.0.1:{log.cdn_port}/signed/k.tpack"  # the signed query left out: it is a credential
    assert trusted.unreachable == f"no such archive (not found on the server it redirects to, {cdn})"


def test_reads_go_where_the_redirect_led_until_its_link_expires(archive, tmp_path, capsys):
    """Each request to Hugging Face's resolve/main/ (or a GitHub release asset) is a round trip to a rate-limited
    origin for a redirect to a signed CDN link: the link is kept for the reads that follow, and asked for anew once
    the CDN refuses it (here after two ranges: an expired signature's 403)."""
    with signed_links(archive, uses=2) as links:
        assert listing(links.url, capsys) == listing(str(archive), capsys)
        assert links.asked == [("origin", "/resolve/main/k.tpack"), ("cdn", 1, 206), ("cdn", 1, 206),
                               ("cdn", 1, 403), ("origin", "/resolve/main/k.tpack"), ("cdn", 2, 206)]
        links.asked.clear()
        assert main(["unpack", links.url, "--cache-dir", str(tmp_path / "url"), "--arch", "90"]) == 0
        assert main(["unpack", str(archive), "--cache-dir", str(tmp_path / "file"), "--arch", "90"]) == 0
        capsys.readouterr()
        same_tree(tmp_path / "url", tmp_path / "file")
        cdn = [a for a in links.asked if a[0] == "cdn"]
        assert sum(a[2] == 206 for a in cdn) >= 4 and len(links.asked) - len(cdn) == 1 + sum(a[2] == 403 for a in cdn)


def test_reads_go_through_the_proxy_the_environment_names(archive, log, tmp_path, capsys, monkeypatch):
    """HTTP_PROXY (HTTPS_PROXY for https://) as curl, requests and botocore take it, NO_PROXY too: where the only
    way out is a proxy, aiohttp's default (no proxy) failed every read."""
    url = log.url + "/302/k.tpack"
    with forward_proxy() as proxy:
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        assert listing(url, capsys) == listing(str(archive), capsys)
        assert [a.split("?")[0] for a in proxy.asked] == [url] + [f"http://127.0.0.1:{log.cdn_port}/k.tpack"] * 3
        assert main(["unpack", url, "--cache-dir", str(tmp_path / "url")]) == 0
        assert main(["unpack", str(archive), "--cache-dir", str(tmp_path / "file")]) == 0
        same_tree(tmp_path / "url", tmp_path / "file")
        capsys.readouterr()
        proxy.asked.clear()
        monkeypatch.setenv("NO_PROXY", "127.0.0.1")
        assert listing(url, capsys) == listing(str(archive), capsys)
        assert not proxy.asked
    monkeypatch.delenv("NO_PROXY")
    monkeypatch.setenv("HTTP_PROXY", f"http://127.0.0.1:{free_port()}")  # nothing answers there
    assert main(["list", url]) == 7
    assert one_line_error(capsys, url).startswith("cannot connect to the proxy 127.0.0.1:")


BUSY = [  # what the server answers first, the waits between the attempts, and the list's exit status
    ([(503, {}), (502, {})], [0.5, 1.0], 0),
    ([(429, {"Retry-After": "2"})], [2.0], 0),
    ([(0, {})] * 2, [0.5], 0),  # a connection dropped unanswered, twice: aiohttp itself asks again once
    ([(503, {})] * 3, [0.5, 1.0], 7),
    ([(429, {"Retry-After": "3600"})], [], 7),  # not waited for
    ([(404, {})], [], 2),
]


@pytest.mark.parametrize("answers, waits, code", BUSY)
def test_a_busy_server_is_asked_again_three_times_at_most(archive, capsys, monkeypatch, answers, waits, code):
    """A 429 or 5xx, or a dropped connection, is asked again after the Retry-After it names (20 s at most), else
    0.5 s then 1 s: three attempts, as botocore's standard mode for S3."""
    slept: list[float] = []
    monkeypatch.setattr(remote.time, "sleep", slept.append)
    with busy_server(archive, answers) as (url, given):
        assert main(["list", url]) == code
    assert slept == waits
    assert given[:len(answers)] == [status for status, _ in answers][:len(given)]
    if code == 0:
        assert given[len(answers):] == [206] * 3
    else:
        message = one_line_error(capsys, url)
        assert message.startswith({7: f"HTTP {answers[0][0]} ", 2: "no such archive"}[code]), message


def test_a_kept_link_that_fails_otherwise_names_where_it_led(archive, capsys, monkeypatch):
    """A CDN that fails (500) on a link it served before, three times asked: the error names the CDN, not its
    signed query, and the origin is not asked again (only a 4xx says the link is done)."""
    monkeypatch.setattr(remote.time, "sleep", lambda seconds: None)
    with signed_links(archive, uses=1, failure=500) as links:
        assert main(["list", links.url]) == 7
        cdn = links.url.split("/resolve/")[0].rsplit(":", 1)[0]
        error = one_line_error(capsys, links.url)
        assert error.startswith("HTTP 500 Internal Server Error (from http://127.0.0.1:") and error.endswith(
            "/k.tpack, where it redirects)") and "Signature" not in error and cdn in error
        assert links.asked == [("origin", "/resolve/main/k.tpack"), ("cdn", 1, 206)] + [("cdn", 1, 500)] * 3


@pytest.mark.parametrize("path, code, message", [
    ("/loop/k.tpack", 7, "too many redirects (10 in a row): a redirect loop?"),
    ("/302/missing.tpack", 2, "no such archive (not found on the server it redirects to, http://127.0.0.1:{cdn}/missing.tpack)"),
    ("/302/signed/k.tpack?X-Amz-Signature=expired", 7,
     "HTTP 403 Forbidden (from http://127.0.0.1:{cdn}/signed/k.tpack, where it redirects)"),
])
def test_a_redirect_that_leads_nowhere_is_one_line(archive, server, tmp_path, capsys, path, code, message):
    url = server.url + path
    for command in (["list", url], ["unpack", url, "--cache-dir", str(tmp_path / "root")],
                    ["ensure", url, "--cache-dir", str(tmp_path / "root")]):
        assert main(command) == code
        assert one_line_error(capsys, url) == message.format(cdn=server.cdn_port)
    assert not (tmp_path / "root").exists()


def test_a_url_is_sent_as_written_but_for_what_no_url_may_hold(archive, server, capsys):
    """A space typed in a URL is sent as %20; escapes written in it are sent as they are (the signed query)."""
    shutil.copyfile(archive, server.www / "k v.tpack")
    local = listing(str(archive), capsys)
    assert listing(f"{server.url}/k v.tpack", capsys) == listing(f"{server.url}/k%20v.tpack", capsys) == local
    assert remote.wire_url("http://h/a b/é.tpack?s=a%2Fb+c&t=~") == "http://h/a%20b/%C3%A9.tpack?s=a%2Fb+c&t=~"


def test_a_server_that_ignores_range_is_refused_at_its_first_reply(server, tmp_path, capsys):
    """A 2 GiB archive on a server that answers every range with the whole file: each command stops at the first
    reply's headers, having read a few MB at most, writes nothing, and says how to read it instead."""
    with open(server.www / "huge.tpack", "wb") as f:
        f.truncate(2 << 30)
    url = f"{server.url}/no-ranges/huge.tpack"
    for command in (["list", url], ["check", url], ["unpack", url, "--cache-dir", str(tmp_path / "root")],
                    ["ensure", url, "--cache-dir", str(tmp_path / "root")]):
        server.reset_log()
        assert main(command) == 7
        assert one_line_error(capsys, url) == remote.NO_RANGES
        assert not (tmp_path / "root").exists()
        deadline = time.monotonic() + 10
        while not server.requests():  # nginx logs the answer once its connection is closed
            assert time.monotonic() < deadline, "the refused answer's connection was left open"
            time.sleep(0.01)
        [(_, _, status, sent, _)] = server.requests()
        assert status == 200 and sent < 64 << 20, sent


@pytest.mark.parametrize("mode, message", [
    ("chunked", remote.NO_RANGES),
    ("gzip-ranges", "the server sent the archive compressed (Content-Encoding: gzip), so the bytes of its replies "
                    "are not the archive's: serve it without a Content-Encoding"),
    ("wrong-range", f"the server answered bytes 0-{TRAILER_SIZE - 1} where bytes=-{TRAILER_SIZE} was asked"),
    ("long-body", "the server answered bytes {span} in a body of {length} bytes"),
    ("short-body", "the server answered bytes {span} in a body of {length} bytes"),
])
def test_replies_that_are_not_the_bytes_asked_for_are_refused_before_they_are_read(archive, tmp_path, capsys, mode,
                                                                                   message):
    """Not an error that blames the archive (corrupt, truncated): the transport is at fault, and is named."""
    assert mode in FILE_SERVER_MODES
    size = archive.stat().st_size
    span = f"{size - TRAILER_SIZE}-{size - 1}"  # the first range asked: the trailer
    length = {"long-body": TRAILER_SIZE + (64 << 20), "short-body": TRAILER_SIZE // 2}.get(mode)
    with file_server(archive, mode) as base:
        url = f"{base}/k.tpack"
        for command in (["list", url], ["unpack", url, "--cache-dir", str(tmp_path / "root")]):
            assert main(command) == 7
            assert one_line_error(capsys, url) == message.format(span=span, length=length)
    assert not (tmp_path / "root").exists()


def test_a_reply_whose_body_never_ends_is_cut_at_the_range_s_length(archive, tmp_path, capsys):
    """A 206 of the range asked, chunked (no Content-Length to refuse it by), whose body never ends: it was read
    into memory until the range's deadline, at the server's rate (gigabytes on loopback)."""
    with file_server(archive, "endless-ranges") as base:
        url = f"{base}/k.tpack"
        for command in (["list", url], ["unpack", url, "--cache-dir", str(tmp_path / "root")]):
            began = time.monotonic()
            assert main(command) == 7
            assert one_line_error(capsys, url) == (f"the server sent more than the {TRAILER_SIZE} bytes asked for in "
                                                   "one reply (a body that does not end, or not the range asked)")
            assert time.monotonic() - began < 10
    assert not (tmp_path / "root").exists()


def test_a_connection_dropped_within_a_reply_is_asked_again(archive, tmp_path, capsys):
    """A reply whose connection ends before its Content-Length (a proxy's idle cut, a backend restarting): asked
    again, as a dropped connection before its reply is (it failed the read, with aiohttp's repr)."""
    assert main(["unpack", str(archive), "--cache-dir", str(tmp_path / "file")]) == 0
    with file_server(archive, "dropped-once") as base:
        assert main(["unpack", f"{base}/k.tpack", "--cache-dir", str(tmp_path / "url")]) == 0
    same_tree(tmp_path / "file", tmp_path / "url")


def test_a_ctrl_c_ends_an_unpack_by_url_without_waiting_for_its_reads(compiled_root, tmp_path, interruptible):
    """A server that goes silent once the index is read: a Ctrl-C ended the unpack only after the blocks asked
    had timed out, and the blocks queued behind them had been asked and had timed out too (about two minutes)."""
    import signal
    import subprocess
    import time

    from tritonpack.archive.writer import write_archive
    from tritonpack.cacheroot import scan_cache

    tritonpack.pack(compiled_root, tmp_path / "usual.tpack")
    with tritonpack.open(tmp_path / "usual.tpack") as reader:
        info = reader.info
    archive = tmp_path / "small-blocks.tpack"
    write_archive(str(archive), scan_cache(str(compiled_root)).entries, info, block_size=4096)
    with file_server(archive, "silent-blocks") as base:
        proc = subprocess.Popen([sys.executable, "-m", "tritonpack", "unpack", f"{base}/k.tpack", "--cache-dir",
                                 str(tmp_path / "root")], stdin=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        time.sleep(3)  # the index read, the first blocks asked: silent
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        start = time.monotonic()
        assert proc.wait(timeout=60) == 130
        assert time.monotonic() - start < 10 and proc.stderr.read().endswith("error: interrupted\n")
    assert temp_files(tmp_path / "root") == [] and not list((tmp_path / "root").glob("*/__grp__*"))


def test_a_url_s_password_and_signed_query_are_never_shown_nor_kept(archive, server, tmp_path, capsys):
    """A URL's user:password and its query (a signed URL's signature) are credentials: they were in every error,
    summary and --json document, and in ensure's record of the URL, a file in the cache root."""
    secret = server.url.replace("http://", "http://alice:s3cret@") + "/k.tpack?X-Amz-Signature=SIGSECRET"
    missing = secret.replace("/k.tpack", "/missing.tpack")
    root = tmp_path / "root"
    commands = [["list", secret], ["list", secret, "--json"], ["check", secret, "--json"], ["list", missing],
                ["list", missing, "--json"], ["unpack", secret, "--cache-dir", str(tmp_path / "unpacked"), "--json"],
                ["ensure", secret, "--cache-dir", str(root)], ["ensure", secret, "--cache-dir", str(root), "--json"],
                ["unpack", secret, "--cache-dir", str(tmp_path / "refused"), "--target", "cuda:75", "--json"]]
    for command in commands:
        main(command)
        said = "".join(capsys.readouterr())
        assert "s3cret" not in said and "SIGSECRET" not in said and "127.0.0.1" in said, said
    kept = [p for p in (root / ".tritonpack").iterdir() if p.name.startswith("ensure-url-")]
    assert kept and not any("s3cret" in p.read_text() or "SIGSECRET" in p.read_text() for p in kept)


def test_ranges_streamed_or_behind_gzip_on_are_read_as_they_are(archive, server, tmp_path, capsys):
    """A proxy that streams each range (chunked, no Content-Length), nginx with ``gzip on`` for every type (which
    compresses the whole file for a client that accepts gzip, and ignores its Range then): tritonpack asks for
    identity, and gets the ranges; and a server whose ranges leave the total unsaid, whose HEAD says it."""
    local = listing(str(archive), capsys)
    assert main(["unpack", str(archive), "--cache-dir", str(tmp_path / "file")]) == 0
    capsys.readouterr()
    with file_server(archive, "chunked-ranges") as base, file_server(archive, "unsaid-total") as unsaid:
        for n, url in enumerate((f"{base}/k.tpack", f"{server.url}/gzip/k.tpack", f"{unsaid}/k.tpack")):
            assert listing(url, capsys) == local
            root = tmp_path / f"url{n}"
            assert main(["unpack", url, "--cache-dir", str(root)]) == 0
            capsys.readouterr()
            same_tree(root, tmp_path / "file")


def replaced(path, by: bytes) -> None:
    """Upload ``by`` under ``path`` as a web server's files are replaced: a new file renamed over the old one,
    with a later mtime (nginx's ETag is the mtime, in seconds, and the size)."""
    new = path.with_suffix(".uploading")
    new.write_bytes(by)
    later = path.stat().st_mtime + 60
    os.utime(new, (later, later))
    os.replace(new, path)


@pytest.mark.parametrize("where, validator", [("", "ETag"), ("/no-etag", "Last-Modified")])
def test_an_archive_replaced_while_it_is_unpacked_is_refused(archive, server, tmp_path, capsys, monkeypatch, where,
                                                            validator):
    """A new archive of the same size uploaded under the URL once the index is read: its blocks are not mixed
    with the index of the first (a digest mismatch, said as a corrupt archive), the change is said."""
    served = server.www / f"{tmp_path.name}.tpack"
    shutil.copyfile(archive, served)
    with tritonpack.open(archive) as reader:
        first_block = reader.index.blocks[0]
    other = bytearray(archive.read_bytes())
    other[first_block.offset + first_block.length // 2] ^= 0xFF
    reads = []
    real_read_at = remote.FsspecSource.read_at

    def read_at(source, offset: int, length: int) -> bytes:
        reads.append(offset)
        if len(reads) == 4:  # the header, the trailer (which came with the size) and the index were read
            replaced(served, bytes(other))
        return real_read_at(source, offset, length)

    monkeypatch.setattr(remote.FsspecSource, "read_at", read_at)
    url = f"{server.url}{where}/{served.name}"
    assert main(["unpack", url, "--cache-dir", str(tmp_path / "root")]) == 7
    assert len(reads) >= 4  # refused at a block's read, not the index's
    error = one_line_error(capsys, url)
    assert error.startswith(f"{CHANGED} ({validator} ") and error.endswith("): try again"), error


def test_ensure_does_not_stamp_an_archive_uploaded_after_its_digest_was_read(archive, server, compiled_root,
                                                                            tmp_path, monkeypatch):
    """ensure reads the digest, then unpacks: an archive uploaded in between is refused, not unpacked under the
    stamp of the first; the next ensure unpacks the new one under its own stamp."""
    from tritonpack import ensuring

    served = server.www / f"{tmp_path.name}.tpack"
    shutil.copyfile(archive, served)
    small = tmp_path / "small.tpack"
    tritonpack.pack(compiled_root, small)
    url, root = f"{server.url}/302/{served.name}", tmp_path / "cache"
    real_digest = ensuring.archive_digest

    def digest_then_upload(path: str) -> str:
        digest = real_digest(path)
        replaced(served, small.read_bytes())
        return digest

    monkeypatch.setattr(ensuring, "archive_digest", digest_then_upload)
    with pytest.raises(tritonpack.RemoteError, match=f"{CHANGED} \\(its size went from "):
        tritonpack.ensure(url, root)
    assert not list((root / ".tritonpack").glob("ensure-*.json"))
    monkeypatch.setattr(ensuring, "archive_digest", real_digest)
    result = tritonpack.ensure(url, root)
    with tritonpack.open(small) as reader:
        assert (result.status, result.digest) == ("unpacked", reader.digest)


# -- S3, against moto's server --------------------------------------------------------------------------------------

def require_s3_packages() -> None:
    """Skip without moto and s3fs (the test extra installs them); under CI, fail."""
    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("s3fs") is None:
        reason = "moto and s3fs are not installed (pip install '.[test]')"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """moto's S3 server (the test extra installs moto; without it these tests skip, under CI they fail): its URL
    and its log, a line per request."""
    require_s3_packages()
    port = free_port()
    directory = tmp_path_factory.mktemp("moto")
    with running([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], port,
                 directory / "moto.log"):
        yield f"http://127.0.0.1:{port}", directory / "moto.log"


def s3_environment(endpoint: str, monkeypatch, tmp_path) -> None:
    """Reach ``endpoint`` as a user reaches MinIO or R2: ``AWS_ENDPOINT_URL_S3`` and keys in the environment, no
    AWS configuration files, no fsspec configuration."""
    import fsspec.config
    import s3fs

    for name in [n for n in os.environ if n.startswith(("AWS_", "FSSPEC_S3"))]:
        monkeypatch.delenv(name)
    monkeypatch.delitem(fsspec.config.conf, "s3", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "tritonpack")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "tritonpack-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # no instance metadata to wait for
    s3fs.S3FileSystem.clear_instance_cache()  # made with another test's environment


@pytest.fixture()
def s3(s3_endpoint, monkeypatch, tmp_path):
    """A bucket on moto (``s3_environment``)."""
    import boto3
    import s3fs

    endpoint, log = s3_endpoint
    s3_environment(endpoint, monkeypatch, tmp_path)
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


def test_s3_ensure_does_not_stamp_an_object_uploaded_after_its_digest_was_read(archive, s3, tmp_path, monkeypatch):
    """As over HTTP, by the object's ETag: here the new object has the size of the first."""
    from tritonpack import ensuring

    client, bucket, _ = s3
    client.upload_file(str(archive), bucket, "k.tpack")
    other = bytearray(archive.read_bytes())
    other[HEADER_SIZE + 100] ^= 0xFF
    real_digest = ensuring.archive_digest

    def digest_then_upload(path: str) -> str:
        digest = real_digest(path)
        client.put_object(Bucket=bucket, Key="k.tpack", Body=bytes(other))
        return digest

    monkeypatch.setattr(ensuring, "archive_digest", digest_then_upload)
    root = tmp_path / "cache"
    with pytest.raises(tritonpack.RemoteError, match=f'{CHANGED} \\(ETag "[^"]+" became "[^"]+"\\)'):
        tritonpack.ensure(f"s3://{bucket}/k.tpack", root)
    assert not list((root / ".tritonpack").glob("ensure-*.json"))


@pytest.fixture()
def silent_s3(monkeypatch, tmp_path):
    """An S3 endpoint that takes each connection and never answers (a hung proxy, a wedged MinIO): the head of
    each request it was sent. The read timeout is cut to half a second, as a user would in fsspec's
    configuration."""
    require_s3_packages()
    import socket
    import threading

    import fsspec.config

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.1)  # a close does not wake a thread blocked in accept: it looks at ``over`` instead
    over = threading.Event()
    requests: list[str] = []
    held = []

    def take() -> None:
        while not over.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            held.append(connection)
            connection.settimeout(5)
            with contextlib.suppress(OSError):
                requests.append(connection.recv(4096).decode())

    taker = threading.Thread(target=take, daemon=True)
    taker.start()
    s3_environment(f"http://127.0.0.1:{listener.getsockname()[1]}", monkeypatch, tmp_path)
    monkeypatch.setitem(fsspec.config.conf, "s3", {"config_kwargs": {"read_timeout": 0.5}})
    yield requests
    over.set()
    taker.join()
    listener.close()
    for connection in held:
        connection.close()


@pytest.mark.parametrize(("retries", "attempts"), [
    (None, remote.S3_ATTEMPTS),  # s3fs's loop of 5 around botocore's 5: 25 attempts, 6 minutes at its timeouts
    ("env", 1), ("profile", 2), ("fsspec", 1)])
def test_a_silent_s3_endpoint_fails_after_botocores_retries_alone(silent_s3, monkeypatch, tmp_path, capsys, retries,
                                                                  attempts):
    import fsspec.config

    if retries == "env":
        monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    elif retries == "profile":
        (tmp_path / "aws-config").write_text("[default]\nretry_mode = standard\nmax_attempts = 2\n")
        monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    elif retries == "fsspec":
        fsspec.config.conf["s3"]["config_kwargs"]["retries"] = {"total_max_attempts": 1}
    url = "s3://models/k.tpack"
    assert main(["list", url]) == 7
    assert one_line_error(capsys, url).startswith("timed out (Read timeout on endpoint URL: ")
    assert [request.split("\r\n", 1)[0] for request in silent_s3] == ["HEAD /models/k.tpack HTTP/1.1"] * attempts
    agent = re.search(r"^User-Agent: (.*)$", silent_s3[0], re.IGNORECASE | re.MULTILINE)
    assert agent and f"tritonpack/{tritonpack.__version__}" in agent.group(1).split()
