"""Preflight (check, unpack refusing what will not be used), the fingerprint cache, verify and relocate."""
from __future__ import annotations

import json
import os
import shutil
import sysconfig
from pathlib import Path

import pytest

triton = pytest.importorskip("triton")

from conftest import FIXTURES, cache_key, snapshot  # noqa: E402
from kernels import HAS_LISTENER, SOURCES, TRITON_VERSION, compile_all, links_amd, targets  # noqa: E402

import tritonpack  # noqa: E402
from tritonpack.entry import main  # noqa: E402
from tritonpack.fingerprint import local_triton  # noqa: E402
from tritonpack.model import ArchiveInfo, TritonInfo  # noqa: E402
from tritonpack.selection import Selection  # noqa: E402

HERE_VERSION = triton.__version__
VERSION_ARCHIVES = sorted((FIXTURES / "archives").glob("triton-*.tpack"))
GOLDEN = FIXTURES / "golden" / "h200-triton36-v1.0.tpack"  # the H200 cache, packed by its own Triton 3.6
# fixtures/h200-triton36's launcher stubs were built for CPython 3.12: only there are they usable (by Python alone)
STUBS_USABLE = sysconfig.get_config_var("EXT_SUFFIX") == ".cpython-312-x86_64-linux-gnu.so"
INVALIDATING = "TRITON_DISABLE_LINE_INFO"  # in every release's key (TRITON_DEFAULT_FP_FUSION: from 3.2)


def archive_version(path: Path) -> str:
    return path.stem.removeprefix("triton-")


@pytest.mark.parametrize("archive", VERSION_ARCHIVES, ids=archive_version)
def test_archive_of_another_triton_is_refused_and_force_writes_it(tmp_path, archive, capsys):
    root = tmp_path / "root"
    theirs = archive_version(archive)
    code = main(["unpack", str(archive), "--cache-dir", str(root)])
    out = capsys.readouterr()
    with tritonpack.open(archive) as reader:
        recorded = reader.info.triton.key_sha256
    here = local_triton().key_sha256
    if recorded == here:  # same wheel, same triton_key: everything is used
        assert code == 0 and "6 written" in out.out
        return
    # the archives were packed on Python 3.11: another Python's wheel of the same version is another build
    mismatch = (f"Triton: archive {theirs}, here {HERE_VERSION}" if theirs != HERE_VERSION else
                f"Triton: archive {theirs} (build {recorded[:12]}), here {HERE_VERSION} (build {here[:12]})")
    assert code == 5
    assert mismatch in out.err and out.err.count("\n") == 1
    assert not root.exists(), "a refused unpack leaves the target root untouched"
    assert main(["check", str(archive)]) == 5
    assert f"6 entries: {mismatch}" in capsys.readouterr().out
    assert main(["unpack", str(archive), "--cache-dir", str(root), "--force"]) == 0
    assert len(list(root.glob("*/__grp__*.json"))) == 6


def test_env_var_set_at_pack_time_is_flagged_by_name(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(INVALIDATING, "1")
    root = tmp_path / "cache"
    compile_all(root)
    archive = tmp_path / "k.tpack"
    tritonpack.pack(root, archive)
    assert main(["check", str(archive)]) == 0  # same environment: usable
    capsys.readouterr()
    monkeypatch.delenv(INVALIDATING)
    assert main(["check", str(archive), "--json"]) == 5
    doc = json.loads(capsys.readouterr().out)
    mismatch = doc["entries"][0]["mismatches"][0]
    assert mismatch["factor"] == "env" and mismatch["archive"].startswith(f"{INVALIDATING}=")
    assert mismatch["here"] == "unset"


def test_arch_mismatch_is_explained(tmp_path, compiled_root, capsys):
    archive = tmp_path / "k.tpack"
    tritonpack.pack(compiled_root, archive)
    assert main(["check", str(archive), "--target", "cuda:90"]) == 6
    text = capsys.readouterr().out
    assert "target: archive cuda:80, here cuda:90 (--target)" in text
    result = tritonpack.unpack(archive, tmp_path / "root", targets=["cuda:90"])
    assert result.written == len(SOURCES) and result.not_used_entries == len(SOURCES) * (len(targets()) - 1)
    assert any("cuda:80" in line for line in result.notes())
    # JSON says why alike in check, unpack and ensure: one object a reason
    assert main(["check", str(archive), "--target", "cuda:90", "--json"]) == 6
    reasons = json.loads(capsys.readouterr().out)["reasons"]
    assert main(["unpack", str(archive), "--cache-dir", str(tmp_path / "r2"), "--target", "cuda:90", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["not_used"] == reasons
    assert main(["ensure", str(archive), "--cache-dir", str(tmp_path / "r3"), "--target", "cuda:90", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["not_used"] == reasons and reasons[0]["entries"] > 0


def test_targets_take_the_forms_arch_takes_and_a_bad_one_names_the_option(tmp_path, compiled_root, capsys):
    archive = tmp_path / "k.tpack"
    tritonpack.pack(compiled_root, archive)
    assert main(["check", str(archive), "--target", "90", "--json"]) == 6
    one = json.loads(capsys.readouterr().out)
    assert main(["check", str(archive), "--target", "cuda:90,gfx942", "--target", "80", "-q"]) == 0
    assert main(["check", str(archive), "--target", "cuda:90", "--json"]) == 6
    assert json.loads(capsys.readouterr().out) == one
    assert main(["check", str(archive), "--target", "sm_90"]) == 2
    assert capsys.readouterr().err == ("error: --target: a target looks like cuda:90, hip:gfx942, 90 or gfx942, "
                                       "not 'sm_90'\n")


def test_no_gpu_is_reported_not_refused(tmp_path, compiled_root):
    archive = tmp_path / "k.tpack"
    tritonpack.pack(compiled_root, archive)
    report = tritonpack.check(archive)
    assert not report.unusable
    assert any("no GPU visible" in note for note in report.unchecked)


def test_the_unpack_summary_counts_what_it_put_in_place_of_what_the_archive_holds(tmp_path, compiled_root):
    archive = tmp_path / "k.tpack"
    tritonpack.pack(compiled_root, archive)
    result = tritonpack.unpack(archive, tmp_path / "root", targets=["cuda:90"])
    assert result.summary().startswith(f"unpacked {len(SOURCES)} of {len(SOURCES) * len(targets())} entries")


def test_without_triton_nothing_could_be_checked(tmp_path, compiled_root, monkeypatch):
    archive = tmp_path / "k.tpack"
    tritonpack.pack(compiled_root, archive)
    monkeypatch.setattr("tritonpack.fingerprint.local_triton", lambda *a, **k: None)
    result = tritonpack.unpack(archive, tmp_path / "root")
    assert result.written == result.entries
    assert any("Triton is not importable" in line for line in result.notes())
    report = tritonpack.check(archive)  # passes what it could check, and promises no hit
    assert report.summary() == (f"all {len(report.verdicts)} entries pass what could be checked without Triton "
                                "(install Triton to check the rest)")


def test_launcher_stub_of_another_python_is_not_written(tmp_path, gpu_cache):
    archive = tmp_path / "gpu.tpack"
    tritonpack.pack(gpu_cache, archive)
    report = tritonpack.check(archive)
    stubs = [v for v in report.verdicts if v.entry.kind == "file"]
    assert stubs
    for verdict in stubs:  # another Python's stubs are refused for it; this one's, by the Triton that built them
        assert ("python" in [m.factor for m in verdict.mismatches]) != STUBS_USABLE
        assert verdict.usable == (STUBS_USABLE and HERE_VERSION == FIXTURE_TRITON)


def test_fingerprint_is_cached_and_keyed_by_environment(monkeypatch):
    first = local_triton({("cuda", 90, 32)})
    again = local_triton({("cuda", 90, 32)})
    assert again.cached and again == first._replace(cached=True)
    monkeypatch.setenv(INVALIDATING, "0")
    changed = local_triton({("cuda", 90, 32)})
    assert not changed.cached and changed.env.get(INVALIDATING) in ("0", "false", "False")


def test_fingerprints_of_installations_gone_are_pruned(tmp_path, monkeypatch):
    """Each Triton installation, toolkit and set of TRITON_* variables has a fingerprint of its own: they piled up in
    ~/.cache/tritonpack, one more at every reinstall. The oldest go past KEPT_FINGERPRINTS; the rest stay."""
    from tritonpack.fingerprint import KEPT_FINGERPRINTS

    home = tmp_path / "xdg" / "tritonpack"
    home.mkdir(parents=True)
    (home / "tracking.py").write_text("")  # another file of that directory (record's), never pruned
    for n in range(KEPT_FINGERPRINTS + 8):
        old = home / f"fingerprint-{n:024x}-{n:016x}.json"
        old.write_text("{}")
        os.utime(old, (1000 + n, 1000 + n))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert not local_triton({("cuda", 90, 32)}).cached
    left = sorted(p.name for p in home.glob("fingerprint-*.json"))
    assert len(left) == KEPT_FINGERPRINTS and (home / "tracking.py").exists()
    newest = KEPT_FINGERPRINTS + 7
    assert f"fingerprint-{0:024x}-{0:016x}.json" not in left and f"fingerprint-{newest:024x}-{newest:016x}.json" in left
    assert local_triton({("cuda", 90, 32)}).cached


def test_a_user_with_no_home_keeps_no_fingerprint_and_makes_no_tilde_directory(tmp_path, monkeypatch):
    """``docker run --user 12345``: no ``HOME``, no entry in the password database. ``~`` stays ``~``: the
    fingerprint is computed every time, as with a read-only home, where it went to ``./~/.cache/tritonpack``."""
    import pwd

    def unknown(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", unknown)
    monkeypatch.chdir(tmp_path)
    assert local_triton({("cuda", 90, 32)}).key_sha256 and list(tmp_path.iterdir()) == []


def test_copied_cache_verify_relocate_and_hits(tmp_path, capsys):
    a, c, d = tmp_path / "a" / "cache", tmp_path / "c" / "cache", tmp_path / "d" / "cache"
    compile_all(a)
    shutil.copytree(a, c)
    assert main(["verify", str(c)]) == 1  # old root still there: stale, Triton reads a's files
    assert "stale" in capsys.readouterr().err
    shutil.copytree(a, d)
    shutil.rmtree(a)
    assert main(["verify", str(c)]) == 1
    assert "broken" in capsys.readouterr().err

    assert main(["relocate", str(c)]) == 0
    assert f"relocated {len(SOURCES) * len(targets())} manifests" in capsys.readouterr().out
    assert main(["relocate", str(c), "--json"]) == 0  # idempotent
    report = json.loads(capsys.readouterr().out)
    assert report == {"cache_dir": str(c), "fixed": [], "already_ok": len(SOURCES) * len(targets()), "not_fixed": [],
                      "trimmed": []}
    assert main(["verify", str(c)]) == 0

    before = snapshot(c)
    hits = compile_all(c)
    if HAS_LISTENER:
        assert all(hits)
    assert snapshot(c) == before
    misses = compile_all(d)  # the same copy without relocate
    if HAS_LISTENER:
        assert not any(misses)
    for manifest in c.glob("*/__grp__*.json"):
        assert all(p.startswith(str(c)) for p in json.loads(manifest.read_text())["child_paths"].values())


def test_relocate_reports_what_it_cannot_fix(tmp_path, compiled_root):
    root = tmp_path / "cache"
    shutil.copytree(compiled_root, root)
    victim = next(root.glob("*/*.json"))
    group = next(p for p in root.iterdir() if list(p.glob("__grp__*.json")))
    next(p for p in group.iterdir() if p.suffix in (".cubin", ".hsaco")).unlink()  # lost IR files are fixed
    report = tritonpack.relocate(root)
    assert report.not_fixed and report.not_fixed[0][0].startswith(group.name)
    assert victim.exists()
    verify = tritonpack.verify(root)
    assert any(g.state == "incomplete" for g in verify.problems)


def test_verify_asks_triton_at_its_root_and_leaves_the_process_alone(tmp_path, compiled_root, monkeypatch):
    """verify runs Triton's get_group at the root it is given, whatever root the program's Triton is set to (its
    environment, or 3.4+'s knobs), and changes neither: a serving process's other threads compile meanwhile."""
    root = shutil.copytree(compiled_root, tmp_path / "cache")
    assert tritonpack.relocate(root).fixed
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "elsewhere"))
    knobs = getattr(triton, "knobs", None)
    try:
        if knobs is not None:  # 3.4+: the knob set by the program (which writes it to the environment too)
            knobs.cache.dir = str(tmp_path / "set-by-the-program")
        environment = dict(os.environ)
        report = tritonpack.verify(root)
        assert report.resolved_by == "triton" and report.groups and not report.problems
        assert dict(os.environ) == environment
        if knobs is not None:
            assert knobs.cache.dir == str(tmp_path / "set-by-the-program")
        assert not (tmp_path / "elsewhere").exists() and not (tmp_path / "set-by-the-program").exists()
    finally:  # the program's setting dropped (monkeypatch puts the environment back)
        if knobs is not None:
            del knobs.cache.dir


def test_nvidia_gpus_are_found_through_nvidia_smi_on_the_path(tmp_path, monkeypatch):
    """Without a GPU here, a stand-in nvidia-smi on PATH answers as the real one does on an H200 and an A100."""
    from tritonpack import gpus

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\nprintf '9.0\\n8.0\\n9.0\\n'\n")
    smi.chmod(0o755)
    (tmp_path / "empty").mkdir()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", os.pathsep.join([str(tmp_path / "empty"), str(smi.parent)]))
    assert gpus._which("nvidia-smi") == str(smi)
    assert sorted(gpus._nvidia_answer(gpus._start_nvidia_smi())) == [("cuda", 80, 32), ("cuda", 90, 32),
                                                                     ("cuda", 90, 32)]
    assert gpus.visible_targets() == [("cuda", 80, 32), ("cuda", 90, 32)]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "-1")
    assert gpus._start_nvidia_smi() is None and gpus.visible_targets() is None
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")
    assert gpus.visible_targets() is None  # a driver that does not answer: no GPU visible, as before
    smi.chmod(0o644)  # not executable: not a command
    assert gpus._which("nvidia-smi") is None and gpus._start_nvidia_smi() is None


def fake_kfd(monkeypatch, tmp_path, versions) -> None:
    """The KFD topology of an AMD host (a CPU node is version 0), and its /dev/kfd, open to this user."""
    from tritonpack import gpus

    for n, version in enumerate(versions):
        (tmp_path / "nodes" / str(n)).mkdir(parents=True)
        (tmp_path / "nodes" / str(n) / "properties").write_text(f"simd_count 304\ngfx_target_version {version}\n")
    (tmp_path / "kfd").touch()
    monkeypatch.setattr(gpus, "_KFD_NODES", str(tmp_path / "nodes" / "*" / "properties"))
    monkeypatch.setattr(gpus, "KFD", str(tmp_path / "kfd"))
    for variable in ("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES"):
        monkeypatch.delenv(variable, raising=False)


@pytest.mark.parametrize("variable,value", [("HIP_VISIBLE_DEVICES", "-1"), ("ROCR_VISIBLE_DEVICES", ""),
                                            ("CUDA_VISIBLE_DEVICES", ""), ("/dev/kfd", "gone")])
def test_amd_gpus_the_runtime_cannot_see_are_not_visible(tmp_path, monkeypatch, variable, value):
    """As CUDA_VISIBLE_DEVICES='' gives "no GPU visible" on NVIDIA, so do the HIP and ROCr variables that hide every
    AMD GPU, and a /dev/kfd this process cannot open (a container without the device: an image built on an MI300
    host, whose sysfs lists the host's GPUs): the probe read the topology alone, and refused a gfx90a archive."""
    from tritonpack import gpus

    fake_kfd(monkeypatch, tmp_path, [0, 90402, 90010])
    assert gpus.visible_targets() == [("hip", "gfx90a", 64), ("hip", "gfx942", 64)]
    if variable == "/dev/kfd":
        (tmp_path / "kfd").unlink()
    else:
        monkeypatch.setenv(variable, value)
    assert gpus.visible_targets() is None


def test_the_amd_arch_triton_is_told_to_compile_for_is_the_one_visible(tmp_path, monkeypatch):
    """Triton 3.4+'s HIP driver makes TRITON_OVERRIDE_ARCH the current target's arch: on a gfx942 host told gfx950,
    Triton looks up gfx950 kernels, which the probe refused as another target."""
    from tritonpack import gpus

    fake_kfd(monkeypatch, tmp_path, [0, 90402])
    monkeypatch.setenv("TRITON_OVERRIDE_ARCH", "gfx950:xnack-")
    expected = "gfx950" if TRITON_VERSION >= (3, 4) else "gfx942"  # 3.0-3.3's driver reads the device alone
    assert gpus.visible_targets() == [("hip", expected, 64)]


@pytest.mark.parametrize("text", ["gfx90a:sramecc+:xnack-", "hip:gfx90a:xnack-", "hip:gfx942:sramecc+:xnack-"])
def test_targets_and_archs_take_the_names_rocm_prints(text):
    """rocminfo, amd-smi and torch's gcnArchName print ``gfx90a:sramecc+:xnack-``, and Triton keeps what comes
    before the first colon: --target and --arch refused them (exit 2, "warp size must be a number")."""
    from tritonpack.gpus import parse_target
    from tritonpack.selection import Selection

    arch = text.removeprefix("hip:").split(":")[0]
    assert parse_target(text) == ("hip", arch, 64)
    assert Selection(archs=(text,)).checked().archs == (f"hip:{arch}" if text.startswith("hip:") else arch,)


def test_gpu_probe_runs_beside_the_index_read_and_is_stopped_if_never_read(tmp_path, monkeypatch):
    """The probe is started before the archive is read; an error before its answer is read stops it."""
    from tritonpack import gpus

    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\n{shutil.which('sleep')} 30\necho 9.0\n")  # PATH below holds no sleep
    smi.chmod(0o755)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    with gpus.GpuProbe() as probe:
        started = probe._smi
        assert started is not None and started.poll() is None  # running while the caller goes on
    assert started.returncode is not None and started.stdout.closed  # stopped and reaped, its pipe closed

    seen = []
    start = gpus._start_nvidia_smi
    monkeypatch.setattr(gpus, "_start_nvidia_smi", lambda: seen.append(start()) or seen[-1])
    (tmp_path / "bad.tpack").write_bytes(b"not an archive")
    with pytest.raises(tritonpack.TpackError):
        tritonpack.check(tmp_path / "bad.tpack")  # the archive fails before the answer is read
    assert len(seen) == 1 and seen[0].returncode is not None  # its probe was started, then stopped and reaped


def test_verdicts_read_as_the_list_of_each_entrys_verdict():
    """Verdicts are made as they are read, from the entries and the mismatches of those that have some."""
    from tritonpack.compat import TRITON, Mismatch, Verdict, Verdicts
    from tritonpack.model import GROUP, Entry, StoredFile

    entries = tuple(Entry(GROUP, "K" * 52, f"k{n}", (StoredFile(f"k{n}.json", 1, bytes(32)),)) for n in range(4))
    bad = (Mismatch(TRITON, "3.3.1", "3.9.0"),)
    verdicts = Verdicts(entries, {1: bad, 3: bad})
    expected = [Verdict(entries[0]), Verdict(entries[1], bad), Verdict(entries[2]), Verdict(entries[3], bad)]
    assert list(verdicts) == expected and len(verdicts) == 4
    assert verdicts[-1] == expected[-1] and verdicts[1:3] == expected[1:3]
    assert verdicts.unusable() == [expected[1], expected[3]] and verdicts.unusable_count == 2
    assert [verdicts.usable(n) for n in range(4)] == [True, False, True, False]
    with pytest.raises(IndexError):
        verdicts[4]


FIXTURE_TRITON = "3.6.0"  # the Triton that compiled fixtures/h200-triton36: its kernels' own triton_version
another_triton = pytest.mark.skipif(HERE_VERSION == FIXTURE_TRITON,
                                    reason=f"the H200 cache was compiled by Triton {FIXTURE_TRITON}, this Triton's "
                                           "version: the case does not arise")


def autotune_verdict(archive, targets=("cuda:90",)):
    report = tritonpack.check(archive, list(targets))
    [tuned] = [v for v in report.verdicts if v.entry.kind == "autotune"]
    return tuned, report


def test_cache_of_another_triton_records_that_triton_not_the_packers(tmp_path, gpu_cache, capsys):
    """The archive's Triton is the one that compiled the cache: the H200's 3.6, whichever Triton packs it. Its
    autotune result and launcher stubs, which name no version, are then judged as the golden archive (packed by
    3.6) judges them: by 3.6, so that none is written here."""
    archive = tmp_path / "fx.tpack"
    assert main(["pack", str(gpu_cache), "-o", str(archive)]) == 0
    err = capsys.readouterr().err
    local = local_triton({("cuda", 90, 32)})
    with tritonpack.open(archive) as reader:
        recorded = reader.info.triton
    if HERE_VERSION == FIXTURE_TRITON:  # compiled by this version: recorded as before, with the build key
        assert recorded == TritonInfo(local.version, local.key_sha256, {"cuda:90": local.backend_hashes["cuda:90"]})
        assert autotune_verdict(archive)[0].usable
        return
    assert recorded == TritonInfo(FIXTURE_TRITON, None, {})
    assert (f"kernels compiled by Triton {FIXTURE_TRITON}, Triton here is {HERE_VERSION}: build key and backend "
            "hashes not recorded, entries judged by version only") in err.splitlines()
    assert main(["list", str(archive)]) == 0
    assert f", Triton {FIXTURE_TRITON}, " in capsys.readouterr().out.splitlines()[0]
    for packed in (archive, GOLDEN):
        tuned, _ = autotune_verdict(packed)
        assert [str(m) for m in tuned.mismatches] == [f"Triton: archive {FIXTURE_TRITON}, here {HERE_VERSION}"]
        assert main(["check", str(packed), "--target", "cuda:90"]) == 5
        out = capsys.readouterr().out
        # 5 kernels, 1 autotune result, 3 launcher stubs
        assert f"9 entries: Triton: archive {FIXTURE_TRITON}, here {HERE_VERSION}" in out
    root = tmp_path / "root"
    assert main(["unpack", str(archive), "--cache-dir", str(root), "--target", "cuda:90"]) == 5
    assert not root.exists()


@another_triton
def test_cache_of_another_triton_is_used_where_that_triton_is(tmp_path, gpu_cache, monkeypatch):
    """Packed here, unpacked on a machine whose Triton is the cache's 3.6: everything of 3.6 is written, the
    autotune result too, and what could be compared by version only is said."""
    archive = tmp_path / "fx.tpack"
    tritonpack.pack(gpu_cache, archive)
    fingerprint = local_triton({("cuda", 90, 32)})
    monkeypatch.setattr("tritonpack.fingerprint.local_triton",
                        lambda *a, **k: fingerprint._replace(version=FIXTURE_TRITON))
    result = tritonpack.unpack(archive, tmp_path / "root", targets=["cuda:90"])
    assert result.kinds["autotune"] == 1 and result.kinds["group"] == 5
    assert len(list((tmp_path / "root").glob("*/scaled_add_kernel.autotune.json"))) == 1
    assert "not checked: 9 entries matched by Triton version only: the archive holds no build key (nor backend " \
           "hash) of the Triton that compiled them" in result.notes()  # and the stubs, of another Python here


def test_cache_compiled_here_records_this_tritons_build(tmp_path, compiled_root):
    archive = tmp_path / "k.tpack"
    result = tritonpack.pack(compiled_root, archive)
    local = local_triton({(t.backend, t.arch, t.warp_size) for t in targets()})
    with tritonpack.open(archive) as reader:
        recorded = reader.info.triton
    assert recorded.version == HERE_VERSION and recorded.key_sha256 == local.key_sha256 is not None
    assert recorded.backend_hashes == {f"{t.backend}:{t.arch}": local.backend_hashes[f"{t.backend}:{t.arch}"]
                                       for t in targets()}
    assert not any("Triton" in note for note in result.notes())
    assert not any("Triton" in note for note in tritonpack.check(archive).unchecked)


@another_triton
def test_cache_of_several_tritons_records_none_and_reports_its_autotune_result(tmp_path, gpu_cache, compiled_root,
                                                                              capsys):
    """The H200's 3.6 kernels, their autotune result and launcher stubs beside kernels compiled here: no one
    Triton compiled the cache, so none is recorded, and each kernel is judged by its own version (before 3.3, which
    names none, by its key). The autotune result and stubs are reported unchecked where this Triton's kernels name
    their version; where they name none, they are judged by the one version named (Triton caches autotune results
    since 3.4 only). Merging the archives of the two parts gives the same entries, but each input knew the Triton of
    its autotune result and stubs: the merged archive names it, and they are judged."""
    mixed = tmp_path / "mixed"
    shutil.copytree(gpu_cache, mixed)
    shutil.copytree(compiled_root, mixed, dirs_exist_ok=True)
    archive = tmp_path / "mixed.tpack"
    assert main(["pack", str(mixed), "-o", str(archive)]) == 0
    counts = sorted([(-5, FIXTURE_TRITON), (-len(SOURCES) * len(targets()), HERE_VERSION)])  # most kernels first
    named_here = TRITON_VERSION >= (3, 3)  # this Triton's kernels name their version
    tuned_by = "reported unchecked" if named_here else f"by Triton {FIXTURE_TRITON}, the one version named"
    assert (f"kernels compiled by several Tritons ({', '.join(f'{v}: {-n} kernels' for n, v in counts)}), "
            f"Triton here is {HERE_VERSION}: the archive records none; each kernel is judged by its own version only, "
            f"and autotune results and launcher stubs, which name none, {tuned_by}") in capsys.readouterr().err
    with tritonpack.open(archive) as reader:
        assert reader.info.triton is None
    tuned, report = autotune_verdict(archive)
    if TRITON_VERSION >= (3, 4):
        assert tuned.usable
        assert ("4 entries without a Triton version of their own (autotune results, launcher stubs, kernels of "
                "Triton before 3.3): the archive records no one Triton that compiled its kernels, so their Triton "
                "was not checked") in report.unchecked
    elif named_here:  # 3.3 reads no autotune result from its cache, whoever wrote it
        assert tuned.mismatches == (("triton", "3.4+ (autotune results are cached from 3.4)", HERE_VERSION),)
    else:
        assert tuned.mismatches == (("triton", FIXTURE_TRITON, HERE_VERSION),)
    for verdict in report.verdicts:
        if verdict.entry.kind == "group":
            own = verdict.entry.kernel.triton_version in (HERE_VERSION, None)  # None: this Triton's, before 3.3
            assert (verdict.usable or verdict.mismatches[0].factor == "target") if own else \
                verdict.mismatches[0] == ("triton", FIXTURE_TRITON, HERE_VERSION)
    parts = tmp_path / "h200.tpack", tmp_path / "here.tpack"
    tritonpack.pack(gpu_cache, parts[0])
    tritonpack.pack(compiled_root, parts[1])
    merged = tmp_path / "merged.tpack"
    tritonpack.merge(parts, merged)
    with tritonpack.open(merged) as reader, tritonpack.open(archive) as packed:
        # where this Triton's kernels name no version, the merge attributes 3.6's to the one version named
        assert reader.info.format_version == ((1, 2) if named_here else (1, 0)) and packed.info.format_version == (1, 0)
        assert [(e.ident, e.files) for e in reader.entries] == [(e.ident, e.files) for e in packed.entries]
    tuned, report = autotune_verdict(merged)
    assert [str(m) for m in tuned.mismatches] == [f"Triton: archive {FIXTURE_TRITON}, here {HERE_VERSION}"]
    # this Triton's kernels before 3.3 name no version: judged by their keys' encoding, noted as such
    assert any("without a Triton version" in note for note in report.unchecked) != named_here


@another_triton
@pytest.mark.skipif(TRITON_VERSION < (3, 4), reason=f"Triton {HERE_VERSION} never looks up the H200's autotune "
                    "result and stubs (named as 3.4 and later name them): their names judge them, not the kernels")
def test_an_unpack_of_some_kernels_judges_the_stubs_as_check_does(tmp_path, gpu_cache, compiled_root):
    """The archive of a cache of several Tritons attributes its launcher stubs to none (spec §4.2, by the kernels
    it holds): an unpack that takes only this Triton's kernels (``--kernel``) still reports them unchecked, as
    ``check`` does, rather than passing them as this Triton's (some are 3.6's)."""
    mixed = tmp_path / "mixed"
    shutil.copytree(gpu_cache, mixed)
    shutil.copytree(compiled_root, mixed, dirs_exist_ok=True)
    archive = tmp_path / "mixed.tpack"
    tritonpack.pack(mixed, archive)
    note = ("{} entries without a Triton version of their own (autotune results, launcher stubs, kernels of Triton "
            "before 3.3): the archive records no one Triton that compiled its kernels, so their Triton was not "
            "checked")
    every_target = [f"{t.backend}:{t.arch}" for t in targets()]
    assert note.format(4) in tritonpack.check(archive, every_target).unchecked  # 3 stubs, 1 autotune result
    result = tritonpack.unpack(archive, tmp_path / "root", targets=every_target,
                               selection=Selection(kernels=(SOURCES[0][0].__name__,)))
    assert f"not checked: {note.format(3)}" in result.notes()  # the stubs: the kernel filter keeps them


@another_triton
def test_archive_of_an_earlier_writer_judges_the_autotune_result_by_its_kernels(tmp_path, gpu_cache):
    """Earlier writers recorded the packing host's Triton, here this one, beside kernels of the H200's 3.6: the
    autotune result is judged by the version its kernels name, not passed for this Triton's."""
    from tritonpack.archive.writer import write_archive
    from tritonpack.cacheroot import scan_cache

    local = local_triton({("cuda", 90, 32)})
    packer = TritonInfo(local.version, local.key_sha256, {"cuda:90": local.backend_hashes["cuda:90"]})
    archive = tmp_path / "earlier.tpack"
    write_archive(str(archive), scan_cache(str(gpu_cache)).entries, ArchiveInfo("1.0.0", (1, 0), None, None, packer))
    tuned, _ = autotune_verdict(archive)
    assert [str(m) for m in tuned.mismatches] == [f"Triton: archive {FIXTURE_TRITON}, here {HERE_VERSION}"]


@pytest.mark.skipif(TRITON_VERSION < (3, 4), reason=f"Triton {HERE_VERSION} writes no autotune result and names "
                    "stubs <name>.so: the H200 fixture's, said to be its own, are refused by their names")
def test_autotune_result_and_stubs_naming_their_triton_are_judged_by_it(tmp_path, gpu_cache):
    """Format 1.2: an autotune result or a file that names its Triton is judged by that version, whatever the
    kernels beside it name, and by the archive's build key only where the archive's record is of that version."""
    from tritonpack.archive.writer import write_archive
    from tritonpack.cacheroot import scan_cache
    from tritonpack.model import named_version

    def archive(name: str, version: str, recorded: TritonInfo) -> Path:
        entries = [e._replace(autotune=e.autotune._replace(triton_version=version)) if e.autotune else
                   e._replace(stub=e.stub._replace(triton_version=version)) if e.stub else e
                   for e in scan_cache(str(gpu_cache)).entries]
        path = tmp_path / name
        write_archive(str(path), entries, ArchiveInfo("1.0.0", (1, 0), None, None, recorded))
        return path

    def verdicts(path: Path) -> list:
        return [v for v in tritonpack.check(path, ["cuda:90"]).verdicts if v.entry.kind != "group"]

    ours = archive("ours.tpack", HERE_VERSION, TritonInfo(FIXTURE_TRITON, None, {}))
    with tritonpack.open(ours) as reader:
        assert reader.info.format_version == (1, 2)
        assert {named_version(e) for e in reader.entries if e.kind != "group"} == {HERE_VERSION}
    assert len(verdicts(ours)) == 4 and all(m.factor != "triton" for v in verdicts(ours) for m in v.mismatches)
    local = local_triton({("cuda", 90, 32)})
    other_build = archive("build.tpack", HERE_VERSION, TritonInfo(HERE_VERSION, "0" * 64, {}))
    assert {str(v.mismatches[0]) for v in verdicts(other_build)} == {
        f"Triton: archive {HERE_VERSION} (build 000000000000), here {HERE_VERSION} (build {local.key_sha256[:12]})"}
    older = archive("older.tpack", "3.1.0", TritonInfo(HERE_VERSION, "0" * 64, {}))
    assert {v.mismatches[0] for v in verdicts(older)} == {("triton", "3.1.0", HERE_VERSION)}


def mixed_root(tmp_path: Path, gpu_cache: Path) -> Path:
    """The H200's Triton 3.6 cache (cuda:90 kernels, an autotune result, launcher stubs) and Triton 3.9's kernels
    for cuda:90 and cuda:80 (``fixtures/archives``), in one root: a cache kept across an upgrade."""
    root = tmp_path / "mixed"
    shutil.copytree(gpu_cache, root)
    tritonpack.unpack(FIXTURES / "archives" / "triton-3.9.0.tpack", root, force=True)
    return root


def test_a_selection_of_one_tritons_kernels_does_not_pass_the_others_stubs_as_its(tmp_path, gpu_cache, monkeypatch,
                                                                                 capsys):
    """``pack --arch cuda:80`` takes only 3.9's kernels, but the autotune result and launcher stubs, which name no
    Triton and which 3.6 wrote: the archive would attribute them to 3.9 (spec §4.2), and a Triton 3.6 would skip
    them as another Triton's. They say instead that their Triton is unknown (format 1.3), and are reported
    unchecked. ``merge --arch`` of the whole root's archive, which attributes them to none, says the same."""
    from tritonpack.model import disowned

    root = mixed_root(tmp_path, gpu_cache)
    archive, whole, merged = (tmp_path / name for name in ("a80.tpack", "whole.tpack", "m80.tpack"))
    assert main(["pack", str(root), "--arch", "cuda:80", "-o", str(archive)]) == 0
    assert ("autotune results and launcher stubs packed beside kernels of Triton 3.9.0 only, from a cache of kernels "
            "of Triton 3.6.0 too (not selected), which could have written them: 4 entries say their Triton is "
            "unknown (reported unchecked where unpacked)") in capsys.readouterr().err
    tritonpack.pack(root, whole)
    result = tritonpack.merge([whole], merged, selection=Selection(archs=("cuda:80",)))
    assert result.unknown_written == 4 and result.versions_written == 0
    for path in (archive, merged):
        with tritonpack.open(path) as reader:
            assert reader.info.format_version == (1, 3)
            assert sorted((e.kind, disowned(e)) for e in reader.entries) == \
                [("autotune", True)] + [("file", True)] * 3 + [("group", False)] * 3
    with tritonpack.open(whole) as reader:  # no map, nothing attributed: nothing to say
        assert reader.info.format_version == (1, 0) and not any(disowned(e) for e in reader.entries)

    fingerprint = local_triton({("cuda", 80, 32)})
    monkeypatch.setattr("tritonpack.fingerprint.local_triton",
                        lambda *a, **k: fingerprint._replace(version=FIXTURE_TRITON))  # a Triton 3.6 unpacks
    report = tritonpack.check(archive, ["cuda:80"])
    assert not [v for v in report.verdicts if v.entry.kind != "group" and any(
        m.factor == "triton" for m in v.mismatches)]  # where 3.9.0 was said before
    assert ("4 entries whose archive cannot name their Triton (autotune results, launcher stubs packed beside the "
            "kernels of one Triton, from a cache of several): their Triton was not checked") in report.unchecked
    assert main(["list", str(archive)]) == 0
    assert capsys.readouterr().out.count("  unknown  ") == 4


def test_a_stub_that_only_a_left_out_triton_names_so_names_it():
    """A launcher stub named ``<name>.so`` (Triton 3.3 and before) beside 3.9's kernels, from a cache of 3.3.1's
    too: its name says it is 3.3.1's, which the archive writes (1.2). An autotune result there is 3.9's (3.3 wrote
    none): nothing to say."""
    from collections import Counter

    from tritonpack.api import _owned
    from tritonpack.cacheroot import LocalEntry
    from tritonpack.model import AutotuneInfo, StubInfo, disowned, named_version

    key = "A" * 52  # in the encoding of Triton 3.3 and later
    stub = LocalEntry("file", key, "__triton_launcher.so", (), stub=StubInfo("launcher", ".so", "linux-x86_64",
                                                                           "packer"))
    tuned = LocalEntry("autotune", key, "f.autotune.json", (), autotune=AutotuneInfo("f", [], 0, {}, []))
    owners: Counter = Counter()
    assert named_version(_owned(stub, "3.9.0", {"3.3.1"}, owners)) == "3.3.1"
    kept = _owned(tuned, "3.9.0", {"3.3.1"}, owners)
    assert kept == tuned and not disowned(kept) and owners == {"3.3.1": 1}


@pytest.mark.parametrize(("theirs", "releases"), [("3.0.0", "3.0-3.1"), ("3.2.0", "3.2")])
def test_cache_of_a_triton_before_3_3_packed_beside_another_is_judged_by_its_keys(tmp_path, compiled_root, theirs,
                                                                                  releases, capsys):
    """Kernels of Triton before 3.3 name no version, and their keys are hex (3.0-3.1) or urlsafe base64 (3.2),
    which no later Triton looks up. Packed beside another Triton, here, they are not recorded as its kernels
    (they were: the preflight then passed them all), and the preflight refuses them by their keys, as it refuses
    them in an archive whose writer recorded the packing Triton. Beside kernels of this Triton they make a cache
    of several Tritons."""
    from tritonpack.archive.writer import write_archive
    from tritonpack.cacheroot import scan_cache
    from tritonpack.triton_env import releases_keyed_as

    if releases_keyed_as(HERE_VERSION) == releases:
        pytest.skip(f"Triton {HERE_VERSION} writes keys as Triton {theirs} does")
    old = tmp_path / "old"
    assert main(["unpack", str(FIXTURES / "archives" / f"triton-{theirs}.tpack"), "--cache-dir", str(old), "--force",
                 "-q"]) == 0
    archive = tmp_path / "old.tpack"
    assert main(["pack", str(old), "-o", str(archive)]) == 0
    assert (f"kernels that name no Triton version, keyed by Triton {releases}, Triton here is {HERE_VERSION}: the "
            "archive records none; the preflight judges them by their keys' encoding") in capsys.readouterr().err
    with tritonpack.open(archive) as reader:
        assert reader.info.triton is None
    local = local_triton({("cuda", 90, 32)})
    earlier = tmp_path / "earlier.tpack"
    write_archive(str(earlier), scan_cache(str(old)).entries,
                  ArchiveInfo("1.0.0", (1, 0), None, None, TritonInfo(local.version, local.key_sha256, {})))
    for packed in (archive, earlier):
        assert main(["check", str(packed)]) == 5
        assert f"6 entries: Triton: archive {releases} (by its key's encoding), here {HERE_VERSION}" in \
            capsys.readouterr().out
        assert main(["unpack", str(packed), "--cache-dir", str(tmp_path / "root")]) == 5
        assert not (tmp_path / "root").exists()
    old_keys = {p.name for p in old.iterdir()}
    shutil.copytree(compiled_root, old, dirs_exist_ok=True)
    assert main(["pack", str(old), "-o", str(tmp_path / "mixed.tpack")]) == 0
    assert f"{releases} by their keys: 6 kernels" in capsys.readouterr().err
    report = tritonpack.check(tmp_path / "mixed.tpack")
    assert {v.entry.key for v in report.unusable} == old_keys


def test_root_of_kernels_from_before_and_after_3_3_packed_by_the_older_triton(tmp_path, gpu_cache, monkeypatch,
                                                                              capsys):
    """A root kept across a PyTorch upgrade, packed and checked by its older Triton (here, said to be 3.0.0): its
    own kernels, which name no version, are neither recorded as nor judged by the 3.6 kernels beside them (the
    archive recorded Triton 3.6.0, and the preflight refused this Triton's kernels for it)."""
    root = tmp_path / "root"
    assert main(["unpack", str(FIXTURES / "archives" / "triton-3.0.0.tpack"), "--cache-dir", str(root), "--force",
                 "-q"]) == 0
    old_keys = {p.name for p in root.iterdir()}
    shutil.copytree(gpu_cache, root, dirs_exist_ok=True)
    fingerprint = local_triton({("cuda", 90, 32)})
    monkeypatch.setattr("tritonpack.fingerprint.local_triton",
                        lambda *a, **k: fingerprint._replace(version="3.0.0"))
    archive = tmp_path / "k.tpack"
    assert main(["pack", str(root), "-o", str(archive)]) == 0
    assert (f"kernels compiled by several Tritons (3.0.0: 6 kernels, {FIXTURE_TRITON}: 5 kernels), Triton here is "
            "3.0.0: the archive records none; each kernel is judged by its own version only, and autotune results and "
            f"launcher stubs, which name none, by Triton {FIXTURE_TRITON}, the one version named") \
        in capsys.readouterr().err
    report = tritonpack.check(archive, ["cuda:90", "cuda:80"])
    assert {v.entry.key for v in report.usable} == old_keys  # the stubs are the 3.6 kernels' too
    assert all(v.mismatches[0] == ("triton", FIXTURE_TRITON, "3.0.0") for v in report.unusable)


def hip_archive(path: Path, compiled_root: Path, backend_hash: str) -> Path:
    """An archive of one kernel, said to be compiled for hip:gfx942 by this Triton with ``backend_hash``."""
    from tritonpack.archive.writer import write_archive
    from tritonpack.cacheroot import scan_cache

    entry = next(e for e in scan_cache(str(compiled_root)).entries if e.kind == "group")
    entry = entry._replace(kernel=entry.kernel._replace(backend="hip", arch="gfx942", warp_size=64))
    local = local_triton()
    write_archive(str(path), [entry], ArchiveInfo("1.0.0", (1, 0), None, None,
                                                  TritonInfo(local.version, local.key_sha256,
                                                             {"hip:gfx942": backend_hash})))
    return path


def test_amd_backend_of_triton_before_3_5_is_named_by_its_linker(tmp_path, compiled_root, monkeypatch):
    """Triton 3.0-3.4 hash the AMD backend with ``ld.lld --version``: a mismatch names both linkers."""
    linked = "Debian LLD 19.1.7 (compatible with GNU linkers)\n-GPUTarget(backend='hip', arch='gfx942', warp_size=64)"
    archive = hip_archive(tmp_path / "hip.tpack", compiled_root, linked)
    here = local_triton()._replace(backend_hashes={"hip:gfx942": "AMD LLD 17.0.0 (/ROCm/llvm 6.2)\n-GPUTarget(...)"})
    monkeypatch.setattr("tritonpack.fingerprint.local_triton", lambda *a, **k: here)
    [verdict] = tritonpack.check(archive, ["hip:gfx942"]).verdicts
    assert [str(m) for m in verdict.mismatches] == ["backend: archive ld.lld 19.1.7, here ld.lld 17.0.0"]


@pytest.mark.skipif(not links_amd(), reason="this Triton cannot compile for AMD here")
def test_an_amd_arch_at_two_warp_sizes_keeps_a_backend_hash_for_each(tmp_path, monkeypatch):
    """Triton's AMD backend hash names the warp size. The hashes were kept by arch alone: the fingerprint served one
    warp size's hash for the other, the archive recorded it, and a fresh machine refused kernels Triton hits."""
    from kernels import cache_dir, source
    from triton.backends.compiler import GPUTarget

    fn, signature, constexprs = SOURCES[0]
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-build"))
    for warp in (32, 64):
        with cache_dir(tmp_path / f"w{warp}"):
            triton.compile(source(fn, signature, constexprs), target=GPUTarget("hip", "gfx942", warp))
        tritonpack.pack(tmp_path / f"w{warp}", tmp_path / f"w{warp}.tpack")
    for warp, key in ((32, "hip:gfx942:32"), (64, "hip:gfx942")):
        with tritonpack.open(tmp_path / f"w{warp}.tpack") as reader:
            assert list(reader.info.triton.backend_hashes) == [key]
            assert f"warp_size={warp}" in reader.info.triton.backend_hashes[key] or TRITON_VERSION < (3, 5)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-deploy"))  # another machine, the same Triton
    for warp in (32, 64):
        report = tritonpack.check(tmp_path / f"w{warp}.tpack", [f"hip:gfx942:{warp}"])
        assert report.usable_count == 1, [str(m) for v in report.verdicts for m in v.mismatches]


def test_a_target_that_differs_in_its_warp_size_alone_names_both_warp_sizes(tmp_path, compiled_root):
    """A gfx942 kernel of warp 64 checked against --target hip:gfx942:32 read "target: archive hip:gfx942, here
    hip:gfx942 (--target)": the same words on both sides."""
    archive = hip_archive(tmp_path / "hip.tpack", compiled_root, "GPUTarget('hip', 'gfx942', 64)")
    [verdict] = tritonpack.check(archive, ["hip:gfx942:32"]).verdicts
    assert [str(m) for m in verdict.mismatches if m.factor == "target"] == [
        "target: archive hip:gfx942:64, here hip:gfx942:32 (--target)"]
    [verdict] = tritonpack.check(archive, ["cuda:90", "hip:gfx1100"]).verdicts
    assert [str(m) for m in verdict.mismatches if m.factor == "target"] == [
        "target: archive hip:gfx942, here cuda:90, hip:gfx1100 (--target)"]


def test_a_backend_this_triton_cannot_hash_is_said_unchecked_and_asked_once(tmp_path, compiled_root, monkeypatch):
    """Triton 3.0-3.4 run ROCm's ld.lld even to hash the AMD backend: without it, a kernel for hip:gfx942 is not
    checked against its backend hash, and says so (it passed unsaid); the fingerprint remembers that it could not
    be computed (every check imported Triton and hashed it again: 0.4 s for 0.06 s)."""
    from tritonpack import triton_env

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    real = triton_env._backend_hash
    asked = []

    def no_linker(backend, arch, warp_size):
        asked.append(backend)
        return None if backend == "hip" else real(backend, arch, warp_size)

    monkeypatch.setattr(triton_env, "_backend_hash", no_linker)
    archive = hip_archive(tmp_path / "hip.tpack", compiled_root, "GPUTarget('hip', 'gfx942', 64)")
    report = tritonpack.check(archive, ["hip:gfx942"])
    assert report.usable_count == 1
    assert ("1 entry for hip:gfx942: this Triton cannot compute the backend hash (its toolchain, e.g. ROCm's ld.lld, "
            "is missing), so the backend was not checked") in report.unchecked
    assert asked == ["hip"]
    assert local_triton({("hip", "gfx942", 64)}).cached and asked == ["hip"]


def test_the_fingerprint_sees_rocm_s_linker_change_where_triton_hashes_it(tmp_path, monkeypatch):
    """Triton 3.0-3.4 hash the AMD backend with the ``--version`` of ROCm's ld.lld, found outside their package: a
    fingerprint kept the old linker's hash after ROCm was upgraded in place (refusing kernels Triton would hit), and
    "cannot compute" after one was installed. It is keyed by the linkers' files too."""
    if TRITON_VERSION >= (3, 5):
        pytest.skip("Triton 3.5+ hash the AMD backend without ld.lld")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    lld = tmp_path / "ld.lld"
    monkeypatch.setenv("TRITON_HIP_LLD_PATH", str(lld))
    if links_amd():  # a linker at /opt/rocm or /usr/bin answers where TRITON_HIP_LLD_PATH names none
        pytest.skip("a ROCm linker is installed here")
    assert "hip:gfx942" not in local_triton({("hip", "gfx942", 64)}).backend_hashes
    for version, mtime in (("17.0.0", 1), ("18.0.0", 2)):  # installed, then upgraded in place
        lld.write_text(f'#!/bin/sh\necho "AMD LLD {version} (/opt/rocm/llvm)"\n')
        lld.chmod(0o755)
        os.utime(lld, (mtime, mtime))
        assert version in local_triton({("hip", "gfx942", 64)}).backend_hashes.get("hip:gfx942", "")


def add_stubs_and_autotune_result(root: Path) -> dict[str, Path]:
    """A launcher stub named as Triton 3.3 and before name them, one named as 3.4 and later do, and an autotune
    result, each in a key directory of its own in this Triton's encoding (no GPU here to build or tune real ones)."""
    made = {"bare": root / cache_key("bare") / "__triton_launcher.so",
            "tagged": root / cache_key("tagged") / f"__triton_launcher{sysconfig.get_config_var('EXT_SUFFIX')}",
            "tuned": root / cache_key("tuned") / "add_kernel.autotune.json"}
    for path in made.values():
        path.parent.mkdir(parents=True)
    made["bare"].write_bytes(b"\x7fELF launcher of 3.3")
    made["tagged"].write_bytes(b"\x7fELF launcher of 3.4+")
    made["tuned"].write_text(json.dumps({"key": [1024], "configs_timings": [[{"kwargs": {"BLOCK": 64}}, [0.5]]]}))
    return made


def test_stubs_and_autotune_results_are_judged_by_how_triton_names_them(tmp_path, compiled_root):
    """Triton 3.3 and before name a launcher stub ``<name>.so`` and read no autotune result from the cache; 3.4
    and later look for ``<name>`` + ``EXT_SUFFIX``. Whatever the archive says of their Triton, the ones this Triton
    never looks up are not written, with the reason (they were written, as dead files)."""
    root = tmp_path / "root"
    shutil.copytree(compiled_root, root)
    made = add_stubs_and_autotune_result(root)
    archive = tmp_path / "k.tpack"
    tritonpack.pack(root, archive)
    verdicts = {v.entry.name: v for v in tritonpack.check(archive).verdicts if v.entry.kind != "group"}
    bare, tagged, tuned = (verdicts[made[what].name] for what in ("bare", "tagged", "tuned"))
    if TRITON_VERSION >= (3, 4):
        assert [str(m) for m in bare.mismatches] == [f"Triton: archive 3.0-3.3 (by its file name), here {HERE_VERSION}"]
        assert tagged.usable and tuned.usable
    else:
        assert bare.usable
        assert [str(m) for m in tagged.mismatches] == [f"Triton: archive 3.4+ (by its file name), here {HERE_VERSION}"]
        assert [str(m) for m in tuned.mismatches] == [
            f"Triton: archive 3.4+ (autotune results are cached from 3.4), here {HERE_VERSION}"]
    result = tritonpack.unpack(archive, tmp_path / "out")
    keys = {m.parent.name for m in made.values()}
    unpacked = {p.name for p in (tmp_path / "out").glob("*/*") if p.parent.name in keys}
    assert unpacked == {made[what].name for what in (("tagged", "tuned") if TRITON_VERSION >= (3, 4) else ("bare",))}
    assert result.written == result.entries - (1 if TRITON_VERSION >= (3, 4) else 2)


@another_triton
def test_a_stub_that_the_kernels_triton_never_names_so_is_not_attributed_to_it(tmp_path, gpu_cache, compiled_root):
    """A root kept across a PyTorch upgrade from Triton 3.3 holds 3.3's bare ``<name>.so`` stubs beside the H200's
    3.6 kernels: the archive attributes what names no version to 3.6, which never names a stub so. The stub is
    not held to 3.6 (it was refused as 3.6's under 3.3, whose stub it is); a merge does not name 3.6 for it."""
    root = tmp_path / "root"
    shutil.copytree(gpu_cache, root)
    bare = add_stubs_and_autotune_result(root)["bare"]
    archive = tmp_path / "k.tpack"
    tritonpack.pack(root, archive)
    report = tritonpack.check(archive, ["cuda:90"])
    (verdict,) = [v for v in report.verdicts if v.entry.key == bare.parent.name]
    if TRITON_VERSION >= (3, 4):
        assert [str(m) for m in verdict.mismatches] == [
            f"Triton: archive 3.0-3.3 (by its file name), here {HERE_VERSION}"]
    else:
        assert verdict.usable
        assert any(note.startswith("1 entry without a Triton version of its own") for note in report.unchecked)
    merged = tmp_path / "m.tpack"
    tritonpack.merge([archive, tritonpack.pack(compiled_root, tmp_path / "here.tpack").archive], merged)
    with tritonpack.open(merged) as reader:
        (entry,) = [e for e in reader.entries if e.key == bare.parent.name]
        assert entry.stub.triton_version is None
        # before 3.3 this Triton's kernels name no version: the merged archive attributes the rest to 3.6.0 itself
        assert {e.stub.triton_version for e in reader.entries if e.stub and e.key != bare.parent.name} == \
            {FIXTURE_TRITON if TRITON_VERSION >= (3, 3) else None}


COMPILE_WITH = """
import json, os, sys
sys.path.insert(0, sys.argv[1])
from kernels import compile_all
print(json.dumps(compile_all(sys.argv[2])))
"""


def compile_in_a_process(root: Path, **env: str) -> list[bool]:
    """The kernels of ``tests/kernels.py`` compiled for cuda:90 and cuda:80 in a process of their own, with ``env``
    (Triton keeps ``ptxas --version`` for the life of a process): whether each was a hit (3.4+: the listener)."""
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRITON_PTXAS")}
    out = subprocess.run([sys.executable, "-c", COMPILE_WITH, str(Path(__file__).parent), str(root)],
                         env={**clean, **env}, check=True, capture_output=True, text=True).stdout
    return json.loads(out.splitlines()[-1])


def test_kernels_another_ptxas_compiled_record_no_backend_hash_and_say_so(tmp_path, monkeypatch):
    """vLLM and PyTorch set TRITON_PTXAS_PATH inside the process for new GPUs: pack, without it, recorded its own
    ptxas as the kernels' backend, so the preflight passed them where Triton recompiles them (and refused them where
    it hits). Their .ptx names the PTX ISA of the ptxas that compiled them: where it is not the packer's, the
    archive records no backend hash for their target, and check says the backend was not checked."""
    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    fake = {}
    for name, variable in (("ptxas", "TRITON_PTXAS_PATH"), ("ptxas-blackwell", "TRITON_PTXAS_BLACKWELL_PATH")):
        if (bundled / name).exists():  # the bundled one, but for its --version: release 12.3
            wrapper = tmp_path / f"fake-{name}"
            wrapper.write_text(f'#!/bin/sh\nif [ "$1" = --version ]; then "{bundled / name}" --version | sed -E '
                               "'s/release [0-9.]+, V[0-9.]+/release 12.3, V12.3.107/'; exit 0; fi\n"
                               f'exec "{bundled / name}" "$@"\n')
            wrapper.chmod(0o755)
            fake[variable] = str(wrapper)
    for variable in ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    compile_in_a_process(tmp_path / "elsewhere", **fake)
    compile_in_a_process(tmp_path / "here")
    result = tritonpack.pack(tmp_path / "elsewhere", tmp_path / "elsewhere.tpack")
    assert "PTX 8.3, where the ptxas here writes" in result.triton_note and "cuda:80, cuda:90" in result.triton_note
    with tritonpack.open(tmp_path / "elsewhere.tpack") as reader:
        assert not [t for t in reader.info.triton.backend_hashes if t.startswith("cuda:")]
    report = tritonpack.check(tmp_path / "elsewhere.tpack")
    assert report.usable_count == len(report.verdicts)
    assert any(n.endswith("for cuda:80, cuda:90: the archive records no backend hash for their target (their packer "
                          "could not compute it, or found them compiled with another ptxas than its own), so the "
                          "backend was not checked") for n in report.unchecked), report.unchecked
    tritonpack.unpack(tmp_path / "elsewhere.tpack", tmp_path / "deploy")
    hits = compile_in_a_process(tmp_path / "deploy")
    if HAS_LISTENER:  # what the preflight could not promise: Triton here recompiles them (AMD's, it hits)
        cuda = [hit for n, hit in enumerate(hits) if targets()[n % len(targets())].backend == "cuda"]
        assert cuda and not any(cuda)
    result = tritonpack.pack(tmp_path / "here", tmp_path / "here.tpack")  # compiled with the packer's ptxas
    assert not result.triton_note
    with tritonpack.open(tmp_path / "here.tpack") as reader:
        assert {"cuda:80", "cuda:90"} <= set(reader.info.triton.backend_hashes)


def test_the_fingerprint_sees_a_ptxas_replaced_where_triton_ptxas_path_names_it(tmp_path, monkeypatch):
    """A CUDA toolkit upgraded in place (or a switched /usr/local/cuda link) behind TRITON_PTXAS_PATH changes the
    backend hash, and no file of Triton's: the cached fingerprint kept the old ptxas's, and check passed kernels
    that Triton recompiles. Each fingerprint in a process of its own, as each command is (Triton keeps a ptxas's
    version for the life of a process)."""
    import subprocess
    import sys

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    ptxas = tmp_path / "ptxas"
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "xdg"), "TRITON_PTXAS_PATH": str(ptxas),
           "TRITON_PTXAS_BLACKWELL_PATH": str(ptxas)}  # 3.6+ hash cuda:90 with either, as the release says
    fingerprint = ("from tritonpack.fingerprint import local_triton; "
                   "print(local_triton({('cuda', 90, 32)}).backend_hashes['cuda:90'])")
    for release, mtime in (("12.3", 1), ("12.4", 2)):
        ptxas.write_text(f'#!/bin/sh\n"{bundled}" --version | sed -E "s/release [0-9.]+, V[0-9.]+/release '
                         f'{release}, V{release}.1/"\n')
        ptxas.chmod(0o755)
        os.utime(ptxas, (mtime, mtime))
        out = subprocess.run([sys.executable, "-c", fingerprint], env=env, check=True, capture_output=True,
                             text=True).stdout
        assert f"release {release}," in out


@pytest.mark.parametrize("variable", ["TRITON_ALWAYS_COMPILE", "TRITON_DEBUG"])
def test_a_setting_under_which_triton_misses_unseen_is_said(tmp_path, compiled_root, monkeypatch, variable):
    """TRITON_ALWAYS_COMPILE reads nothing from the cache; under TRITON_DEBUG the JIT compiles every kernel with
    debug on (part of the key), which the archive's index does not record. Neither is among the variables a kernel
    records: check said every kernel "will be used here" while Triton recompiled them all."""
    archive = tmp_path / "k.tpack"
    tritonpack.pack(compiled_root, archive)
    monkeypatch.setenv(variable, "1")
    report = tritonpack.check(archive)
    assert [n for n in report.unchecked if n.startswith(f"{variable} is set here: ")]
    monkeypatch.setenv(variable, "0")
    assert not [n for n in tritonpack.check(archive).unchecked if n.startswith(variable)]
    monkeypatch.setenv(variable, "true")  # a knob from 3.4 on; 3.0-3.3 take "1" alone
    said = [n for n in tritonpack.check(archive).unchecked if n.startswith(variable)]
    assert bool(said) == (TRITON_VERSION >= (3, 4))


def test_a_launcher_stub_keyed_by_where_triton_is_installed_is_said_so(tmp_path, compiled_root):
    """Triton 3.8+ key a launcher stub by their install directory and libcuda's too (``runtime/build.py``), which
    no archive records: check called such a stub usable, and it hits only where both are the same."""
    root = tmp_path / "root"
    shutil.copytree(compiled_root, root)
    add_stubs_and_autotune_result(root)
    tritonpack.pack(root, tmp_path / "a.tpack")
    said = [n for n in tritonpack.check(tmp_path / "a.tpack").unchecked if "(launcher stubs): Triton 3.8+" in n]
    assert len(said) == (TRITON_VERSION >= (3, 8))
    if said:
        assert said[0].startswith("1 entry (launcher stubs): Triton 3.8+ looks one up by a key that names its install")


def test_a_stub_whose_name_says_no_python_is_said_tagged_with_the_packer_s(tmp_path, compiled_root, monkeypatch):
    """Triton 3.0-3.3 name a launcher stub <name>.so: pack tags it with its own Python's ABI, right where it runs on
    the program's Python. Where the kernels' Triton is not importable beside it (tritonpack installed with pipx,
    on another Python), that may be another ABI, and pack says so."""
    root = tmp_path / "root"
    shutil.copytree(compiled_root, root)
    add_stubs_and_autotune_result(root)
    assert not (tritonpack.pack(root, tmp_path / "a.tpack").triton_note or "").count("launcher stub")
    monkeypatch.setattr("tritonpack.fingerprint.local_triton", lambda *a, **k: None)
    note = tritonpack.pack(root, tmp_path / "b.tpack").triton_note
    assert f"1 launcher stub named <name>.so, as Triton 3.0-3.3 name them, which says no Python: tagged with this " \
           f"Python's ABI ({sysconfig.get_config_var('EXT_SUFFIX')})" in note


def test_a_kernel_that_asked_for_its_ptx_version_keeps_its_target_s_backend_hash(tmp_path):
    """A kernel compiled with ``ptx_version`` (a compile option, in its metadata) declares that PTX whatever its
    ptxas: it left out its target's backend hash, blaming another ptxas."""
    from kernels import cache_dir, source
    from triton.backends.compiler import GPUTarget

    root = tmp_path / "root"
    fn, signature, constexprs = SOURCES[0]
    with cache_dir(root):
        triton.compile(source(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32))
        triton.compile(source(fn, signature, constexprs), target=GPUTarget("cuda", 90, 32), options={"ptx_version": 80})
    result = tritonpack.pack(root, tmp_path / "a.tpack")
    with tritonpack.open(tmp_path / "a.tpack") as reader:
        assert "cuda:90" in reader.info.triton.backend_hashes, result.triton_note
