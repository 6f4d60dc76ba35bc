"""The budget and the open incident hold in memory whatever the history does: another process
holding the database's lock neither stalls a tick nor buys an extra restart, and loses no row;
a WAL file from before is switched to a rollback journal (no -shm to be truncated under us)."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mlx_watchdog.config import parse_config
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.record.store import Store
from tests.builders import BAD_VALUES, EDITED, QUICK_TOML, a_history, command_config
from tests.conftest import BadByPidfile, DaemonThread, mlx_watchdog, until

HOLD = 6.0  # seconds the other process keeps the database locked


def lock_history(db: Path, seconds: float) -> subprocess.Popen[str]:
    """Another process that takes the database's exclusive lock and keeps it for `seconds`."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sqlite3, sys, time\n"
            "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
            "db.execute('BEGIN EXCLUSIVE')\n"
            "print('locked', flush=True)\n"
            "time.sleep(float(sys.argv[2]))\n"
            "db.execute('COMMIT')\n",
            str(db),
            str(seconds),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "locked"
    proc.stdout.close()
    return proc


def test_a_locked_history_stalls_no_tick_buys_no_restart_and_loses_nothing(
    tmp_path: Path, hanging: BadByPidfile, run_daemon: Callable[[object], DaemonThread]
) -> None:
    raw = command_config(tmp_path, hanging)
    server = raw["server"][0]  # type: ignore[index]
    server["restart_command"][-2] = "hang"  # restarted, it hangs again: the budget decides
    server["probe"] = {**QUICK_TOML, "startup_grace": "1500ms"}
    server["restart"] = {"max_restarts": 1, "window": "1h", "backoff": "200ms"}
    daemon = Daemon(parse_config(raw)).open()
    w = daemon.cycles["bad"]
    ticks: list[tuple[float, float, bool]] = []  # began, ended, whether it restarted
    real_tick = daemon.tick

    def timed(name: str) -> object:
        began, before = time.monotonic(), len(w.tally.restarts_here)
        try:
            return real_tick(name)
        finally:
            ticks.append((began, time.monotonic(), len(w.tally.restarts_here) != before))

    daemon.tick = timed  # type: ignore[method-assign]
    asked: list[float] = []  # probe rows the ticks asked the history for
    real_record = daemon.store.record_probe

    def counted(*args: object, **kwargs: object) -> None:
        asked.append(time.monotonic())
        real_record(*args, **kwargs)  # type: ignore[arg-type]

    daemon.store.record_probe = counted  # type: ignore[method-assign]
    t = run_daemon(daemon)
    until(lambda: len(ticks) >= 2, 10, "the first ticks")
    locker = lock_history(tmp_path / "state" / "history.db", HOLD)
    locked_at = time.monotonic()
    try:
        until(lambda: w.needs_person is not None, 30, "the budget to be spent")
        spent_at = time.monotonic()
        time.sleep(1.0)  # more ticks while held: none may restart
    finally:
        locker.wait(30)
    assert spent_at - locked_at < HOLD, "the budget was spent only after the lock was gone"
    assert len(w.tally.restarts_here) == 1  # max_restarts = 1, whatever the history could take

    under_lock = [
        (end - began, restarted)
        for began, end, restarted in ticks
        if locked_at <= began < locked_at + HOLD
    ]
    plain = [took for took, restarted in under_lock if not restarted]
    assert len(under_lock) >= 5 and max(plain) < 1.0, plain

    store = daemon.store
    until(lambda: store.flush(0.1), 20, "the queued writes to land")
    t.stop()
    assert store.lost == 0
    again = Store(tmp_path / "state" / "history.db")
    try:
        assert [r.outcome for r in again.restarts("bad", 0.0)] == ["failed"]
        (incident,) = again.incidents(0.0)
        assert incident.closed_at is None and len(incident.actions) == 1
        kinds = [e.kind for e in again.events("bad")]
        for kind in ("detected", "restarting", "restart_failed", "budget_spent"):
            assert kinds.count(kind) == 1, kinds
        assert again.hold_reason("bad") is not None
        assert len(again.probes("bad", 0.0)) == len(asked)  # every verdict kept
        assert any(locked_at <= at < locked_at + HOLD for at in asked)
    finally:
        again.close()


def test_a_wal_history_from_before_becomes_a_rollback_journal(tmp_path: Path) -> None:
    path = tmp_path / "history.db"
    db = sqlite3.connect(path, isolation_level=None)
    assert db.execute("PRAGMA journal_mode=WAL").fetchone()[0] == "wal"
    db.execute("CREATE TABLE t (x)")
    db.close()
    store = Store(path, behind=True)
    store.add_event("s", 1.0, "detected", "x", {})
    store.close()
    db = sqlite3.connect(path)
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "delete"
    db.close()
    assert not path.with_name("history.db-shm").exists()
    again = Store(path)
    assert [e.kind for e in again.events("s")] == ["detected"]
    again.close()


def test_a_truncated_shm_file_beside_the_history_harms_nothing(
    tmp_path: Path, hanging: BadByPidfile, run_daemon: Callable[[object], DaemonThread]
) -> None:
    """WAL maps history.db-shm into memory, and a truncated one was SIGBUS (exit 135); the
    daemon no longer maps it, and a planted one is not read."""
    t = run_daemon(Daemon(parse_config(command_config(tmp_path, hanging))).open())
    db = tmp_path / "state" / "history.db"
    until(lambda: t.daemon.store.probes("bad", 0.0), 10, "a probe row")
    shm = db.with_name("history.db-shm")
    assert not shm.exists()
    shm.write_bytes(b"\xff" * 32768)
    shm.write_bytes(b"")
    rows = len(t.daemon.store.probes("bad", 0.0))
    until(lambda: len(t.daemon.store.probes("bad", 0.0)) > rows + 3, 10, "more probe rows")
    assert t.thread.is_alive()
    t.stop()


def test_a_daemon_starting_while_the_history_is_locked_waits_for_it(tmp_path: Path) -> None:
    """Falling back to memory would keep the whole run's history out of the file."""
    path = tmp_path / "history.db"
    Store(path).close()
    locker = lock_history(path, 2.0)
    try:
        store = Store(path, behind=True)
        store.add_event("s", 1.0, "detected", "x", {})
        assert store.problem is None  # the file, not memory
        store.close()
    finally:
        locker.wait(30)
    again = Store(path)
    assert [e.kind for e in again.events("s")] == ["detected"]
    again.close()


def test_text_where_the_history_holds_numbers_is_left_unread(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    """SQLite keeps what it is given: an edited history with text for a time to first token, a
    probe's time and a restart's cost stopped `run` from starting. Such rows are left unread;
    the daemon starts and judges, status answers, and the page says what it could not read."""
    import httpx

    ok = BadByPidfile(tmp_path, "ok")
    try:
        raw = command_config(tmp_path, ok)
        raw["watchdog"]["listen"] = "127.0.0.1:0"  # type: ignore[index]
        config = parse_config(raw)
        db = config.watchdog.state_dir / "history.db"
        Store(db).close()
        now = time.time()
        con = sqlite3.connect(db)
        with con:
            for at, ttft in ((now - 60, "fast"), ("yesterday", 0.2), (now - 30, 0.3)):
                con.execute(
                    "INSERT INTO probes (server, at, state, reason, ttft_s, waited_s, evidence)"
                    " VALUES ('bad', ?, 'healthy', 'r', ?, NULL, '{}')",
                    (at, ttft),
                )
            con.execute(
                "INSERT INTO restarts (server, at, trigger, outcome, served_s) "
                "VALUES ('bad', ?, 'wedged', 'recovered', 'soon')",
                (now - 600,),
            )
        con.close()
        t = run_daemon(Daemon(config).open())
        cycle = t.daemon.cycles["bad"]
        until(lambda: cycle.verdict is not None and cycle.verdict.state == "healthy", 20, "healthy")
        assert t.daemon.store.ttfts("bad", 0.0)[0] == (now - 30, 0.3)  # the readable one
        port = t.daemon.endpoint.server_address[1]  # type: ignore[union-attr]
        page = httpx.get(f"http://127.0.0.1:{port}/", timeout=20)
        assert page.status_code == 200 and "history unreadable" in page.text
        assert t.daemon.status().servers[0].state == "healthy"
    finally:
        ok.kill()


@pytest.mark.parametrize("table", sorted(EDITED))
def test_a_hand_edited_history_stops_no_reader(
    table: str, tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    """Every column of `table` holding text, bytes, a huge or negative number in one row each:
    the daemon starts, judges and answers every route; status, history, history --show and
    doctor answer without a traceback."""
    import httpx

    from mlx_watchdog.config import effective, to_toml

    ok = BadByPidfile(tmp_path, "ok")
    try:
        raw = command_config(tmp_path, ok)
        raw["watchdog"]["listen"] = "127.0.0.1:0"  # type: ignore[index]
        config = parse_config(raw)
        db = config.watchdog.state_dir / "history.db"
        db.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        a_history(db, "bad", time.time())
        con = sqlite3.connect(db)
        with con:
            ids = [r[0] for r in con.execute(f"SELECT rowid FROM {table} ORDER BY rowid")]
            n = 0
            for column in EDITED[table]:
                for value in BAD_VALUES:
                    row = ids[n % len(ids)]
                    n += 1
                    con.execute(f"UPDATE {table} SET {column} = ? WHERE rowid = ?", (value, row))
        con.close()
        cfg = tmp_path / "config.toml"
        cfg.write_text(to_toml(effective(config)))
        t = run_daemon(Daemon(config).open())
        cycle = t.daemon.cycles["bad"]
        until(lambda: cycle.verdict is not None and cycle.verdict.state == "healthy", 20, "healthy")
        port = t.daemon.endpoint.server_address[1]  # type: ignore[union-attr]
        for route in ("/healthz", "/healthz/bad", "/metrics", "/status", "/"):
            answer = httpx.get(f"http://127.0.0.1:{port}{route}", timeout=20)
            assert answer.status_code == 200, (route, answer.status_code, answer.text[:300])
        t.stop()
        for args in (
            ("status",),
            ("status", "--json"),
            ("history",),
            ("history", "--show", "1"),
            ("history", "--show", "2"),
            ("doctor",),
        ):
            done = mlx_watchdog(*args, "--config", str(cfg))
            assert "Traceback" not in done.stderr, (args, done.stderr[-2000:])
            assert done.returncode in (0, 1, 2, 3), (args, done.returncode, done.stderr[-500:])
    finally:
        ok.kill()
