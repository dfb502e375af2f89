"""Unpack's plan in tables (``staging.Staged``, ``staging.ManifestJobs``, ``staging.Destinations``): each entry
reads back as the records it replaced, a staged file's temp path kept only where it has a temp name."""
from __future__ import annotations

from array import array

from tritonpack.cachedest import WRITE, Placement
from tritonpack.model import GROUP, Entry, StoredFile
from tritonpack.staging import KEY_DIRECTORY, MANIFEST, NOT_STAGED, Destinations, ManifestJobs, Staged


def _entry(key: str, name: str, count: int) -> Entry:
    return Entry(GROUP, key, name, tuple(StoredFile(f"{name}.{n}", 1, bytes(32)) for n in range(count)))


def test_staged_files_read_back_per_entry():
    # entry 0 in a staging directory, entry 1 not written, entry 2 into its key directory under temp names
    entries = [_entry("KEY0", "k", 3), _entry("KEY1", "b", 4), _entry("KEY2", "c", 2)]
    placements = [Placement(e, (0,) * len(e.files), WRITE, tuple(range(len(e.files)))) for e in entries]
    staged = Staged(placements, Destinations("/root", placements, array("i", [0, NOT_STAGED, KEY_DIRECTORY]),
                                             ["/root/.stage"]))
    staged.record(0, 2, "/root/.stage0000/k.2")
    staged.record(0, MANIFEST, "/root/.stage0000/__grp__k.json")
    staged.record(2, 1, "/root/KEY2/tmp.1")
    staged.record(2, MANIFEST, "/root/KEY2/tmp.m")

    first = staged.of(0)
    assert first.files == [False, False, None, None]  # own names in the staging directory: no path kept
    assert first.staged() == [(2, None)]
    assert first.path(2, "k.2") == "/root/.stage0000/k.2"
    assert first.path(MANIFEST, "__grp__k.json") == "/root/.stage0000/__grp__k.json"
    assert first.temp(MANIFEST) is None

    third = staged.of(2)
    assert third.directory is None
    assert third.files == [False, "/root/KEY2/tmp.1", "/root/KEY2/tmp.m"]
    assert third.staged() == [(1, "/root/KEY2/tmp.1")]
    assert third.path(1, "b.1") == "/root/KEY2/tmp.1" and third.temp(MANIFEST) == "/root/KEY2/tmp.m"
    assert staged.of(1).files == []


def test_manifest_jobs_are_made_as_they_are_read():
    entries = [_entry("KEY0", "a", 2), _entry("KEY1", "b", 3), _entry("KEY2", "c", 1)]
    placements = [Placement(e, (0,) * len(e.files), WRITE, tuple(range(len(e.files)))) for e in entries]
    placements[2] = placements[2]._replace(others=("c.ptx",))  # its manifest keeps listing a file of the group's
    where = Destinations("/root", placements, array("i", [0, NOT_STAGED, KEY_DIRECTORY]), ["/root/.stage"])
    assert list(where) == [("/root/.stage0000", ("a.0", "a.1")), None, ("/root/KEY2", None)]
    jobs = ManifestJobs([0, 2], placements, where)
    expected = [("/root/.stage0000", "__grp__a.json", 0, entries[0], ("a.0", "a.1")),
                ("/root/KEY2", None, 2, entries[2], ("c.0", "c.ptx"))]
    assert len(jobs) == 2 and list(jobs) == expected and jobs[-1] == expected[-1]
    assert list(jobs[1:]) == expected[1:] and len(jobs[:0]) == 0


def test_staging_directories_past_a_tokens_names_are_under_the_next_token():
    from tritonpack.staging import STAGE_DIRS_A_TOKEN

    entries = [_entry("KEY0", "a", 1), _entry("KEY1", "b", 1)]
    placements = [Placement(e, (0,), WRITE, (0,)) for e in entries]
    where = Destinations("/root", placements, array("i", [STAGE_DIRS_A_TOKEN - 1, STAGE_DIRS_A_TOKEN + 3]),
                         ["/root/tmp.tpack.1.aaaaaaaa", "/root/tmp.tpack.1.bbbbbbbb"])
    assert [w[0] for w in where] == ["/root/tmp.tpack.1.aaaaaaaaffff", "/root/tmp.tpack.1.bbbbbbbb0003"]
