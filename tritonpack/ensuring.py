"""``ensure``: make an archive's usable entries present under a cache root, once, for model-loading code.

The first call unpacks (with the preflight: entries this environment will not use are not written) and leaves a
stamp in ``<root>/.tritonpack/``, named after the archive digest and a key of the preflight-relevant environment.
Later calls read the archive's 64-byte trailer, compute that key from a few ``stat`` calls, find the stamp and
check that it is this root's (a root copied or mounted elsewhere has manifests naming the old path) and that none of
the key directories it lists has changed since: one ``stat`` a directory, whose mtime changes with every file removed
from it, added or renamed (IR files deleted to slim the root make Triton 3.8+ miss
the group). An image's layers keep mtimes to the second only: an mtime of whole seconds is taken for the one stamped in
that second. No index decoding, no Triton import, no fingerprint.

Many processes may call it at once (every rank of a job): the first takes an exclusive ``flock`` on
``<root>/.tritonpack/lock`` and unpacks; the others wait on the lock, then find the stamp. A process killed while
unpacking releases the lock with its death and leaves no stamp, so the next caller simply unpacks (idempotent).
A root this process may not write (a read-only mount, an image's root started as another user) takes no lock and
keeps no stamp: the unpack then writes nothing when every entry is in place, and fails when one is missing.
Each stamp written (under the lock) prunes the stamps beyond the ``KEPT_STAMPS`` most recent, and the URL records
whose stamp is gone: a root on a volume that sees a new archive at every deploy would otherwise keep one of each per
archive forever.

An archive behind a URL may be briefly unreachable when a pod starts. Each ensure of a URL also records, beside
the stamps, which digest that URL (in this environment) last had; when the server cannot be reached or no longer
has the archive, that record names the stamp to trust, and ensure answers from it if its entries are all there.
A local path that is gone stays an error: an image without its archive is broken, not briefly unreachable.

What the environment key covers: the archive, this tritonpack, the Python ABI and platform, the installed Triton
(its directory and the size and mtime of ``__init__.py``, ``libtriton`` and the backends directory, which any
reinstall changes), the variables that may invalidate Triton's cache, the GPUs (``--target`` list, or the models
and counts read from ``/proc/driver/nvidia`` and the AMD KFD topology, and whether ``CUDA_VISIBLE_DEVICES`` hides
them all, which is all the GPU probe reads of it: every rank of a job, each given its own GPU, finds one stamp).
In-place edits of Triton's own sources are not seen by the stamp; ``unpack`` (whose fingerprint hashes every file)
sees them.
"""
from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import json
import os
import re
import stat
import sys
import sysconfig
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field

from . import __version__
from .archive.format import HEADER_SIZE, TRAILER_SIZE, parse_header, parse_trailer
from .cacheroot import TOOL_DIR as STAMP_DIR
from .errors import ArchiveError, CacheError, IncompatibleError, NotFoundError, RemoteError, UsageError
from .gpus import amd_hidden, cuda_hidden
from .report import kept_lines, none_used, plural, reasons_to_dicts, root_only_lines
from .triton_env import resolved_root

STAMP_VERSION = 2  # 2: the root and its key directories' mtimes, where 1 listed the manifests
UNPACKED = "unpacked"  # this call wrote
PRESENT = "present"  # done before, by this or another process: nothing written
UNUSABLE = "unusable"  # no entry of the archive would be used here: nothing written
# Stamps a root keeps, the most recently written: a root serves a few archives (models) at once, each stamped in a
# few environments (the build's --target, the start's GPU probe, another GPU kind), well under this; the rest are
# the archives of past deploys. A live stamp pruned costs its next ensure one check of its entries, nothing written.
KEPT_STAMPS = 32
_STAMP_NAME = re.compile(r"ensure-[0-9a-f]{32}-[0-9a-f]{32}\.json")
_RECORD_NAME = re.compile(r"ensure-url-[0-9a-f]{32}\.json")
# Errors that say this process may not write the stamp directory (a read-only mount, a root the image's build owns)
_NOT_WRITABLE = (errno.EACCES, errno.EPERM, errno.EROFS)


@dataclass
class EnsureResult:
    archive: str
    cache_dir: str
    digest: str  # the archive digest (index sha256)
    status: str  # UNPACKED, PRESENT or UNUSABLE
    waited: bool  # another process held the lock (was unpacking) when this one arrived
    entries: int
    usable: int  # entries this environment will use
    written: int  # entries written by this call (their files and manifests)
    conflicts: list[str] = field(default_factory=list)  # kept: content differs
    linked: list[str] = field(default_factory=list)  # kept: the key directory is a symbolic link
    key_not_directory: list[str] = field(default_factory=list)  # kept: a file where the key directory goes
    file_is_directory: list[str] = field(default_factory=list)  # kept: a directory where one of its files goes
    not_used: list[tuple[str, int]] = field(default_factory=list)  # (reason, entries)
    unchecked: list[str] = field(default_factory=list)
    seconds: float = 0.0
    stamp: str = ""
    unreachable: str = ""  # why the archive could not be read, when this result is the stamp of its URL's last ensure
    unstamped: str = ""  # why no stamp could be written (the next ensure checks the entries again), else ""
    root_only: str = ""  # written as root with a umask that keeps other users out (``cachedest.root_only``)
    pinned: str = ""  # an hf:// URL at a branch: the same at the commit read, which names this archive alone
    relinked: int = 0  # entries whose files were there (a copied root): only their manifests written by this call
    not_writable: list[str] = field(default_factory=list)  # kept: a key directory to write this user may not write

    @property
    def ok(self) -> bool:
        """True when every usable entry is in place (an empty archive included)."""
        return self.status != UNUSABLE

    def summary(self) -> str:
        relinked = f", {self.relinked} relinked" if self.relinked else ""
        what = {UNPACKED: f"unpacked: {self.written} written{relinked}", PRESENT: "already present, nothing to do",
                UNUSABLE: "none will be used here, nothing written"}[self.status]
        return (f"ensured {self.archive} in {self.cache_dir}: {what} ({self.usable} of "
                f"{plural(self.entries, 'entry', 'entries')} usable) in {self.seconds * 1000:.1f} ms")

    def notes(self) -> list[str]:
        lines = [f"archive not reachable: {self.unreachable}; trusted the stamp of the last ensure of this URL"
                 ] if self.unreachable else []
        lines += [f"not used here, {n}: {reason}" for reason, n in self.not_used]
        lines += kept_lines(self.conflicts, self.linked, self.key_not_directory, self.file_is_directory,
                            self.not_writable)
        lines += [f"not checked: {note}" for note in self.unchecked]
        if self.unstamped:
            lines.append(f"no stamp written ({self.unstamped}): the next ensure checks every entry again")
        if self.pinned:
            lines.append(f"read at a commit: {self.pinned} names this archive alone, and its ensure asks the Hub "
                         "nothing once done")
        return lines + root_only_lines(self.root_only)

    def to_dict(self) -> dict:
        return {**asdict(self), "not_used": reasons_to_dicts(self.not_used), "ok": self.ok}


def archive_digest(path: str) -> str:
    """The archive digest from the header and trailer alone (80 bytes read, two range requests for a URL), as
    ``ArchiveReader.digest``. Not of an ``oci://`` reference: that is pulled whole to be read, at every call."""
    from .remote import open_source, scheme_of

    if scheme_of(path) == "oci":
        raise UsageError("ensure reads an archive's 80-byte digest at every call, which an oci:// reference "
                         "would pull whole: pull it once (tritonpack pull), then ensure the file", path)
    source = open_source(path)
    try:
        size = source.size()
        parse_header(source.read_at(0, HEADER_SIZE), source.name)
        if size < HEADER_SIZE + TRAILER_SIZE:
            raise ArchiveError("truncated archive (no trailer)", source.name)
        return parse_trailer(source.read_at(size - TRAILER_SIZE, TRAILER_SIZE), size, source.name).index_sha256.hex()
    finally:
        source.close()


def _names_one_archive(location: str) -> bool:
    """Whether the URL's bytes cannot change: an hf:// URL at a commit. Its last ensure's stamp answers for it
    without a request, so that a pod's start does not depend on the Hub once its kernels are there."""
    from .remote import scheme_of

    if scheme_of(location) != "hf":
        return False
    from .hub import COMMIT, parse

    try:
        return COMMIT.fullmatch(parse(location).revision) is not None
    except UsageError:
        return False


def _at_commit_read(location: str) -> str:
    """An hf:// URL, at the commit its reads named (within ``same_archives``); else ""."""
    from .remote import commit_read, scheme_of

    if scheme_of(location) != "hf":
        return ""
    from .hub import parse

    commit = commit_read(location)
    return parse(location).uri(commit) if commit else ""


def _is_remote(location: str) -> bool:
    """Read through a server (``https://``, ``s3://``, ``hf://``...), as opposed to a path or ``file://`` URL."""
    from .remote import scheme_of

    return scheme_of(location) not in ("", "file")


def _stat_id(path: str) -> list:
    try:
        st = os.stat(path)
    except OSError:
        return [path, None]
    return [path, st.st_size, st.st_mtime_ns]


def _triton_identity() -> list:
    import importlib.util

    try:
        spec = importlib.util.find_spec("triton")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        return []
    package = os.path.dirname(os.path.realpath(spec.origin))
    from .fingerprint import toolchain_files

    files = [os.path.join(package, "__init__.py"), os.path.join(package, "backends"),
             *sorted(glob.glob(os.path.join(package, "_C", "libtriton*")))]
    return [_stat_id(f) for f in [*files, *toolchain_files()]]


def _read(path: str) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _gpu_identity() -> list:
    """The GPUs of this host, from files the drivers publish (no nvidia-smi, no CUDA initialisation)."""
    nvidia = sorted(line.strip() for info in glob.glob("/proc/driver/nvidia/gpus/*/information")
                    for line in _read(info).splitlines() if line.startswith("Model:"))
    amd = sorted(line.strip() for props in glob.glob("/sys/class/kfd/kfd/topology/nodes/*/properties")
                 for line in _read(props).splitlines() if line.startswith("gfx_target_version"))
    return [nvidia, amd, cuda_hidden(), bool(amd) and amd_hidden()]  # and what hides them (``gpus``)


def environment_key(targets: list[str] | None = None) -> str:
    """A digest of everything the preflight's answer depends on, computed without Triton (see the docstring)."""
    from .fingerprint import env_digest

    doc = {
        "stamp": STAMP_VERSION,
        "tritonpack": __version__,
        "python": [sys.implementation.cache_tag, sysconfig.get_config_var("EXT_SUFFIX"), sysconfig.get_platform()],
        "triton": _triton_identity(),
        "env": env_digest(os.environ),
        "targets": sorted(targets) if targets else _gpu_identity(),
    }
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _stamped(stamp: str, root: str, archive: str, waited: bool, start: float) -> EnsureResult | None:
    """The recorded outcome, if the stamp exists, was written for this root, and its key directories are as they
    were then."""
    try:
        with open(stamp, encoding="utf-8") as f:
            doc = json.load(f)
        if doc.get("stamp") != STAMP_VERSION or doc["root"] != root:
            return None
        if not _unchanged(_directories(root, doc["directories"]), doc["directories"]):
            return None
        return EnsureResult(
            archive=archive, cache_dir=root, digest=doc["digest"], status=UNUSABLE if doc["unusable"] else PRESENT,
            waited=waited, entries=doc["entries"], usable=doc["usable"], written=0, conflicts=doc["conflicts"],
            linked=doc.get("linked", []), key_not_directory=doc.get("key_not_directory", []),
            not_writable=doc.get("not_writable", []),
            file_is_directory=doc.get("file_is_directory", []), not_used=[tuple(r) for r in doc["not_used"]],
            unchecked=doc["unchecked"], seconds=time.perf_counter() - start, stamp=stamp)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _lock_file(directory: str) -> int | str:
    """The lock file's descriptor, or why this process may not write ``directory``."""
    try:
        os.makedirs(directory, exist_ok=True)
        return os.open(os.path.join(directory, "lock"), os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as e:
        if e.errno in _NOT_WRITABLE:
            return f"{directory}: {e.strerror}"
        raise CacheError(f"cannot lock: {e.strerror}", directory) from e


Waiting = Callable[[float, str, str], None]  # (seconds waited so far, who holds it: "pid 12 on host-a", the lock)
WAIT_NOTE_AFTER = 5.0  # a wait this long is said (``ensure``'s ``waiting``), then again at each doubling


@contextlib.contextmanager
def _exclusive(directory: str, waiting: Waiting | None = None) -> Iterator[tuple[bool, str]]:
    """An exclusive ``flock`` on ``directory/lock``; yields whether another process held it first, and why there
    is no lock ("" when there is one). A directory this process may not write takes none: no unpack can write
    there either, and one that finds every entry in place writes nothing, so it need not wait for others. The
    holder writes who it is into the lock file, so that a long wait can name it (``waiting``)."""
    import fcntl

    fd = _lock_file(directory)
    if isinstance(fd, str):
        yield False, fd
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            waited = False
        except BlockingIOError:
            _wait_for_lock(fd, os.path.join(directory, "lock"), waiting)
            waited = True
        with contextlib.suppress(OSError):  # a name for the waiters' notes, nothing more
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"pid {os.getpid()} on {os.uname().nodename or 'this host'}\n".encode(), 0)
    except OSError as e:
        os.close(fd)
        raise CacheError(f"cannot lock: {e.strerror}", directory) from e
    try:
        yield waited, ""
    finally:
        os.close(fd)  # releases the lock


def _wait_for_lock(fd: int, path: str, waiting: Waiting | None) -> None:
    """Block until the lock is this process's; with ``waiting``, poll instead (at most 0.1 s behind its release)
    and say who holds it at ``WAIT_NOTE_AFTER`` seconds and at each doubling: a rank stuck behind another that
    hangs (a stopped process, a stalled mount) is then seen, where it waited in silence."""
    import fcntl

    if waiting is None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return
    began = time.monotonic()
    note_at, pause = WAIT_NOTE_AFTER, 0.005
    while True:
        time.sleep(pause)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        pause = min(pause * 2, 0.1)
        waited = time.monotonic() - began
        if waited >= note_at:
            try:
                holder = os.pread(fd, 200, 0).decode("utf-8", "replace").strip()
            except OSError:
                holder = ""
            waiting(waited, holder or "another process", path)
            note_at *= 2


def _unpack(archive: str, root: str, digest: str, targets: list[str] | None,
            processes: bool) -> tuple[EnsureResult, dict[str, int]]:
    from .api import open as open_archive
    from .api import unpack
    from .remote import shown

    try:
        result = unpack(archive, root, targets=targets, processes=processes)
    except IncompatibleError as e:
        report = e.report
        if report is None:  # not the preflight's refusal, which carries its report
            raise
        return EnsureResult(archive, root, digest, UNUSABLE, False, len(report.verdicts), 0, 0,
                            not_used=report.reasons(), unchecked=report.unchecked), {}
    if result.digest != digest:  # a URL's archive replaced between the digest read and the unpack, unseen
        raise RemoteError("the archive changed on the server while it was read (its digest is not the one read "
                          "first): try again", shown(archive))
    with open_archive(archive) as reader:
        directories = _directories(root, {e.key for e in reader.entries})
    usable = result.entries - result.not_used_entries
    changed = result.written or result.relinked
    return EnsureResult(archive, root, digest, UNPACKED if changed else PRESENT, False, result.entries, usable,
                        result.written, relinked=result.relinked, conflicts=result.conflicts, linked=result.linked,
                        key_not_directory=result.key_not_directory, file_is_directory=result.file_is_directory,
                        not_writable=list(result.not_writable),
                        not_used=result.not_used, unchecked=result.unchecked, root_only=result.root_only), directories


def _location_record(stamp_dir: str, location: str, env_key: str) -> str:
    """The file that says which digest ``location`` had at its last ensure in this environment. It names the URL by
    its digest and as output shows it (``remote.shown``): its password or signed query never reach the disk."""
    name = hashlib.sha256(json.dumps([location, env_key]).encode()).hexdigest()[:32]
    return os.path.join(stamp_dir, f"ensure-url-{name}.json")


def _url_digest(location: str) -> str:
    return hashlib.sha256(location.encode("utf-8", "surrogateescape")).hexdigest()


def _recorded_digest(record: str, location: str, env_key: str) -> str | None:
    try:
        with open(record, encoding="utf-8") as f:
            doc = json.load(f)
        if doc.get("stamp") != STAMP_VERSION or \
                [doc.get("location_sha256"), doc.get("environment")] != [_url_digest(location), env_key]:
            return None
        digest = doc["digest"]
        return digest if isinstance(digest, str) else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_json(path: str, doc: dict) -> str:
    """Write a stamp or a record; why it could not be written, else "". A stamp only saves the next ensure its
    check: a root this process may not write (a read-only mount, an image's root) is no error."""
    from .cachedest import atomic_write

    try:
        atomic_write(os.path.dirname(path), os.path.basename(path), json.dumps(doc, indent=1).encode())
    except OSError as e:
        return f"{path}: {e.strerror}"
    return ""


def _record_location(record: str, location: str, env_key: str, digest: str) -> str:
    """Write the record unless it already names this digest (one small read on the repeat path); why it could not
    be written, else ""."""
    if _recorded_digest(record, location, env_key) == digest:
        return ""
    from .remote import shown

    return _write_json(record, {"stamp": STAMP_VERSION, "location": shown(location),
                                "location_sha256": _url_digest(location), "environment": env_key,
                                "digest": digest})


def _stamp_path(stamp_dir: str, digest: str, env_key: str) -> str:
    return os.path.join(stamp_dir, f"ensure-{digest[:32]}-{env_key[:32]}.json")


def _last_ensured(stamp_dir: str, root: str, location: str, env_key: str, start: float) -> EnsureResult | None:
    """The result of the last ensure of this URL here, if it was recorded and its entries are all still there."""
    digest = _recorded_digest(_location_record(stamp_dir, location, env_key), location, env_key)
    if digest is None:
        return None
    result = _stamped(_stamp_path(stamp_dir, digest, env_key), root, location, False, start)
    return result if result is not None and result.digest == digest else None


def _directories(root: str, keys) -> dict[str, int]:
    """The mtime (ns) of each key directory that is there: a file removed from one, added or renamed changes it."""
    found = {}
    for key in keys:
        with contextlib.suppress(OSError):
            found[key] = os.stat(os.path.join(root, key)).st_mtime_ns
    return found


def _unchanged(now: dict[str, int], stamped: dict[str, int]) -> bool:
    """Whether the key directories are those stamped: the same ones, each with its mtime, or that mtime cut to
    whole seconds, as an image's layers carry it from the build to every host that pulls it."""
    second = 1_000_000_000
    return now.keys() == stamped.keys() and all(
        mtime == stamped[key] or (mtime % second == 0 and mtime // second == stamped[key] // second)
        for key, mtime in now.items())


def _write_stamp(stamp: str, result: EnsureResult, root: str, directories: dict[str, int]) -> str:
    doc = {"stamp": STAMP_VERSION, "root": root, "directories": directories, "digest": result.digest,
           "unusable": result.status == UNUSABLE,
           "entries": result.entries, "usable": result.usable, "conflicts": result.conflicts,
           "linked": result.linked, "key_not_directory": result.key_not_directory, "not_writable": result.not_writable,
           "file_is_directory": result.file_is_directory,
           "not_used": result.not_used, "unchecked": result.unchecked}
    return _write_json(stamp, doc)


def _prune_stamps(stamp_dir: str, written: str) -> None:
    """Remove the stamps beyond the ``KEPT_STAMPS`` most recent, never ``written`` (this call's). Called under the
    lock, the only place stamps are written, so no stamp is written meanwhile; a process reading one without the
    lock and finding it gone takes the lock and checks its entries. Only regular files named as ``_stamp_path``
    names them are stamps; the URL records whose stamp is gone go with it, and the lock, temp files and anything
    else are left alone. A stamp that cannot be removed stays (a small file), to be tried again at the next stamp
    written."""
    others = sorted(((mtime, path) for mtime, path in _ours(stamp_dir, _STAMP_NAME) if path != written), reverse=True)
    for _, stale in others[KEPT_STAMPS - 1:]:
        with contextlib.suppress(OSError):
            os.unlink(stale)
    _prune_records(stamp_dir)


def _prune_records(stamp_dir: str) -> None:
    """Remove the URL records whose stamp is gone: a record serves only to name a stamp to trust when its URL is
    unreachable, so a deploy that ensures a new URL each time would otherwise keep one per URL forever. Records are
    written outside the lock: one rewritten between its reading here and its removal is lost, and the next ensure
    of its URL writes it again (only that URL's fallback is missing meanwhile)."""
    for _, record in _ours(stamp_dir, _RECORD_NAME):
        try:
            with open(record, encoding="utf-8") as f:
                doc = json.load(f)
            digest, env_key = doc["digest"], doc["environment"]
            if os.path.exists(_stamp_path(stamp_dir, digest, env_key)):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            pass  # unreadable: names no stamp to trust
        with contextlib.suppress(OSError):
            os.unlink(record)


def _ours(stamp_dir: str, name: re.Pattern[str]) -> list[tuple[int, str]]:
    """The stamps or the URL records in ``stamp_dir``, with their mtimes (ns): regular files named as ensure names
    them; nothing else there is ever removed."""
    found: list[tuple[int, str]] = []
    with contextlib.suppress(OSError), os.scandir(stamp_dir) as items:
        for item in items:
            if name.fullmatch(item.name):
                with contextlib.suppress(OSError):
                    st = item.stat(follow_symlinks=False)
                    if stat.S_ISREG(st.st_mode):
                        found.append((st.st_mtime_ns, item.path))
    return found


def _first_missing(root: str) -> str | None:
    """The outermost directory of ``root``'s path (``root`` included) that does not exist yet, if any."""
    missing = None
    while not os.path.lexists(root):
        missing, parent = root, os.path.dirname(root)
        if parent == root:
            break
        root = parent
    return missing


def _remove_bare(root: str, stamp_dir: str, missing: str) -> None:
    """After a failed unpack (a corrupt archive) into a root that ensure made for its lock: the lock, the stamp
    directory, the root and the parents made with it, where nothing else is in them, as unpack leaves none. A
    process that waits on the lock takes it on the removed file, and unpacks into a root made anew."""
    try:  # entries written before the failure keep the root, and its lock with it
        bare = os.listdir(stamp_dir) == ["lock"] and os.listdir(root) == [STAMP_DIR]
    except OSError:
        return
    if not bare:
        return
    with contextlib.suppress(OSError):
        os.unlink(os.path.join(stamp_dir, "lock"))
        os.rmdir(stamp_dir)
        directory = root
        while True:
            os.rmdir(directory)  # fails where anything else is there: it stays
            if directory == missing:
                break
            directory = os.path.dirname(directory)


def _ensured(path: str, root: str, stamp_dir: str, digest: str, env_key: str, targets: list[str] | None,
             processes: bool, start: float, waiting: Waiting | None) -> EnsureResult:
    """The stamp's result if it holds, else unpack (one process at a time) and stamp."""
    stamp = _stamp_path(stamp_dir, digest, env_key)
    result = _stamped(stamp, root, path, False, start)
    if result is None:
        missing = _first_missing(root)  # made for the lock: gone again if the unpack fails and leaves it bare
        with _exclusive(stamp_dir, waiting) as (waited, unlocked):
            result = _stamped(stamp, root, path, waited, start)  # the process we waited for did it
            if result is None:
                try:
                    result, directories = _unpack(path, root, digest, targets, processes)
                except BaseException:
                    if missing is not None:
                        _remove_bare(root, stamp_dir, missing)
                    raise
                result.waited = waited
                result.unstamped = unlocked or _write_stamp(stamp, result, root, directories)
                if not result.unstamped:
                    _prune_stamps(stamp_dir, stamp)
    result.stamp = stamp
    return result


def ensure(
    archive: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    *,
    targets: list[str] | None = None,
    strict: bool = False,
    processes: bool = False,
    waiting: Waiting | None = None,
) -> EnsureResult:
    """Make the archive's usable entries present under the cache root (Triton's default when ``None``), once.

    Idempotent and near-free when already done; safe when many processes call it at once. When no entry would
    be used here, nothing is written and the result says so (``status == "unusable"``); ``strict`` raises
    ``IncompatibleError`` instead. ``targets`` and ``processes`` as for ``unpack``. A stream (``-``, standard
    input) is read whole at every call: its digest is in the trailer at its end. An hf:// URL at a commit is not
    read at all once ensured. ``waiting(seconds, holder, lock)`` is called while another process unpacks into the
    root, after ``WAIT_NOTE_AFTER`` seconds and at each doubling of the wait (``holder``: "pid 12 on host-a").
    """
    from .remote import same_archives, shown
    from .streams import kept_streams

    start = time.perf_counter()
    path = os.fspath(archive)
    public = shown(path)  # what the results and the URL's record on disk say: no password, no signed query
    root = resolved_root(cache_dir)
    stamp_dir = os.path.join(root, STAMP_DIR)
    env_key = environment_key(targets)
    # A stream (``-``) gives its bytes once: its copy serves every opening below. A URL must hold one archive
    # throughout: the stamp of the digest read first must not name the entries of an archive uploaded meanwhile.
    with kept_streams(), same_archives():
        at_commit = _names_one_archive(path)
        result = _last_ensured(stamp_dir, root, path, env_key, start) if at_commit else None
        if result is None:
            try:
                digest = archive_digest(path)
            except (RemoteError, NotFoundError) as e:
                result = _last_ensured(stamp_dir, root, path, env_key, start) if _is_remote(path) else None
                if result is None:
                    raise
                result.unreachable = e.message
            else:
                result = _ensured(path, root, stamp_dir, digest, env_key, targets, processes, start, waiting)
                if _is_remote(path):
                    unrecorded = _record_location(_location_record(stamp_dir, path, env_key), path, env_key, digest)
                    result.unstamped = result.unstamped or unrecorded
                result.pinned = "" if at_commit else _at_commit_read(path)
    result.archive = public
    result.seconds = time.perf_counter() - start
    if strict and result.status == UNUSABLE:
        raise IncompatibleError(none_used(result.entries, result.not_used), public, result=result)
    return result
