"""Unpacking into Redis for Triton's own remote cache, against a real redis-server on 127.0.0.1: a Triton process
with the Redis backend and an EMPTY local cache dir hits every kernel, and stores nothing (no SET) doing so."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

redis = pytest.importorskip("redis")
triton = pytest.importorskip("triton")

from servers import free_port, redis_server  # noqa: E402

import tritonpack  # noqa: E402
from tritonpack.entry import main  # noqa: E402
from tritonpack.redis_cache import DEFAULT_KEY_FORMAT, manifest_value  # noqa: E402

if not hasattr(triton.runtime.cache, "RemoteCacheManager"):
    pytest.skip(f"Triton {triton.__version__} has no remote cache", allow_module_level=True)

TRITONS = "triton.runtime.cache:RedisRemoteCacheBackend"
OURS = "tritonpack.triton_redis:RedisRemoteCacheBackend"
TESTS = Path(__file__).resolve().parent
COMPILE = """
import json, sys
sys.path.insert(0, sys.argv[1])
from kernels import compile_all
print(json.dumps(compile_all(sys.argv[2])))
"""


@pytest.fixture(scope="module")
def port(tmp_path_factory):
    with redis_server(tmp_path_factory.mktemp("redis")) as p:
        yield p


@pytest.fixture()
def db(port):
    client = redis.Redis(host="127.0.0.1", port=port)
    client.flushall()
    yield client
    client.close()


@pytest.fixture(scope="module")
def archive(compiled_root, tmp_path_factory):
    path = tmp_path_factory.mktemp("redis-archive") / "kernels.tpack"
    tritonpack.pack(compiled_root, path)
    return path


def stock_backend_starts() -> str | None:
    """Why Triton's own backend cannot be used here, or None: 3.4-3.9 read knobs.cache.redis, which they lack."""
    try:
        triton.runtime.cache.RedisRemoteCacheBackend("probe")
    except Exception as e:
        return f"Triton {triton.__version__}'s own RedisRemoteCacheBackend cannot start ({type(e).__name__}: {e})"
    return None


def triton_with_redis(port: int, local: Path, backend: str, key_format: str | None = None) -> list:
    """compile_all in a fresh process whose Triton reads the Redis remote cache (TRITON_CACHE_MANAGER and
    TRITON_REMOTE_CACHE_BACKEND; Triton 3.3 caches the manager class per process, hence the process)."""
    env = dict(os.environ, TRITON_CACHE_MANAGER="triton.runtime.cache:RemoteCacheManager",
               TRITON_REMOTE_CACHE_BACKEND=backend, TRITON_REDIS_HOST="127.0.0.1", TRITON_REDIS_PORT=str(port))
    if key_format:
        env["TRITON_REDIS_KEY_FORMAT"] = key_format
    out = subprocess.run([sys.executable, "-c", COMPILE, str(TESTS), str(local)], env=env, capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def sets(client) -> int:
    return client.info("commandstats").get("cmdstat_set", {}).get("calls", 0)


@pytest.mark.parametrize("backend", [TRITONS, OURS])
def test_triton_hits_from_redis_with_an_empty_local_cache(archive, db, port, tmp_path, backend):
    from kernels import HAS_LISTENER

    if backend == TRITONS and (reason := stock_backend_starts()):
        pytest.skip(reason)
    assert main(["unpack", str(archive), "--to-redis", f"redis://127.0.0.1:{port}", "-q"]) == 0
    with tritonpack.open(archive) as reader:
        entries = reader.entries
    for entry in entries:
        for f in entry.files:
            assert db.strlen(DEFAULT_KEY_FORMAT.format(key=entry.key, filename=f.name)) == f.size
        if entry.kind == "group":
            manifest = db.get(f"triton:{entry.key}:__grp__{entry.name}.json")
            assert manifest == manifest_value(entry)
            assert json.loads(manifest) == {"child_paths": sorted(f.name for f in entry.files)}

    local = tmp_path / "empty-local-cache"
    local.mkdir()
    db.config_resetstat()
    hits = triton_with_redis(port, local, backend)
    assert len(hits) == len([e for e in entries if e.kind == "group"])
    if HAS_LISTENER:
        assert all(hits), hits
    assert sets(db) == 0, "a Triton that hit stores nothing in Redis"
    assert list(local.iterdir()), "Triton materialised the kernels from Redis under its local cache dir"

    if backend == TRITONS:
        return
    # The control: the same Triton, looking under other keys, misses and stores what it compiled.
    db.config_resetstat()
    misses = triton_with_redis(port, tmp_path / "control", backend, key_format="other:{key}:{filename}")
    if HAS_LISTENER:
        assert not any(misses), misses
    assert sets(db) > 0


def test_rerun_is_idempotent_and_differing_values_are_kept_unless_overwrite(archive, db, port):
    url = f"redis://127.0.0.1:{port}"
    first = tritonpack.unpack_to_redis(archive, url)
    assert first.written == first.entries and first.files_written > 0 and first.cache_dir == url
    again = tritonpack.unpack_to_redis(archive, url)
    assert again.present == again.entries and again.files_written == 0
    with tritonpack.open(archive) as reader:
        group = next(e for e in reader.entries if e.kind == "group")
    victim = f"triton:{group.key}:{group.files[0].name}"
    db.set(victim, b"locally different")
    kept = tritonpack.unpack_to_redis(archive, url)
    assert kept.conflicts == [f"{group.key}/{group.name}"] and db.get(victim) == b"locally different"
    replaced = tritonpack.unpack_to_redis(archive, url, overwrite=True)
    assert replaced.replaced == 1 and replaced.files_written == 1 and db.get(victim) != b"locally different"
    db.delete(f"triton:{group.key}:{group.files[-1].name}")  # evicted, say: the group is repaired
    repaired = tritonpack.unpack_to_redis(archive, url)
    assert repaired.written == 1 and repaired.files_written == 1


def test_a_thinned_copy_over_whole_groups_is_present_and_leaves_them_whole(compiled_root, db, port, tmp_path):
    """An archive of a cache thinned to its binaries, unpacked over the whole groups: every group was a conflict,
    and --overwrite rewrote each manifest to list the binaries alone. They are present, as into a directory."""
    from conftest import full_and_thinned

    url = f"redis://127.0.0.1:{port}"
    full, thinned = full_and_thinned(compiled_root, tmp_path)
    tritonpack.unpack_to_redis(full, url, force=True)
    manifests = {k: db.get(k) for k in db.keys("*__grp__*")}
    for overwrite in (False, True):
        result = tritonpack.unpack_to_redis(thinned, url, force=True, overwrite=overwrite)
        assert result.conflicts == [] and result.present == result.entries and result.files_written == 0
        assert {k: db.get(k) for k in db.keys("*__grp__*")} == manifests
    db.delete(*[k for k in db.keys("triton:*") if k.endswith(b".ttir")])  # evicted (maxmemory)
    repaired = tritonpack.unpack_to_redis(thinned, url, force=True)  # Triton 3.8+ misses a group lacking one
    assert repaired.present == 0 and repaired.written == len(manifests) and repaired.files_written == 0
    for key, before in manifests.items():  # it lists what is there: the thinned files, and the others left
        listed = json.loads(db.get(key))["child_paths"]
        assert listed == [n for n in json.loads(before)["child_paths"] if not n.endswith(".ttir")]
        assert all(db.exists(key.decode().rpartition(":")[0] + ":" + name) for name in listed)
    from kernels import HAS_LISTENER

    db.config_resetstat()
    hits = triton_with_redis(port, tmp_path / "local", OURS)
    if HAS_LISTENER:
        assert all(hits), hits
    assert sets(db) == 0, "a Triton that hit stores nothing in Redis"


def test_force_counts_what_it_wrote(archive, db, port, capsys):
    url = f"redis://127.0.0.1:{port}"
    args = ["unpack", str(archive), "--to-redis", url, "--target", "cuda:80", "--force", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    with tritonpack.open(archive) as reader:
        unusable = first["entries"] - len([e for e in reader.entries if e.target == "cuda:80"])
    assert first["written"] == first["entries"] and first["forced"] == unusable > 0 and first["forced_present"] == 0
    assert main(args) == 0
    again = json.loads(capsys.readouterr().out)
    assert (again["written"], again["forced"], again["forced_present"]) == (0, 0, unusable)
    assert main(args[:-1]) == 0
    err = capsys.readouterr().err
    assert "wrote" not in err and f"--force: {unusable} entries that the preflight says will not be used here were " \
        "already present" in err


def test_preflight_applies(archive, db, port):
    result = tritonpack.unpack_to_redis(archive, f"redis://127.0.0.1:{port}", targets=["cuda:80"])
    assert result.not_used_entries == result.entries - result.written > 0
    with tritonpack.open(archive) as reader:
        for entry in reader.entries:
            stored = db.exists(f"triton:{entry.key}:__grp__{entry.name}.json")
            assert stored == (entry.target == "cuda:80")


def test_errors(archive, tmp_path, capsys):
    url = f"redis://127.0.0.1:{free_port()}"
    assert main(["unpack", str(archive), "--to-redis", url]) == 7
    err = capsys.readouterr().err
    assert err.startswith(f"error: {url}: ") and "onnection refused" in err and err.count("\n") == 1, err
    assert main(["unpack", str(archive), "--to-redis", url, "--cache-dir", str(tmp_path)]) == 2
    assert "exclude each other" in capsys.readouterr().err


@pytest.mark.parametrize("database", ["/1", "?db=2", "/0?db=3"])
def test_a_database_triton_never_reads_is_refused_before_anything_is_written(archive, db, port, database, capsys):
    """Triton's backend connects to TRITON_REDIS_HOST:TRITON_REDIS_PORT, database 0: kernels written to another
    database would never be hit, by any process of the fleet."""
    url = f"redis://127.0.0.1:{port}{database}"
    number = database[-1]
    assert main(["unpack", str(archive), "--to-redis", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {url}: database {number}: Triton's RedisRemoteCacheBackend reads database 0 only")
    assert "leave the database out of the URL" in err and err.count("\n") == 1
    assert db.info("keyspace") == {} and db.info("commandstats").get("cmdstat_select") is None
    with pytest.raises(tritonpack.UsageError, match=f"database {number}: "):
        tritonpack.unpack_to_redis(archive, url)
    result = tritonpack.unpack_to_redis(archive, f"redis://127.0.0.1:{port}/0")  # database 0 named: Triton's
    assert result.written == result.entries > 0 and db.dbsize() > 0
