"""Rendering an archive's index for people (a table) and programs (JSON)."""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from .model import AUTOTUNE, GROUP, ArchiveInfo, Entry, disowned, named_version
from .report import human_bytes, reasons_to_dicts
from .safetext import printable, unsafe

if TYPE_CHECKING:
    from .compat import CheckReport


def entry_to_dict(entry: Entry) -> dict:
    d: dict = {
        "kind": entry.kind,
        "key": entry.key,
        "name": entry.name,
        "size": entry.size,
        "files": [{"name": f.name, "size": f.size, "sha256": f.sha256.hex()} for f in entry.files],
    }
    if entry.kernel:
        k = entry.kernel
        d.update(target=k.target, backend=k.backend, arch=k.arch, warp_size=k.warp_size, num_warps=k.num_warps,
                 num_stages=k.num_stages, num_ctas=k.num_ctas, shared=k.shared, triton_version=k.triton_version,
                 hash=k.hash, env=k.env)
    if entry.autotune:
        a = entry.autotune
        d.update(function=a.function, tuning_key=_jsonable(a.tuning_key), configs=a.configs,
                 best_config=_jsonable(a.best_config), best_timing=a.best_timing, triton_version=a.triton_version,
                 triton_unknown=disowned(entry))
    if entry.stub:
        s = entry.stub
        d.update(role=s.role, ext_suffix=s.ext_suffix, platform=s.platform, tag_from=s.tag_from,
                 triton_version=s.triton_version, triton_unknown=disowned(entry))
    return d


def _jsonable(value):
    """Autotune values are any msgpack values (depth-limited by the reader): binary becomes hex, keys text."""
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {(k.hex() if isinstance(k, bytes) else k): _jsonable(v) for k, v in value.items()}
    return value


def info_to_dict(info: ArchiveInfo, digest: str) -> dict:
    return {
        "tritonpack": info.tritonpack,
        "format_version": ".".join(map(str, info.format_version)),
        "created": info.created,
        "index_sha256": digest,
        "python": info.python._asdict() if info.python else None,
        "triton": info.triton._asdict() if info.triton else None,
    }


def _config_text(config: dict) -> str:
    kwargs = config.get("kwargs")
    kwargs = kwargs if isinstance(kwargs, dict) else {}
    parts = [f"{k}={v}" for k, v in kwargs.items()]
    parts += [f"{k}={config[k]}" for k in ("num_warps", "num_stages", "num_ctas") if k in config]
    return ", ".join(parts)


def _table(headers: list[str], rows: Iterable[list[str]]) -> Iterator[str]:
    """The table's lines. Each row is held as one string until the columns' widths are known (a list of its cells
    took 0.6 KB an entry, 90 MB for 1,060,970 files; a string, 0.1 KB)."""
    widths = list(map(len, headers))
    held = []
    for row in rows:
        if unsafe("".join(row)):  # names come from the archive: cells escaped (one search a row, not a cell)
            row = [printable(cell) for cell in row]
        widths = list(map(max, widths, map(len, row)))
        held.append("\0".join(row))  # an escaped cell holds no NUL
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    yield fmt.format(*headers).rstrip()
    for cells in held:
        yield fmt.format(*cells.split("\0")).rstrip()


def _names_triton(entries: Sequence[Entry]) -> bool:
    """Whether an autotune result or a file of these names its own Triton (format 1.2, a merge of several) or
    says it cannot (1.3): the tables then show a ``triton`` column, as the kernels' does."""
    return any(named_version(e) or disowned(e) for e in entries)


def _triton_cell(entry: Entry) -> str:
    return named_version(entry) or ("unknown" if disowned(entry) else "?")


def table_lines(info: ArchiveInfo, entries: Sequence[Entry], archive: str) -> Iterator[str]:
    """``tritonpack list``'s lines, each printable, made as they are written."""
    triton = f"Triton {info.triton.version}" if info.triton else "Triton unknown"
    python = f"{info.python.cache_tag} {info.python.platform}" if info.python else "python unknown"
    yield printable(f"{archive}: tpack {'.'.join(map(str, info.format_version))}, tritonpack {info.tritonpack}, "
                    f"{triton}, {python}")
    groups = sorted((e for e in entries if e.kind == GROUP), key=lambda e: (e.name, e.target or "", e.key))
    if groups:
        def kernel_rows():
            for e in groups:
                k = e.kernel
                assert k is not None  # the index gives every group its kernel (index._decode_meta)
                yield [e.name, k.target, str(k.num_warps), str(k.num_stages), str(k.shared), str(len(e.files)),
                       human_bytes(e.size), k.triton_version or "?", e.key[:12]]

        yield from ("", f"kernels ({len(groups)})")
        yield from _table(["name", "target", "warps", "stages", "shared", "files", "bytes", "triton", "key"],
                          kernel_rows())
    tuned = [e for e in entries if e.kind == AUTOTUNE]
    if tuned:
        yield from ("", f"autotune results ({len(tuned)})")
        named = _names_triton(tuned)

        def autotune_rows():
            for e in tuned:
                a = e.autotune
                assert a is not None  # the index gives every autotune result its info (index._decode_meta)
                yield [a.function, str(a.configs), _config_text(a.best_config), ", ".join(map(str, a.tuning_key)),
                       *([_triton_cell(e)] if named else []), e.key[:12]]

        yield from _table(["function", "configs", "best config", "tuning key", *(["triton"] if named else []),
                           "key"], autotune_rows())
    other = [e for e in entries if e.kind not in (GROUP, AUTOTUNE)]
    if other:
        yield from ("", f"other files ({len(other)})")
        named = _names_triton(other)
        yield from _table(["name", "role", "bytes", *(["triton"] if named else []), "key"], (
            [e.name, e.stub.role if e.stub else "?", human_bytes(e.size),
             *([_triton_cell(e)] if named else []), e.key[:12]] for e in other))
    if not entries:
        yield "(empty archive)"


def _environment_line(report: CheckReport) -> str:
    env = report.environment
    triton = (f"Triton {env.triton.version} (build {env.triton.key_sha256[:12]})" if env.triton and
              env.triton.key_sha256 else f"Triton {env.triton.version}" if env.triton else "no Triton")
    if env.targets is None:
        gpus = "no GPU visible"
    else:
        names = ", ".join(f"{b}:{a}" for b, a, _ in env.targets)
        gpus = f"targets {names} ({'--target' if env.targets_from == '--target' else 'visible GPUs'})"
    return f"here: {triton}, {gpus}, {env.ext_suffix}"


def check_lines(report: CheckReport, archive: str) -> Iterator[str]:
    """``tritonpack check``'s lines, each printable, made as they are written."""
    yield from (printable(archive), printable(_environment_line(report)), "")
    if report.verdicts:
        statuses: dict[tuple, str] = {(): "ok"}  # entries share their mismatches' text: each made once

        def rows():
            for e, mismatches in report.verdicts:
                status = statuses.get(mismatches)
                if status is None:
                    status = statuses[mismatches] = "; ".join(map(str, mismatches))
                yield [e.name, (e.target if e.kind == GROUP else e.kind) or "?", e.key[:12], status]

        yield from _table(["name", "target", "key", "will be used"], rows())
        yield ""
    yield from map(printable, report.lines())
    yield report.summary()


def check_to_dict(report: CheckReport, archive: str | None) -> dict:
    env = report.environment
    return {
        "archive": archive,
        "usable": report.usable_count,
        "unusable": report.unusable_count,
        "unchecked": report.unchecked,
        "here": {
            "triton": env.triton.version if env.triton else None,
            "triton_key_sha256": env.triton.key_sha256 if env.triton else None,
            "targets": None if env.targets is None else [f"{b}:{a}" for b, a, _ in env.targets],
            "targets_from": env.targets_from,
            "ext_suffix": env.ext_suffix,
            "platform": env.platform,
        },
        "reasons": reasons_to_dicts(report.reasons()),
        "entries": [
            {"kind": v.entry.kind, "key": v.entry.key, "name": v.entry.name, "target": v.entry.target,
             "usable": v.usable,
             "mismatches": [{"factor": m.factor, "archive": m.archive, "here": m.here} for m in v.mismatches]}
            for v in report.verdicts
        ],
    }
