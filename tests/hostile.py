"""Archives written byte by byte from spec/tpack-v1.md, valid or not, and the corpus of hostile ones.

``Crafted`` assembles header, blocks, msgpack index and trailer itself, so that every field can be made to lie in
ways the real writer refuses to write. ``corpus()`` is the hostile corpus: one named case per way an archive can
be wrong (spec §7 checks 1-28, the reader's bomb guards, and path tricks), each with the exit code it must get.
``python tests/hostile.py DIR`` writes the corpus as files (seeds for fuzz/fuzz_unpack.py).
"""
from __future__ import annotations

import copy
import hashlib
import os
import struct
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import msgpack
import zstandard

MAGIC = b"\x89TPACK\r\n"
TRAILER_MAGIC = b"TPACKEND"
KEY = "PDL5D4U4PLTPDCZLQK7JKR3W7OLYRB2YBSRGKSHM2WORL2RHJFIQ"
KEY2 = "6VZ3XVXWWCZ4GYS27QS5M3P73GJQUYFGMNT5VGQVL5RS2NUH6JVA"
MiB = 1 << 20


def zframe(data: bytes, level: int = 3, content_size: bool = True) -> bytes:
    return zstandard.ZstdCompressor(level=level, write_content_size=content_size).compress(data)


def group(key: str, name: str, files: dict[str, bytes] | None = None) -> dict:
    """A group entry spec: the files of a small kernel unless given."""
    files = files if files is not None else {
        f"{name}.source": f"# source of {name}\n".encode(),
        f"{name}.ttir": f"module @{name} {{}}\n".encode() * 4,
        f"{name}.cubin": hashlib.sha256(name.encode()).digest() * 8,
        f"{name}.json": f'{{"name": "{name}", "hash": "{key}"}}'.encode(),
    }
    return {"kind": "group", "key": key, "name": name, "files": files,
            "meta": {"backend": "cuda", "arch": 90, "warp_size": 32, "num_warps": 4, "env": {}}}


def autotune(key: str, fn: str) -> dict:
    name = f"{fn}.autotune.json"
    return {"kind": "autotune", "key": key, "name": name, "files": {name: b'{"key": [1], "configs_timings": []}'},
            "meta": {"function": fn, "tuning_key": [1], "configs": 0, "best_config": {}, "best_timing": []}}


@dataclass
class Crafted:
    """An archive assembled from its parts; every hook may make a part lie.

    The index document is built from ``entries`` (contents deduplicated into blobs, all in one block unless
    ``split`` puts each blob in its own block). ``doc_hook(doc)`` edits the msgpack document before encoding;
    ``raw_index``, ``index_frame``, ``blocks_frames`` replace encoded parts; ``trailer_hook(fields)`` edits the
    trailer fields (dict) before packing; ``post(bytes)`` edits the final bytes.
    """

    entries: list[dict] = field(default_factory=lambda: [group(KEY, "add_kernel")])
    split: bool = False
    header: tuple = (MAGIC, 1, 0, 0)
    doc_hook: Callable[[dict], None] | None = None
    frame_hook: Callable[[int, bytes], bytes] | None = None
    raw_index: bytes | None = None
    index_frame: bytes | None = None
    index_hook: Callable[[bytes], bytes] | None = None
    trailer_hook: Callable[[dict], None] | None = None
    post: Callable[[bytes], bytes] | None = None
    block_sizes: dict[int, int] = field(default_factory=dict)  # declared size overrides

    def build(self) -> bytes:
        contents: list[bytes] = []
        by_digest: dict[bytes, int] = {}
        doc_entries = []
        for e in self.entries:
            files = []
            for fname, data in e["files"].items():
                digest = hashlib.sha256(data).digest()
                if digest not in by_digest:
                    by_digest[digest] = len(contents)
                    contents.append(data)
                files.append([fname, by_digest[digest]])
            doc_entries.append({"kind": e["kind"], "key": e["key"], "name": e["name"], "files": files,
                                "meta": copy.deepcopy(e.get("meta", {}))})
        groups = [[i] for i in range(len(contents))] if self.split else [list(range(len(contents)))]
        groups = [g for g in groups if g]
        out = bytearray(struct.pack("<8sHHI", *self.header))
        blocks, blobs = [], [None] * len(contents)
        for n, members in enumerate(groups):
            data = b""
            for b in members:
                blobs[b] = [n, len(data), len(contents[b]), hashlib.sha256(contents[b]).digest()]
                data += contents[b]
            frame = zframe(data)
            if self.frame_hook:
                frame = self.frame_hook(n, frame)
            blocks.append({"codec": "zstd", "offset": len(out), "length": len(frame),
                           "size": self.block_sizes.get(n, len(data))})
            out += frame
        doc = {"format": "tpack", "version": [1, 0], "producer": {"tritonpack": "1.0.0"},
               "python": {"implementation": "cpython", "version": "3.11", "platform": "linux-x86_64"},
               "triton": None, "blocks": blocks, "blobs": blobs, "entries": doc_entries}
        if self.doc_hook:
            self.doc_hook(doc)
        raw = self.raw_index if self.raw_index is not None else msgpack.packb(doc, use_bin_type=True)
        frame = self.index_frame if self.index_frame is not None else zframe(raw, 19)
        if self.index_hook:
            frame = self.index_hook(frame)
        fields = {"offset": len(out), "length": len(frame), "size": len(raw),
                  "sha256": hashlib.sha256(frame).digest(), "magic": TRAILER_MAGIC}
        out += frame
        if self.trailer_hook:
            self.trailer_hook(fields)
        out += struct.pack("<QQQ32s8s", fields["offset"], fields["length"], fields["size"], fields["sha256"],
                           fields["magic"])
        data = bytes(out)
        return self.post(data) if self.post else data


# -- the corpus --

ARCHIVE, USAGE, CACHE = 3, 2, 4  # exit codes of the CLI


def _set(path: str, value) -> Callable[[dict], None]:
    """A doc hook that sets ``doc[a][b]...`` (``path`` like ``entries.0.name``)."""
    def hook(doc):
        parts = path.split(".")
        target = doc
        for p in parts[:-1]:
            target = target[int(p)] if isinstance(target, list) else target[p]
        last = parts[-1]
        if isinstance(target, list):
            target[int(last)] = value
        else:
            target[last] = value
    return hook


def _delete(path: str) -> Callable[[dict], None]:
    def hook(doc):
        parts = path.split(".")
        target = doc
        for p in parts[:-1]:
            target = target[int(p)] if isinstance(target, list) else target[p]
        del target[parts[-1]]
    return hook


def _file_name(name: str) -> Callable[[dict], None]:
    return _set("entries.0.files.0.0", name)


def _flip(offset_of: Callable[[bytes], int]) -> Callable[[bytes], bytes]:
    def post(data: bytes) -> bytes:
        i = offset_of(data)
        return data[:i] + bytes([data[i] ^ 0x10]) + data[i + 1:]
    return post


def _index_offset(data: bytes) -> int:
    return struct.unpack("<Q", data[-64:-56])[0]


def _bomb_frame(size: int) -> bytes:
    """A zstd frame of ``size`` zero bytes: a few hundred bytes that declare ``size``."""
    c = zstandard.ZstdCompressor(level=1, write_content_size=True)
    return c.compress(b"\0" * size)


def _deep(n: int):
    value: list = []
    for _ in range(n):
        value = [value]
    return value


def corpus() -> dict[str, tuple[Callable[[], bytes], int, dict]]:
    """name -> (build function, expected exit code, environment). Every case must be refused with a one-line
    error; ``environment`` holds variables to set for it (lower reader limits)."""
    C = Crafted
    valid = C().build()
    idx = _index_offset(valid)
    cases: dict[str, tuple[Callable[[], bytes], int, dict]] = {}

    def add(name, build, code=ARCHIVE, env=None):
        assert name not in cases, name
        cases[name] = (build, code, env or {})

    # §7 1-8: header, trailer, index frame
    add("empty", lambda: b"")
    add("short-header", lambda: valid[:15])
    add("bad-magic", lambda: b"PK\x03\x04" + valid[4:])
    add("major-2", lambda: C(header=(MAGIC, 2, 0, 0)).build())
    add("flags", lambda: C(header=(MAGIC, 1, 0, 1)).build())
    add("no-trailer", lambda: valid[:16] + b"\0" * 60)
    add("trailer-magic", lambda: valid[:-8] + b"TPACKENX")
    add("appended-bytes", lambda: valid + b"\0")
    add("index-offset-below-header", lambda: C(trailer_hook=lambda f: f.update(offset=8)).build())
    add("index-length-zero", lambda: C(trailer_hook=lambda f: f.update(length=0)).build())
    add("index-length-lies", lambda: C(trailer_hook=lambda f: f.update(length=f["length"] + 1)).build())
    add("index-offset-huge", lambda: C(trailer_hook=lambda f: f.update(offset=2**64 - 1)).build())
    add("index-size-zero", lambda: C(trailer_hook=lambda f: f.update(size=0)).build())
    add("index-size-over-512MiB", lambda: C(trailer_hook=lambda f: f.update(size=512 * MiB + 1)).build())
    add("index-size-lies", lambda: C(trailer_hook=lambda f: f.update(size=f["size"] + 1)).build())
    add("index-ratio-bomb", lambda: C(trailer_hook=lambda f: f.update(size=500 * MiB)).build())
    add("index-digest", lambda: C(trailer_hook=lambda f: f.update(sha256=b"\0" * 32)).build())
    add("index-not-zstd", lambda: C(index_frame=b"not a zstd frame at all").build())
    add("index-no-content-size", lambda: C(index_hook=_no_content_size).build())
    add("index-trailing-bytes", lambda: C(index_hook=lambda f: f + b"\0").build())
    add("index-two-frames", lambda: C(index_hook=lambda f: f + zframe(b"\x80")).build())
    add("index-corrupt-frame", lambda: C(index_hook=lambda f: f[:-6] + bytes(b ^ 0x55 for b in f[-6:])).build())
    # §7 9-11: the document
    add("msgpack-garbage", lambda: C(raw_index=b"\xc1\xc1\xc1").build())
    add("msgpack-truncated", lambda: C(raw_index=msgpack.packb({"format": "tpack", "x": "y" * 40})[:-5]).build())
    add("msgpack-extra-data", lambda: C(raw_index=msgpack.packb({}) + b"\x00").build())
    add("msgpack-not-a-map", lambda: C(raw_index=msgpack.packb(["format", "tpack"])).build())
    add("msgpack-bad-utf8", lambda: C(raw_index=b"\x81\xa6format\xa5tp\xffck").build())
    add("msgpack-int-key", lambda: C(doc_hook=lambda d: d.update({7: 1})).build())
    add("msgpack-array-count-lies", lambda: C(raw_index=b"\x81\xa7entries\xdd\xff\xff\xff\xff").build())
    add("msgpack-map-count-lies", lambda: C(raw_index=b"\xdf\x7f\xff\xff\xff\xa1a\xc0").build())
    add("msgpack-deep-nesting", lambda: C(raw_index=b"\x91" * 100000).build())
    add("msgpack-values-bomb", lambda: C(raw_index=_values_bomb()).build())  # the ratio guard refuses it
    add("format-missing", lambda: C(doc_hook=_delete("format")).build())
    add("format-wrong", lambda: C(doc_hook=_set("format", "zip")).build())
    add("format-int", lambda: C(doc_hook=_set("format", 1)).build())
    add("version-missing", lambda: C(doc_hook=_delete("version")).build())
    add("version-major-2", lambda: C(doc_hook=_set("version", [2, 0])).build())
    add("version-bool", lambda: C(doc_hook=_set("version", [True, 0])).build())
    add("version-float", lambda: C(doc_hook=_set("version", [1.0, 0])).build())
    add("version-str", lambda: C(doc_hook=_set("version", "1.0")).build())
    add("version-empty", lambda: C(doc_hook=_set("version", [])).build())
    add("producer-missing", lambda: C(doc_hook=_delete("producer")).build())
    add("producer-tritonpack-int", lambda: C(doc_hook=_set("producer", {"tritonpack": 1})).build())
    add("producer-created-negative", lambda: C(doc_hook=_set("producer", {"tritonpack": "x", "created": -1})).build())
    add("producer-created-bool", lambda: C(doc_hook=_set("producer", {"tritonpack": "x", "created": True})).build())
    add("python-not-map", lambda: C(doc_hook=_set("python", [1])).build())
    add("python-platform-missing", lambda: C(doc_hook=_delete("python.platform")).build())
    add("triton-hashes-int", lambda: C(doc_hook=_set("triton", {"version": "3", "backend_hashes": {"a": 1}})).build())
    add("triton-version-bin", lambda: C(doc_hook=_set("triton", {"version": b"3"})).build())
    add("blocks-missing", lambda: C(doc_hook=_delete("blocks")).build())
    add("blocks-not-list", lambda: C(doc_hook=_set("blocks", {"0": 1})).build())
    add("blobs-missing", lambda: C(doc_hook=_delete("blobs")).build())
    add("entries-missing", lambda: C(doc_hook=_delete("entries")).build())
    add("entries-not-list", lambda: C(doc_hook=_set("entries", "all")).build())
    # §7 12-14 and 26-28: blocks
    two = [group(KEY, "add_kernel"), group(KEY2, "mul_kernel")]
    add("block-overlap", lambda: C(entries=two, split=True, doc_hook=_set("blocks.1.offset", 16)).build())
    add("block-out-of-order", lambda: C(entries=two, split=True,
                                        doc_hook=lambda d: d["blocks"].reverse()).build())
    add("block-size-over-256MiB", lambda: C(doc_hook=_set("blocks.0.size", 256 * MiB + 1)).build())
    add("block-size-bool", lambda: C(doc_hook=_set("blocks.0.size", True)).build())
    add("block-offset-negative", lambda: C(doc_hook=_set("blocks.0.offset", -16)).build())
    add("block-offset-in-header", lambda: C(doc_hook=_set("blocks.0.offset", 0)).build())
    add("block-past-data-region", lambda: C(doc_hook=lambda d: d["blocks"][0].update(length=idx)).build())
    add("block-offset-2**64", lambda: C(doc_hook=_set("blocks.0.offset", 2**64 - 1)).build())
    add("block-codec-unknown", lambda: C(doc_hook=_set("blocks.0.codec", "lz4")).build())
    add("block-codec-missing", lambda: C(doc_hook=_delete("blocks.0.codec")).build())
    add("block-not-zstd", lambda: C(frame_hook=lambda n, f: b"\0" * len(f)).build())
    add("block-no-content-size", lambda: C(frame_hook=lambda n, f: _no_content_size(f)).build())
    add("block-size-lies-up", lambda: C(block_sizes={0: 100000}).build())
    add("block-size-lies-down", lambda: C(block_sizes={0: 10}, doc_hook=_shrink_blobs).build())
    add("block-trailing-bytes", lambda: C(frame_hook=lambda n, f: f + b"\0\0\0\0").build())
    add("block-two-frames", lambda: C(frame_hook=lambda n, f: f + zframe(b"x")).build())
    add("block-bit-flip", lambda: C(post=_flip(lambda d: 16 + 20)).build())
    add("block-ratio-bomb", lambda: C(frame_hook=lambda n, f: _bomb_frame(64 * MiB), block_sizes={0: 64 * MiB},
                                      doc_hook=_keep_blobs_small).build())
    add("blocks-total-over-limit", lambda: valid, env={"TRITONPACK_MAX_UNPACK_BYTES": "100"})
    add("blob-sha256-mismatch", lambda: C(doc_hook=_set("blobs.0.3", b"\1" * 32)).build())
    # §7 15-17: blobs
    add("blob-not-list", lambda: C(doc_hook=_set("blobs.0", {"block": 0})).build())
    add("blob-three-items", lambda: C(doc_hook=lambda d: d["blobs"][0].pop()).build())
    add("blob-negative-offset", lambda: C(doc_hook=_set("blobs.0.1", -1)).build())
    add("blob-bool-block", lambda: C(doc_hook=_set("blobs.0.0", False)).build())
    add("blob-sha256-short", lambda: C(doc_hook=_set("blobs.0.3", b"\0" * 31)).build())
    add("blob-sha256-str", lambda: C(doc_hook=_set("blobs.0.3", "0" * 32)).build())
    add("blob-block-out-of-range", lambda: C(doc_hook=_set("blobs.0.0", 5)).build())
    add("blob-past-block-end", lambda: C(doc_hook=_set("blobs.0.2", 10**6)).build())
    add("blob-size-2**64", lambda: C(doc_hook=_set("blobs.0.2", 2**64 - 1)).build())
    # §7 18-25: entries, names, keys
    add("entry-not-map", lambda: C(doc_hook=_set("entries.0", ["group"])).build())
    add("entry-kind-int", lambda: C(doc_hook=_set("entries.0.kind", 1)).build())
    for label, key in [("dotdot", "../../../../etc/x"), ("absolute", "/etc/passwd" + "x" * 8),
                       ("slash", "AAAAAAAA/BBBBBBBBB"), ("backslash", "AAAAAAAA\\BBBBBBBBB"),
                       ("nul", "AAAAAAAA\0BBBBBBBBB"), ("short", "ABCDEFGHIJKLMNO"), ("long", "A" * 129),
                       ("dot", "................"), ("space", "AAAAAAAA BBBBBBBBB"), ("unicode", "ÄAAAAAAABBBBBBBBB"),
                       ("newline", "AAAAAAAA\nBBBBBBBBB"), ("bin", KEY.encode()), ("int", 12345)]:
        add(f"key-{label}", lambda key=key: C(doc_hook=_set("entries.0.key", key)).build())
    for label, name in [("dotdot", ".."), ("dot", "."), ("traversal", "../../etc/passwd"), ("absolute", "/etc/passwd"),
                        ("backslash", "..\\..\\x"), ("nul", "add\0kernel"), ("empty", ""),
                        ("long", "k" * 256), ("grp-too-long", "k" * 249), ("tmp", "tmp.pid_1_x"),
                        ("bin", b"add_kernel"), ("int", 7)]:
        add(f"name-{label}", lambda name=name: C(doc_hook=_set("entries.0.name", name)).build())
    for label, name in [("dotdot", ".."), ("traversal", "../x.json"), ("absolute", "/tmp/x"),
                        ("backslash", "a\\b"), ("nul", "a\0b"), ("long", "f" * 256), ("grp", "__grp__add_kernel.json"),
                        ("tmp", "tmp.tpack.1.000000000000"), ("empty", ""), ("bin", b"x")]:
        add(f"file-name-{label}", lambda name=name: C(doc_hook=_file_name(name)).build())
    add("entry-duplicate", lambda: C(entries=[group(KEY, "add_kernel")] * 2).build())
    add("entry-files-empty", lambda: C(doc_hook=_set("entries.0.files", [])).build())
    add("entry-file-not-pair", lambda: C(doc_hook=_set("entries.0.files.0", ["a.json"])).build())
    add("entry-file-twice", lambda: C(doc_hook=lambda d: d["entries"][0]["files"].append(
        list(d["entries"][0]["files"][0]))).build())
    add("entry-file-blob-out-of-range", lambda: C(doc_hook=_set("entries.0.files.0.1", 99)).build())
    add("entry-file-blob-negative", lambda: C(doc_hook=_set("entries.0.files.0.1", -1)).build())
    add("entry-file-blob-bool", lambda: C(doc_hook=_set("entries.0.files.0.1", True)).build())
    add("group-without-json", lambda: C(entries=[group(KEY, "k", {"k.ptx": b"x"})]).build())
    add("autotune-two-files", lambda: C(entries=[autotune(KEY, "f")],
                                        doc_hook=lambda d: d["entries"][0]["files"].append(["g.json", 0])).build())
    add("autotune-name-differs", lambda: C(entries=[autotune(KEY, "f")], doc_hook=_set("entries.0.name", "g")).build())
    add("paths-claimed-twice", lambda: C(entries=[group(KEY, "a", {"a.json": b"1", "b.json": b"2"}),
                                                  group(KEY, "b", {"b.json": b"2"})]).build())
    add("file-entry-claims-manifest", lambda: C(entries=[group(KEY, "a"), {
        "kind": "file", "key": KEY, "name": "__grp__a.json", "files": {"__grp__a.json": b"{}"},
        "meta": {"role": "other"}}]).build())
    add("meta-not-map", lambda: C(doc_hook=_set("entries.0.meta", [1])).build())
    add("meta-env-int", lambda: C(doc_hook=_set("entries.0.meta.env", {"TRITON_X": 1})).build())
    add("meta-arch-bool", lambda: C(doc_hook=_set("entries.0.meta.arch", True)).build())
    add("meta-arch-float", lambda: C(doc_hook=_set("entries.0.meta.arch", 9.0)).build())
    add("meta-num-warps-negative", lambda: C(doc_hook=_set("entries.0.meta.num_warps", -4)).build())
    add("autotune-timing-str", lambda: C(entries=[autotune(KEY, "f")],
                                         doc_hook=_set("entries.0.meta.best_timing", ["fast"])).build())
    add("autotune-function-missing", lambda: C(entries=[autotune(KEY, "f")],
                                               doc_hook=_delete("entries.0.meta.function")).build())
    add("autotune-key-deep", lambda: C(entries=[autotune(KEY, "f")],
                                       doc_hook=_set("entries.0.meta.tuning_key", _deep(200))).build())
    add("file-role-missing", lambda: C(entries=[{"kind": "file", "key": KEY, "name": "x.so", "files": {"x.so": b"E"},
                                                 "meta": {}}]).build())
    # bombs and lies about sizes
    add("files-total-over-limit", lambda: C(entries=[group(KEY, "k", {"k.json": b"x" * 1000})],
                                            doc_hook=_fan_out_one_blob).build(),
        env={"TRITONPACK_MAX_UNPACK_BYTES": str(10 * MiB)})
    return cases


def _no_content_size(frame: bytes) -> bytes:
    # Re-encode the frame's content without the content-size field.
    data = zstandard.ZstdDecompressor().decompress(frame)
    return zframe(data, content_size=False)


def _shrink_blobs(doc: dict) -> None:
    for blob in doc["blobs"]:
        blob[1], blob[2] = 0, min(blob[2], 10)


def _keep_blobs_small(doc: dict) -> None:
    for blob in doc["blobs"]:
        blob[1], blob[2] = 0, 1


def _fan_out_one_blob(doc: dict) -> None:
    """One 1000-byte blob named by 20,000 files of one group: 20 MB declared from a few hundred bytes. The case
    sets TRITONPACK_MAX_UNPACK_BYTES below that; the default 64 GiB would need 70 million names."""
    entry = doc["entries"][0]
    json_blob = next(b for n, b in entry["files"] if n == "k.json")
    entry["files"] = [["k.json", json_blob]] + [[f"f{i}.bin", json_blob] for i in range(20000)]


def _values_bomb(n: int = 4_000_000) -> bytes:
    """An index of one array of ``n`` empty maps (1 byte each, 64 in memory)."""
    return b"\x82\xa6format\xa5tpack\xa7entries" + b"\xdd" + struct.pack(">I", n) + b"\x80" * n


def write_corpus(directory: str) -> int:
    os.makedirs(directory, exist_ok=True)
    count = 0
    for name, (build, _, env) in corpus().items():
        if env:  # refused only under lowered limits: as seeds they are just large valid archives
            continue
        data = build()
        if len(data) > 4 * MiB:  # keep fuzz seeds small
            continue
        with open(os.path.join(directory, f"{name}.tpack"), "wb") as f:
            f.write(data)
        count += 1
    with open(os.path.join(directory, "valid.tpack"), "wb") as f:
        f.write(Crafted(entries=[group(KEY, "add_kernel"), group(KEY2, "mul_kernel"), autotune(KEY2, "f")],
                        split=True).build())
    return count + 1


if __name__ == "__main__":
    print(write_corpus(sys.argv[1] if len(sys.argv) > 1 else "hostile-corpus"), "archives written")
