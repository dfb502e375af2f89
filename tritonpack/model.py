"""The typed model shared by sources, destinations and the archive format.

Its records are typed named tuples, immutable like frozen dataclasses: the module ``dataclasses`` (with the
``inspect`` it imports) and a frozen dataclass's generated methods cost 17 ms and 2 ms a class at every start on
Python 3.11, where a named tuple costs 0.3 ms, and ``tritonpack list`` must answer within 0.2 s. Copy one with
``_replace``.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

if TYPE_CHECKING:
    from .cacheroot import LocalEntry

GROUP = "group"
AUTOTUNE = "autotune"
FILE = "file"
KINDS = (GROUP, AUTOTUNE, FILE)
MANIFEST_PREFIX = "__grp__"


def manifest_name(group_name: str) -> str:
    """Triton names a group's manifest after its metadata file: ``__grp__<name>.json``."""
    return f"{MANIFEST_PREFIX}{group_name}.json"


def hash_key(backend: str, arch: str | int | None, warp_size: int | None) -> str:
    """Where an archive's or a fingerprint's backend hash of a target is kept: ``backend:arch``, then ``:warp``
    where the warp size is not the arch family's own (64 for AMD's gfx9, else 32; spec §4.2). Triton's AMD backend
    hash names the warp size: one arch compiled at two warp sizes has two hashes."""
    own = 64 if backend == "hip" and str(arch).startswith("gfx9") else 32
    return f"{backend}:{arch}" if warp_size in (None, own) else f"{backend}:{arch}:{warp_size}"


HIDDEN_MANIFEST = b'{"child_paths": {}}'  # what a replace puts in a group's manifest while its files change


def hidden(manifest) -> bool:
    """Whether a parsed manifest is a replace's ``HIDDEN_MANIFEST``: a group Triton misses, whose files no
    manifest Triton reads names, as if it had none (an unpack killed mid-replace leaves it; the next completes)."""
    return isinstance(manifest, dict) and manifest == {"child_paths": {}}


class StoredFile(NamedTuple):
    """One file of an entry as the archive records it (a tuple: archives hold tens of thousands)."""

    name: str
    size: int
    sha256: bytes


class LazyFiles(Sequence):
    """An entry's files made one by one as they are read, from tables that hold them in less memory than a tuple of
    records (hundreds of thousands of files in a large cache); equal to, and hashed as, the tuple of its files."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, (tuple, LazyFiles)):
            return NotImplemented
        return tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return repr(tuple(self))


def names_of(files: Sequence) -> Sequence[str]:
    """Files' names, in order: a lazy sequence's from its table, without making each file (a loop over many files
    takes these, not the files)."""
    names = getattr(files, "names", None)
    return names if names is not None else tuple(f.name for f in files)


def sizes_of(files: Sequence) -> Sequence[int]:
    """Files' sizes, in order (as ``names_of``)."""
    sizes = getattr(files, "sizes", None)
    return sizes if sizes is not None else tuple(f.size for f in files)


def total_size(files: Sequence) -> int:
    total = getattr(files, "total_size", None)  # an archive's entries sum their sizes without the files
    return total if total is not None else sum(sizes_of(files))


def index_order(entry) -> tuple[str, str, str]:
    """Where an entry goes in an archive's index: by key, kind and name."""
    return (entry.key, entry.kind, entry.name)


class KernelInfo(NamedTuple):
    """What a group's metadata json says about the compiled kernel (``None`` where it says nothing)."""

    backend: str | None
    arch: str | int | None
    warp_size: int | None
    num_warps: int | None
    num_stages: int | None
    num_ctas: int | None
    shared: int | None
    triton_version: str | None
    hash: str | None
    env: dict[str, str]  # the cache-invalidating variables it was compiled under

    @property
    def target(self) -> str:
        """``backend:arch`` as users write it (``cuda:90``, ``hip:gfx942``)."""
        if self.backend is None:
            return "?"
        return f"{self.backend}:{self.arch}"

    @property
    def hash_key(self) -> str:
        """Where the backend hash of its target is kept (``hash_key``)."""
        return hash_key(self.backend, self.arch, self.warp_size) if self.backend is not None else "?"


class AutotuneInfo(NamedTuple):
    """A ``<fn>.autotune.json``: the tuning key and the fastest config."""

    function: str
    tuning_key: list[Any]
    configs: int
    best_config: dict[str, Any]
    best_timing: list[float]
    triton_version: str | None = None  # the Triton that tuned it, where an archive names it (format 1.2)
    triton_unknown: bool = False  # its archive cannot say which Triton tuned it (format 1.3)


class StubInfo(NamedTuple):
    """A loose file; launcher stubs are CPython extensions tied to an ABI and a platform."""

    role: str  # "launcher" or "other"
    ext_suffix: str | None = None  # e.g. ".cpython-311-x86_64-linux-gnu.so"
    platform: str | None = None  # sysconfig.get_platform() of the packing host
    tag_from: str | None = None  # "filename" when the name carries the ABI tag, "packer" when assumed
    triton_version: str | None = None  # the Triton that built it, where an archive names it (format 1.2)
    triton_unknown: bool = False  # its archive cannot say which Triton built it (format 1.3)


class Described(Protocol):
    """An entry as the archive has it (``Entry``) or as a scan finds it (``cacheroot.LocalEntry``)."""

    @property
    def kind(self) -> str: ...
    @property
    def key(self) -> str: ...
    @property
    def kernel(self) -> KernelInfo | None: ...
    @property
    def autotune(self) -> AutotuneInfo | None: ...
    @property
    def stub(self) -> StubInfo | None: ...


D = TypeVar("D", "Entry", "LocalEntry")


def named_version(entry: Described) -> str | None:
    """The Triton version an entry names of its own (a kernel's metadata; an autotune result's or a file's, in a
    1.2 archive), or None: the preflight then judges it by the Triton its archive attributes to it."""
    info = entry.kernel or entry.autotune or entry.stub
    return info.triton_version if info is not None else None


def naming_triton(entry: D, version: str | None, unknown: bool = False) -> D:
    """An autotune result or a file naming ``version`` as its Triton (None: naming none), or, ``unknown``, saying
    that its archive cannot name one; any other entry as it is."""
    if entry.autotune is not None:
        return entry._replace(autotune=entry.autotune._replace(triton_version=version, triton_unknown=unknown))
    if entry.stub is not None:
        return entry._replace(stub=entry.stub._replace(triton_version=version, triton_unknown=unknown))
    return entry


def disowned(entry: Described) -> bool:
    """Whether an autotune result or a file says that its archive cannot tell which Triton produced it (1.3): the
    archive's attribution (spec §4.2) is not its, and the preflight reports it unchecked."""
    info = entry.autotune or entry.stub
    return info is not None and info.triton_unknown and info.triton_version is None


class Entry(NamedTuple):
    """One unit of a cache: a compiled kernel group, an autotune result, or a loose file.

    ``key`` is the cache key directory; ``name`` the kernel name (groups) or the file name.
    ``files`` of a group are in the order of its manifest: a tuple, or a sequence equal to one (an archive's
    entries make each file as it is read, ``archive.index.StoredFiles``).
    """

    kind: str
    key: str
    name: str
    files: Sequence[StoredFile]
    kernel: KernelInfo | None = None
    autotune: AutotuneInfo | None = None
    stub: StubInfo | None = None

    @property
    def size(self) -> int:
        return total_size(self.files)

    @property
    def file_names(self) -> Sequence[str]:
        """The files' names, in order (``names_of``): a loop over an unpack's files takes these, not ``files``."""
        return names_of(self.files)

    @property
    def file_sizes(self) -> Sequence[int]:
        """The files' sizes, in order (as ``file_names``)."""
        return sizes_of(self.files)

    @property
    def ident(self) -> tuple[str, str, str]:
        return index_order(self)

    @property
    def target(self) -> str | None:
        return self.kernel.target if self.kernel else None


class PythonInfo(NamedTuple):
    implementation: str
    version: str
    cache_tag: str | None
    ext_suffix: str | None
    platform: str


class TritonInfo(NamedTuple):
    """The Triton that packed the archive: what decides whether its cache keys match elsewhere."""

    version: str
    key_sha256: str | None
    backend_hashes: dict[str, str]  # "cuda:90" -> backend.hash()


class ArchiveInfo(NamedTuple):
    tritonpack: str
    format_version: tuple[int, int]
    created: int | None
    python: PythonInfo | None
    triton: TritonInfo | None
