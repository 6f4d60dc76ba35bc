"""The history database, including what happens when the file is corrupt, read-only or locked."""

from __future__ import annotations

import logging
import sqlite3
from pathlib import Path

import pytest

from mlx_watchdog.record.db import MIGRATIONS
from mlx_watchdog.record.store import Store
from tests.builders import toml
from tests.conftest import mlx_watchdog


def test_incident_lifecycle(tmp_path: Path) -> None:
    store = Store(tmp_path / "h.db")
    iid = store.open_incident("a", 100.0, "wedged", "wedged: x", {"abandoned_connections": 2})
    assert iid is not None
    store.add_action(iid, {"at": 101.0, "action": "restart", "outcome": "ok"})
    assert store.open_incident_for("a") is not None
    store.close_incident(iid, 160.0, "recovered", recover_s=12.5)
    assert store.open_incident_for("a") is None
    (inc,) = store.incidents(since=0.0)
    assert (inc.outage_s, inc.recover_s, inc.outcome) == (60.0, 12.5, "recovered")
    assert inc.evidence == {"abandoned_connections": 2} and inc.actions[0]["action"] == "restart"


def test_outage_counts_from_when_serving_stopped(tmp_path: Path) -> None:
    store = Store(tmp_path / "h.db")
    iid = store.open_incident("a", 100.0, "wedged", "wedged: x", {}, began_at=40.0)
    assert iid is not None
    store.close_incident(iid, 160.0, "restarted", recover_s=5.0)
    (inc,) = store.incidents(since=0.0)
    assert (inc.opened_at, inc.began_at, inc.outage_s) == (100.0, 40.0, 120.0)


def test_a_first_version_database_is_migrated_and_keeps_its_incidents(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("CREATE TABLE migrations (name TEXT PRIMARY KEY, applied_at REAL)")
    db.executescript(MIGRATIONS[0][1])
    db.execute("INSERT INTO migrations VALUES (?, 0)", (MIGRATIONS[0][0],))
    db.execute(
        "INSERT INTO incidents (server, opened_at, state, reason, evidence)"
        " VALUES ('a', 50.0, 'dead', 'dead: x', '{}')"
    )
    db.close()
    store = Store(path)
    old = store.open_incident_for("a")
    assert old is not None and old.began_at == 50.0
    store.close_incident(old.id, 80.0, "restarted", recover_s=2.0)
    assert store.incidents(0.0)[0].outage_s == 30.0


def test_history_survives_reopening(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    store = Store(path)
    rid = store.start_restart("a", 10.0, "wedged")
    store.hold("a", 11.0, "budget spent")
    store.close()
    again = Store(path)
    assert [r.id for r in again.restarts("a", 0.0)] == [rid.id]
    assert again.hold_reason("a") == "budget spent"
    assert [r.outcome for r in again.interrupt_unfinished("a", 20.0)] == [None]
    assert again.restarts("a", 0.0)[0].outcome == "interrupted"
    assert again.interrupt_unfinished("a", 21.0) == []


def test_schema_is_versioned_and_migrations_recorded(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    Store(path).close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA user_version").fetchone()[0] == len(MIGRATIONS)
    assert [r[0] for r in db.execute("SELECT name FROM migrations")] == [m[0] for m in MIGRATIONS]
    # A rollback journal: no -shm file mapped into memory (a truncated one is SIGBUS).
    assert db.execute("PRAGMA journal_mode").fetchone()[0] != "wal"
    assert not path.with_name("h.db-shm").exists()
    db.close()


def test_corrupt_file_is_moved_aside(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "h.db"
    path.write_bytes(b"this is not sqlite at all" * 100)
    with caplog.at_level(logging.ERROR):
        store = Store(path, wall=lambda: 1234.0)
    aside = tmp_path / "h.db.corrupt-1234"
    assert aside.read_bytes().startswith(b"this is not sqlite")
    assert store.problem and "corrupt" in store.problem and "moved it to" in caplog.text
    store.add_event("a", 1.0, "detected", "m", {})
    assert len(store.events()) == 1


def test_a_corrupt_historys_journal_goes_aside_with_it(tmp_path: Path) -> None:
    """A hot journal left beside a fresh database would be rolled into it (SQLite replays a
    journal it finds valid on the next open; it deletes one it does not)."""
    path = tmp_path / "h.db"
    store = Store(path, wall=lambda: 77.0)
    store.close()
    (tmp_path / "h.db-journal").write_bytes(b"the journal of a transaction cut short")
    store.db._move_aside(sqlite3.DatabaseError("database disk image is malformed"))
    assert not (tmp_path / "h.db-journal").exists()
    moved = tmp_path / "h.db.corrupt-77-journal"
    assert moved.read_bytes() == b"the journal of a transaction cut short"


def test_file_found_corrupt_while_running_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    store = Store(path, wall=lambda: 99.0)
    store.close()
    path.write_bytes(b"garbage" * 1000)
    for suffix in ("-wal", "-shm"):
        Path(str(path) + suffix).unlink(missing_ok=True)
    store.db._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
    store.db.closed = False
    store.start_restart("a", 3.0, "wedged")  # fails on the garbage, moves it aside, retries
    assert store.problem is not None and "corrupt" in store.problem
    assert (tmp_path / "h.db.corrupt-99").exists()
    assert len(store.restarts("a", 0.0)) == 1


def test_unwritable_folder_falls_back_to_memory(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    store = Store(blocker / "sub" / "h.db")  # a folder cannot be made under a file
    assert store.problem and "in memory" in store.problem
    store.start_restart("a", 1.0, "wedged")
    assert len(store.restarts("a", 0.0)) == 1


def test_locked_database_skips_the_write(tmp_path: Path) -> None:
    path = tmp_path / "h.db"
    store = Store(path)
    other = sqlite3.connect(path, timeout=0, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")
    try:
        store.add_event("a", 1.0, "detected", "m", {})  # must not raise
        assert store.problem and "locked" in store.problem
    finally:
        other.execute("ROLLBACK")
        other.close()
    store.add_event("a", 2.0, "detected", "m", {})
    assert [e.at for e in store.events()] == [2.0]


def test_probe_retention_is_bounded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx_watchdog.record.store as mod

    monkeypatch.setattr(mod, "PROBES_KEPT", 100)
    store = Store(tmp_path / "h.db")
    for i in range(1000):
        store.record_probe("a", float(i), "healthy", "ok", {"ttft_s": 0.04})
    kept = store.probes("a", 0.0)
    assert 100 <= len(kept) <= 600 and kept[-1].at == 999.0


def test_retention_holds_across_many_short_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import mlx_watchdog.record.store as mod

    monkeypatch.setattr(mod, "PROBES_KEPT", 100)
    for run in range(40):  # 40 processes of 49 probes each: none reaches PRUNE_EVERY alone
        store = Store(tmp_path / "h.db")
        for i in range(49):
            store.record_probe("a", float(run * 49 + i), "healthy", "ok", {})
        store.close()
    store = Store(tmp_path / "h.db")
    kept = store.probes("a", 0.0)
    store.close()
    assert len(kept) <= 100 + 49 and kept[-1].at == 40 * 49 - 1


def test_a_row_edited_into_nonsense_neither_stops_the_daemon_nor_the_commands(
    tmp_path: Path,
) -> None:
    """`actions = 'nope'` in one incident row, garbage in an event's and a probe's JSON: the
    daemon starts with that history, `status` and `history` print, the row reads as empty."""
    import json as _json

    from mlx_watchdog.config import parse_config
    from mlx_watchdog.daemon import Daemon

    state = tmp_path / "state"
    store = Store(state / "history.db")
    iid = store.open_incident("s", 100.0, "wedged", "wedged: x", {"pid": 1})
    store.add_event("s", 100.0, "detected", "x", {"n": 1})
    store.record_probe("s", 100.0, "wedged", "wedged: x", {"pid": 1})
    store.close()
    with sqlite3.connect(state / "history.db") as db:
        db.execute(
            "UPDATE incidents SET actions = 'nope', evidence = '[[[' WHERE id = ?", (iid.id,)
        )
        db.execute("UPDATE events SET data = '{\"a\":' ")
        db.execute("UPDATE probes SET evidence = 'NaN-ish'")
    raw = {
        "watchdog": {"state_dir": str(state), "listen": "off"},
        "server": [{"name": "s", "url": "http://127.0.0.1:1"}],
    }
    daemon = Daemon(parse_config(raw)).open()  # reads the open incident, events and probes back
    assert daemon.cycles["s"].incident is not None
    daemon.close()
    cfg = tmp_path / "w.toml"
    cfg.write_text(toml(raw))
    for args in (["status", "--json"], ["history", "--json"], ["history"], ["status"]):
        run = mlx_watchdog(*args, "--config", str(cfg))
        assert "Traceback" not in run.stderr, (args, run.stderr)
        assert run.returncode in (0, 3), (args, run.stderr)
    (incident,) = _json.loads(mlx_watchdog("history", "--json", "--config", str(cfg)).stdout)
    assert incident["actions"] == [] and incident["evidence"] == {}


def test_gave_up_counts_edited_by_hand_do_not_stop_the_numbers(tmp_path: Path) -> None:
    """The day's numbers are read from the history at start and by `status`: a count that is
    not one (text, a float, negative, a bool) counts 0 instead of raising."""
    from mlx_watchdog.config import ServerConfig
    from mlx_watchdog.record.tally import Tally

    store = Store(tmp_path / "h.db")
    for count in ("many", 2.5, -3, True, None, 4):
        store.add_event("s", 100.0, "gave_up", "clients left", {"count": count})
    server = ServerConfig(name="s", url="http://127.0.0.1:1")
    tally = Tally.load(store, server, 200.0)
    held = tally.figures(server, 200.0, 200.0, incident=None, needs_person=None)
    assert held.gave_up_24h == 4
    store.close()


def test_serving_time_counts_probed_seconds_by_the_earlier_state_and_skips_gaps(
    tmp_path: Path,
) -> None:
    """The page's 30-day uptime: the time from one probe to the next counts as the earlier
    probe's state; a gap of more than three intervals (the watchdog away) counts for nothing;
    rows are per UTC day and survive the process."""
    from mlx_watchdog.record.serving import DAY_S

    path = tmp_path / "history.db"
    store = Store(path)
    day0 = 20_000 * DAY_S
    at = day0 + 100.0
    for state in ["healthy"] * 10 + ["wedged"] * 5 + ["healthy"] * 5:  # 19 gaps of 1 s
        store.record_probe("a", at, state, "r", {}, step=1.0)
        at += 1.0
    at += 60.0  # the watchdog away: not counted
    for _ in range(3):
        store.record_probe("a", at, "busy", "r", {}, step=1.0)
        at += 1.0
    store.record_probe("a", day0 + DAY_S + 5, "healthy", "r", {}, step=1.0)  # the next day
    store.record_probe("b", at, "healthy", "r", {})  # no step (a `probe` command): not counted
    assert store.serving("a", day0) == (21.0, 16.0)  # 19 + 2 probed; 9 + 5 + 2 serving
    store.close()
    again = Store(path)
    assert again.serving("a", day0) == (21.0, 16.0)
    assert again.serving("a", day0 + DAY_S) == (0.0, 0.0)  # from the next day on
    assert again.serving("b", day0) == (0.0, 0.0)
    con = sqlite3.connect(path)
    assert con.execute("SELECT day, probed_s, serving_s FROM serving").fetchall() == [
        (20_000, 21.0, 16.0)
    ]
    con.close()
    again.close()


def test_serving_time_is_written_about_once_a_minute_and_read_with_what_is_not_yet(
    tmp_path: Path,
) -> None:
    from mlx_watchdog.record.serving import DAY_S, WRITE_EVERY

    path = tmp_path / "history.db"
    store = Store(path)
    start = 20_000 * DAY_S + 10.0
    n = int(WRITE_EVERY) + 31
    for k in range(n):
        store.record_probe("a", start + k, "healthy", "r", {}, step=1.0)
    con = sqlite3.connect(path)
    written = con.execute("SELECT probed_s FROM serving").fetchall()
    con.close()
    assert written == [(WRITE_EVERY,)]  # one row written; the rest still in memory
    assert store.serving("a", start) == (n - 1.0, n - 1.0)  # both, read together
    store.close()
