"""Triggers, clocks, crashes, a locked history and retention: every path to a restart is tried
wrongly here (a sleep, a clock step, a lost database), and the right ones are timed."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from mlx_watchdog.config import ProbeSettings, parse_config
from mlx_watchdog.cycle import NoSink
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.judge import triggers
from mlx_watchdog.judge.triggers import Streak, Trigger
from mlx_watchdog.record import db as db_module
from mlx_watchdog.record import store as store_module
from mlx_watchdog.record.store import Store
from tests.builders import badserver_argv, command_config, watchdog_config
from tests.conftest import BadByPidfile, DaemonThread, Running, free_port, until

SETTINGS = ProbeSettings(startup_grace=60.0)


# -- triggers.step: pure --------------------------------------------------------------------


def test_wedged_triggers_at_once_and_ends_every_streak() -> None:
    streak, trigger = triggers.step(Streak(dead=1, down_since=5.0), "wedged", 10.0, SETTINGS)
    assert (streak, trigger) == (Streak(), Trigger.WEDGED)


def test_dead_triggers_on_the_second_verdict_in_a_row() -> None:
    streak, first = triggers.step(Streak(), "dead", 0.0, SETTINGS)
    assert first is None and streak.dead == 1
    _, second = triggers.step(streak, "dead", 1.0, SETTINGS)
    assert second is Trigger.DEAD
    # A verdict in between ends the streak.
    streak, _ = triggers.step(Streak(dead=1), "busy", 1.0, SETTINGS)
    assert triggers.step(streak, "dead", 2.0, SETTINGS)[1] is None


def test_down_waits_for_startup_grace_unless_the_owned_process_exited() -> None:
    streak, trigger = triggers.step(Streak(), "down", 100.0, SETTINGS)
    assert trigger is None and streak.down_since == 100.0
    assert triggers.step(streak, "down", 159.0, SETTINGS)[1] is None
    assert triggers.step(streak, "down", 160.0, SETTINGS)[1] is Trigger.DOWN
    assert triggers.step(Streak(), "down", 100.0, SETTINGS, exited=True)[1] is Trigger.CRASHED


@pytest.mark.parametrize("state", ["starting", "busy", "slow", "healthy"])
def test_other_states_trigger_nothing(state: str) -> None:
    streak, trigger = triggers.step(Streak(dead=1, down_since=1.0), state, 500.0, SETTINGS)  # type: ignore[arg-type]
    assert (streak, trigger) == (Streak(), None)


# -- a sleep or a clock jump is judged afresh ------------------------------------------------


class Kinds(NoSink):
    """Counts the events the cycles fire, in order."""

    def __init__(self, kinds: list[str]) -> None:
        self.kinds = kinds

    def event(self, server: str, kind: str, data: dict[str, object]) -> None:
        self.kinds.append(kind)


class Clocks:
    def __init__(self) -> None:
        self.wall = 1_800_000_000.0
        self.mono = 1000.0

    def advance(self, wall: float, mono: float) -> None:
        self.wall += wall
        self.mono += mono


@pytest.mark.parametrize(
    ("wall", "mono", "wedged"),
    [
        (11.0, 11.0, True),  # the control: a real 11 s wait with nobody served is a wedge
        (3 * 3600.0, 2.0, False),  # a Mac that slept 3 h: the wall clock jumps
        (-3600.0, 11.0, False),  # the clock is stepped back an hour
        (3 * 3600.0, 3 * 3600.0, False),  # a watchdog suspended 3 h: far longer than the interval
    ],
)
def test_a_sleep_or_clock_jump_is_not_a_wedge(
    tmp_path: Path,
    hanging: BadByPidfile,
    wall: float,
    mono: float,
    wedged: bool,
    caplog: pytest.LogCaptureFixture,
) -> None:
    raw = command_config(tmp_path, hanging)
    server = raw["server"][0]  # type: ignore[index]
    server["manager"] = "none"
    server["probe"] = {"slow_after": "1s", "wedge_after": "10s"}
    raw["watchdog"]["interval"] = "5s"  # type: ignore[index]
    clocks = Clocks()
    daemon = Daemon(parse_config(raw), wall=lambda: clocks.wall, mono=lambda: clocks.mono).open()
    try:
        assert daemon.tick("bad") is None  # the probe is out, too early to tell
        until(lambda: daemon.cycles["bad"].checker.inspector.sample().live == 1, 5, "the probe")
        clocks.advance(wall, mono)
        verdict = daemon.tick("bad")
        assert (verdict is not None and verdict.state == "wedged") is wedged
        assert ("judging afresh" in caplog.text) is not wedged
        if not wedged:
            # Judged afresh: the wait counts from the jump, so a wedge still shows after it.
            clocks.advance(11.0, 11.0)
            verdict = daemon.tick("bad")
            assert verdict is not None and verdict.state == "wedged"
            assert verdict.evidence.waited_s == pytest.approx(11.0)
    finally:
        daemon.cycles["bad"].checker.abort()
        daemon.close()


def test_an_outage_across_a_clock_stepped_back_is_measured_on_the_span_clock(
    tmp_path: Path, bad_server: Callable[..., Running]
) -> None:
    """Issue 54: a wall clock stepped back an hour during an incident recorded an outage of
    -3561 s. The outage is the span from when serving stopped to the first token."""
    hang = tmp_path / "hang"
    hang.touch()
    srv = bad_server("hang_later", extra=("--hang-file", str(hang)))
    server = {
        "name": "bad",
        "url": srv.url,
        "manager": "none",
        "probe": {"slow_after": "1s", "wedge_after": "10s"},
    }
    raw = watchdog_config(tmp_path / "state", [server], interval="5s")
    clocks = Clocks()
    daemon = Daemon(parse_config(raw), wall=lambda: clocks.wall, mono=lambda: clocks.mono).open()
    c = daemon.cycles["bad"]
    try:
        assert daemon.tick("bad") is None
        until(lambda: c.checker.inspector.sample().live == 1, 5, "the probe")
        clocks.advance(11.0, 11.0)
        v = daemon.tick("bad")
        assert v is not None and v.state == "wedged" and c.incident is not None
        clocks.advance(-3600.0, 5.0)  # stepped back an hour, 5 s later
        hang.unlink()
        c.checker.abort()  # the hung probe's request is held forever: the next one is served
        until(lambda: (daemon.tick("bad") or v).state == "healthy", 10, "served again")
        (incident,) = daemon.store.incidents(0.0)
        assert incident.outage_s is not None and 16.0 <= incident.outage_s < 30.0
    finally:
        c.checker.abort()
        daemon.close()


# -- an owned server that crashes is respawned at once ---------------------------------------


def test_a_crashed_child_is_respawned_without_waiting_for_startup_grace(
    tmp_path: Path,
    hook: tuple[list[str], Path],
    run_daemon: Callable[[object], DaemonThread],
) -> None:
    argv, hook_out = hook
    port = free_port()
    badserver = badserver_argv(port, "ok")
    config = parse_config(
        {
            "watchdog": {
                "interval": "300ms",
                "listen": "127.0.0.1:0",
                "state_dir": str(tmp_path / "state"),
                "on_event": argv,
            },
            "server": [
                {
                    "name": "owned",
                    "url": f"http://127.0.0.1:{port}",
                    "manager": "process",
                    "match": "badserver",
                    "command": badserver,
                    "probe": {"slow_after": "1s", "wedge_after": "5s", "startup_grace": "10m"},
                    "restart": {"max_restarts": 3, "backoff": "30s"},
                }
            ],
        }
    )
    t = run_daemon(Daemon(config).open())
    w = t.daemon.cycles["owned"]
    until(lambda: w.verdict is not None and w.verdict.state == "healthy", 30, "healthy")
    first = w.manager.pid()
    assert first is not None
    os.kill(first, signal.SIGKILL)
    # startup_grace is 10 minutes: only the crash path can bring it back within this bound.
    until(
        lambda: w.manager.pid() not in (None, first) and w.verdict and w.verdict.state == "healthy",
        20,
        "the server respawned and serving",
    )
    restarts = t.daemon.store.restarts("owned", 0.0)
    assert [(r.trigger, r.outcome) for r in restarts] == [("crashed", "recovered")]
    t.daemon.alerter.flush()
    events = [json.loads(line) for line in hook_out.read_text().splitlines()]
    restarting = [e for e in events if e["kind"] == "restarting"]
    assert len(restarting) == 1 and "was killed by SIGKILL" in restarting[0]["message"]
    assert [e["kind"] for e in events][-1] == "recovered"


# -- a locked history: one detected, one recovered -------------------------------------------


def test_a_locked_history_during_a_wedge_announces_it_once_and_closes_it(
    tmp_path: Path,
    hanging: BadByPidfile,
    run_daemon: Callable[[object], DaemonThread],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(db_module, "BUSY_TIMEOUT", 0.05)
    kinds: list[str] = []
    daemon = Daemon(parse_config(command_config(tmp_path, hanging))).open()
    daemon.crew.sink = Kinds(kinds)
    other = sqlite3.connect(str(tmp_path / "state" / "history.db"), isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another process holds the history for the whole wedge
    try:
        run_daemon(daemon)
        until(lambda: "recovered" in kinds, 30, "the wedge healed")
        time.sleep(1.0)  # a few more ticks: nothing is announced again
        assert kinds.count("detected") == 1 and kinds.count("recovered") == 1, kinds
        assert daemon.store.problem is not None and "locked" in daemon.store.problem
        assert daemon.status().watchdog.history_problem == daemon.store.problem
        assert b"mlx_watchdog_history_in_memory 1.0" in daemon.prometheus()[0]
    finally:
        other.execute("ROLLBACK")
        other.close()
        hanging.kill()


# -- retention is per server -----------------------------------------------------------------


def test_each_server_keeps_its_own_bounded_history(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "PROBES_KEPT", 100)
    monkeypatch.setattr(store_module, "PRUNE_EVERY", 50)
    store = Store(tmp_path / "history.db")
    for i in range(600):
        for server in ("a", "b"):
            store.record_probe(server, float(i), "healthy", "ok", {"ttft_s": 0.01})
    counts = {s: len(store.probes(s, 0.0)) for s in ("a", "b")}
    store.close()
    assert all(100 <= n <= 150 for n in counts.values()), counts


def test_the_owned_child_that_exits_is_named_by_how_it_ended(tmp_path: Path) -> None:
    from mlx_watchdog.act.managers import System
    from mlx_watchdog.act.managers.process import ProcessManager

    config = parse_config(
        {
            "server": [
                {
                    "url": f"http://127.0.0.1:{free_port()}",
                    "manager": "process",
                    "command": [sys.executable, "-c", "import time; time.sleep(60)"],
                }
            ]
        }
    )
    manager = ProcessManager(config.servers[0], System(), tmp_path / "record.json")
    manager.start()
    pid = manager.pid()
    assert pid is not None and manager.exited() is None
    os.kill(pid, signal.SIGKILL)
    until(lambda: manager.exited() is not None, 10, "the exit to be seen")
    assert manager.exited() == "was killed by SIGKILL" and manager.pid() is None
    manager.stop()  # reaps it; an exit the watchdog caused itself is not a crash
    assert manager.exited() is None and not psutil.pid_exists(pid)


# -- the incident phases: every move is in the table, nothing else moves ---------------------


def test_every_phase_is_reachable_and_left_and_illegal_moves_are_refused(tmp_path: Path) -> None:
    from mlx_watchdog.cycle import TRANSITIONS, Phase

    assert {a for a, _ in TRANSITIONS} == set(Phase) == {b for _, b in TRANSITIONS}
    assert (Phase.NORMAL, Phase.HELD) not in TRANSITIONS  # a hold follows a failing incident
    assert (Phase.HELD, Phase.FAILING) not in TRANSITIONS  # only a token or a person ends it
    daemon = Daemon(parse_config({"watchdog": {"state_dir": str(tmp_path)}})).open()
    try:
        w = next(iter(daemon.cycles.values()))
        with pytest.raises(AssertionError, match="no budget_spent move normal -> held"):
            w.transition(Phase.HELD, "budget_spent", "spent")
        assert w.phase is Phase.NORMAL and daemon.store.events() == []
        w.transition(Phase.RESTARTING, "restarting", "a person asked")
        assert w.restarting and [e.kind for e in daemon.store.events()] == ["restarting"]
    finally:
        daemon.close()


def test_a_hold_without_an_open_incident_opens_one_and_stays_held(tmp_path: Path) -> None:
    """A history with a hold and no incident open (a person's restart that did not cure, a
    history written in part): the server found down opens its incident, still held; the tick
    raised at each probe before and no incident was ever opened."""
    from mlx_watchdog.cycle import Phase

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    store = Store(state / "history.db")
    store.hold("s", time.time() - 60, "3 restarts did not help")
    store.close()
    raw = {
        "watchdog": {"state_dir": str(state)},
        "server": [{"name": "s", "url": f"http://127.0.0.1:{free_port()}"}],
    }
    daemon = Daemon(parse_config(raw)).open()
    try:
        w = daemon.cycles["s"]
        assert w.phase is Phase.HELD and w.incident is None
        v = daemon.tick("s")
        assert v is not None and v.state == "down"
        assert w.phase is Phase.HELD and w.incident is not None and w.needs_person
        daemon.store.flush(5.0)
        assert [e.kind for e in daemon.store.events("s")] == ["detected"]
    finally:
        daemon.close()


def test_with_manager_none_every_way_out_says_nobody_restarts_it(tmp_path: Path) -> None:
    """manager = "none": a person's restart is refused at once (it waited 264 s, then said
    "had not ended"), and the failure's event (its alert), status and the page say that
    nobody restarts the server and what to do."""
    from mlx_watchdog.cycle import Conflict
    from mlx_watchdog.serve.notes import notes

    port = free_port()
    raw = {
        "watchdog": {"state_dir": str(tmp_path / "state")},
        "server": [{"name": "s", "url": f"http://127.0.0.1:{port}", "manager": "none"}],
    }
    with Daemon(parse_config(raw)) as daemon:
        with pytest.raises(Conflict, match='manager = "none": the watchdog only watches s'):
            daemon.act("s", "restart")
        assert daemon.cycles["s"].asks.queued == deque()
        v = daemon.tick("s")
        assert v is not None and v.state == "down"
        daemon.store.flush(5.0)
        (detected,) = daemon.store.events("s")
        assert "nobody will restart it; restart it yourself" in detected.message
        (shown,) = daemon.status().servers
        said = [n for n in notes(shown) if n.label == "Nobody restarts it"]
        assert len(said) == 1 and "set `manager` in the config" in said[0].text


def test_history_lists_the_newest_first_and_the_last_n(tmp_path: Path) -> None:
    from tests.builders import a_history
    from tests.conftest import mlx_watchdog

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    a_history(state / "history.db", "s", time.time())  # five incidents, #1 the oldest
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[watchdog]\nstate_dir = "{state}"\n\n[[server]]\nname = "s"\nurl = "http://127.0.0.1:9"\n'
    )
    shown = mlx_watchdog("history", "--config", str(cfg))
    rows = [line.split()[0] for line in shown.stdout.splitlines() if line.split()[:1] != ["#"]]
    assert rows[:5] == ["5", "4", "3", "2", "1"], shown.stdout
    last = mlx_watchdog("history", "--last", "2", "--config", str(cfg))
    assert [line.split()[0] for line in last.stdout.splitlines()[1:3]] == ["5", "4"], last.stdout
    assert "#3" not in last.stdout
    as_json = mlx_watchdog("history", "--last", "2", "--json", "--config", str(cfg))
    assert [i["id"] for i in json.loads(as_json.stdout)] == [4, 5]
