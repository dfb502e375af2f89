"""What must hold of a cache root whatever happened to an unpack: shared by the tests and bench/crash_trials.py."""
from __future__ import annotations

import hashlib
import json
import os
import re

import tritonpack

TEMP = re.compile(r"tmp\.tpack\..*")


def tree(path) -> set[str]:
    """Every path under ``path`` (files, directories, links), relative, without following links."""
    out = set()
    for dirpath, dirnames, names in os.walk(path):
        for name in dirnames + names:
            out.add(os.path.relpath(os.path.join(dirpath, name), path))
    return out


def temp_files(root) -> list[str]:
    """tritonpack's temp files and run locks anywhere under ``root``."""
    return sorted(p for p in tree(root) if TEMP.fullmatch(os.path.basename(p))) if os.path.isdir(root) else []


def sha(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def expected_groups(archive) -> dict[tuple[str, str], dict[str, str]]:
    """(key, group name) -> {file name: sha256 hex} as the archive holds them."""
    with tritonpack.open(archive) as reader:
        return {(e.key, e.name): {f.name: f.sha256.hex() for f in e.files} for e in reader.entries
                if e.kind == "group"}


def manifests(root) -> list[str]:
    """The manifests Triton can see a group through: ``<key>/__grp__*.json`` directly in a key directory of the
    root. A killed unpack's staging directory (``tmp.tpack.*``, never a cache key) holds manifests that no lookup
    reaches, and a manifest a replace hid (it lists no file: every Triton misses it) shows no group."""
    if not os.path.isdir(root):
        return []
    return sorted(p for p in tree(root) if os.path.basename(p).startswith("__grp__")
                  and len(p.split(os.sep)) == 2 and not p.startswith("tmp.") and not _hidden(os.path.join(root, p)))


def _hidden(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read()) == {"child_paths": {}}
    except (OSError, ValueError):
        return False


def group_problems(root, allowed: dict[tuple[str, str], list[dict[str, str]]] | None = None) -> list[str]:
    """Every visible group (a manifest) must be whole: its children exist, in its own key directory, and, where
    ``allowed`` names the group, the files are exactly one of the allowed versions (e.g. the archive's or the
    user's own). Returns what is wrong, empty if nothing."""
    root = os.path.abspath(root)
    problems = []
    for rel in manifests(root):
        key, manifest = os.path.split(rel)
        name = manifest[len("__grp__"):-len(".json")]
        path = os.path.join(root, rel)
        try:
            with open(path, "rb") as f:
                children = json.loads(f.read())["child_paths"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            problems.append(f"{rel}: unreadable manifest ({e})")
            continue
        missing = [c for c, p in children.items() if not os.path.isfile(p)]
        outside = [c for c, p in children.items() if os.path.dirname(p) != os.path.join(root, key)]
        if missing or outside:
            problems.append(f"{rel}: missing {missing} outside {outside}")
            continue
        versions = (allowed or {}).get((key, name))
        if versions is not None:
            actual = {c: sha(p) for c, p in children.items()}
            if actual not in versions:
                problems.append(f"{rel}: files match no allowed version")
    return problems


def triton_resolves(root, key: str, name: str) -> bool | None:
    """Triton's own answer: does ``FileCacheManager(key).get_group`` resolve the group (None: no Triton)."""
    try:
        from triton.runtime.cache import FileCacheManager
    except Exception:
        return None
    old = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = os.fspath(root)
    try:
        group = FileCacheManager(key).get_group(f"{name}.json")
    finally:
        if old is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = old
    return group is not None and f"{name}.json" in group
