"""The history's rows as the rest of the watchdog reads them, and a row still to be written."""

from __future__ import annotations

import json
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


def probe_row(row: sqlite3.Row) -> ProbeRecord:
    return ProbeRecord(
        id=row["id"],
        server=row["server"],
        at=row["at"],
        state=row["state"],
        reason=row["reason"],
        ttft_s=row["ttft_s"],
        waited_s=row["waited_s"],
        evidence=doc(row["evidence"], {}),
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


def incident_row(row: sqlite3.Row) -> Incident:
    return Incident(
        id=row["id"],
        server=row["server"],
        opened_at=row["opened_at"],
        began_at=row["began_at"] if row["began_at"] is not None else row["opened_at"],
        closed_at=row["closed_at"],
        state=row["state"],
        reason=row["reason"],
        evidence=doc(row["evidence"], {}),
        actions=doc(row["actions"], []),
        outage_s=row["outage_s"],
        recover_s=row["recover_s"],
        outcome=row["outcome"],
        advice=row["advice"],
    )
