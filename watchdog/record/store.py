"""SQLite history: probes, incidents, events, restarts and holds, in `state_dir`.

The history must never stop the probing. Every call is guarded: a corrupt file is moved aside
and a new one started, an unwritable one is replaced by an in-memory database for the life of
the process, and either is reported. The daemon writes behind (`behind=True`): its ticks queue
each write and go on, one writer thread carries them out in order and waits out another
process's lock, so a locked database neither stalls a tick nor loses a row; a short-lived
command writes at once and skips a write the lock keeps out. The file uses a rollback journal,
not WAL: WAL maps its `-shm` file into memory, and a truncated `-shm` kills the process with
SIGBUS.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from mlx_watchdog.record.private import UnsafeState, create_private

log = logging.getLogger("mlx_watchdog.store")

T = TypeVar("T")

MIGRATIONS: list[tuple[str, str]] = [
    (
        "0001_initial",
        """
        CREATE TABLE probes (
            id INTEGER PRIMARY KEY, server TEXT NOT NULL, at REAL NOT NULL, state TEXT NOT NULL,
            reason TEXT NOT NULL, ttft_s REAL, waited_s REAL, evidence TEXT NOT NULL);
        CREATE INDEX probes_server_at ON probes (server, at);
        CREATE TABLE incidents (
            id INTEGER PRIMARY KEY, server TEXT NOT NULL, opened_at REAL NOT NULL,
            closed_at REAL, state TEXT NOT NULL, reason TEXT NOT NULL, evidence TEXT NOT NULL,
            actions TEXT NOT NULL DEFAULT '[]', outage_s REAL, recover_s REAL, outcome TEXT);
        CREATE INDEX incidents_server ON incidents (server, opened_at);
        CREATE TABLE events (
            id INTEGER PRIMARY KEY, server TEXT NOT NULL, at REAL NOT NULL, kind TEXT NOT NULL,
            message TEXT NOT NULL, data TEXT NOT NULL);
        CREATE TABLE restarts (
            id INTEGER PRIMARY KEY, server TEXT NOT NULL, at REAL NOT NULL, trigger TEXT NOT NULL,
            finished_at REAL, outcome TEXT);
        CREATE INDEX restarts_server_at ON restarts (server, at);
        CREATE TABLE holds (server TEXT PRIMARY KEY, since REAL NOT NULL, reason TEXT NOT NULL);
        """,
    ),
    # When serving stopped, as far as the probes saw: the send time of the first probe that
    # went unanswered, which is earlier than the moment the wedge was judged.
    ("0002_incident_began_at", "ALTER TABLE incidents ADD COLUMN began_at REAL"),
    (
        "0003_calibrations_and_advice",
        """
        CREATE TABLE calibrations (
            id INTEGER PRIMARY KEY, server TEXT NOT NULL, at REAL NOT NULL, doc TEXT NOT NULL);
        CREATE INDEX calibrations_server_at ON calibrations (server, at);
        ALTER TABLE incidents ADD COLUMN advice TEXT;
        """,
    ),
]

HISTORY_FILE = "history.db"
PROBES_KEPT = 20_000  # per server; a week of probes every 30 s
PRUNE_EVERY = 500  # probes of one server between two prunings of its rows
BUSY_TIMEOUT = 2.0  # seconds a write waits for another process's lock before it is skipped
BEHIND_BUSY = 0.1  # writing behind: one attempt's wait, so a reader never waits long for it
RETRY_LOCKED = 0.5  # between two attempts of a write another process's lock keeps out
QUEUE_MAX = 10_000  # writes waiting; past this the newest are lost, and that is reported
FLUSH_TIMEOUT = 5.0  # at close, for the queued writes
OPEN_WAIT = 10.0  # the daemon's wait at start for another process's lock
READ_WAIT = 0.5  # a read waits this long at most for the writes queued before it


@dataclass
class Row:
    """A row the history was asked to write: its id once written; None while it waits in the
    queue, or when it could not be written. Later writes about it read the id when they run."""

    id: int | None = None


Ref = Row | int | None


def row_id(ref: Ref) -> int | None:
    return ref.id if isinstance(ref, Row) else ref


class _Later(Exception):
    """Another process holds the database's lock, or the disk is full: try again later."""


@dataclass(frozen=True)
class Incident:
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
    id: int
    server: str
    at: float
    kind: str
    message: str
    data: dict[str, Any]


@dataclass(frozen=True)
class Restart:
    id: int
    server: str
    at: float
    trigger: str
    finished_at: float | None
    outcome: str | None


class Store:
    def __init__(
        self, path: Path | None, *, clock: Callable[[], float] = time.time, behind: bool = False
    ) -> None:
        self.path = path
        self.clock = clock
        self.problem: str | None = None  # the last trouble, for status output
        self.lost = 0  # writes given up (the queue full, or still waiting at close)
        self._lock = threading.RLock()
        self._writes: dict[str, int] = {}  # probes written per server since the last pruning
        self._closed = False
        self._behind = behind
        self._busy = BEHIND_BUSY if behind else BUSY_TIMEOUT
        self._db = self._open()
        self._queue: deque[Callable[[sqlite3.Connection], None]] = deque()
        self._queued = threading.Condition()
        self._writer: threading.Thread | None = None
        if behind:
            self._writer = threading.Thread(target=self._write_behind, name="history", daemon=True)
            self._writer.start()

    # -- opening and guarding ---------------------------------------------------------------

    def _open(self) -> sqlite3.Connection:
        if self.path is None:
            return self._connect(":memory:")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            # Created 0600 before SQLite opens it: its -wal and -shm take the same mode.
            create_private(self.path)
            return self._connect_waiting(str(self.path))
        except sqlite3.DatabaseError as exc:
            if _is_corrupt(exc):
                self._move_aside(exc)
                return self._connect(str(self.path))
            return self._fall_back(exc)
        except (OSError, UnsafeState) as exc:
            return self._fall_back(exc)

    def _connect_waiting(self, where: str) -> sqlite3.Connection:
        """The daemon waits out another process's lock at start (up to OPEN_WAIT), rather than
        keep its whole run's history in memory; a command opens at once or not at all."""
        deadline = time.monotonic() + (OPEN_WAIT if self._behind else 0.0)
        while True:
            try:
                return self._connect(where)
            except sqlite3.OperationalError as exc:
                text = str(exc).lower()
                if not ("locked" in text or "busy" in text) or time.monotonic() > deadline:
                    raise
                time.sleep(RETRY_LOCKED)

    def _connect(self, where: str) -> sqlite3.Connection:
        db = sqlite3.connect(
            where, timeout=self._busy, check_same_thread=False, isolation_level=None
        )
        try:
            db.row_factory = sqlite3.Row
            with contextlib.suppress(sqlite3.OperationalError):
                # A WAL file from an earlier version: switched when nobody else has it open.
                db.execute("PRAGMA journal_mode=TRUNCATE")
            db.execute("PRAGMA mmap_size=0")
            db.execute("PRAGMA synchronous=NORMAL")
            # A small page cache: the daemon reads little, and its memory stays flat as the
            # history grows (the default 2 MiB filled up over the first 10,000 probes).
            db.execute("PRAGMA cache_size = -512")
            db.execute("PRAGMA quick_check").fetchone()
            self._migrate(db)
        except BaseException:
            db.close()
            raise
        return db

    @staticmethod
    def _migrate(db: sqlite3.Connection) -> None:
        db.execute("CREATE TABLE IF NOT EXISTS migrations (name TEXT PRIMARY KEY, applied_at REAL)")
        done = {row[0] for row in db.execute("SELECT name FROM migrations")}
        for number, (name, sql) in enumerate(MIGRATIONS, start=1):
            if name in done:
                continue
            db.execute("BEGIN IMMEDIATE")
            try:
                for statement in sql.split(";"):
                    if statement.strip():
                        db.execute(statement)
                db.execute("INSERT INTO migrations VALUES (?, ?)", (name, time.time()))
                db.execute(f"PRAGMA user_version = {number}")
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

    def _move_aside(self, exc: BaseException) -> None:
        assert self.path is not None
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(self.clock())}")
        for suffix in ("", "-wal", "-shm"):
            part = Path(str(self.path) + suffix)
            if part.exists():
                part.replace(Path(str(aside) + suffix))
        self._report(f"history database {self.path} is corrupt ({exc}); moved it to {aside}")

    def _fall_back(self, exc: BaseException) -> sqlite3.Connection:
        self._report(
            f"history database {self.path} cannot be used ({exc}); keeping history in memory "
            "until the watchdog restarts"
        )
        return self._connect(":memory:")

    def _report(self, message: str) -> None:
        self.problem = message
        log.error(message)

    def _guard(
        self, default: T, work: Callable[[sqlite3.Connection], T], *, wait: bool = False
    ) -> T:
        """`work` on the database, through its faults; `wait`: raise _Later on another
        process's lock or a full disk instead of giving up (the writer thread tries again)."""
        with self._lock:
            if self._closed:  # a job still finishing after shutdown: nothing to write to
                return default
            for attempt in (1, 2):
                try:
                    return work(self._db)
                except sqlite3.OperationalError as exc:
                    text = str(exc).lower()
                    if wait and ("locked" in text or "busy" in text or "full" in text):
                        raise _Later(str(exc)) from None
                    if "locked" in text or "busy" in text:
                        self._report(f"history database is locked; skipped ({exc})")
                        return default
                    if attempt == 2:
                        break
                    self._db.close()
                    self._db = self._fall_back(exc)
                except sqlite3.DatabaseError as exc:
                    if attempt == 2:
                        break
                    self._db.close()
                    if _is_corrupt(exc) and self.path is not None:
                        self._move_aside(exc)
                        self._db = self._open()
                    else:
                        self._db = self._fall_back(exc)
            return default

    @contextmanager
    def _tx(self, db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
        db.execute("BEGIN IMMEDIATE")
        try:
            yield db
            db.execute("COMMIT")
        except BaseException:
            # SQLite may have rolled back by itself (a full disk): the first error is the one.
            if db.in_transaction:
                with contextlib.suppress(sqlite3.Error):
                    db.execute("ROLLBACK")
            raise

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
            with self._tx(db):
                cur = db.execute(sql, values)
                if then is not None:
                    db.execute(then, then_args)
                row.id = int(cur.lastrowid or 0)

        if self._writer is None:
            self._guard(None, work)
            return row
        with self._queued:
            if self._closed or len(self._queue) >= QUEUE_MAX:
                self.lost += 1
                self._report(f"history: {self.lost} writes lost (the queue is full or closed)")
                return row
            self._queue.append(work)
            self._queued.notify()
        return row

    def _write_behind(self) -> None:
        """The writer thread: each queued write in order; another process's lock or a full
        disk is waited out, a write at a time, so the queue keeps what the ticks asked for."""
        said_locked = False
        while True:
            with self._queued:
                while not self._queue and not self._closed:
                    self._queued.wait()
                if not self._queue:
                    return
                work = self._queue[0]
            try:
                self._guard(None, work, wait=True)
            except _Later as exc:
                if not said_locked:
                    said_locked = True
                    self._report(f"history database cannot be written now ({exc}); writes wait")
                with self._queued:
                    self._queued.wait(RETRY_LOCKED)
                continue
            if said_locked:
                said_locked = False
                log.info("history database is written again")
                self.problem = None
            with self._queued:
                self._queue.popleft()
                self._queued.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until the queued writes are done; False when some still wait."""
        deadline = time.monotonic() + timeout
        with self._queued:
            while self._queue and time.monotonic() < deadline:
                self._queued.wait(deadline - time.monotonic())
            return not self._queue

    def _rows(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        if self._writer is not None and threading.current_thread() is not self._writer:
            self.flush(READ_WAIT)  # this process reads what it wrote, while the file lets it
        empty: list[sqlite3.Row] = []
        return self._guard(empty, lambda db: db.execute(sql, args).fetchall())

    def close(self) -> None:
        if self._writer is not None and not self.flush(FLUSH_TIMEOUT):
            with self._queued:
                self.lost += len(self._queue)
                self._queue.clear()
            self._report(f"history: {self.lost} writes lost at close (the database stayed locked)")
        with self._queued:
            self._closed = True
            self._queued.notify_all()
        if self._writer is not None:
            self._writer.join(FLUSH_TIMEOUT)
        with self._lock:
            self._closed = True
            self._db.close()

    # -- probes -----------------------------------------------------------------------------

    def record_probe(
        self, server: str, at: float, state: str, reason: str, evidence: dict[str, Any]
    ) -> None:
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
        return [_probe(r) for r in rows]

    def ttfts(self, server: str, since: float) -> list[tuple[float, float]]:
        """(when, time to first token) of the probes since then that got a token."""
        rows = self._rows(
            "SELECT at, ttft_s FROM probes WHERE server = ? AND at >= ? AND ttft_s IS NOT NULL"
            " ORDER BY at",
            (server, since),
        )
        return [(float(r[0]), float(r[1])) for r in rows]

    def last_probe(self, server: str) -> ProbeRecord | None:
        rows = self._rows(
            "SELECT * FROM probes WHERE server = ? ORDER BY at DESC LIMIT 1", (server,)
        )
        return _probe(rows[0]) if rows else None

    def last_token_at(self, server: str) -> float | None:
        rows = self._rows(
            "SELECT MAX(at) FROM probes WHERE server = ? AND ttft_s IS NOT NULL", (server,)
        )
        return None if not rows or rows[0][0] is None else float(rows[0][0])

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
        self, incident: Ref, at: float, outcome: str, recover_s: float | None
    ) -> None:
        if incident is None:
            return
        self._write(
            "UPDATE incidents SET closed_at = ?, outcome = ?, recover_s = ?,"
            " outage_s = ? - COALESCE(began_at, opened_at) WHERE id = ? AND closed_at IS NULL",
            (at, outcome, recover_s, at, incident),
        )

    def open_incident_for(self, server: str) -> Incident | None:
        rows = self._rows(
            "SELECT * FROM incidents WHERE server = ? AND closed_at IS NULL"
            " ORDER BY opened_at DESC LIMIT 1",
            (server,),
        )
        return _incident(rows[0]) if rows else None

    def incidents(self, since: float, server: str | None = None) -> list[Incident]:
        sql = "SELECT * FROM incidents WHERE (closed_at IS NULL OR closed_at >= ?)"
        args: list[Any] = [since]
        if server is not None:
            sql += " AND server = ?"
            args.append(server)
        rows = self._rows(sql + " ORDER BY opened_at", args)
        return [_incident(r) for r in rows]

    def set_advice(self, incident: Ref, advice: str) -> None:
        if incident is not None:
            self._write("UPDATE incidents SET advice = ? WHERE id = ?", (advice, incident))

    # -- calibrations -----------------------------------------------------------------------

    def save_calibration(self, server: str, at: float, doc: dict[str, Any]) -> None:
        self._write(
            "INSERT INTO calibrations (server, at, doc) VALUES (?, ?, ?)",
            (server, at, json.dumps(doc)),
        )

    def last_calibration(self, server: str) -> dict[str, Any] | None:
        rows = self._rows(
            "SELECT doc FROM calibrations WHERE server = ? ORDER BY at DESC LIMIT 1", (server,)
        )
        doc: dict[str, Any] = _doc(rows[0][0], {}) if rows else {}
        return doc or None

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
        return [
            EventRecord(r["id"], r["server"], r["at"], r["kind"], r["message"], _doc(r["data"], {}))
            for r in rows
        ]

    # -- restarts and holds: what the budget is made of -------------------------------------

    def start_restart(self, server: str, at: float, trigger: str) -> Row:
        """Written before the manager acts, so a watchdog killed mid-restart still counts it."""
        return self._write(
            "INSERT INTO restarts (server, at, trigger) VALUES (?, ?, ?)", (server, at, trigger)
        )

    def finish_restart(self, restart: Ref, at: float, outcome: str) -> None:
        if restart is not None:
            self._write(
                "UPDATE restarts SET finished_at = ?, outcome = ? WHERE id = ?",
                (at, outcome, restart),
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
        return [
            Restart(r["id"], r["server"], r["at"], r["trigger"], r["finished_at"], r["outcome"])
            for r in rows
        ]

    def hold(self, server: str, at: float, reason: str) -> None:
        self._write("INSERT OR REPLACE INTO holds VALUES (?, ?, ?)", (server, at, reason))

    def release(self, server: str) -> None:
        self._write("DELETE FROM holds WHERE server = ?", (server,))

    def held(self, server: str) -> str | None:
        rows = self._rows("SELECT reason FROM holds WHERE server = ?", (server,))
        return str(rows[0][0]) if rows else None


def _probe(row: sqlite3.Row) -> ProbeRecord:
    return ProbeRecord(
        id=row["id"],
        server=row["server"],
        at=row["at"],
        state=row["state"],
        reason=row["reason"],
        ttft_s=row["ttft_s"],
        waited_s=row["waited_s"],
        evidence=_doc(row["evidence"], {}),
    )


def _doc(text: object, default: T) -> T:
    """A JSON column as written, or `default` when the row holds something else (edited by
    hand, or by another program): one bad row must not keep the daemon, `status` or `history`
    from working."""
    try:
        value = json.loads(text) if isinstance(text, (str, bytes)) else None
    except (ValueError, RecursionError):
        return default
    return value if isinstance(value, type(default)) else default


def _is_corrupt(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "not a database" in text or "malformed" in text or "corrupt" in text


def _incident(row: sqlite3.Row) -> Incident:
    return Incident(
        id=row["id"],
        server=row["server"],
        opened_at=row["opened_at"],
        began_at=row["began_at"] if row["began_at"] is not None else row["opened_at"],
        closed_at=row["closed_at"],
        state=row["state"],
        reason=row["reason"],
        evidence=_doc(row["evidence"], {}),
        actions=_doc(row["actions"], []),
        outage_s=row["outage_s"],
        recover_s=row["recover_s"],
        outcome=row["outcome"],
        advice=row["advice"],
    )


def open_history(state_dir: Path, *, create: bool = True) -> Store:
    """The history in `state_dir`. A reader (`create=False`) gets an empty in-memory store
    when there is none yet, instead of creating the file."""
    path = state_dir / HISTORY_FILE
    return Store(path if create or path.exists() else None)
