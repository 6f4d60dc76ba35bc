"""Text from outside (a server's answer, its log, a planted file) made safe to keep and show.

Two hazards, each mended in one place. A JSON `\\ud800` escape decodes to a lone surrogate: a
Python str that no UTF-8 encoder, SQLite binding or terminal write accepts, so it must not get
past the parser (`whole`, applied by `load_json`). And control characters, escape sequences and
bidirectional overrides would reach a terminal or a log raw (`printable`). JSON is parsed here
too, bounded in depth and numbers, without the HTTP stack (`status` reads the daemon's files).
"""

from __future__ import annotations

import json
import math
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


class BadJson(ValueError):
    """A body that is not JSON the watchdog accepts; the message says why."""


MAX_DEPTH = 64  # no answer the watchdog reads nests deeper than a few levels


def load_json(body: bytes | str) -> object:
    """JSON as the watchdog accepts it: finite numbers only (no NaN, Infinity or 1e400),
    nesting at most MAX_DEPTH deep, every string whole (a lone surrogate becomes U+FFFD).
    Raises BadJson, never anything else."""
    try:
        text = body.decode("utf-8") if isinstance(body, bytes) else whole(body)
    except UnicodeDecodeError:
        raise BadJson("not UTF-8") from None

    def constant(name: str) -> float:
        raise BadJson(f"{name} is not a number JSON allows")

    def finite(literal: str) -> float:
        value = float(literal)
        if not math.isfinite(value):
            raise BadJson(f"{literal[:40]} is out of range")
        return value

    if _depth(text) > MAX_DEPTH:
        raise BadJson(f"nested deeper than {MAX_DEPTH} levels")
    try:
        doc = json.loads(text, parse_constant=constant, parse_float=finite)
    except BadJson:
        raise
    except (ValueError, RecursionError) as exc:
        raise BadJson(str(exc)[:120] or type(exc).__name__) from None
    # Only a \u escape can make a lone surrogate: the walk is skipped for nearly every answer.
    return mended(doc) if "\\u" in text else doc


def _depth(text: str) -> int:
    """The deepest bracket nesting, strings skipped: checked before parsing, so a million
    brackets cost one pass instead of a RecursionError deep in the parser."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > MAX_DEPTH:
                return deepest
        elif ch in "]}":
            depth -= 1
    return deepest


def finite_count(value: object, limit: float = 1e9) -> float | None:
    """A number that can count requests or steps: finite, not negative, not absurd."""
    if isinstance(value, bool):
        return 1.0 if value else 0.0
    if not isinstance(value, (int, float)):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    if not math.isfinite(number) or number < 0 or number > limit:
        return None
    return number
