"""Markdown tables of bench/perf.py results, one column per run: python bench/perf_table.py RESULT.json ..."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def label(doc: dict) -> str:
    where = "tmpfs" if doc.get("work", "").startswith("/dev/shm") else "disk"
    return f"{doc['machine'].split(', ')[1]}, {where}"


def cell(text: str) -> str:
    return text.replace("|", "\\|")


def goal_name(goal: str) -> str:
    """Older results named the partial-unpack goal after the target count."""
    return "one arch / full unpack (<= 0.4 for 1 of 3)" if goal.startswith("one arch of") else goal


def main(paths: list[str]) -> None:
    docs = [json.loads(Path(p).read_text()) for p in paths]
    for d in docs:
        d["goals"] = {goal_name(g): v for g, v in d["goals"].items()}
    print("| | " + " | ".join(label(d) for d in docs) + " |")
    print("|---|" + "---|" * len(docs))
    cases = list(dict.fromkeys(name for d in docs for name in d["cases"]))
    for name in cases:
        cells = []
        for d in docs:
            case = d["cases"].get(name)
            if case is None:
                cells.append("")
                continue
            size = f", {case['bytes'] / 1e6:.2f} MB" if "bytes" in case else ""
            cells.append(f"{case['seconds']:.2f} s, {case['peak_rss_mb']:.0f} MB RSS{size}")
        print(f"| `{cell(name)}` | " + " | ".join(cells) + " |")
    goals = list(dict.fromkeys(g for d in docs for g in d["goals"]))
    for goal in goals:
        values = [d["goals"].get(goal) for d in docs]
        print(f"| **{cell(goal)}** | " + " | ".join("n/a" if v is None else f"{v}" for v in values) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
