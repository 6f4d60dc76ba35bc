"""Text from outside (a server's answer, its log, a planted file) made safe to keep and show.

Two hazards, each mended in one place. A JSON `\\ud800` escape decodes to a lone surrogate: a
Python str that no UTF-8 encoder, SQLite binding or terminal write accepts, so it must not get
past the parser (`whole`, applied by `load_json`). And control characters, escape sequences and
bidirectional overrides would reach a terminal or a log raw (`printable`).
"""

from __future__ import annotations

import re

REPLACEMENT = "\ufffd"
_SURROGATE = re.compile("[\ud800-\udfff]")
# C0 and C1 controls, DEL, the line and paragraph separators (a terminal or a log reader may
# break a line there: a forged line), and the bidirectional embeddings, overrides and isolates.
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u2028-\u202e\u2066-\u2069]")


def whole(text: str) -> str:
    """`text` with each lone surrogate replaced by U+FFFD."""
    return _SURROGATE.sub(REPLACEMENT, text)


def mended(value: object) -> object:
    """A parsed JSON document with every string (keys too) made `whole`."""
    if isinstance(value, str):
        return whole(value)
    if isinstance(value, list):
        return [mended(v) for v in value]
    if isinstance(value, dict):
        return {whole(k): mended(v) for k, v in value.items()}
    return value


def printable(text: str, *, lines: bool = False) -> str:
    """`text` whole, with control characters shown as escapes (`\\x1b`, `\\u202e`) instead of
    acting on a terminal; `lines` keeps newlines and tabs (a log tail)."""

    def escape(m: re.Match[str]) -> str:
        ch = m.group()
        if lines and ch in "\n\t":
            return ch
        return f"\\x{ord(ch):02x}" if ord(ch) < 0x100 else f"\\u{ord(ch):04x}"

    return _CONTROL.sub(escape, whole(text))
