"""The daemon against the misbehaving server, fake service managers and its own crashes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from mlx_watchdog.config import parse_config
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.judge.budget import allowance
from mlx_watchdog.record.store import Store
from tests.builders import (
    QUICK_TOML,
    badserver_argv,
    command_config,
    toml,
)
from tests.conftest import (
    BadByPidfile,
    DaemonThread,
    Receiver,
    Running,
    daemon_process,
    free_port,
    listens,
    mlx_watchdog,
    restarts_in,
    until,
)


def test_permanent_wedge_is_healed_through_the_command_manager(
    tmp_path: Path,
    hanging: BadByPidfile,
    receiver: Receiver,
    hook: tuple[list[str], Path],
    run_daemon: Callable[[object], DaemonThread],
) -> None:
    argv, hook_out = hook
    wedged_pid = hanging.pid()
    config = parse_config(command_config(tmp_path, hanging, alerts=[receiver.url()], hook=argv))
    t = run_daemon(Daemon(config).open())
    store = t.daemon.store
    until(lambda: any(i.closed_at for i in store.incidents(0.0)), 30, "the incident to close")
    (incident,) = store.incidents(0.0)
    assert incident.state == "wedged" and "no other client" in incident.reason
    assert incident.outcome == "restarted"
    assert [(r.trigger, r.outcome) for r in store.restarts("bad", 0.0)] == [("wedged", "recovered")]
    assert hanging.pid() != wedged_pid
    t.daemon.alerter.flush()
    assert receiver.titles() == ["bad is wedged", "restarting bad", "bad recovered"]
    kinds = [json.loads(line)["kind"] for line in hook_out.read_text().splitlines()]
    assert kinds == ["detected", "restarting", "recovered"]


def test_a_wedge_restarted_into_the_same_wedge_is_one_incident_and_no_client_left(
    tmp_path: Path,
    hanging: BadByPidfile,
    hook: tuple[list[str], Path],
    run_daemon: Callable[[object], DaemonThread],
) -> None:
    """A server that never answers, restarted into the same state: no "recovered" without a
    token (a "slow" verdict with none yet is not one), one incident until a person acts, and the
    restart check's own probes, cut at startup_grace, are no client that gave up."""
    argv, hook_out = hook
    raw = command_config(tmp_path, hanging, hook=argv)
    server = raw["server"][0]  # type: ignore[index]
    server["restart_command"][-2] = "hang"  # restarted, it hangs again
    server["probe"] = {**QUICK_TOML, "startup_grace": "1500ms"}
    server["restart"] = {"max_restarts": 2, "backoff": "200ms", "command_timeout": "1m"}
    t = run_daemon(Daemon(parse_config(raw)).open())
    store = t.daemon.store
    until(lambda: store.hold_reason("bad"), 60, "the budget to be spent")
    time.sleep(2.0)  # ticks go on while held: starting, then slow with no token, then wedged
    restarts = [r.outcome for r in store.restarts("bad", 0.0)]
    incidents = store.incidents(0.0)
    gave_up = store.events("bad", since=0.0, kind="gave_up")
    states = [row.state for row in store.probes("bad", 0.0)]
    t.stop()
    assert restarts == ["failed", "failed"]
    assert [i.closed_at for i in incidents] == [None]
    kinds = [json.loads(line)["kind"] for line in hook_out.read_text().splitlines()]
    assert "recovered" not in kinds and kinds.count("detected") == 1, kinds
    assert gave_up == []
    assert "slow" in states and states[-1] == "wedged", states


def test_crash_loop_stops_at_the_budget_and_a_healthy_probe_ends_the_hold(
    tmp_path: Path,
    hook: tuple[list[str], Path],
    run_daemon: Callable[[object], DaemonThread],
) -> None:
    argv, hook_out = hook
    port = free_port()
    config = parse_config(
        {
            "watchdog": {
                "interval": "200ms",
                "listen": "127.0.0.1:0",
                "state_dir": str(tmp_path / "state"),
                "on_event": argv,
            },
            "server": [
                {
                    "name": "loop",
                    "url": f"http://127.0.0.1:{port}",
                    "manager": "process",
                    "match": "crash",
                    "command": [sys.executable, "-c", "import sys; sys.exit(3)  # crash"],
                    "probe": {**QUICK_TOML, "startup_grace": "1s"},
                    "restart": {"max_restarts": 2, "window": "1h", "backoff": "200ms"},
                }
            ],
        }
    )
    t = run_daemon(Daemon(config).open())
    store = t.daemon.store
    until(lambda: store.hold_reason("loop"), 30, "the budget to be spent")
    assert [r.outcome for r in store.restarts("loop", 0.0)] == ["failed", "failed"]
    t.daemon.alerter.flush()
    events = [json.loads(line) for line in hook_out.read_text().splitlines()]
    spent = [e for e in events if e["kind"] == "budget_spent"]
    assert len(spent) == 1 and spent[0]["title"] == "loop needs a person"
    assert spent[0]["message"].startswith("2 restarts in the last 3600 s did not bring it back")
    assert [e["kind"] for e in events].count("restart_failed") == 2

    # Probing goes on; once something serves on the port, the hold ends.
    ok = subprocess.Popen(
        badserver_argv(port, "ok"),
        stdout=subprocess.DEVNULL,
    )
    try:
        until(lambda: store.hold_reason("loop") is None, 30, "the hold to end")
        assert len(store.restarts("loop", 0.0)) == 2  # no restart while held
        assert t.daemon.cycles["loop"].verdict.state == "healthy"  # type: ignore[union-attr]
    finally:
        t.stop()
        ok.kill()
        ok.wait()


def test_a_second_daemon_on_one_state_folder_exits_3_naming_the_first(
    tmp_path: Path, hanging: BadByPidfile
) -> None:
    """Two daemons on one config would each count the other's probe as a client and restart
    the server twice. The second exits at once, before it reads or writes anything; the lock
    goes with the first one's process, however it ends, so a relaunch runs."""
    cfg = tmp_path / "w.toml"
    raw = command_config(tmp_path, hanging)
    raw["server"][0]["manager"] = "none"  # type: ignore[index]
    cfg.write_text(toml(raw))
    log = tmp_path / "daemon.log"
    first = daemon_process(cfg, log)
    try:
        until(lambda: (tmp_path / "state" / "daemon.json").exists(), 30, "the first daemon")
        second = mlx_watchdog("run", "--config", str(cfg), timeout=30)
        assert second.returncode == 3, second.stderr
        assert f"another watchdog (PID {first.pid}) runs on the state folder" in second.stderr
        assert first.poll() is None
        assert "restarting" not in log.read_text()
    finally:
        first.kill()  # kill -9: the kernel drops the lock with the process
        first.wait()
    relaunched = daemon_process(cfg, log)
    try:
        until(lambda: log.read_text().count("watching bad") >= 2, 30, "the relaunch to run")
        assert relaunched.poll() is None
    finally:
        relaunched.send_signal(signal.SIGTERM)
        assert relaunched.wait(30) == 0


def test_a_state_folder_removed_under_the_daemon_ends_it_and_a_relaunch_holds_a_new_one(
    tmp_path: Path, hanging: BadByPidfile
) -> None:
    """Issue 54: the state folder removed under a running watchdog took its lock along;
    `status` said none ran and a second `run` started beside it, both restarting one server.
    The daemon sees its lock gone within a second or two and ends (EX_SOFTWARE, so launchd's
    KeepAlive and systemd's Restart= start it afresh), saying why; the relaunch makes a new
    folder and holds it, and a second `run` beside it is refused."""
    import shutil

    cfg = tmp_path / "w.toml"
    raw = command_config(tmp_path, hanging)
    raw["server"][0]["manager"] = "none"  # type: ignore[index]
    cfg.write_text(toml(raw))
    log = tmp_path / "daemon.log"
    state = tmp_path / "state"
    first = daemon_process(cfg, log)
    try:
        until(lambda: (state / "daemon.json").exists(), 30, "the first daemon")
        shutil.rmtree(state)
        assert first.wait(60) == 70
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    said = log.read_text()
    assert "the state folder's lock" in said and "was removed or replaced under the" in said
    relaunched = daemon_process(cfg, log)
    try:
        until(lambda: (state / "daemon.json").exists(), 30, "the relaunch")
        status = mlx_watchdog("status", "--config", str(cfg), "--json", timeout=30)
        assert json.loads(status.stdout)["watchdog"]["running"] is True, status.stdout
        second = mlx_watchdog("run", "--config", str(cfg), timeout=30)
        assert second.returncode == 3, second.stderr
        assert f"another watchdog (PID {relaunched.pid}) runs" in second.stderr
    finally:
        relaunched.send_signal(signal.SIGTERM)
        assert relaunched.wait(30) == 0


def test_kill_9_mid_restart_neither_restarts_again_nor_forgets(
    tmp_path: Path, hanging: BadByPidfile
) -> None:
    cfg = tmp_path / "w.toml"
    cfg.write_text(toml(command_config(tmp_path, hanging, delay=30.0)))
    db = tmp_path / "state" / "history.db"
    log = tmp_path / "daemon.log"
    first = daemon_process(cfg, log)
    helpers: list[psutil.Process] = []
    try:
        until(lambda: restarts_in(db) == [("wedged", None)], 30, "a restart in progress")
        until(lambda: psutil.Process(first.pid).children(), 10, "the restart command")
        helpers = psutil.Process(first.pid).children(recursive=True)
        first.kill()  # kill -9, mid-restart: its restart command runs on, orphaned
        first.wait()
        assert all(h.is_running() for h in helpers)
        # The restart took effect after all (as a slow one would), while no watchdog ran.
        hanging.replace("ok")

        second = daemon_process(cfg, log)
        try:
            until(lambda: "recovered" in log.read_text(), 30, "the new daemon to see it serve")
            # The orphaned command was the new daemon's to end, its whole group.
            assert not any(h.is_running() and h.status() != "zombie" for h in helpers)
            assert "ended a command the previous watchdog left running" in log.read_text()
        finally:
            second.send_signal(signal.SIGTERM)
            assert second.wait(30) == 0
    finally:
        for child in helpers:
            if child.is_running():
                child.kill()
    assert restarts_in(db) == [("wedged", "interrupted")]  # and no second restart
    text = log.read_text()
    assert "never finished" in text and text.count("restarting through") == 1
    store = Store(db)
    config = parse_config(command_config(tmp_path, hanging))
    used = allowance(
        config.servers[0].restart,
        [r.at for r in store.restarts("bad", 0.0)],
        store.restarts("bad", 0.0)[0].at + 1,
    ).used
    assert used == 1  # the budget remembers the interrupted restart
    (incident,) = store.incidents(0.0)
    assert incident.outcome == "recovered by itself"


def test_a_stop_mid_restart_ends_it_and_records_it_as_interrupted(
    tmp_path: Path,
    hanging: BadByPidfile,
    run_daemon: Callable[[object], DaemonThread],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The stop (SIGTERM's handler calls it) waits its bound for a restart to end, then kills
    the restart command. The bound is injected: 1 s here, 20 s in a real run."""
    caplog.set_level("INFO", "mlx_watchdog")
    config = parse_config(command_config(tmp_path, hanging, delay=600.0))  # a restart that hangs
    daemon = Daemon(config, stop_timeout=1.0).open()
    db = tmp_path / "state" / "history.db"
    running = tmp_path / "state" / "commands.json"
    t = run_daemon(daemon)
    until(lambda: restarts_in(db) == [("wedged", None)], 30, "a restart in progress")
    until(lambda: running.exists() and json.loads(running.read_text()), 10, "the command to run")
    (entry,) = json.loads(running.read_text())
    command = psutil.Process(entry["pgid"])
    assert any("restart_bad" in part for part in command.cmdline())
    t.stop()  # returns only once run() has: the restart command never ends by itself
    assert not command.is_running() or command.status() == psutil.STATUS_ZOMBIE
    assert restarts_in(db) == [("wedged", "interrupted")]
    assert "a restart is still running after 1s; interrupting it" in caplog.text
    assert "interrupted: the watchdog stopped during the restart" in caplog.text
    assert caplog.messages[-1] == "stopped"


def test_sighup_reloads_and_keeps_the_old_config_when_the_new_is_bad(
    tmp_path: Path, bad_server: Callable[..., object]
) -> None:
    a, b = bad_server("ok"), bad_server("ok")
    cfg = tmp_path / "w.toml"
    base = {
        "watchdog": {
            "interval": "200ms",
            "listen": "127.0.0.1:0",
            "state_dir": str(tmp_path / "state"),
        }
    }
    cfg.write_text(toml({**base, "server": [{"name": "a", "url": a.url}]}))  # type: ignore[attr-defined]
    log = tmp_path / "daemon.log"
    proc = daemon_process(cfg, log)
    try:
        until(lambda: "watching a every" in log.read_text(), 20, "the daemon to start")
        cfg.write_text('[watchdog]\ninterval = "soon"\n')
        proc.send_signal(signal.SIGHUP)
        until(lambda: "reload refused" in log.read_text(), 20, "the bad reload to be refused")
        assert 'watchdog.interval = "soon"' in log.read_text()
        cfg.write_bytes(b'[watchdog]\n# caf\xe9\ninterval = "1s"\n')  # Latin-1, not UTF-8
        proc.send_signal(signal.SIGHUP)
        until(lambda: "is not UTF-8" in log.read_text(), 20, "the second bad reload refused")
        assert proc.poll() is None and "Traceback" not in log.read_text()
        cfg.write_text(
            toml(
                {
                    **base,
                    "server": [
                        {"name": "a", "url": a.url},  # type: ignore[attr-defined]
                        {"name": "b", "url": b.url},
                    ],
                }
            )
        )  # type: ignore[attr-defined]
        proc.send_signal(signal.SIGHUP)
        until(lambda: "config reloaded: watching a, b" in log.read_text(), 20, "the reload")
        until(lambda: "b healthy" in log.read_text(), 20, "the new server to be probed")
    finally:
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(30)
    assert code == 0 and log.read_text().rstrip().endswith("stopped")


def test_sigterm_stops_the_managed_process_server(tmp_path: Path) -> None:
    port = free_port()
    cfg = tmp_path / "w.toml"
    cfg.write_text(
        toml(
            {
                "watchdog": {
                    "interval": "200ms",
                    "listen": "127.0.0.1:0",
                    "state_dir": str(tmp_path / "state"),
                },
                "server": [
                    {
                        "name": "p",
                        "url": f"http://127.0.0.1:{port}",
                        "manager": "process",
                        "match": "badserver",
                        "command": badserver_argv(port, "ok"),
                    }
                ],
            }
        )
    )
    log = tmp_path / "daemon.log"
    proc = daemon_process(cfg, log)
    try:
        until(lambda: "p healthy" in log.read_text(), 20, "the managed server to serve")
        child = psutil.Process(proc.pid).children()[0].pid
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie"
    assert not listens(port)
    # status from the history: the server it stopped is not shown as running with its PID.
    shown = mlx_watchdog("status", "--config", str(cfg))
    assert shown.returncode == 3 and f"PID {child} has exited since" in shown.stdout, shown.stdout
    assert "(recorded " in shown.stdout and " gone " in shown.stdout


def test_other_signals_neither_kill_the_daemon_nor_pass_unsaid(tmp_path: Path) -> None:
    """SIGUSR1 (logrotate's postrotate) rotates the logs; SIGUSR2 and SIGALRM, whose default
    ends a process, are said and ignored; SIGTERM still stops it, with its exit 0."""
    port = free_port()
    cfg = tmp_path / "w.toml"
    server = {
        "name": "p",
        "url": f"http://127.0.0.1:{port}",
        "manager": "process",
        "match": "badserver",
        "command": badserver_argv(port, "ok"),
    }
    settings = {"interval": "200ms", "listen": "127.0.0.1:0", "state_dir": str(tmp_path / "s")}
    cfg.write_text(toml({"watchdog": settings, "server": [server]}))
    log = tmp_path / "daemon.log"
    proc = daemon_process(cfg, log)
    try:
        until(lambda: "p healthy" in log.read_text(), 20, "the managed server to serve")
        for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGALRM):
            proc.send_signal(sig)
        until(lambda: "SIGALRM ignored" in log.read_text(), 20, "the signals answered")
        text = log.read_text()
        assert "SIGUSR1: rotating the logs now" in text and "SIGUSR2 ignored" in text
        assert proc.poll() is None
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_reloads_keep_each_servers_job_and_restart_only_for_a_new_command(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    """A reload never runs two ticks of one server at once and adds no thread; a change of a
    threshold leaves the managed process alone; a new command restarts it through the one
    restart path (recorded, and counted against the budget)."""
    import threading

    port = free_port()
    command = badserver_argv(port, "ok")
    raw: dict[str, object] = {
        "watchdog": {"interval": "200ms", "listen": "off", "state_dir": str(tmp_path / "state")},
        "server": [
            {
                "name": "owned",
                "url": f"http://127.0.0.1:{port}",
                "manager": "process",
                "match": "badserver",
                "command": command,
                "probe": {"slow_after": "1s", "wedge_after": "5s", "startup_grace": "20s"},
            }
        ],
    }
    cfg = tmp_path / "w.toml"
    cfg.write_text(toml(raw))
    daemon = Daemon(parse_config(raw), config_path=cfg).open()
    inside: dict[str, int] = {}
    most = [0]
    lock = threading.Lock()
    tick = daemon.tick

    def counted(name: str) -> object:
        with lock:
            inside[name] = inside.get(name, 0) + 1
            most[0] = max(most[0], inside[name])
        try:
            return tick(name)
        finally:
            with lock:
                inside[name] -= 1

    daemon.tick = counted  # type: ignore[method-assign]
    t = run_daemon(daemon)
    w = daemon.cycles["owned"]
    until(lambda: w.verdict is not None and w.verdict.state == "healthy", 30, "healthy")
    pid = w.manager.pid()
    threads = threading.active_count()
    for _ in range(100):
        daemon.request_reload()
        time.sleep(0.01)
    time.sleep(1.0)
    assert threading.active_count() <= threads + 1
    assert daemon.cycles["owned"] is w and w.manager.pid() == pid

    server = raw["server"][0]  # type: ignore[index]
    server["probe"] = {**server["probe"], "wedge_after": "6s"}
    cfg.write_text(toml(raw))
    daemon.request_reload()
    until(lambda: w.server.probe.wedge_after == 6.0, 10, "the new threshold to apply")
    assert w.manager.pid() == pid and daemon.store.restarts("owned", 0.0) == []

    server["command"] = [*command, "--delay", "0.5"]
    cfg.write_text(toml(raw))
    daemon.request_reload()
    until(lambda: daemon.store.restarts("owned", 0.0), 20, "the restart for the new command")
    until(
        lambda: w.verdict is not None and w.verdict.state == "healthy" and not w.restarting,
        30,
        "serving",
    )
    (restart,) = daemon.store.restarts("owned", 0.0)
    assert (restart.trigger, restart.outcome) == ("reload", "recovered")
    assert w.manager.pid() not in (None, pid)
    assert "--delay" in " ".join(psutil.Process(w.manager.pid()).cmdline())
    t.stop()
    assert most[0] == 1, "two ticks of one server ran at once"


def test_a_killed_daemons_probe_is_no_client_of_the_next_one(
    tmp_path: Path, hanging: BadByPidfile
) -> None:
    """kill -9 while its probe waits on a stuck server: the kernel closes the socket and the
    server holds it in CLOSE_WAIT. The next daemon must not count it as a client that left."""
    cfg = tmp_path / "w.toml"
    raw = command_config(tmp_path, hanging)
    raw["server"][0]["manager"] = "none"  # type: ignore[index]
    raw["server"][0]["probe"] = {**QUICK_TOML, "wedge_after": "30s", "max_busy": "40s"}  # type: ignore[index]
    cfg.write_text(toml(raw))
    log = tmp_path / "daemon.log"
    first = daemon_process(cfg, log)
    try:
        until(
            lambda: any(
                c.status == "ESTABLISHED"
                for c in psutil.Process(hanging.pid()).net_connections()
                if c.raddr
            ),
            30,
            "the first daemon's probe to wait on the server",
        )
    finally:
        first.kill()
        first.wait()
    until(
        lambda: any(
            c.status == "CLOSE_WAIT" for c in psutil.Process(hanging.pid()).net_connections()
        ),
        10,
        "its probe left in CLOSE_WAIT",
    )
    second = Daemon(parse_config(raw)).open()
    try:
        sample = second.cycles["bad"].checker.observe(hanging.pid())
        assert sample.process.abandoned == 0, sample.process.clients
        assert second.cycles["bad"].checker.inspector.gave_up == 0
    finally:
        second.cycles["bad"].checker.abort()
        second.close()


def test_a_bad_config_under_a_service_waits_for_the_fix_instead_of_a_respawn_loop(
    tmp_path: Path, bad_server: Callable[..., object]
) -> None:
    """The installed services run `run --wait-for-config`: a bad file at start is logged once
    and waited on; fixed, the watchdog starts by itself. By hand, `run` still exits 3."""
    srv = bad_server("ok")
    cfg = tmp_path / "w.toml"
    cfg.write_text('[watchdog]\ninterval = "soon"\n')
    by_hand = mlx_watchdog("run", "--config", str(cfg), timeout=30)
    assert by_hand.returncode == 3 and 'watchdog.interval = "soon"' in by_hand.stderr
    log = tmp_path / "daemon.log"
    with log.open("ab") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mlx_watchdog",
                "run",
                "--wait-for-config",
                "--config",
                str(cfg),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )
    try:
        until(lambda: "waiting for the file to be fixed" in log.read_text(), 20, "the wait")
        time.sleep(5)  # read again and again meanwhile, said once
        assert proc.poll() is None and log.read_text().count("config error") == 1
        state = str(tmp_path / "state")
        good = {"watchdog": {"interval": "200ms", "listen": "off", "state_dir": state}}
        cfg.write_text(toml({**good, "server": [{"name": "s", "url": srv.url}]}))  # type: ignore[attr-defined]
        until(lambda: "s healthy" in log.read_text(), 30, "the fixed config to start it")
        assert "the config is good now; starting" in log.read_text()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_a_new_interval_retimes_the_next_run_and_never_brings_it_forward() -> None:
    from mlx_watchdog.daemon.schedule import Schedule

    runs: list[float] = []
    schedule = Schedule()
    schedule.keep({"j": (30.0, lambda: runs.append(time.monotonic()))})
    try:
        until(lambda: len(runs) == 1, 5, "the first run")
        schedule.keep({"j": (60.0, lambda: runs.append(time.monotonic()))})  # longer: later
        schedule.keep({"j": (45.0, lambda: runs.append(time.monotonic()))})
        time.sleep(0.5)  # a run brought forward would show here
        assert len(runs) == 1
        schedule.keep({"j": (1.0, lambda: runs.append(time.monotonic()))})  # shorter: sooner
        until(lambda: len(runs) == 2, 5, "the run at the new interval")
        assert runs[1] - runs[0] >= 1.0 - 0.05
    finally:
        schedule.keep({})


def test_reloads_that_change_settings_do_not_probe_sooner(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread], bad_server: Callable[..., Running]
) -> None:
    """A reload's settings wait for the server's next tick: 40 reloads, each changing a
    threshold, over two seconds at a 1 s interval, are no reason for 40 probes."""
    srv = bad_server("ok")
    raw: dict[str, object] = {
        "watchdog": {"interval": "1s", "listen": "off", "state_dir": str(tmp_path / "state")},
        "server": [{"name": "a", "url": srv.url, "probe": {"wedge_after": "5s"}}],
    }
    cfg = tmp_path / "w.toml"
    cfg.write_text(toml(raw))
    daemon = Daemon(parse_config(raw), config_path=cfg).open()
    ticks: list[float] = []
    tick = daemon.tick

    def counted(name: str) -> object:
        ticks.append(time.monotonic())
        return tick(name)

    daemon.tick = counted  # type: ignore[method-assign]
    run_daemon(daemon)
    until(lambda: ticks, 10, "the first tick")
    began, first = time.monotonic(), len(ticks)
    server = raw["server"][0]  # type: ignore[index]
    for i in range(40):
        server["probe"] = {"wedge_after": f"{5 + i % 2}s"}
        cfg.write_text(toml(raw))
        assert daemon.reload()  # as SIGHUP's loop does
        time.sleep(0.05)
    spent = time.monotonic() - began
    assert len(ticks) - first <= spent / 1.0 + 2, (len(ticks) - first, spent)


def test_a_daemon_is_built_for_nothing_and_opened_and_closed_in_reverse(tmp_path: Path) -> None:
    """Building a daemon touches nothing; `open()` takes the state folder's lock and the
    history, `close()` gives both back (a second daemon then opens the same folder), and a
    daemon used as a context manager closes on the way out."""
    from mlx_watchdog.record.private import AlreadyRunning

    state = tmp_path / "state"
    config = parse_config({"watchdog": {"state_dir": str(state)}})
    built = Daemon(config)
    assert not state.exists() and built.cycles == {}
    with built as opened:
        assert opened is built and list(opened.cycles) and (state / "history.db").exists()
        with pytest.raises(AlreadyRunning):
            Daemon(config).open()
        opened.open()  # a second open is no second lock
    with Daemon(config) as again:
        assert again.store.problem is None
    again.close()  # closed already: nothing to undo


def test_an_open_that_fails_part_way_gives_back_what_it_took(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A part after the history failing to open (here a server's history that cannot be
    loaded) left the state folder locked and the history's writer thread running: the next
    open in the same process said "already running". Now what was opened is closed."""
    import threading

    from mlx_watchdog.cycle.cycle import Cycle

    state = tmp_path / "state"
    config = parse_config({"watchdog": {"state_dir": str(state)}})
    before = {t.name for t in threading.enumerate()}

    def cannot_load(self: Cycle) -> None:
        raise OSError(f"{self.server.name}: the disk went away")

    with monkeypatch.context() as m:
        m.setattr(Cycle, "load", cannot_load)
        failed = Daemon(config)
        with pytest.raises(OSError, match="the disk went away"):
            failed.open()
    left = {t.name for t in threading.enumerate() if t.is_alive()} - before
    assert not left & {"history", "alerts"}, f"left running: {left}"
    assert failed.cycles == {}
    with Daemon(config) as again:  # the lock was given back
        assert list(again.cycles) and again.store.problem is None


def test_a_reload_during_the_last_ones_apply_is_applied_at_the_next_tick(tmp_path: Path) -> None:
    """A reload's settings are taken in one step under the asks' lock: the latest wins, and
    one made while the earlier ones are applied waits for the next tick (the job read the
    settings, then cleared them, and a reload between the two was lost)."""
    raw = {
        "watchdog": {"state_dir": str(tmp_path / "state")},
        "server": [{"name": "s", "url": "http://127.0.0.1:9", "manager": "none"}],
    }
    with Daemon(parse_config(raw)) as daemon:
        cycle = daemon.cycles["s"]
        configs = [
            parse_config({**raw, "server": [{**raw["server"][0], "probe": {"wedge_after": w}}]})
            for w in ("7s", "8s", "9s")
        ]
        first, second, third = (c.servers[0] for c in configs)
        cycle.reconfigure_later(first)
        cycle.reconfigure_later(second)
        seen = []
        reconfigure = cycle.checker.reconfigure

        def mid_apply(server: object) -> None:
            seen.append(server)
            if len(seen) == 1:
                cycle.reconfigure_later(third)  # SIGHUP again, on the main thread
            reconfigure(server)  # type: ignore[arg-type]

        cycle.checker.reconfigure = mid_apply  # type: ignore[method-assign]
        cycle.apply_new_config(daemon._manager)
        assert cycle.server.probe.wedge_after == 8.0
        cycle.apply_new_config(daemon._manager)
        assert cycle.server.probe.wedge_after == 9.0 and seen == [second, third]
        cycle.apply_new_config(daemon._manager)
        assert seen == [second, third]


def test_a_reload_applies_the_alert_channels_and_names_what_needs_a_restart(
    tmp_path: Path, hook: tuple[list[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    """SIGHUP said "config reloaded" and kept the alert channels it was started with. Now a
    new on_event is the one the next event goes to, and a setting a reload cannot change
    under a running watchdog (its listen address) is named, with when it takes effect."""
    from mlx_watchdog.config import to_toml
    from mlx_watchdog.judge.states import EventKind
    from mlx_watchdog.record.alerts import Event

    argv, got = hook
    cfg = tmp_path / "c.toml"
    raw: dict[str, object] = {
        "watchdog": {"state_dir": str(tmp_path / "s"), "listen": "127.0.0.1:0"}
    }
    cfg.write_text(to_toml(raw))
    with Daemon(parse_config(raw), config_path=cfg) as daemon:
        assert daemon.alerter.channels == []
        raw["watchdog"] = {
            "state_dir": str(tmp_path / "s"),
            "listen": "127.0.0.1:1",
            "on_event": argv,
        }
        cfg.write_text(to_toml(raw))
        assert daemon.reload()
        daemon.alerter.send(Event(EventKind.TEST, "x", time.time(), "after the reload"))
        daemon.alerter.flush(30)
        assert json.loads(got.read_text())["message"] == "after the reload"
    said = [r.getMessage() for r in caplog.records if "takes effect when" in r.getMessage()]
    assert said == [
        "watchdog.listen_port changed (0 -> 1): it takes effect when the watchdog restarts"
    ]


def test_an_incident_the_watchdogs_own_start_ends_is_not_said_to_end_by_itself(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    """A watchdog stopped with an incident open (its `process` server stopped with it) starts
    the server again; the incident ends then, by the watchdog's start, not "by itself"."""
    from mlx_watchdog.daemon import Daemon
    from mlx_watchdog.record.store import Store

    port = free_port()
    state = tmp_path / "state"
    raw = {
        "watchdog": {"interval": "200ms", "listen": "off", "state_dir": str(state)},
        "server": [
            {
                "name": "p",
                "url": f"http://127.0.0.1:{port}",
                "manager": "process",
                "match": "badserver",
                "command": badserver_argv(port, "ok"),
            }
        ],
    }
    state.mkdir()
    store = Store(state / "history.db")
    store.open_incident("p", time.time() - 60, "wedged", "no token", {}, began_at=time.time() - 60)
    store.close()
    t = run_daemon(Daemon(parse_config(raw)))
    cycles = t.daemon.cycles
    until(lambda: "p" in cycles and cycles["p"].incident is None, 30, "the server to serve")
    t.stop()
    (incident,) = Store(state / "history.db").incidents(0.0)
    assert incident.outcome == "started by the watchdog"


def test_a_command_that_cannot_run_is_said_once_and_spends_no_restart(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    """A `process` server whose program is on no PATH: every restart would fail. The watchdog
    says so once, naming the key, and spends none of the budget on it."""
    from mlx_watchdog.daemon import Daemon

    port = free_port()
    raw = {
        "watchdog": {"interval": "200ms", "listen": "off", "state_dir": str(tmp_path / "s")},
        "server": [
            {
                "name": "p",
                "url": f"http://127.0.0.1:{port}",
                "manager": "process",
                "command": ["no-such-server-program", "--port", str(port)],
                "probe": {"startup_grace": "1s"},
            }
        ],
    }
    t = run_daemon(Daemon(parse_config(raw)))
    cycles = t.daemon.cycles

    def refused() -> list[str]:
        if "p" not in cycles:
            return []
        return [e.message for e in t.daemon.store.events("p", since=0.0) if e.kind == "refused"]

    until(refused, 30, "the refusal")
    said_at = time.time()

    def judged_later() -> bool:  # five more ticks' verdicts, each a chance to say it again
        at = cycles["p"].shown.judged_at
        return at is not None and at > said_at + 1.0

    until(judged_later, 30, "more verdicts")
    t.daemon.store.flush(5.0)
    (said,) = refused()
    assert 'command[0] = "no-such-server-program" is not on the PATH' in said, said
    assert t.daemon.store.restarts("p", 0.0) == []
    t.stop()
