"""Unpacking into Redis, in the layout of Triton's own remote cache, so that a fleet hits without local copies.

Triton (3.0 and later, read from ``triton/runtime/cache.py``) reads a remote cache when a process sets
``TRITON_CACHE_MANAGER=triton.runtime.cache:RemoteCacheManager`` and
``TRITON_REMOTE_CACHE_BACKEND=triton.runtime.cache:RedisRemoteCacheBackend`` (``TRITON_REDIS_HOST``/``_PORT``).
``RedisRemoteCacheBackend`` stores each file of cache key directory ``KEY`` under
``TRITON_REDIS_KEY_FORMAT.format(key=KEY, filename=NAME)`` (default ``triton:{key}:{filename}``) with the file's
bytes as value. ``RemoteCacheManager.put_group`` stores a group's manifest ``__grp__<name>.json`` as
``json.dumps({"child_paths": sorted(file names)})``: names, not paths, since every process materialises the files
under its own ``TRITON_CACHE_DIR``; ``get_group`` then fetches those names and (3.9) misses unless all are there.
Autotune results and launcher stubs are plain files (``get_file``).

A value has no path in it, so unlike a directory there is nothing to relink: an entry is present when every value
is identical (a group's stored manifest may list more files: the whole group beside a thinned copy), in conflict
when one differs, and written otherwise; a group's manifest goes last.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Callable, Sequence
from urllib.parse import urlsplit, urlunsplit

from .api import Progress, preflight, progress_counter
from .archive.reader import ArchiveReader
from .cachedest import CONFLICT, PRESENT, REPLACE, WRITE, Placement
from .errors import RemoteError, UsageError
from .model import GROUP, Entry, manifest_name
from .remote import SERVER_TIMEOUT, open_source
from .remote import shown as public
from .report import UnpackResult, unpack_result

DEFAULT_KEY_FORMAT = "triton:{key}:{filename}"  # Triton's TRITON_REDIS_KEY_FORMAT default (3.0-3.9)
BATCH_BYTES = 32 << 20  # values sent per pipeline round trip, at most (besides one larger value)


def key_format() -> str:
    """The same setting Triton's backend reads, so that both sides agree by construction."""
    return os.environ.get("TRITON_REDIS_KEY_FORMAT") or DEFAULT_KEY_FORMAT


def redis_key(fmt: str, key: str, filename: str) -> str:
    try:
        return fmt.format(key=key, filename=filename)
    except (KeyError, IndexError, ValueError) as e:
        raise UsageError(f"TRITON_REDIS_KEY_FORMAT {fmt!r} is not a format of {{key}} and {{filename}} ({e})") from None


def manifest_value(entry: Entry, others: Sequence[str] = ()) -> bytes:
    """Exactly what ``RemoteCacheManager.put_group`` stores for the group (with ``others``: files of it stored
    beyond the entry's, which the manifest it replaces listed)."""
    return json.dumps({"child_paths": sorted({*(f.name for f in entry.files), *others})}).encode("utf-8")


def decide(states: Sequence[bool | None], overwrite: bool) -> tuple[str, tuple[int, ...]]:
    """Action and values to write, from each value's state: True same, False different, None absent."""
    todo = tuple(i for i, s in enumerate(states) if s is not True)
    if not todo:
        return PRESENT, ()
    if any(s is False for s in states):
        return (REPLACE, todo) if overwrite else (CONFLICT, ())
    return WRITE, todo


def public_url(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = (f"{parts.username}@" if parts.username else "") + host + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def connect(url: str):
    """A client for ``redis://HOST:PORT``, checked with one PING. A URL naming a database other than 0 (``/N``,
    ``?db=N``) is refused before connecting: Triton's backend never reads another one."""
    shown = public_url(url)
    try:
        import redis
    except ImportError:
        raise UsageError("--to-redis needs the redis package: pip install redis", shown) from None
    try:
        client = redis.Redis.from_url(url, socket_connect_timeout=SERVER_TIMEOUT[0], socket_timeout=SERVER_TIMEOUT[1])
    except ValueError as e:
        raise UsageError(f"not a Redis URL ({e})", shown) from None
    database = client.connection_pool.connection_kwargs.get("db") or 0
    if database != 0:
        client.close()
        raise UsageError(f"database {database}: Triton's RedisRemoteCacheBackend reads database 0 only (it connects "
                         "to TRITON_REDIS_HOST:TRITON_REDIS_PORT, with no database setting), so no Triton would hit "
                         "what is written there; leave the database out of the URL (to keep the kernels apart, give "
                         "this unpack and the fleet one TRITON_REDIS_KEY_FORMAT)", shown)
    _call(client.ping, shown)
    return client


def _call(fn, url: str, *args):
    import redis

    try:
        return fn(*args)
    except redis.exceptions.RedisError as e:
        raise RemoteError(" ".join(str(e).split()) or type(e).__name__, url) from None


def _states(client, url: str, values: Sequence[tuple[str, int | None, Callable[[bytes], bool]]]) -> list[bool | None]:
    """Compare each (key, size, same?) with the server: lengths first, then fetch only the values that may be the
    same (``size`` None: fetch whenever present, for a manifest, whose JSON may be spelled another way)."""
    pipe = client.pipeline(transaction=False)
    for key, _, _ in values:
        pipe.exists(key)
        pipe.strlen(key)
    answers = _call(pipe.execute, url)
    states: list[bool | None] = []
    fetch = []
    for n, (_, size, _) in enumerate(values):
        exists, length = answers[2 * n], answers[2 * n + 1]
        states.append(None if not exists else False)
        if exists and (size is None or length == size):
            fetch.append(n)
    for start in range(0, len(fetch), 256):
        chunk = fetch[start:start + 256]
        for n, data in zip(chunk, _call(client.mget, url, [values[n][0] for n in chunk]), strict=True):
            states[n] = None if data is None else values[n][2](data)
    return states


def plan(client, url: str, fmt: str, chosen: Sequence[tuple[Sequence[int], Entry]],
         overwrite: bool) -> list[Placement]:
    """Compare each chosen entry (with the archive's blob of each of its files) with what the server holds."""
    values: list[tuple[str, int | None, Callable[..., bool]]]  # called with the data (defaults bind the rest)
    values, spans = [], []
    more: dict[int, list[str]] = {}  # a chosen group -> the names its stored manifest lists beyond the entry's
    for n, (_, entry) in enumerate(chosen):
        first = len(values)
        for f in entry.files:
            values.append((redis_key(fmt, entry.key, f.name), f.size,
                           lambda data, digest=f.sha256: hashlib.sha256(data).digest() == digest))
        if entry.kind == GROUP:
            values.append((redis_key(fmt, entry.key, manifest_name(entry.name)), None,
                           lambda data, names=frozenset(entry.file_names), n=n:
                           _lists_all(data, names, more.setdefault(n, []))))
        spans.append((first, len(values)))
    states = _states(client, url, values)
    gone = _absent(client, url, [redis_key(fmt, chosen[n][1].key, name) for n, names in more.items()
                                 for name in names])
    plans = []
    for n, ((blobs, entry), (first, last)) in enumerate(zip(chosen, spans, strict=True)):
        # files the stored manifest lists beyond the entry's: kept listed where still there
        listed = more.get(n, [])
        others = tuple(name for name in listed if redis_key(fmt, entry.key, name) not in gone)
        if len(others) < len(listed):
            states[last - 1] = None  # it lists a value that is gone (evicted): a broken group, written again
        action, todo = decide(states[first:last], overwrite)
        plans.append(Placement(entry, blobs, action, tuple(i for i in todo if i < len(entry.files)), others=others))
    return plans


def _lists_all(data: bytes, names: frozenset[str], more: list[str]) -> bool:
    """Whether a stored manifest lists each of ``names``: one that lists more is the whole group beside a thinned
    or binary-only copy of it, which an unpack must not make smaller (as into a directory). The names it lists
    beyond ``names`` go to ``more``: the group is whole only where their values are all there."""
    manifest = _json(data)
    children = manifest.get("child_paths") if isinstance(manifest, dict) else None
    if not (isinstance(children, list) and all(isinstance(c, str) for c in children) and names <= set(children)):
        return False
    more.extend(sorted(set(children) - names))
    return True


def _absent(client, url: str, keys: Sequence[str]) -> set[str]:
    """Those of ``keys`` that the server does not hold."""
    pipe = client.pipeline(transaction=False)
    for key in keys:
        pipe.exists(key)
    return {key for key, there in zip(keys, _call(pipe.execute, url), strict=True) if not there} if keys else set()


def _json(data: bytes):
    try:
        return json.loads(data)
    except ValueError:
        return None


def write(client, url: str, fmt: str, reader: ArchiveReader, plans: Sequence[Placement],
          on_file: Callable[[int], None] | None = None) -> tuple[int, int]:
    """Hide groups that change (manifest deleted), write their files, then the manifests. Files and bytes."""
    targets: dict[int, list[str]] = {}
    hide = []
    for p in plans:
        if p.action not in (WRITE, REPLACE):
            continue
        if p.writes_manifest and p.files:
            hide.append(redis_key(fmt, p.entry.key, manifest_name(p.entry.name)))
        for i in p.files:
            targets.setdefault(p.blobs[i], []).append(redis_key(fmt, p.entry.key, p.entry.file_names[i]))  # type: ignore[index]  # plan gives each its blobs
    if hide:
        _call(client.delete, url, *hide)
    files = written = pending = 0
    pipe = client.pipeline(transaction=False)
    for blob, content in reader.iter_blobs(targets):
        for key in targets[blob]:
            pipe.set(key, content)
            files += 1
            written += len(content)
            pending += len(content)
            if on_file:
                on_file(len(content))
        if pending >= BATCH_BYTES:
            _call(pipe.execute, url)
            pending = 0
    _call(pipe.execute, url)
    for p in plans:
        if p.writes_manifest:
            manifest = redis_key(fmt, p.entry.key, manifest_name(p.entry.name))
            pipe.set(manifest, manifest_value(p.entry, p.manifest_names))  # the others it lists, unless a replace
    _call(pipe.execute, url)
    return files, written


def unpack_to_redis(
    archive: str | os.PathLike,
    url: str,
    *,
    overwrite: bool = False,
    force: bool = False,
    targets: list[str] | None = None,
    progress: Progress | None = None,
) -> UnpackResult:
    """Write an archive's entries into Redis as Triton's ``RedisRemoteCacheBackend`` stores them.

    The preflight runs as for ``unpack`` (``targets`` names the fleet's GPUs): only entries that will be used are
    written (all with ``force``); when none would be, ``IncompatibleError`` is raised and nothing is written.
    """
    start = time.perf_counter()
    shown = public_url(url)
    fmt = key_format()
    client = connect(url)
    try:
        with ArchiveReader(open_source(archive)) as reader:
            chosen, report = preflight(reader, targets, force=force)
            with_blobs = [(reader.entry_blobs(n), reader.entries[n]) for n in chosen]
            plans = plan(client, shown, fmt, with_blobs, overwrite)
            total = sum(p.size for p in plans)
            files, written = write(client, shown, fmt, reader, plans, progress_counter(total, progress))
    finally:
        client.close()
    return unpack_result(public(os.fspath(archive)), shown, plans, report, force, files, written,
                         time.perf_counter() - start, reader.index.unknown_entries, digest=reader.digest)
