"""One thing `doctor` checked: how it stands, what it is, and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Level = Literal["ok", "note", "warning", "problem"]  # a note: known to happen, and the fix


@dataclass(frozen=True)
class Finding:
    """One thing doctor found: how bad, about what, in words, and the fix."""

    level: Level
    what: str
    detail: str
    fix: str = ""


def exit_code(findings: list[Finding]) -> int:
    levels = {f.level for f in findings}
    return 2 if "problem" in levels else 1 if "warning" in levels else 0
