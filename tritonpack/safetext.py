"""Text from an archive is hostile too: names may hold newlines, terminal escapes or bidi overrides. Everything the
CLI prints for people goes through ``printable`` so that an error stays one line and a listing cannot rewrite the
terminal. (JSON output needs nothing: ``json.dumps`` escapes all of these.)"""
from __future__ import annotations

import re

# C0 and C1 controls, DEL, line/paragraph separators, zero-width and bidi formatting characters, lone surrogates.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u2028-\u202e\u2060-\u2064\u2066-\u2069\ufeff\ud800-\udfff]")


def _escape(match: re.Match) -> str:
    c = ord(match.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def unsafe(text: str) -> bool:
    """Whether ``printable`` would change ``text``."""
    return _UNSAFE.search(text) is not None


def printable(text: str) -> str:
    """``text`` with every unsafe character replaced by a visible escape (``\\n`` becomes ``\\x0a``)."""
    return _UNSAFE.sub(_escape, text)


__all__ = ["printable", "unsafe"]
