"""The history's SQLite file, guarded: it must never stop the probing.

A corrupt file is moved aside and a new one started, an unwritable one is replaced by an
in-memory database for the life of the process, and either is reported. The file uses a
rollback journal, not WAL: WAL maps its `-shm` file into memory, and a truncated `-shm` kills
the process with SIGBUS.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypeVar

from mlx_watchdog.record.private import UnsafeState, create_private

log = logging.getLogger("mlx_watchdog.store")

T = TypeVar("T")

BUSY_TIMEOUT = 2.0  # seconds a write waits for another process's lock before it is skipped
BEHIND_BUSY = 0.1  # writing behind: one attempt's wait, so a reader never waits long for it
RETRY_LOCKED = 0.5  # between two attempts of a write another process's lock keeps out
OPEN_WAIT = 10.0  # the daemon's wait at start for another process's lock

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
    # From a restart's start to the first token after it: what a restart costs this server.
    ("0004_restart_served_s", "ALTER TABLE restarts ADD COLUMN served_s REAL"),
    # The server's last words before a restart: stacks, log tail, sockets (sense/dump.py).
    (
        "0005_dumps",
        """
        CREATE TABLE dumps (
            id INTEGER PRIMARY KEY, server TEXT NOT NULL, incident INTEGER, at REAL NOT NULL,
            doc TEXT NOT NULL);
        CREATE INDEX dumps_incident ON dumps (incident);
        """,
    ),
    # Seconds probed and seconds serving, per server and UTC day (record/serving.py).
    (
        "0006_serving_days",
        """
        CREATE TABLE serving (
            server TEXT NOT NULL, day INTEGER NOT NULL, probed_s REAL NOT NULL,
            serving_s REAL NOT NULL, PRIMARY KEY (server, day));
        """,
    ),
]


class Later(Exception):
    """Another process holds the database's lock, or the disk is full: try again later."""


class Database:
    """The guarded SQLite file of the history: private, migrated, moved aside when corrupt,
    in memory when it cannot be used."""

    def __init__(
        self, path: Path | None, *, wall: Callable[[], float] = time.time, behind: bool = False
    ) -> None:
        self.path = path
        self.wall = wall
        self.problem: str | None = None  # the last trouble, for status output
        self.closed = False
        self._lock = threading.RLock()
        self._behind = behind
        self._busy = BEHIND_BUSY if behind else BUSY_TIMEOUT
        self._db = self._open()

    def _open(self) -> sqlite3.Connection:
        if self.path is None:
            return self._connect(":memory:")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            # Created 0600 before SQLite opens it: its -journal takes the same mode.
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
        aside = self.path.with_name(f"{self.path.name}.corrupt-{int(self.wall())}")
        # Its rollback journal goes with it: a hot journal left behind would be rolled into the
        # fresh database. (-wal/-shm: a history from before the journal was a rollback one.)
        for suffix in ("", "-journal", "-wal", "-shm"):
            part = Path(str(self.path) + suffix)
            if part.exists():
                part.replace(Path(str(aside) + suffix))
        self.report(f"history database {self.path} is corrupt ({exc}); moved it to {aside}")

    def _fall_back(self, exc: BaseException) -> sqlite3.Connection:
        self.report(
            f"history database {self.path} cannot be used ({exc}); keeping history in memory "
            "until the watchdog restarts"
        )
        return self._connect(":memory:")

    def report(self, message: str) -> None:
        self.problem = message
        log.error(message)

    def guard(
        self, default: T, work: Callable[[sqlite3.Connection], T], *, wait: bool = False
    ) -> T:
        """`work` on the database, through its faults; `wait`: raise _Later on another
        process's lock or a full disk instead of giving up (the writer thread tries again)."""
        with self._lock:
            if self.closed:  # a job still finishing after shutdown: nothing to write to
                return default
            for attempt in (1, 2):
                try:
                    return work(self._db)
                except sqlite3.OperationalError as exc:
                    text = str(exc).lower()
                    if wait and ("locked" in text or "busy" in text or "full" in text):
                        raise Later(str(exc)) from None
                    if "locked" in text or "busy" in text:
                        self.report(f"history database is locked; skipped ({exc})")
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
    def tx(self, db: sqlite3.Connection) -> Iterator[sqlite3.Connection]:
        """A transaction; within one already open (a batch of writes), a part of it."""
        if db.in_transaction:
            yield db
            return
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

    def rows(self, sql: str, args: Sequence[Any] = ()) -> list[sqlite3.Row]:
        empty: list[sqlite3.Row] = []
        return self.guard(empty, lambda db: db.execute(sql, args).fetchall())

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._db.close()


def _is_corrupt(exc: BaseException) -> bool:
    text = str(exc).lower()
    return "not a database" in text or "malformed" in text or "corrupt" in text
