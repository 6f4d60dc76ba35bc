"""Memory pressure's cure: stop the server, wait for its memory to come back, then start it;
and say which servers hold the machine's memory together."""

from __future__ import annotations

import os
import plistlib
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from mlx_watchdog.act.ladder import Ladder
from mlx_watchdog.act.managers import Outcome, System
from mlx_watchdog.act.managers.command import CommandManager
from mlx_watchdog.act.managers.launchd import LaunchdManager
from mlx_watchdog.act.managers.process import ProcessManager
from mlx_watchdog.act.managers.systemd import SystemdManager
from mlx_watchdog.config import ServerConfig, parse_config
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.sense.memory import Settle, memory_holders
from mlx_watchdog.sense.signs import Machine
from tests.builders import badserver_argv, watchdog_config
from tests.conftest import DaemonThread, FakeServices, free_port, until

GIB = 1 << 30
LABEL = "com.example.mlx-server"


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


def test_the_start_waits_until_the_stopped_servers_memory_is_back() -> None:
    clock = Clock()
    readings = iter([2 * GIB, 2 * GIB, 3 * GIB, 9 * GIB])
    settle = Settle(
        8 * GIB,
        read=lambda: Machine(16 * GIB, next(readings), 0, 0),
        sleep=clock.sleep,
        mono=clock,
    )
    said = settle()
    assert said == "memory back after 1.0 s: 9.0 GiB available (+7.0 GiB)"
    assert clock.now == 1.0


def test_memory_that_never_comes_back_is_said_and_the_start_goes_ahead() -> None:
    clock = Clock()
    settle = Settle(
        8 * GIB,
        read=lambda: Machine(16 * GIB, 2 * GIB, 0, 0),
        sleep=clock.sleep,
        mono=clock,
        limit=5.0,
    )
    said = settle()
    assert said.startswith("memory not back after 5 s: 2.0 GiB available")
    assert "of the 8.0 GiB the server held); started anyway" in said
    assert 5.0 <= clock.now <= 5.5


def test_memory_that_cannot_be_read_is_not_waited_for() -> None:
    clock = Clock()
    settle = Settle(GIB, read=lambda: None, sleep=clock.sleep, mono=clock)
    assert settle() == "memory could not be read: started without waiting for it"
    assert clock.now == 0.0


def test_a_reading_that_fails_after_the_stop_is_said_not_the_last_good_one() -> None:
    """The reading before the stop worked, the ones after fail: no stale figure is given as
    now, and no 30 s are spent waiting on readings that do not come."""
    clock = Clock()
    readings = iter([Machine(16 * GIB, GIB, 0, 0)])
    settle = Settle(8 * GIB, read=lambda: next(readings, None), sleep=clock.sleep, mono=clock)
    said = settle()
    assert said == "memory could not be read after the stop (0.0 s): started without waiting for it"
    assert clock.now == 0.0


def test_a_watchdog_that_stops_ends_the_wait_for_memory_at_once() -> None:
    clock = Clock()
    settle = Settle(
        8 * GIB,
        read=lambda: Machine(16 * GIB, 2 * GIB, 0, 0),
        sleep=clock.sleep,
        mono=clock,
        stopping=lambda: True,
    )
    assert settle() == "the watchdog is stopping: started after 0.0 s, 2.0 GiB available"
    assert clock.now == 0.0


def test_the_servers_holding_the_memory_are_named_largest_first() -> None:
    said = memory_holders([("small", 3 * GIB), ("gone", 0), ("big", 10 * GIB)], 16 * GIB)
    assert said.startswith("resident in servers: 13.0 GiB of the machine's 16.0 GiB (big 10.0")
    assert "small 3.0 GiB" in said and "gone" not in said
    assert "together more than the machine can give them" in said
    alone = memory_holders([("big", 14 * GIB)], 16 * GIB)
    assert "together" not in alone  # one server: nothing to share
    assert memory_holders([("a", 0)], 16 * GIB) == ""


def server(port: int, **kw: object) -> ServerConfig:
    return ServerConfig(name="s", url=f"http://127.0.0.1:{port}", match="badserver", **kw)  # type: ignore[arg-type]


def alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def listening(port: int) -> bool:
    return any(
        c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN
        for c in psutil.net_connections("tcp")
    )


def between_checks(port: int, old: int) -> tuple[Callable[[], str], list[str]]:
    """A `between` that records what it saw: the old process gone, nothing on the port yet."""
    seen: list[str] = []

    def between() -> str:
        seen.append(f"old alive: {alive(old)}")
        seen.append(f"listening: {listening(port)}")
        return "settled"

    return between, seen


def test_the_process_manager_stops_waits_and_starts(tmp_path: Path) -> None:
    port = free_port()
    cfg = server(port, manager="process", command=badserver_argv(port))
    m = ProcessManager(cfg, System(), tmp_path / "process-s.json")
    m.start()
    try:
        old = until(lambda: m.pid() if listening(port) else None, 10, "the server to listen")
        between, seen = between_checks(port, old)
        outcome = m.stop_then_start(between)
        assert outcome.ok, outcome.detail
        assert seen == ["old alive: False", "listening: False"]
        assert outcome.steps == (f"stopped PID {old}", "settled", f"started PID {m.pid()}")
        assert m.pid() not in (None, old)
    finally:
        m.stop()


def test_systemd_stops_waits_and_starts(
    fake_services: FakeServices, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    port = free_port()
    folder = tmp_path / "config" / "systemd" / "user"
    folder.mkdir(parents=True)
    argv = " ".join(badserver_argv(port))
    (folder / "mlx.service").write_text(f"[Service]\nExecStart={argv}\nRestart=always\n")
    subprocess.run(["systemctl", "--user", "daemon-reload"], check=True)
    subprocess.run(["systemctl", "--user", "start", "mlx.service"], check=True)
    m = SystemdManager(server(port, manager="systemd", unit="mlx.service"), System())
    old = until(lambda: m.pid() if listening(port) else None, 10, "the unit to listen")
    between, seen = between_checks(port, old)
    outcome = m.stop_then_start(between)
    assert outcome.ok, outcome.detail
    # Restart=always does not bring back a unit stopped by systemctl stop.
    assert seen == ["old alive: False", "listening: False"]
    verbs = [c[2] for c in fake_services.calls() if c[:2] == ["systemctl", "--user"]]
    assert verbs[-4:-1] == ["show", "stop", "start"] or "restart" not in verbs
    assert until(lambda: listening(port), 10, "the unit to listen again")
    subprocess.run(["systemctl", "--user", "stop", "mlx.service"], check=True)


def test_launchd_boots_out_waits_and_boots_in(fake_services: FakeServices, tmp_path: Path) -> None:
    """KeepAlive would bring a killed job back at once: the stop is a bootout, which launchd
    finishes asynchronously; the wait starts only once the job is gone."""
    port = free_port()
    plist = tmp_path / f"{LABEL}.plist"
    job = {"Label": LABEL, "ProgramArguments": badserver_argv(port), "RunAtLoad": True}
    plist.write_bytes(plistlib.dumps({**job, "KeepAlive": True, "ExitTimeOut": 2}))
    subprocess.run(["launchctl", "bootstrap", f"gui/{os.getuid()}", str(plist)], check=True)
    m = LaunchdManager(server(port, manager="launchd", label=LABEL, plist=plist), System())
    old = until(lambda: m.pid() if listening(port) else None, 10, "the job to listen")
    between, seen = between_checks(port, old)
    outcome = m.stop_then_start(between)
    assert outcome is not None and outcome.ok, outcome
    assert seen == ["old alive: False", "listening: False"]
    verbs = [c[1] for c in fake_services.calls() if c[0] == "launchctl" and c[1] != "print"]
    assert verbs[-3:] == ["bootout", "bootstrap", "kickstart"]
    assert until(lambda: listening(port), 10, "the job to listen again")
    subprocess.run(["launchctl", "bootout", f"gui/{os.getuid()}/{LABEL}"], check=True)


@pytest.mark.parametrize("kind", ["systemd", "launchd"])
def test_a_watchdog_stopping_during_the_settle_still_starts_what_it_stopped(
    fake_services: FakeServices, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """The watchdog is told to stop (SIGTERM: an upgrade, `systemctl --user stop mlx-watchdog`)
    while it waits for the memory between its stop and its start: the start still comes, the
    server is not left stopped."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    port = free_port()
    system = System()
    m: SystemdManager | LaunchdManager
    if kind == "systemd":
        folder = tmp_path / "config" / "systemd" / "user"
        folder.mkdir(parents=True)
        argv = " ".join(badserver_argv(port))
        (folder / "mlx.service").write_text(f"[Service]\nExecStart={argv}\nRestart=always\n")
        subprocess.run(["systemctl", "--user", "daemon-reload"], check=True)
        subprocess.run(["systemctl", "--user", "start", "mlx.service"], check=True)
        m = SystemdManager(server(port, manager="systemd", unit="mlx.service"), system)
    else:
        plist = tmp_path / f"{LABEL}.plist"
        job = {"Label": LABEL, "ProgramArguments": badserver_argv(port), "RunAtLoad": True}
        plist.write_bytes(plistlib.dumps({**job, "KeepAlive": True, "ExitTimeOut": 2}))
        subprocess.run(["launchctl", "bootstrap", f"gui/{os.getuid()}", str(plist)], check=True)
        m = LaunchdManager(server(port, manager="launchd", label=LABEL, plist=plist), system)
    old = until(lambda: m.pid() if listening(port) else None, 10, "the server to listen")

    def stopping() -> str:
        system.interrupt()  # what the daemon's stop does to a restart still running
        return "interrupted"

    outcome = m.stop_then_start(stopping)
    assert outcome is not None and outcome.ok, outcome
    assert until(lambda: listening(port), 10, "the server to listen again")
    system.resume()  # as the daemon does before its managers' last stops
    assert m.pid() not in (None, old)
    if kind == "systemd":
        subprocess.run(["systemctl", "--user", "stop", "mlx.service"], check=True)
    else:
        subprocess.run(["launchctl", "bootout", f"gui/{os.getuid()}/{LABEL}"], check=True)


def test_a_manager_that_restarts_in_one_step_restarts_and_says_so(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    cfg = server(
        free_port(),
        manager="command",
        restart_command=[sys.executable, "-c", f"open({str(marker)!r}, 'w')"],
    )
    m = CommandManager(cfg, System())
    assert m.stop_then_start(lambda: "never") is None
    outcome = Ladder._replace(m, lambda: "never")
    assert isinstance(outcome, Outcome) and outcome.ok and marker.exists()
    assert outcome.steps[-1] == (
        "command restarts in one step: no wait for memory between stop and start"
    )


def test_a_server_wedged_under_memory_pressure_is_stopped_and_started_when_memory_is_back(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    """The machine is a stand-in: out of memory and swapping while the first server runs,
    its memory back once that process is gone (and the wedge with it)."""
    port = free_port()
    hang = tmp_path / "hang"
    first: list[int] = []

    def machine() -> Machine:
        if first and not alive(first[0]):
            hang.unlink(missing_ok=True)
            return Machine(16 * GIB, 12 * GIB, 8 * GIB, 2 * GIB)
        return Machine(16 * GIB, GIB // 2, 8 * GIB, 8 * GIB - GIB // 4)

    cmd = badserver_argv(port, "hang_later", "--hang-file", str(hang), "--busy-generation")
    srv = {
        "name": "m",
        "url": f"http://127.0.0.1:{port}",
        "manager": "process",
        "match": "badserver",
        "command": cmd,
        "probe": {"slow_after": "500ms", "wedge_after": "1s", "startup_grace": "30s"},
        "restart": {"max_restarts": 3, "backoff": "1s", "least_cost": False},
    }
    config = parse_config(watchdog_config(tmp_path / "state", [srv], interval="300ms"))
    t = run_daemon(Daemon(config, machine=machine).open())
    cycle = t.daemon.cycles["m"]
    until(lambda: cycle.verdict is not None and cycle.verdict.state == "healthy", 30, "serving")
    first.append(until(lambda: cycle.manager.pid(), 5, "its PID"))
    hang.touch()
    until(lambda: any(e.kind == "recovered" for e in t.daemon.store.events()), 60, "a restart")
    events = t.daemon.store.events()
    restarting = next(e for e in events if e.kind == "restarting")
    assert "cause: the machine is out of memory" in restarting.message, restarting.message
    assert "resident in servers: " in restarting.message and "(m " in restarting.message
    (incident,) = t.daemon.store.incidents(0.0)
    (action,) = [a for a in incident.actions if a["action"] == "restart (process)"]
    steps = action["steps"]
    assert steps[0] == f"stopped PID {first[0]}", steps
    assert steps[1].startswith("memory back after ") and "12.0 GiB available" in steps[1]
    assert steps[2].startswith("started PID ")


def test_a_server_removed_by_a_reload_while_its_restart_waits_is_left_running_by_nothing(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    """A reload removes a process-managed server while its memory cure waits between the stop
    and the start: the restart still starts it (it began), and then stops what it started,
    since nothing supervises it any more."""
    from mlx_watchdog.config import effective, to_toml

    port = free_port()
    hang, back = tmp_path / "hang", tmp_path / "back"

    def machine() -> Machine:
        if back.exists():
            return Machine(16 * GIB, 12 * GIB, 8 * GIB, 2 * GIB)
        return Machine(16 * GIB, GIB // 2, 8 * GIB, 8 * GIB - GIB // 4)

    cmd = badserver_argv(port, "hang_later", "--hang-file", str(hang), "--busy-generation")
    srv = {
        "name": "m",
        "url": f"http://127.0.0.1:{port}",
        "manager": "process",
        "match": "badserver",
        "command": cmd,
        "probe": {"slow_after": "500ms", "wedge_after": "1s", "startup_grace": "30s"},
        "restart": {"max_restarts": 3, "backoff": "1s", "least_cost": False},
    }
    other = {"name": "o", "url": "http://127.0.0.1:9", "probe": {"startup_grace": "1h"}}
    raw = watchdog_config(tmp_path / "state", [srv, other], interval="300ms")
    cfg = tmp_path / "config.toml"
    cfg.write_text(to_toml(effective(parse_config(raw))))
    t = run_daemon(Daemon(parse_config(raw), config_path=cfg, machine=machine).open())
    cycle = t.daemon.cycles["m"]
    until(lambda: cycle.verdict is not None and cycle.verdict.state == "healthy", 30, "serving")
    first = until(lambda: cycle.manager.pid(), 5, "its PID")
    hang.touch()
    until(lambda: cycle.restarting and not alive(first), 30, "the stop, then the wait")
    cfg.write_text(to_toml(effective(parse_config({**raw, "server": [other]}))))
    assert t.daemon.reload() and "m" not in t.daemon.cycles
    hang.unlink()
    back.touch()  # the memory comes back: the restart starts the server, then stops it
    until(lambda: not cycle.restarting, 30, "the restart to end")
    assert until(lambda: not listening(port), 10, "nothing left listening")

    def running(p: psutil.Process) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE and str(port) in " ".join(p.cmdline())
        except psutil.Error:
            return False  # gone, or a zombie its parent has yet to reap

    mine = [p for p in psutil.Process().children(recursive=True) if running(p)]
    assert mine == [], mine


def test_a_server_a_killed_watchdog_left_stopped_is_started_at_once_by_the_next(
    fake_services: FakeServices,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    run_daemon: Callable[[object], DaemonThread],
) -> None:
    """kill -9 between a two-step restart's stop and its start leaves the unit stopped and the
    restart unfinished in the history: the next watchdog starts it at its first look, not
    after startup_grace (ten minutes here)."""
    from mlx_watchdog.record.store import Store

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    port = free_port()
    folder = tmp_path / "config" / "systemd" / "user"
    folder.mkdir(parents=True)
    argv = " ".join(badserver_argv(port))
    (folder / "mlx.service").write_text(f"[Service]\nExecStart={argv}\nRestart=always\n")
    subprocess.run(["systemctl", "--user", "daemon-reload"], check=True)
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    store = Store(state / "history.db")
    store.start_restart("m", time.time() - 5, "wedged")  # stopped, never started
    store.close()
    srv = {
        "name": "m",
        "url": f"http://127.0.0.1:{port}",
        "manager": "systemd",
        "unit": "mlx.service",
        "match": "badserver",
        "probe": {"slow_after": "500ms", "wedge_after": "1s", "startup_grace": "10m"},
        "restart": {"backoff": "1s"},  # the budget's pause after the predecessor's restart
    }
    t = run_daemon(Daemon(parse_config(watchdog_config(state, [srv], interval="300ms"))).open())
    until(lambda: listening(port), 30, "the unit started again")
    store = t.daemon.store
    until(lambda: [r.outcome for r in store.restarts("m", 0.0)][-1:] == ["recovered"], 30, "cured")
    restarting = next(e for e in store.events("m") if e.kind == "restarting")
    assert "was left stopped by a restart begun at" in restarting.message, restarting.message
    t.stop()
    subprocess.run(["systemctl", "--user", "stop", "mlx.service"], check=True)
