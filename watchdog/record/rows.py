"""The history's rows as the rest of the watchdog reads them, and a row still to be written."""

from __future__ import annotations

import json
import math
import sqlite3
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass
class Row:
    """A row the history was asked to write: its id once written; None while it waits in the
    queue, or when it could not be written. Later writes about it read the id when they run."""

    id: int | None = None


Ref = Row | int | None


def row_id(ref: Ref) -> int | None:
    return ref.id if isinstance(ref, Row) else ref


@dataclass(frozen=True)
class Incident:
    """An incident as the history keeps it: when, why, what was done, how it ended."""

    id: int
    server: str
    opened_at: float
    began_at: float
    closed_at: float | None
    state: str
    reason: str
    evidence: dict[str, Any]
    actions: list[dict[str, Any]]
    outage_s: float | None
    recover_s: float | None
    outcome: str | None
    advice: str | None = None


@dataclass(frozen=True)
class ProbeRecord:
    """One judged probe as the history keeps it."""

    id: int
    server: str
    at: float
    state: str
    reason: str
    ttft_s: float | None
    waited_s: float | None
    evidence: dict[str, Any]


@dataclass(frozen=True)
class EventRecord:
    """One event as the history keeps it."""

    id: int
    server: str
    at: float
    kind: str
    message: str
    data: dict[str, Any]


@dataclass(frozen=True)
class Restart:
    """One restart as the history keeps it: its trigger, outcome and cost."""

    id: int
    server: str
    at: float
    trigger: str
    finished_at: float | None
    outcome: str | None


# Every value read back is checked for its type: SQLite keeps whatever it is given, and a
# history edited by hand (or by another program) must not stop the daemon, `status`, `history`,
# `doctor` or the endpoint. A row without the numbers that place it (its id, its time) is left
# unread; any other value of the wrong type reads as unknown.


def number(value: object) -> float | None:
    """A finite number, or None for anything else (text, bytes, a bool, NaN, infinity)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


LATEST = 1e11  # seconds since the epoch: the year 5138; a time past it was not written by us
LONGEST = 1e9  # seconds: about 31 years, longer than any span the watchdog measures


def moment(value: object) -> float | None:
    """A time since the epoch that can be one (the clock of a machine that ran the watchdog)."""
    found = number(value)
    return found if found is not None and 0 <= found <= LATEST else None


def span(value: object) -> float | None:
    """A duration in seconds: not negative, not past any the watchdog measures."""
    found = number(value)
    return found if found is not None and 0 <= found <= LONGEST else None


ADVICE_NEEDED = ("prompt_tokens", "prefill_s", "client_s", "agent_s", "load_balancer_s")
ADVICE_OPTIONAL = ("answer_tokens", "answer_s")


def calibration_advice(found: object) -> dict[str, Any] | None:
    """A stored calibration's advice and when it was made ("at", None when unreadable), each
    number finite and within bounds; None when its advice cannot be read (a row edited by hand,
    or from another version): shown as none, never a traceback."""
    if not isinstance(found, dict) or not isinstance(found.get("advice"), dict):
        return None
    advice = found["advice"]
    read = {k: span(advice.get(k)) for k in (*ADVICE_NEEDED, *ADVICE_OPTIONAL)}
    if any(read[k] is None for k in ADVICE_NEEDED):
        return None
    return {"at": moment(found.get("at")), **read}


def whole(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def text(value: object, default: str = "") -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return default


def maybe_text(value: object) -> str | None:
    return None if value is None else text(value)


def probe_row(row: sqlite3.Row) -> ProbeRecord | None:
    id_, at = whole(row["id"]), moment(row["at"])
    if id_ is None or at is None:
        return None
    return ProbeRecord(
        id=id_,
        server=text(row["server"]),
        at=at,
        state=text(row["state"], "unknown"),
        reason=text(row["reason"]),
        ttft_s=span(row["ttft_s"]),
        waited_s=span(row["waited_s"]),
        evidence=doc(row["evidence"], {}),
    )


def event_row(row: sqlite3.Row) -> EventRecord | None:
    id_, at = whole(row["id"]), moment(row["at"])
    if id_ is None or at is None:
        return None
    return EventRecord(
        id_, text(row["server"]), at, text(row["kind"]), text(row["message"]), doc(row["data"], {})
    )


def restart_row(row: sqlite3.Row) -> Restart | None:
    id_, at = whole(row["id"]), moment(row["at"])
    if id_ is None or at is None:
        return None
    return Restart(
        id_,
        text(row["server"]),
        at,
        text(row["trigger"], "unknown"),
        moment(row["finished_at"]),
        maybe_text(row["outcome"]),
    )


def doc(text: object, default: T) -> T:
    """A JSON column as written, or `default` when the row holds something else (edited by
    hand, or by another program): one bad row must not keep the daemon, `status` or `history`
    from working."""
    try:
        value = json.loads(text) if isinstance(text, (str, bytes)) else None
    except (ValueError, RecursionError):
        return default
    return value if isinstance(value, type(default)) else default


def incident_row(row: sqlite3.Row) -> Incident | None:
    id_, opened = whole(row["id"]), moment(row["opened_at"])
    if id_ is None or opened is None:
        return None
    began = moment(row["began_at"])
    return Incident(
        id=id_,
        server=text(row["server"]),
        opened_at=opened,
        began_at=began if began is not None else opened,
        closed_at=moment(row["closed_at"]),
        state=text(row["state"], "unknown"),
        reason=text(row["reason"]),
        evidence=doc(row["evidence"], {}),
        actions=[_action(a) for a in doc(row["actions"], list[Any]()) if isinstance(a, dict)],
        outage_s=span(row["outage_s"]),
        recover_s=span(row["recover_s"]),
        outcome=maybe_text(row["outcome"]),
        advice=maybe_text(row["advice"]),
    )


def _action(a: dict[str, Any]) -> dict[str, Any]:
    """An incident's action as written: what it was, its outcome and detail as text, and
    when (None: unreadable), whatever a hand edit left there."""
    return {
        **a,
        "at": moment(a.get("at")),
        "action": text(a.get("action"), "unknown"),
        "outcome": text(a.get("outcome"), "unknown"),
        "detail": text(a.get("detail")),
    }
