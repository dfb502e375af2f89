"""A clean-room reader of the ``.tpack`` format 1.0-1.2, written from spec/tpack-v1.md alone, as a conformance test.

It was written from the spec without reading tritonpack's source, and it MUST NEVER import tritonpack (nor share
code with it): it stands for a second implementation. ``tests/test_spec_reader.py`` unpacks the same archives with
it and with the reference and requires byte-identical trees; where they differ, the spec is unclear or one of them
is wrong. Dependencies: the standard library, ``zstandard`` and ``msgpack``.

    python tests/spec_reader.py ARCHIVE CACHE_ROOT [--overwrite]

``unpack(archive, root)`` checks the whole archive (§7, checks 1-25) before it acts, decodes the blocks it needs
(codecs "zstd" and "zstd-splice", §5 and §5.1), verifies every blob's sha256 and materialises every entry of a
known kind under the root (§8), writing each group's ``__grp__<name>.json`` manifest. Section numbers (§) and check
numbers are the spec's.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import stat
import struct
import sys
import time
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

import msgpack
import zstandard

HEADER_MAGIC = b"\x89TPACK\r\n"
TRAILER_MAGIC = b"TPACKEND"
HEADER = struct.Struct("<8sHHI")
TRAILER = struct.Struct("<QQQ32s8s")
MIB = 1 << 20
MAX_INDEX_SIZE = 512 * MIB
MAX_BLOCK_SIZE = 256 * MIB
UINT_END = 1 << 63
KEY_RE = re.compile(r"[A-Za-z0-9_\-=]{16,128}")
KNOWN_KINDS = ("group", "autotune", "file")
KNOWN_CODECS = ("zstd", "zstd-splice")
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

# The reference reader's resource limits (§7); another reader may choose others, these match it.
INDEX_RATIO_LIMIT = 1000
MAX_SOURCE_LINES = 1 << 22
MAX_META_DEPTH = 32
MAX_SPLICE_SOURCES = 4  # times the block's size

# §8.2: names of temp files, staging directories and run locks
TEMP_RE = re.compile(r"tmp\.tpack\.([0-9]{1,10})\.([0-9a-f]{8})([0-9a-f]{4})")
LOCK_RE = re.compile(r"tmp\.tpack\.([0-9]{1,10})\.([0-9a-f]{8})\.lock")
ORPHAN_AGE = 3600.0
NAMES_A_TOKEN = 0x10000


def max_expansion() -> int:
    value = os.environ.get("TRITONPACK_MAX_UNPACK_BYTES", "").strip()
    return int(value) if value.isdigit() else 64 << 30


class SpecError(Exception):
    """An archive refused (format, integrity or unsupported version)."""


class UnsupportedVersion(SpecError):
    pass


class IntegrityError(SpecError):
    pass


def fail(message: str) -> NoReturn:
    raise SpecError(message)


# ---- values (§1) ----

def is_int(value: Any) -> bool:
    """A msgpack int: msgpack decodes nothing else to a Python int (a bool is never one)."""
    return type(value) is int


def is_uint(value: Any) -> bool:
    return type(value) is int and 0 <= value < UINT_END


def is_number(value: Any) -> bool:
    return type(value) in (int, float)


def is_bool(value: Any) -> bool:
    return type(value) is bool


def is_str(value: Any) -> bool:
    return type(value) is str


def is_map(value: Any) -> bool:
    return type(value) is dict


def is_array(value: Any) -> bool:
    return type(value) is list


def is_str_map(value: Any) -> bool:
    return is_map(value) and all(is_str(k) and is_str(v) for k, v in value.items())


def required(fields: dict, key: str, check: Callable[[Any], bool], where: str) -> Any:
    """A key whose value is nil is treated exactly as an absent key (§1)."""
    value = fields.get(key)
    if value is None:
        fail(f"{where}.{key} is missing")
    if not check(value):
        fail(f"{where}.{key} has the wrong type")
    return value


def optional(fields: dict, key: str, check: Callable[[Any], bool], where: str) -> Any:
    value = fields.get(key)
    if value is not None and not check(value):
        fail(f"{where}.{key} has the wrong type")
    return value


def deeper_than(value: Any, limit: int) -> bool:
    """Whether ``value``'s depth exceeds ``limit`` (§7): a scalar or an empty array or map is 1 deep, a non-empty
    one 1 more than its deepest element (a map's values)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        if is_map(item) or is_array(item):
            stack.extend((element, depth + 1) for element in (item.values() if is_map(item) else item))
    return False


def valid_name(name: Any) -> bool:
    """Check 20's valid name."""
    return (is_str(name) and name not in ("", ".", "..") and not any(c in name for c in "/\\\0")
            and len(name.encode("utf-8", "surrogatepass")) <= 255 and not name.startswith("tmp."))


def decompress_frame(data: bytes, expected: int, what: str) -> bytes:
    """§5: one zstd frame that declares its content size, equal to ``expected``, with nothing after it."""
    if data[:4] != ZSTD_MAGIC:
        fail(f"{what}: not a zstd frame")
    try:
        declared = zstandard.get_frame_parameters(data).content_size
    except zstandard.ZstdError as e:
        fail(f"{what}: bad zstd frame header: {e}")
    if declared == zstandard.CONTENTSIZE_UNKNOWN:
        fail(f"{what}: the zstd frame declares no content size")
    if declared != expected:
        fail(f"{what}: the zstd frame declares {declared} bytes, not {expected}")
    try:  # the decoder's default window limit is 2^27, what §5 says a reader must accept
        out = zstandard.ZstdDecompressor().decompress(data, max_output_size=expected, allow_extra_data=False)
    except zstandard.ZstdError as e:
        fail(f"{what}: corrupt zstd frame: {e}")
    if len(out) != expected:
        fail(f"{what}: decoded {len(out)} bytes, not {expected}")
    return out


# ---- the index (§4, checks 9-25) ----

def _map_of(pairs: list) -> dict:
    """Every map of the document: str keys only, none twice, at every level (§4, check 9)."""
    fields: dict = {}
    for key, value in pairs:
        if not is_str(key):
            fail("index: a map key is not a str")
        if key in fields:
            fail(f"index: a map holds the key {key!r} twice")
        fields[key] = value
    return fields


def decode_document(raw: bytes) -> dict:
    """Check 9."""
    try:
        doc = msgpack.unpackb(raw, raw=False, strict_map_key=False, use_list=True, object_pairs_hook=_map_of)
    except SpecError:
        raise
    except Exception as e:  # ExtraData, FormatError, StackError, UnicodeDecodeError, ValueError, ...
        fail(f"index: invalid msgpack: {type(e).__name__}")
    if not is_map(doc):
        fail("index: not a map")
    return doc


def check_environment(doc: dict) -> None:
    """§4.2."""
    producer = required(doc, "producer", is_map, "index")
    required(producer, "tritonpack", is_str, "producer")
    optional(producer, "created", is_uint, "producer")
    python = optional(doc, "python", is_map, "index")
    if python is not None:
        for key in ("implementation", "version", "platform"):
            required(python, key, is_str, "python")
        for key in ("cache_tag", "ext_suffix"):
            optional(python, key, is_str, "python")
    triton = optional(doc, "triton", is_map, "index")
    if triton is not None:
        required(triton, "version", is_str, "triton")
        optional(triton, "key_sha256", is_str, "triton")
        optional(triton, "backend_hashes", is_str_map, "triton")


def check_meta(kind: str, meta: dict | None) -> None:
    """§4.6; a group's meta may be absent, the others' have required keys."""
    where = f"{kind} meta"
    if kind == "group":
        if meta is None:
            return
        optional(meta, "backend", is_str, where)
        optional(meta, "arch", lambda v: is_int(v) or is_str(v), where)
        for key in ("warp_size", "num_warps", "num_stages", "num_ctas", "shared"):
            optional(meta, key, is_uint, where)
        optional(meta, "triton_version", is_str, where)
        optional(meta, "hash", is_str, where)
        optional(meta, "env", is_str_map, where)
    elif kind == "autotune":
        if meta is None:
            fail("an autotune entry has no meta")
        required(meta, "function", is_str, where)
        optional(meta, "tuning_key", is_array, where)
        optional(meta, "configs", is_uint, where)
        optional(meta, "best_config", is_map, where)
        optional(meta, "best_timing", lambda v: is_array(v) and all(map(is_number, v)), where)
        for key in ("tuning_key", "best_config"):
            if meta.get(key) is not None and deeper_than(meta[key], MAX_META_DEPTH):
                fail(f"{where}.{key} is nested too deeply")
        optional(meta, "triton_version", is_str, where)  # 1.2
        optional(meta, "triton_unknown", is_bool, where)  # 1.3
    else:
        if meta is None:
            fail("a file entry has no meta")
        required(meta, "role", is_str, where)
        for key in ("ext_suffix", "platform", "tag_from", "triton_version"):  # triton_version: 1.2
            optional(meta, key, is_str, where)
        optional(meta, "triton_unknown", is_bool, where)  # 1.3


def is_splice(item: Any) -> bool:
    return (is_array(item) and len(item) == 6 and all(map(is_uint, item[:4])) and type(item[4]) is bytes
            and is_array(item[5]))


def check_splices(n: int, block: dict) -> None:
    """Check 13a and the reference's limit on the sources' sizes."""
    splices = block.get("splices")
    if not is_array(splices) or not splices:
        fail(f"block {n}: zstd-splice without a non-empty splices array")
    texts: list[tuple[int, int]] = []
    for splice in splices:
        if not is_splice(splice):
            fail(f"block {n}: malformed splice")
        last = -1
        for replacement in splice[5]:
            if not (is_array(replacement) and len(replacement) == 2 and is_uint(replacement[0])
                    and type(replacement[1]) is bytes) or replacement[0] <= last:
                fail(f"block {n}: malformed splice replacement")
            last = replacement[0]
        at, length = splice[0], splice[3]
        if length == 0 or at < (texts[-1][1] if texts else 0) or at + length > block["size"]:
            fail(f"block {n}: a splice lies outside its place")
        texts.append((at, at + length))
    for splice in splices:
        at, source, source_size = splice[0], splice[1], splice[2]
        end = source + source_size
        if end > at or any(not (end <= start or source >= stop) for start, stop in texts):  # §5.1's inequalities
            fail(f"block {n}: a splice's source ends after its text begins or overlaps a text")
    if sum(splice[2] for splice in splices) > MAX_SPLICE_SOURCES * block["size"]:
        fail(f"block {n}: splice sources exceed {MAX_SPLICE_SOURCES}x the block's size")


def check_blocks(blocks: list, index_offset: int) -> None:
    """Checks 10 and 12-14 for the block table."""
    end = None
    for n, block in enumerate(blocks):
        if not is_map(block):
            fail(f"block {n}: not a map")
        required(block, "codec", is_str, f"block {n}")
        for key in ("offset", "length", "size"):
            required(block, key, is_uint, f"block {n}")
        if end is not None and block["offset"] < end:
            fail(f"block {n}: overlaps the previous block or is out of order")
        end = block["offset"] + block["length"]
        if block["size"] > MAX_BLOCK_SIZE:
            fail(f"block {n}: size above 256 MiB")
        if block["codec"] == "zstd-splice":
            check_splices(n, block)
        if block["offset"] < 16 or block["offset"] + block["length"] > index_offset:
            fail(f"block {n}: outside the data region")


def check_blobs(blobs: list, blocks: list) -> None:
    """Checks 15-17."""
    for n, blob in enumerate(blobs):
        if not (is_array(blob) and len(blob) == 4 and all(map(is_uint, blob[:3]))):
            fail(f"blob {n}: malformed")
        if not (type(blob[3]) is bytes and len(blob[3]) == 32):
            fail(f"blob {n}: sha256 is not 32 bytes")
        if blob[0] >= len(blocks) or blob[1] + blob[2] > blocks[blob[0]]["size"]:
            fail(f"blob {n}: outside its block")


def check_files(kind: str, name: str, files: list, blob_count: int) -> list[tuple[str, int]]:
    """Checks 22-24 for one entry's files."""
    if not files:
        fail("entry: no files")
    names: list[str] = []
    for file in files:
        if not (is_array(file) and len(file) == 2):
            fail("entry: a file is not a 2-element array")
        file_name, blob = file
        if not valid_name(file_name) or file_name.startswith("__grp__"):
            fail(f"entry: bad file name {file_name!r}")
        if file_name in names:
            fail(f"entry: file {file_name!r} twice")
        if not (is_int(blob) and 0 <= blob < blob_count):
            fail("entry: bad blob number")
        names.append(file_name)
    if kind != "group" and names != [name]:
        fail("entry: a non-group entry must hold exactly one file, of its name")
    if kind == "group" and f"{name}.json" not in names:
        fail("entry: a group without <name>.json")
    return [(file_name, blob) for file_name, blob in files]


def check_entries(raw_entries: list, blob_count: int) -> tuple[list[dict], int]:
    """Checks 18-25; the entries of known kinds, and how many of unknown kinds were skipped."""
    entries: list[dict] = []
    skipped = 0
    seen: set[tuple[str, str, str]] = set()
    paths: set[tuple[str, str]] = set()
    for raw in raw_entries:
        if not is_map(raw) or not is_str(raw.get("kind")):
            fail("entry: not a map, or its kind is not a str")
        kind = raw["kind"]
        if kind not in KNOWN_KINDS:
            skipped += 1
            continue
        key = required(raw, "key", is_str, "entry")
        name = required(raw, "name", is_str, "entry")
        files = required(raw, "files", is_array, "entry")
        meta = optional(raw, "meta", is_map, "entry")
        check_meta(kind, meta)
        if not KEY_RE.fullmatch(key):
            fail(f"entry: bad key {key!r}")
        if not valid_name(name) or (kind == "group" and not valid_name(f"__grp__{name}.json")):
            fail(f"entry: bad name {name!r}")
        if (key, kind, name) in seen:
            fail(f"entry: duplicate {(key, kind, name)}")
        seen.add((key, kind, name))
        checked = check_files(kind, name, files, blob_count)
        for file_name in [f for f, _ in checked] + ([f"__grp__{name}.json"] if kind == "group" else []):
            if (key, file_name) in paths:
                fail(f"entry: path {key}/{file_name} claimed twice")
            paths.add((key, file_name))
        entries.append({"kind": kind, "key": key, "name": name, "files": checked})
    return entries, skipped


def parse_index(doc: dict, header_major: int, index_offset: int) -> tuple[list, list, list[dict], int]:
    """Checks 10-25 and the reference's expansion limit: (blocks, blobs, entries of known kinds, unknown ones)."""
    for key, check in (("format", is_str), ("version", is_array), ("blocks", is_array), ("blobs", is_array),
                       ("entries", is_array)):
        required(doc, key, check, "index")
    check_environment(doc)
    if doc["format"] != "tpack":
        fail("index: format is not 'tpack'")
    version = doc["version"]
    if not (len(version) == 2 and all(map(is_uint, version))) or version[0] != header_major:
        fail("index: bad version")  # check 11; the minor is the header's and is not checked against anything (§9)
    blocks, blobs = doc["blocks"], doc["blobs"]
    check_blocks(blocks, index_offset)
    check_blobs(blobs, blocks)
    entries, skipped = check_entries(doc["entries"], len(blobs))
    limit = max_expansion()
    if sum(block["size"] for block in blocks) > limit:
        fail("blocks expand past the expansion limit")
    if sum(blobs[blob][2] for entry in entries for _, blob in entry["files"]) > limit:
        fail("entries expand past the expansion limit")
    return blocks, blobs, entries, skipped


class Archive:
    """An open archive whose header, trailer and index are checked (§2-4, §7)."""

    def __init__(self, path: str):
        self.file = open(path, "rb")  # noqa: SIM115 (closed by ``close``)
        try:
            st = os.fstat(self.file.fileno())
            if not stat.S_ISREG(st.st_mode):
                fail("not a regular file")
            self._read_index(st.st_size)
        except BaseException:
            self.file.close()
            raise

    def close(self) -> None:
        self.file.close()

    def _pread(self, offset: int, size: int) -> bytes:
        data = os.pread(self.file.fileno(), size, offset)
        if len(data) != size:
            fail(f"short read at {offset}")
        return data

    def _read_index(self, file_size: int) -> None:
        if file_size < 16:
            fail("shorter than a header")
        magic, major, minor, flags = HEADER.unpack(self._pread(0, 16))
        if magic != HEADER_MAGIC:  # check 1
            fail("bad header magic")
        if major != 1:  # check 2
            raise UnsupportedVersion(f"unsupported format version {major}.{minor}")
        if flags != 0:  # check 3
            fail("header flags are not 0")
        if file_size < 80:  # check 4
            fail("no trailer")
        index_offset, index_length, index_size, index_sha256, magic = TRAILER.unpack(self._pread(file_size - 64, 64))
        if magic != TRAILER_MAGIC:
            fail("bad trailer magic")
        if index_offset < 16 or index_length == 0 or index_offset + index_length != file_size - 64:  # check 5
            fail("bad index location")
        if index_size == 0 or index_size > MAX_INDEX_SIZE or index_length > MAX_INDEX_SIZE:  # check 6
            fail("bad index size")
        if index_size > MIB and index_size > INDEX_RATIO_LIMIT * index_length:  # the reference's limit
            fail("the index expands too much")
        compressed = self._pread(index_offset, index_length)
        if hashlib.sha256(compressed).digest() != index_sha256:  # check 7
            raise IntegrityError("index sha256 mismatch")
        doc = decode_document(decompress_frame(compressed, index_size, "index"))  # checks 8, 9
        self.blocks, self.blobs, self.entries, self.skipped = parse_index(doc, major, index_offset)

    def block_content(self, n: int) -> bytes:
        """§5 and §5.1, checks 26-27a: the block's content, ``size`` bytes."""
        block = self.blocks[n]
        if block["codec"] not in KNOWN_CODECS:  # check 26
            fail(f"block {n}: unknown codec {block['codec']!r}")
        data = os.pread(self.file.fileno(), block["length"], block["offset"])
        if len(data) != block["length"]:
            fail(f"block {n}: short read")
        if block["codec"] == "zstd":
            return decompress_frame(data, block["size"], f"block {n}")
        splices = block["splices"]
        stored = decompress_frame(data, block["size"] - sum(s[3] for s in splices), f"block {n}")
        content = bytearray()
        position = 0  # in ``stored``
        for splice in splices:
            gap = splice[0] - len(content)  # stored bytes before this splice's text (>= 0 by check 13a)
            content += stored[position:position + gap]
            position += gap
            content += derive_text(bytes(content[splice[1]:splice[1] + splice[2]]), splice, n)
        content += stored[position:]
        return bytes(content)


def blank_lines(blanks: bytes, n: int) -> list[int]:
    """§5.1 ``blanks``: a width byte, then the gaps between the numbers of the lines to blank."""
    if not blanks or blanks[0] not in (1, 2, 4) or (len(blanks) - 1) % blanks[0]:
        fail(f"block {n}: malformed blanks")
    width = blanks[0]
    lines: list[int] = []
    for k, at in enumerate(range(1, len(blanks), width)):
        gap = int.from_bytes(blanks[at:at + width], "little")
        if k and gap < 1:
            fail(f"block {n}: malformed blanks (a gap of 0)")
        lines.append(gap + (lines[-1] if lines else 0))
    return lines


def derive_text(source: bytes, splice: list, n: int) -> bytes:
    """§5.1: a splice's text from its source bytes (check 27a)."""
    length, blanks, replacements = splice[3], splice[4], splice[5]
    breaks = source.count(b"\n")
    if breaks + 1 > MAX_SOURCE_LINES or breaks > length:
        fail(f"block {n}: the splice's source has too many lines")
    lines = [line[1:] if line.startswith(b"\t") else line for line in source.split(b"\n")]
    for number in blank_lines(blanks, n):
        if number >= len(lines):
            fail(f"block {n}: blank line {number} is not in the source")
        lines[number] = b""
    for number, text in replacements:
        if number >= len(lines):
            fail(f"block {n}: replaced line {number} is not in the source")
        lines[number] = text
    text = b"\0".join(lines)
    if len(text) != length:
        fail(f"block {n}: the splice's text has {len(text)} bytes, not {length}")
    return text


# ---- paths (§8) ----

def normalised_root(root: str) -> str:
    """§8: the root made absolute and normalised lexically, as POSIX paths are."""
    if not root.startswith("/"):
        root = os.getcwd() + "/" + root
    kept: list[str] = []
    for part in root.split("/"):
        if part in ("", "."):
            continue
        if part == "..":
            if kept:
                kept.pop()
            continue
        kept.append(part)
    lead = "//" if root.startswith("//") and not root.startswith("///") else "/"
    return lead + "/".join(kept)


def key_directory(root: str, key: str) -> str:
    """§8: ``R + "/" + K``, or ``R + K`` where ``R`` ends with ``/``."""
    return root + key if root.endswith("/") else root + "/" + key


def manifest_bytes(root: str, key: str, names: list[str]) -> bytes:
    """§8.2: exactly ``json.dumps({"child_paths": children}).encode()``, the names in the order given (the entry's
    files in ``files`` order, then ``O``, §8.1)."""
    directory = key_directory(root, key)
    return json.dumps({"child_paths": {name: f"{directory}/{name}" for name in names}}).encode()


# ---- deciding (§8.1) ----

SAME, ABSENT, DIRECTORY, DIFFERENT = "same", "absent", "directory", "different"
LINK, OTHER = "link", "other"  # what stands at a key directory's path, besides ABSENT and DIRECTORY
WRITE, REPLACE, RELINK, PRESENT, CONFLICT, KEPT = "write", "replace", "relink", "present", "conflict", "kept"
_UNREADABLE = object()  # a manifest there but unreadable, not JSON or not a regular file: it equals nothing


class Decision(NamedTuple):
    action: str
    todo: tuple[tuple[str, int], ...] = ()  # the files to write
    manifest: tuple[str, ...] | None = None  # the names the manifest to write lists; None: none is written
    manifest_seen: bool = False  # the decision saw a manifest (it is deleted before the files change)
    removes: tuple[str, ...] = ()  # a replace's ``O``: removed after its manifest is written
    replaces_key_path: bool = False  # what stands in the key directory's place is removed, then it is written


def key_path_state(directory: str) -> str:
    """§8.1's first table: ``R/<key>`` not following a link. An error but ``ENOENT`` aborts unpacking."""
    try:
        mode = os.lstat(directory).st_mode
    except FileNotFoundError:
        return ABSENT
    if stat.S_ISLNK(mode):
        return LINK
    return DIRECTORY if stat.S_ISDIR(mode) else OTHER


def _open_regular(path: str) -> int | None:
    """A descriptor of ``path`` opened for reading, or None where it is not a regular file. It opens only what
    ``stat`` calls regular, and without blocking, so that a FIFO is never opened (nor hangs a race)."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        return None
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    os.close(fd)
    return None


def classify(path: str, size: int, digest: bytes) -> str:
    """§8.1's file states; any error but these aborts unpacking (it propagates)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return ABSENT
    except NotADirectoryError:
        return DIFFERENT
    if stat.S_ISDIR(st.st_mode) and _is_directory(path):
        return DIRECTORY  # a link to a directory is different: the rename replaces the link
    if not stat.S_ISREG(st.st_mode) or st.st_size != size:
        return DIFFERENT  # never opened
    fd = _open_regular(path)
    if fd is None:
        return DIFFERENT
    sha = hashlib.sha256()
    with open(fd, "rb") as f:
        for chunk in iter(lambda: f.read(MIB), b""):
            sha.update(chunk)
    return SAME if sha.digest() == digest else DIFFERENT


def read_manifest(path: str) -> Any:
    """None where absent (``ENOENT``, a dangling link too); the parsed JSON; or ``_UNREADABLE`` (unreadable, not
    valid JSON, or not a regular file, which is never opened)."""
    try:
        fd = _open_regular(path)
    except FileNotFoundError:
        return None
    except OSError:
        return _UNREADABLE
    if fd is None:
        return _UNREADABLE
    try:
        with open(fd, "rb") as f:
            data = f.read()
    except OSError:
        return _UNREADABLE
    try:
        return json.loads(data)
    except ValueError:
        return _UNREADABLE


def listed_names(manifest: Any) -> list[str]:
    """The names a manifest's ``child_paths`` lists, in its order; none for one that equals nothing."""
    if not (is_map(manifest) and is_map(manifest.get("child_paths"))):
        return []
    return list(manifest["child_paths"])


def _is_regular(path: str) -> bool:
    """A regular file, not a link to one; an error but ``ENOENT`` aborts unpacking (it propagates)."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def kept_files(directory: str, names: list[str], manifest: Any) -> tuple[list[str], bool]:
    """``O`` and ``gone``: the names the manifest lists beyond the entry's files that name regular files of the key
    directory (valid names not starting with ``__grp__``, not links), and whether it lists any other name."""
    beyond = [name for name in listed_names(manifest) if name not in names]
    kept = [name for name in beyond
            if valid_name(name) and not name.startswith("__grp__") and _is_regular(f"{directory}/{name}")]
    return kept, len(kept) < len(beyond)


def _file_table(entry: dict, states: list[str], overwrite: bool) -> Decision:
    """§8.1's table of non-group entries."""
    todo = tuple(file for file, state in zip(entry["files"], states, strict=True) if state != SAME)
    if not todo:
        return Decision(PRESENT)
    if DIFFERENT in states:
        return Decision(REPLACE, todo) if overwrite else Decision(CONFLICT)
    return Decision(WRITE, todo)


def names_same_files(directory: str, manifest: Any, expected: tuple[str, ...]) -> bool:
    """§8.1: ``M`` names the same files: only ``child_paths``, the expected names, each an absolute path ending in its
    name whose directory, links followed, is the key directory itself (device and inode); any error: not."""
    if not (is_map(manifest) and list(manifest) == ["child_paths"] and is_map(manifest["child_paths"])):
        return False
    children = manifest["child_paths"]
    if set(children) != set(expected):
        return False
    try:
        own = os.stat(directory)
        for name, path in children.items():
            if not is_str(path) or not path.startswith("/") or path.rpartition("/")[2] != name:
                return False
            st = os.stat(path.rpartition("/")[0] or "/")
            if (st.st_dev, st.st_ino) != (own.st_dev, own.st_ino):
                return False
    except (OSError, ValueError):
        return False
    return True


def _group_table(root: str, entry: dict, states: list[str], manifest: Any, overwrite: bool) -> Decision:
    """§8.1's table of groups, with ``O`` and ``gone``: an unpack never makes a group smaller unless it replaces it."""
    todo = tuple(file for file, state in zip(entry["files"], states, strict=True) if state != SAME)
    names = [name for name, _ in entry["files"]]
    if manifest is None or manifest == {"child_paths": {}}:  # absent, or hidden by a replace that was stopped
        return Decision(WRITE, todo, tuple(names))
    kept, gone = kept_files(key_directory(root, entry["key"]), names, manifest)
    expected = (*names, *kept)
    if DIFFERENT in states:
        if overwrite:
            return Decision(REPLACE, todo, tuple(names), True, tuple(kept))
        return Decision(CONFLICT, manifest_seen=True)
    if todo or gone:
        return Decision(WRITE, todo, expected, True)
    if manifest is not _UNREADABLE and (manifest == json.loads(manifest_bytes(root, entry["key"], list(expected)))
                                        or names_same_files(key_directory(root, entry["key"]), manifest, expected)):
        return Decision(PRESENT, manifest_seen=True)
    return Decision(RELINK, (), expected, True)


def decide(root: str, entry: dict, blobs: list, overwrite: bool, again: bool = False) -> Decision:
    """§8.1: the key directory's own state first, then the files' and the manifest's. ``again``: the commit's
    second decision (§8.2), which keeps an entry whose key path is no longer a directory."""
    directory = key_directory(root, entry["key"])
    every = tuple(entry["files"])
    every_name = tuple(name for name, _ in every) if entry["kind"] == "group" else None
    state = key_path_state(directory)
    if state == ABSENT:
        return Decision(WRITE, every, every_name)
    if state == LINK:
        return Decision(KEPT)  # never written through, with or without overwrite
    if state == OTHER:
        if overwrite and not again:
            return Decision(REPLACE, every, every_name, replaces_key_path=True)
        return Decision(KEPT)
    states = [classify(f"{directory}/{name}", blobs[blob][2], blobs[blob][3]) for name, blob in entry["files"]]
    manifest_path = f"{directory}/__grp__{entry['name']}.json"
    if DIRECTORY in states or (entry["kind"] == "group" and _is_directory(manifest_path)):
        return Decision(KEPT)  # no rename replaces a directory, with or without overwrite
    if entry["kind"] != "group":
        return _file_table(entry, states, overwrite)
    return _group_table(root, entry, states, read_manifest(manifest_path), overwrite)


def _is_directory(path: str) -> bool:
    """A directory, not a link to one."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


# ---- temp files, the run lock and orphans (§8.2) ----

class RunLock:
    """A run's token, its lock held from before its first temp name to after its last."""

    def __init__(self, root: str):
        self.root, self.pid, self.counter = root, os.getpid(), 0
        while True:
            self.token = os.urandom(4).hex()
            self.path = f"{root}/tmp.tpack.{self.pid}.{self.token}.lock"
            try:
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                continue
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            try:
                mine = os.stat(self.path).st_ino == os.fstat(self.fd).st_ino
            except FileNotFoundError:
                mine = False
            if mine:
                return
            os.close(self.fd)  # a cleaner removed it before it was locked: another token

    def name(self, directory: str) -> str:
        if self.counter >= NAMES_A_TOKEN:  # a token names 65,536 staging directories; enough here
            raise OSError(errno.EMFILE, "too many temp names for one run token")
        self.counter += 1
        return f"{directory}/tmp.tpack.{self.pid}.{self.token}{self.counter - 1:04x}"

    def release(self) -> None:
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self.fd)


def pid_alive(pid: int) -> bool:
    if not 0 < pid < 1 << 31:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def run_states(root: str, names: list[str]) -> tuple[dict[tuple[str, str], int], set[tuple[str, str]]]:
    """The runs of the lock files at the root: dead ones (with the fd that holds each lock), and live ones."""
    dead: dict[tuple[str, str], int] = {}
    live: set[tuple[str, str]] = set()
    for name in names:
        match = LOCK_RE.fullmatch(name)
        if match is None:
            continue
        try:
            fd = os.open(f"{root}/{name}", os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue  # counts as absent
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            live.add((match[1], match[2]))
            continue
        dead[(match[1], match[2])] = fd
    return dead, live


def remove_orphans(root: str) -> None:
    """§8.2's orphan rules, over every key directory of the root and the root itself."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return
    dead, live = run_states(root, names)
    now = time.time()

    def orphan(name: str, st: os.stat_result) -> bool:
        match = TEMP_RE.fullmatch(name)
        if match is None or (match[1], match[2]) in live:
            return False
        return (match[1], match[2]) in dead or now - st.st_mtime > ORPHAN_AGE or not pid_alive(int(match[1]))

    try:
        for name in names:
            path = f"{root}/{name}"
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISDIR(st.st_mode) and KEY_RE.fullmatch(name):
                _remove_orphan_files(path, orphan)
            elif stat.S_ISDIR(st.st_mode) and orphan(name, st):  # a staging directory
                _remove_orphan_files(path, lambda _name, _st: True)
                with contextlib.suppress(OSError):
                    os.rmdir(path)
    finally:  # a dead run's lock goes last, held until its files are gone
        for (pid, token), fd in dead.items():
            lock = f"{root}/tmp.tpack.{pid}.{token}.lock"
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.lstat(lock).st_mode):
                    os.unlink(lock)
            os.close(fd)


def _remove_orphan_files(directory: str, orphan: Callable[[str, os.stat_result], bool]) -> None:
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        path = f"{directory}/{name}"
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and orphan(name, st):
                os.unlink(path)


# ---- unpacking (§8) ----

def unpack(archive_path: str, cache_root: str, overwrite: bool = False) -> dict[str, int]:
    """Unpack every entry of a known kind of the archive under the root; a summary of what was done."""
    archive = Archive(archive_path)
    try:
        return _unpack(archive, normalised_root(cache_root), overwrite)
    finally:
        archive.close()


def _make_directories(path: str) -> list[str]:
    """``os.makedirs``, returning the directories it made, outermost first."""
    missing = []
    while not os.path.isdir(path):
        missing.append(path)
        path = os.path.dirname(path)
    for directory in reversed(missing):
        os.mkdir(directory, 0o777)
    return missing[::-1]


def _unpack(archive: Archive, root: str, overwrite: bool) -> dict[str, int]:
    if os.path.exists(root) and not os.path.isdir(root):
        raise NotADirectoryError(errno.ENOTDIR, "not a directory", root)
    blobs = archive.blobs
    summary = {"written": 0, "replaced": 0, "relinked": 0, "present": 0, "conflicts": 0, "kept": 0,
               "skipped_unknown": archive.skipped, "files": 0, "bytes": 0}
    plan = [(entry, decide(root, entry, blobs, overwrite)) for entry in archive.entries]  # all decisions first
    for _, decision in plan:
        _count_left(summary, decision)
    contents = _verified_contents(archive, sorted({blob for _, d in plan for _, blob in d.todo}))
    remove_orphans(root)
    work = [(entry, decision) for entry, decision in plan if decision.action in (WRITE, REPLACE, RELINK)]
    if not work:
        return summary  # nothing to write: nothing created, not even the root
    created = _make_directories(root)
    lock = RunLock(root)
    staged: dict[str, str] = {}  # key -> its staging directory
    temps: list[str] = []
    try:
        for entry, decision in work:
            _stage(root, entry, decision, contents, lock, staged, temps)
        _commit(root, work, staged, created, blobs, summary, lock, temps)
    except BaseException:
        _remove_temps(temps, staged)
        lock.release()
        for directory in reversed(created):  # the root too, if this run made it: a failed run leaves nothing
            with contextlib.suppress(OSError):
                os.rmdir(directory)
        raise
    _remove_temps(temps, staged)  # what entries discarded at commit left
    lock.release()
    return summary


def _verified_contents(archive: Archive, needed: list[int]) -> dict[int, bytes]:
    """Each needed block decoded once, each needed blob checked (check 28)."""
    by_block: dict[int, list[int]] = {}
    for blob in needed:
        by_block.setdefault(archive.blobs[blob][0], []).append(blob)
    contents = {}
    for block, of_block in sorted(by_block.items()):
        data = archive.block_content(block)
        for blob in of_block:
            _, offset, size, digest = archive.blobs[blob]
            piece = data[offset:offset + size]
            if hashlib.sha256(piece).digest() != digest:
                raise IntegrityError(f"blob {blob}: sha256 mismatch")
            contents[blob] = piece
    return contents


def _write_new(path: str, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def _stage(root: str, entry: dict, decision: Decision, contents: dict[int, bytes], lock: RunLock,
           staged: dict[str, str], temps: list[str]) -> None:
    """§8.2 phase 1 for one entry: a key directory that is not there (absent, or something else stands in its
    place) is staged whole, under final names; an existing one gets temp files. The entry records where each of
    its files went (``_temps``, ``_manifest``)."""
    directory = key_directory(root, entry["key"])
    if entry["key"] not in staged and not _is_directory(directory):
        staged[entry["key"]] = lock.name(root)
        os.mkdir(staged[entry["key"]], 0o777)
    stage = staged.get(entry["key"])
    entry["_temps"] = []
    for name, blob in decision.todo:
        path = f"{stage}/{name}" if stage else lock.name(directory)
        _write_new(path, contents[blob])
        temps.append(path)
        entry["_temps"].append((path, name))
    if decision.manifest is not None:
        name = f"__grp__{entry['name']}.json"
        path = f"{stage}/{name}" if stage else lock.name(directory)
        _write_new(path, manifest_bytes(root, entry["key"], list(decision.manifest)))
        temps.append(path)
        entry["_manifest"] = (path, name)


def _commit(root: str, work: list[tuple[dict, Decision]], staged: dict[str, str], created: list[str], blobs: list,
            summary: dict[str, int], lock: RunLock, temps: list[str]) -> None:
    """§8.2 phase 2: a staged key directory by one rename (what the decision replaces removed first); in an
    existing one, entry by entry, decided again."""
    replacing = {entry["key"] for entry, decision in work if decision.replaces_key_path}
    committed = set()
    for key, stage in staged.items():
        directory = key_directory(root, key)
        if key in replacing and key_path_state(directory) == OTHER:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(directory)
        try:
            os.rename(stage, directory)
            committed.add(key)
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
    for entry, decision in work:
        if entry["key"] in committed:
            _count(summary, decision, blobs)
            continue
        _commit_entry(root, entry, decision, created, blobs, summary, lock, temps)


def _commit_entry(root: str, entry: dict, decision: Decision, created: list[str], blobs: list,
                  summary: dict[str, int], lock: RunLock, temps: list[str]) -> None:
    """§8.2's second decision for one entry, then its renames: the manifest hidden first where a replace saw it,
    renamed into place last; a replace's ``O`` removed after it."""
    directory = key_directory(root, entry["key"])
    again = decide(root, entry, blobs, decision.action == REPLACE, again=True)
    if again.action in (PRESENT, CONFLICT, KEPT):
        _count_left(summary, again)
        return  # its temp files are removed with the others
    planned = {name for name, _ in decision.todo}
    if any(name not in planned for name, _ in again.todo) or again.manifest != decision.manifest:
        summary["conflicts"] += 1  # left to a re-run
        return
    if not os.path.isdir(directory):
        created.extend(_make_directories(directory))
    if entry["kind"] == "group" and again.todo and again.manifest_seen and again.action == REPLACE:
        hiding = lock.name(directory)
        _write_new(hiding, b'{"child_paths": {}}')
        temps.append(hiding)
        os.replace(hiding, f"{directory}/__grp__{entry['name']}.json")
    to_write = {name for name, _ in again.todo}
    for temp, name in entry["_temps"]:
        if name in to_write:
            os.replace(temp, f"{directory}/{name}")
    if again.manifest is not None:
        temp, name = entry["_manifest"]
        os.replace(temp, f"{directory}/{name}")
    for name in again.removes:  # ``O``'s files: those still regular files
        with contextlib.suppress(FileNotFoundError):
            if _is_regular(f"{directory}/{name}"):
                os.unlink(f"{directory}/{name}")
    _count(summary, again, blobs)


def _remove_temps(temps: list[str], staged: dict[str, str]) -> None:
    """Remove this run's temp files and staging directories that are left (not renamed into place)."""
    for temp in temps:
        with contextlib.suppress(OSError):
            os.unlink(temp)
    for stage in staged.values():
        with contextlib.suppress(OSError):
            os.rmdir(stage)


def _count_left(summary: dict[str, int], decision: Decision) -> None:
    """An entry that writes nothing: present, a conflict, or kept (for its key directory or a directory)."""
    if decision.action in (PRESENT, CONFLICT, KEPT):
        summary[{PRESENT: "present", CONFLICT: "conflicts", KEPT: "kept"}[decision.action]] += 1


def _count(summary: dict[str, int], decision: Decision, blobs: list) -> None:
    summary[{RELINK: "relinked", REPLACE: "replaced"}.get(decision.action, "written")] += 1
    summary["files"] += len(decision.todo)
    summary["bytes"] += sum(blobs[blob][2] for _, blob in decision.todo)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    overwrite = "--overwrite" in argv
    args = [a for a in argv if a != "--overwrite"]
    if len(args) != 2:
        print("usage: spec_reader.py ARCHIVE CACHE_ROOT [--overwrite]", file=sys.stderr)
        return 2
    try:
        done = unpack(args[0], args[1], overwrite=overwrite)
    except SpecError as e:
        print(f"error: {args[0]}: {e}", file=sys.stderr)
        return 3
    except OSError as e:
        print(f"error: {e.filename or args[1]}: {e.strerror or e}", file=sys.stderr)
        return 4
    print(", ".join(f"{value} {name}" for name, value in done.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
