"""The index's compact tables: decoded, they read as the tuples they replace (blobs, each entry's blobs and its
files); the writer's finds each content once."""
from __future__ import annotations

import errno
import tempfile
from pathlib import Path

import pytest

import tritonpack
from tritonpack.archive.index import BlobRef
from tritonpack.model import StoredFile


@pytest.fixture()
def reader(tmp_path, compiled_root):
    path = tmp_path / "k.tpack"
    tritonpack.pack(compiled_root, path)
    with tritonpack.open(path) as reader:
        yield reader


def test_an_entrys_files_read_as_the_tuple_of_its_files(reader):
    table = reader.index.blobs
    for n, entry in enumerate(reader.entries):
        blobs = reader.entry_blobs(n)
        files = tuple(entry.files)
        assert files == tuple(StoredFile(f.name, table[b].size, table[b].sha256) for f, b in zip(files, blobs,
                                                                                                   strict=True))
        assert entry.files == files and hash(entry.files) == hash(files) and repr(entry.files) == repr(files)
        assert len(entry.files) == len(files) and entry.files[-1] == files[-1] and entry.files[1:] == files[1:]
        assert list(entry.file_names) == [f.name for f in files]
        assert list(entry.file_sizes) == [f.size for f in files]
        assert entry.size == sum(f.size for f in files)
        assert [reader.blob_of(n, j) for j in range(len(files))] == list(blobs)
        with pytest.raises(IndexError):
            entry.files[len(files)]
        with pytest.raises(IndexError):
            reader.blob_of(n, len(files))
    taken = reader.entries[0]._replace(files=tuple(reader.entries[0].files)[:1])
    assert taken.file_names == (taken.files[0].name,) and taken.size == taken.files[0].size


def test_the_blob_table_reads_as_blob_refs(reader):
    table = reader.index.blobs
    refs = list(table)
    assert len(refs) == len(table) > 0 and all(type(ref) is BlobRef for ref in refs)
    assert refs == [table[b] for b in range(len(table))] and table[-1] == refs[-1]
    assert all(len(ref.sha256) == 32 and type(ref.sha256) is bytes for ref in refs)
    with pytest.raises(IndexError):
        table[len(table)]
    with pytest.raises(IndexError):
        reader.entry_blobs(len(reader.entries))


def test_the_writers_blob_table_finds_each_content_once():
    """The pack's dedupe: an open addressing table over the digests, sized from the file count (never more than
    half full), so that probing past taken slots finds each digest, and a digest never seen comes back negative."""
    import hashlib

    from tritonpack.archive.writer import _Blobs

    blobs = _Blobs(files=12)
    digests = [hashlib.sha256(bytes([n])).digest() for n in range(12)]
    for n, digest in enumerate(digests):
        missing = blobs.find(digest)
        assert missing < 0
        assert blobs.add(missing, n % 3, 100 * n, n, digest) == n
    assert [blobs.find(d) for d in digests] == list(range(12))
    assert blobs.find(hashlib.sha256(b"other").digest()) < 0
    assert list(blobs) == [(n % 3, 100 * n, n, digests[n]) for n in range(12)]
    assert all(type(d) is bytes for *_, d in blobs)  # packed as msgpack bin, as before
    blobs.forget_contents()  # the digests stay for the index
    assert len(blobs) == 12 and list(blobs)[5][3] == digests[5]


def test_what_groups_share_is_decoded_once():
    """A kernel's configurations share its name, most groups an empty env and a few shared-memory sizes: the
    decoded index holds one object of each (the real cache: 780 groups, 23 names)."""
    with tritonpack.open(FIXTURE) as reader:
        groups = [e for e in reader.entries if e.kind == "group"]
    assert len(groups) == 780
    assert len({id(e.name) for e in groups}) == len({e.name for e in groups}) == 23
    assert len({id(e.kernel.env) for e in groups}) == 1 and groups[0].kernel.env == {}
    assert len({id(e.kernel.shared) for e in groups}) == len({e.kernel.shared for e in groups})


FIXTURE = Path(__file__).parent.parent / "fixtures" / "torch-max-autotune-h200-triton36.tpack"


def _decoded():
    with tritonpack.open(FIXTURE) as reader:
        return reader.index


def _spill_past_the_first_digest(monkeypatch):
    """Readers that hold no digests past the first: the rest go to a temp file, two at a time."""
    from tritonpack.archive import index

    monkeypatch.setattr(index, "HELD_DIGESTS", 1)
    monkeypatch.setattr(index, "_DIGESTS_A_WRITE", 64)


def test_a_large_indexs_digests_are_read_from_a_temp_file(tmp_path, monkeypatch):
    """Past ``HELD_DIGESTS`` blobs a reader writes their digests to a temp file and reads them from there: the same
    table, files and unpack."""
    from tritonpack.archive.index import FileSpan

    held = _decoded()
    plain = tmp_path / "plain"
    tritonpack.unpack(FIXTURE, plain, force=True)
    _spill_past_the_first_digest(monkeypatch)
    spilled = _decoded()
    assert isinstance(spilled.blobs.digests, FileSpan) and isinstance(held.blobs.digests, bytes)
    assert spilled.blobs == held.blobs and list(spilled.blobs) == list(held.blobs)
    assert [tuple(e.files) for e in spilled.entries] == [tuple(e.files) for e in held.entries]
    for processes in (False, True):
        root = tmp_path / f"root-{processes}"
        result = tritonpack.unpack(FIXTURE, root, force=True, processes=processes)
        assert result.written == result.entries
        assert sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) == \
            sorted(p.relative_to(plain).as_posix() for p in plain.rglob("*") if p.is_file())
        assert tritonpack.unpack(FIXTURE, root, force=True).present == result.entries


class _Filling:
    """A temp file that takes 1,000 bytes, then part of a write, then no more: a temp directory filling up."""

    def __init__(self, file):
        self.file, self.taken = file, 0

    def write(self, data):
        if self.taken >= 1000:
            raise OSError(errno.ENOSPC, "No space left on device")
        n = self.file.write(data[:min(len(data), 1007 - self.taken)])
        self.taken += n
        return n

    def fileno(self):
        return self.file.fileno()

    def close(self):
        self.file.close()


def _temp_directory(monkeypatch, state: str) -> None:
    """Temp files as a temp directory in ``state`` makes them: ``usable``, ``no temp file`` (read-only) or ``a temp
    directory filling up``."""
    real = tempfile.TemporaryFile

    def made(*args, **kwargs):
        if state == "no temp file":
            raise OSError(errno.EROFS, "Read-only file system")
        file = real(*args, **kwargs)
        return file if state == "usable" else _Filling(file)

    monkeypatch.setattr(tempfile, "TemporaryFile", made)


@pytest.mark.parametrize("failing", ["no temp file", "a temp directory filling up"])
def test_digests_stay_held_where_no_temp_file_takes_them(monkeypatch, failing):
    """A missing, read-only or full temp directory: the digests are held, those written already read back."""
    held = _decoded().blobs
    _spill_past_the_first_digest(monkeypatch)
    _temp_directory(monkeypatch, failing)
    blobs = _decoded().blobs
    assert isinstance(blobs.digests, bytes) and blobs == held


@pytest.mark.parametrize("temp_dir", ["usable", "no temp file", "a temp directory filling up"])
def test_a_writers_digests_past_the_first_go_to_a_temp_file(monkeypatch, temp_dir):
    """The pack's dedupe with its digests in a temp file past the first few (or held, where no temp file takes
    them): each content found once, and read back whole and by blob."""
    import hashlib

    from tritonpack.archive import writer

    _temp_directory(monkeypatch, temp_dir)
    monkeypatch.setattr(writer, "HELD_DIGESTS", 2)
    blobs = writer._Blobs(files=100)
    digests = [hashlib.sha256(bytes([n])).digest() for n in range(100)]
    for n, digest in enumerate(digests):
        assert blobs.add(blobs.find(digest), 0, n, 1, digest) == n
    assert [blobs.find(d) for d in digests] == list(range(100)) and blobs.find(hashlib.sha256(b"x").digest()) < 0
    assert (len(blobs.digests._tail) < 64) == (temp_dir == "usable")  # the rest is in the file, where one took it
    assert [blobs.digest(n) for n in range(100)] == digests == [ref.sha256 for ref in blobs]
    assert blobs.digest_run(0, 100) == b"".join(digests) and blobs.digest_run(3, 5) == b"".join(digests[3:5])


def test_an_archive_packed_with_its_digests_in_a_temp_file_is_the_same(tmp_path, compiled_root, monkeypatch):
    from tritonpack.archive import writer

    tritonpack.pack(compiled_root, tmp_path / "held.tpack")
    monkeypatch.setattr(writer, "HELD_DIGESTS", 1)
    tritonpack.pack(compiled_root, tmp_path / "spilled.tpack")
    assert (tmp_path / "spilled.tpack").read_bytes() == (tmp_path / "held.tpack").read_bytes()
