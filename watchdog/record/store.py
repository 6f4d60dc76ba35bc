"""The history: probes, incidents, events, restarts and holds, in `state_dir`.

Every call goes through the guarded database (record/db.py), so the history never stops the
probing. The daemon writes behind (`behind=True`, record/behind.py); a short-lived command
writes at once and skips a write another process's lock keeps out.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mlx_watchdog.record.behind import Behind
from mlx_watchdog.record.db import Database
from mlx_watchdog.record.rows import (
    LATEST,
    EventRecord,
    Incident,
    ProbeRecord,
    Ref,
    Restart,
    Row,
    doc,
    event_row,
    incident_row,
    probe_row,
    restart_row,
    row_id,
)
from mlx_watchdog.record.serving import DAY_S, KEEP_DAYS, Gathered, ServingTime

HISTORY_FILE = "history.db"
DUMPS_KEPT = 50  # per server: a dump is up to about 100 kB
PROBES_KEPT = 20_000  # per server; a week of probes every 30 s
PRUNE_EVERY = 500  # probes of one server between two prunings of its rows
READ_WAIT = 0.5  # a read waits this long at most for the writes queued before it

__all__ = [
    "HISTORY_FILE",
    "EventRecord",
    "Incident",
    "ProbeRecord",
    "Ref",
    "Restart",
    "Row",
    "Store",
    "open_history",
    "row_id",
]


def number(column: str) -> str:
    """SQL that is true when `column` holds a number: a history someone edited may hold text
    where a number belongs (SQLite keeps what it is given). What the daemon loads to run is
    read through this, so such a row is left unread rather than stopping the watchdog (text
    also compares greater than any number there); the page's day says it instead."""
    return f"typeof({column}) IN ('integer', 'real')"


class Store:
    """What the watchdog asks of its history: probes, incidents, events, restarts, dumps."""

    def __init__(
        self, path: Path | None, *, wall: Callable[[], float] = time.time, behind: bool = False
    ) -> None:
        self.db = Database(path, wall=wall, behind=behind)
        self._behind = Behind(self.db) if behind else None
        self._writes: dict[str, int] = {}  # probes written per server since the last pruning
        self._serving = ServingTime()

    @property
    def problem(self) -> str | None:
        """The last trouble, for status output."""
        return self.db.problem

    @property
    def lost(self) -> int:
        return self._behind.lost if self._behind is not None else 0

    def _write(
        self,
        sql: str,
        args: Sequence[Any] = (),
        *,
        then: str | None = None,
        then_args: Sequence[Any] = (),
    ) -> Row:
        """Every write: one statement (and an optional second) in one transaction, guarded;
        now, or queued when writing behind. A `Row` among the arguments stands for its id when
        the write runs; one that was never written makes the write moot."""
        row = Row()

        def work(db: sqlite3.Connection) -> None:
            values = [row_id(a) if isinstance(a, Row) else a for a in args]
            if any(isinstance(a, Row) and a.id is None for a in args):
                return
            with self.db.tx(db):
                cur = db.execute(sql, values)
                if then is not None:
                    db.execute(then, then_args)
                row.id = int(cur.lastrowid or 0)

        if self._behind is None:
            self.db.guard(None, work)
        else:
            self._behind.put(work)
        return row

    def flush(self, timeout: float) -> bool:
        """Wait until the queued writes are done; False when some still wait."""
        return self._behind is None or self._behind.flush(timeout)

    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        if self._behind is not None and not self._behind.writing():
            self._behind.flush(READ_WAIT)  # this process reads what it wrote, if the file lets it
        return self.db.rows(sql, args)

    def close(self) -> None:
        for server, gathered in self._serving.drain():
            self._write_serving(server, gathered)
        if self._behind is not None:
            self._behind.close()
        self.db.close()

    # -- probes -----------------------------------------------------------------------------

    def record_probe(
        self,
        server: str,
        at: float,
        state: str,
        reason: str,
        evidence: dict[str, Any],
        *,
        step: float | None = None,
    ) -> None:
        """One probe's verdict. With `step` (the daemon's probe interval) its time also counts
        toward the server's serving days (record/serving.py)."""
        if step is not None and (due := self._serving.probe(server, at, state, step)) is not None:
            self._write_serving(server, due)
        written = self._writes.get(server, 0) + 1
        prune = None
        # The first write of each server in a process prunes too: runs shorter than
        # PRUNE_EVERY probes (a `probe` command, a daemon restarted often) must not add up.
        if written >= PRUNE_EVERY or server not in self._writes:
            prune = (
                "DELETE FROM probes WHERE server = ? AND id <= "
                "(SELECT id FROM probes WHERE server = ? ORDER BY id DESC LIMIT 1 OFFSET ?)"
            )

        self._writes[server] = written % PRUNE_EVERY
        self._write(
            "INSERT INTO probes (server, at, state, reason, ttft_s, waited_s, evidence)"
            " VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                server,
                at,
                state,
                reason,
                evidence.get("ttft_s"),
                evidence.get("waited_s"),
                json.dumps(evidence),
            ),
            then=prune,
            then_args=(server, server, PROBES_KEPT),
        )

    def probes(self, server: str, since: float) -> list[ProbeRecord]:
        rows = self._rows(
            "SELECT * FROM probes WHERE server = ? AND at >= ? ORDER BY at", (server, since)
        )
        return [p for r in rows if (p := probe_row(r)) is not None]

    def ttfts(self, server: str, since: float) -> list[tuple[float, float]]:
        """(when, time to first token) of the probes since then that got a token."""
        rows = self._rows(
            "SELECT at, ttft_s FROM probes WHERE server = ? AND at >= ? AND "
            f"{number('at')} AND {number('ttft_s')} ORDER BY at",
            (server, since),
        )
        return [(float(r[0]), float(r[1])) for r in rows]

    def states(self, server: str, since: float) -> list[tuple[float, str, float | None]]:
        """(when, state, time to first token or None) of the probes since then: the page's
        day, without reading each probe's evidence."""
        rows = self._rows(
            # Unfiltered: a value of the wrong type here is said on the page (serve/day.py).
            "SELECT at, state, ttft_s FROM probes WHERE server = ? AND at >= ? ORDER BY at",
            (server, since),
        )
        return [
            (float(r[0]), str(r[1]), None if r[2] is None else float(r[2]))
            for r in rows
            if not isinstance(r[0], (int, float)) or r[0] <= LATEST  # no clock shows it
        ]

    def last_probe(self, server: str) -> ProbeRecord | None:
        rows = self._rows(
            "SELECT * FROM probes WHERE server = ? ORDER BY at DESC LIMIT 1", (server,)
        )
        return probe_row(rows[0]) if rows else None

    def last_token_at(self, server: str) -> float | None:
        rows = self._rows(
            f"SELECT MAX(at) FROM probes WHERE server = ? AND {number('ttft_s')} "
            f"AND {number('at')}",
            (server,),
        )
        return None if not rows or rows[0][0] is None else float(rows[0][0])

    def _write_serving(self, server: str, g: Gathered) -> None:
        self._write(
            "INSERT INTO serving (server, day, probed_s, serving_s) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (server, day) DO UPDATE SET probed_s = probed_s + excluded.probed_s, "
            "serving_s = serving_s + excluded.serving_s",
            (server, g.day, g.probed_s, g.serving_s),
            then="DELETE FROM serving WHERE server = ? AND day < ?",
            then_args=(server, g.day - KEEP_DAYS),
        )

    def serving(self, server: str, since: float) -> tuple[float, float]:
        """(seconds probed, seconds serving) from the day of `since` on, what this process
        has not written yet included."""
        rows = self._rows(
            "SELECT SUM(probed_s), SUM(serving_s) FROM serving WHERE server = ? AND day >= ? "
            f"AND {number('probed_s')} AND {number('serving_s')}",
            (server, int(since // DAY_S)),
        )
        probed, serving = (float(v or 0.0) for v in rows[0]) if rows else (0.0, 0.0)
        if (g := self._serving.unwritten(server)) is not None:
            probed, serving = probed + g.probed_s, serving + g.serving_s
        return probed, serving

    # -- incidents --------------------------------------------------------------------------

    def open_incident(
        self,
        server: str,
        at: float,
        state: str,
        reason: str,
        evidence: dict[str, Any],
        *,
        began_at: float | None = None,
    ) -> Row:
        return self._write(
            "INSERT INTO incidents (server, opened_at, began_at, state, reason, evidence)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (server, at, at if began_at is None else began_at, state, reason, json.dumps(evidence)),
        )

    def add_action(self, incident: Ref, action: dict[str, Any]) -> None:
        if incident is not None:
            self._write(
                "UPDATE incidents SET actions = json_insert(actions, '$[#]', json(?)) WHERE id = ?",
                (json.dumps(action), incident),
            )

    def close_incident(
        self,
        incident: Ref,
        at: float,
        outcome: str,
        recover_s: float | None,
        outage_s: float | None = None,
    ) -> None:
        """Close it at `at`; its outage is `outage_s` where the span clock measured it (a
        wall clock stepped meanwhile makes the walls' difference wrong), else that difference."""
        if incident is None:
            return
        self._write(
            "UPDATE incidents SET closed_at = ?, outcome = ?, recover_s = ?,"
            " outage_s = COALESCE(?, ? - COALESCE(began_at, opened_at))"
            " WHERE id = ? AND closed_at IS NULL",
            (at, outcome, recover_s, outage_s, at, incident),
        )

    def open_incident_for(self, server: str) -> Incident | None:
        rows = self._rows(
            "SELECT * FROM incidents WHERE server = ? AND closed_at IS NULL"
            f" AND {number('opened_at')} ORDER BY opened_at DESC LIMIT 1",
            (server,),
        )
        return incident_row(rows[0]) if rows else None

    def incidents(self, since: float, server: str | None = None) -> list[Incident]:
        sql = (
            "SELECT * FROM incidents WHERE (closed_at IS NULL OR "
            f"({number('closed_at')} AND closed_at >= ?))"
        )
        args: list[Any] = [since]
        if server is not None:
            sql += " AND server = ?"
            args.append(server)
        rows = self._rows(sql + " ORDER BY opened_at", args)
        return [i for r in rows if (i := incident_row(r)) is not None]

    def incident(self, number: int) -> Incident | None:
        rows = self._rows("SELECT * FROM incidents WHERE id = ?", (number,))
        return incident_row(rows[0]) if rows else None

    def set_advice(self, incident: Ref, advice: str) -> None:
        if incident is not None:
            self._write("UPDATE incidents SET advice = ? WHERE id = ?", (advice, incident))

    # -- calibrations -----------------------------------------------------------------------

    def add_dump(self, server: str, incident: Ref, at: float, dump: dict[str, Any]) -> None:
        """Kept with its incident; the newest DUMPS_KEPT of each server only."""
        self._write(
            "INSERT INTO dumps (server, incident, at, doc) VALUES (?, ?, ?, ?)",
            (server, incident, at, json.dumps(dump)),
            then="DELETE FROM dumps WHERE server = ? AND id NOT IN "
            "(SELECT id FROM dumps WHERE server = ? ORDER BY id DESC LIMIT ?)",
            then_args=(server, server, DUMPS_KEPT),
        )

    def dumps(self, incident: int) -> list[dict[str, Any]]:
        rows = self._rows("SELECT doc FROM dumps WHERE incident = ? ORDER BY at", (incident,))
        return [doc(r["doc"], {}) for r in rows]

    def save_calibration(self, server: str, at: float, doc: dict[str, Any]) -> None:
        self._write(
            "INSERT INTO calibrations (server, at, doc) VALUES (?, ?, ?)",
            (server, at, json.dumps(doc)),
        )

    def last_calibration(self, server: str) -> dict[str, Any] | None:
        rows = self._rows(
            "SELECT doc FROM calibrations WHERE server = ? ORDER BY at DESC LIMIT 1", (server,)
        )
        found: dict[str, Any] = doc(rows[0][0], {}) if rows else {}
        return found or None

    # -- events -----------------------------------------------------------------------------

    def add_event(
        self, server: str, at: float, kind: str, message: str, data: dict[str, Any]
    ) -> None:
        self._write(
            "INSERT INTO events (server, at, kind, message, data) VALUES (?, ?, ?, ?, ?)",
            (server, at, kind, message, json.dumps(data)),
        )

    def events(
        self, server: str | None = None, *, since: float = 0.0, kind: str | None = None
    ) -> list[EventRecord]:
        sql = "SELECT * FROM events WHERE at >= ?"
        args: list[Any] = [since]
        if server is not None:
            sql, args = sql + " AND server = ?", [*args, server]
        if kind is not None:
            sql, args = sql + " AND kind = ?", [*args, kind]
        rows = self._rows(sql + " ORDER BY id", args)
        return [e for r in rows if (e := event_row(r)) is not None]

    # -- restarts and holds: what the budget is made of -------------------------------------

    def start_restart(self, server: str, at: float, trigger: str) -> Row:
        """Written before the manager acts, so a watchdog killed mid-restart still counts it."""
        return self._write(
            "INSERT INTO restarts (server, at, trigger) VALUES (?, ?, ?)", (server, at, trigger)
        )

    def finish_restart(
        self, restart: Ref, at: float, outcome: str, served_s: float | None = None
    ) -> None:
        if restart is not None:
            self._write(
                "UPDATE restarts SET finished_at = ?, outcome = ?, served_s = ? WHERE id = ?",
                (at, outcome, served_s, restart),
            )

    def interrupt_unfinished(self, server: str, at: float) -> list[Restart]:
        """Restarts a previous watchdog began and never finished: mark and return them."""
        unfinished = [r for r in self.restarts(server, 0.0) if r.finished_at is None]
        for r in unfinished:
            self.finish_restart(r.id, at, "interrupted")
        return unfinished

    def restarts(self, server: str, since: float) -> list[Restart]:
        rows = self._rows(
            "SELECT * FROM restarts WHERE server = ? AND at >= ? ORDER BY at", (server, since)
        )
        return [x for r in rows if (x := restart_row(r)) is not None]

    def restart_costs(self, server: str, n: int) -> list[float]:
        """The last `n` times from a restart to its first token, oldest first."""
        rows = self._rows(
            f"SELECT served_s FROM restarts WHERE server = ? AND {number('served_s')} "
            "AND served_s > 0 ORDER BY at DESC LIMIT ?",
            (server, n),
        )
        return [float(r["served_s"]) for r in reversed(rows)]

    def hold(self, server: str, at: float, reason: str) -> None:
        self._write("INSERT OR REPLACE INTO holds VALUES (?, ?, ?)", (server, at, reason))

    def release(self, server: str) -> None:
        self._write("DELETE FROM holds WHERE server = ?", (server,))

    def hold_reason(self, server: str) -> str | None:
        rows = self._rows("SELECT reason FROM holds WHERE server = ?", (server,))
        return str(rows[0][0]) if rows else None


def open_history(state_dir: Path, *, create: bool = True) -> Store:
    """The history in `state_dir`. A reader (`create=False`) gets an empty in-memory store
    when there is none yet, instead of creating the file."""
    path = state_dir / HISTORY_FILE
    return Store(path if create or path.exists() else None)
