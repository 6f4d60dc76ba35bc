"""Managers against fake launchctl/systemctl on PATH that run real job processes."""

from __future__ import annotations

import contextlib
import json
import os
import plistlib
import shlex
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from mlx_watchdog.act.ladder import Ladder
from mlx_watchdog.act.managers import System, identity_problem
from mlx_watchdog.act.managers.launchd import LaunchdManager
from mlx_watchdog.act.managers.process import ProcessManager
from mlx_watchdog.act.managers.systemd import SystemdManager
from mlx_watchdog.config import ServerConfig
from mlx_watchdog.cycle import Crew, Cycle, NoSink
from mlx_watchdog.record.alerts import Alerter
from mlx_watchdog.record.store import Store
from mlx_watchdog.sense.process import ProcessTable
from mlx_watchdog.sense.round import Checker
from tests.builders import badserver_argv
from tests.conftest import FakeServices, free_port, until

LABEL = "com.example.mlx-server"


def bad_argv(port: int, mode: str = "ok") -> list[str]:
    return badserver_argv(port, mode)


def listening(port: int) -> int | None:
    return ProcessTable().listener(port)


def launchd_job(tmp_path: Path, port: int) -> Path:
    """A job bootstrapped into this user's GUI domain (RunAtLoad: it starts at once)."""
    plist = tmp_path / f"{LABEL}.plist"
    plist.write_bytes(
        plistlib.dumps(
            {
                "Label": LABEL,
                "ProgramArguments": bad_argv(port),
                "RunAtLoad": True,
                "KeepAlive": True,
                "ExitTimeOut": 2,
            }
        )
    )
    plist.chmod(0o644)
    subprocess.run(["launchctl", "bootstrap", f"gui/{os.getuid()}", str(plist)], check=True)
    return plist


def server(port: int, **kw: object) -> ServerConfig:
    return ServerConfig(name="s", url=f"http://127.0.0.1:{port}", match="badserver", **kw)  # type: ignore[arg-type]


def test_launchd_kickstart_replaces_the_process(
    fake_services: FakeServices, tmp_path: Path
) -> None:
    port = free_port()
    plist = launchd_job(tmp_path, port)
    m = LaunchdManager(server(port, manager="launchd", label=LABEL, plist=plist), System())
    first = until(lambda: listening(port), 10, "the job to listen")
    assert m.pid() == first
    outcome = m.restart()
    assert outcome.ok, outcome.detail
    second = until(lambda: listening(port), 10, "the new job to listen")
    assert second != first and m.pid() == second
    uid = os.getuid()
    assert ["launchctl", "kickstart", "-k", f"gui/{uid}/{LABEL}"] in fake_services.calls()
    assert not any(c[1] == "bootout" for c in fake_services.calls())


def test_launchd_job_that_is_not_loaded_is_loaded_again(
    fake_services: FakeServices, tmp_path: Path
) -> None:
    """Booted out (by hand, or a failed escalation): KeepAlive no longer brings it back, and
    kickstart cannot find it. The escalation bootstraps the plist again."""
    port = free_port()
    plist = launchd_job(tmp_path, port)
    first = until(lambda: listening(port), 10, "the job to listen")
    uid = os.getuid()
    subprocess.run(["launchctl", "bootout", f"gui/{uid}/{LABEL}"], check=True)
    until(lambda: fake_services.launchd_job(f"gui/{uid}", LABEL) is None, 20, "the job gone")
    m = LaunchdManager(server(port, manager="launchd", label=LABEL, plist=plist), System())
    assert m.pid() is None
    outcome = m.restart()
    assert outcome.ok, outcome.detail
    assert "bootout + bootstrap" in outcome.detail and "Could not find service" in outcome.detail
    verbs = [c[1] for c in fake_services.calls() if c[0] == "launchctl" and c[1] != "print"]
    assert verbs[-4:] == ["kickstart", "bootout", "bootstrap", "kickstart"]
    second = until(lambda: listening(port), 10, "the bootstrapped job to listen")
    assert second != first


def test_launchd_unknown_job_has_no_pid_and_no_plist_fails_clearly(
    fake_services: FakeServices, tmp_path: Path
) -> None:
    port = free_port()
    m = LaunchdManager(
        server(port, manager="launchd", label="com.nope", plist=tmp_path / "missing.plist"),
        System(),
    )
    assert m.pid() is None
    outcome = m.restart()
    assert not outcome.ok and "missing.plist does not exist" in outcome.detail


def systemd_unit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, port: int) -> None:
    """mlx.service in this test's user unit folder, loaded by daemon-reload."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    folder = tmp_path / "config" / "systemd" / "user"
    folder.mkdir(parents=True)
    (folder / "mlx.service").write_text(
        f"[Service]\nExecStart={shlex.join(bad_argv(port))}\nRestart=on-failure\n"
    )
    subprocess.run(["systemctl", "--user", "daemon-reload"], check=True)


def test_systemd_restart(
    fake_services: FakeServices, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    port = free_port()
    systemd_unit(tmp_path, monkeypatch, port)
    m = SystemdManager(server(port, manager="systemd", unit="mlx.service"), System())
    assert m.pid() is None
    assert m.restart().ok
    first = until(lambda: listening(port), 10, "the unit to listen")
    assert m.pid() == first
    assert m.restart().ok
    assert until(lambda: listening(port) not in (None, first), 10, "a new PID")
    assert ["systemctl", "--user", "restart", "mlx.service"] in fake_services.calls()
    assert [
        "systemctl",
        "--user",
        "show",
        "-p",
        "MainPID",
        "--value",
        "mlx.service",
    ] in fake_services.calls()


def test_systemd_unknown_unit(fake_services: FakeServices) -> None:
    m = SystemdManager(server(free_port(), manager="systemd", unit="nope.service"), System())
    outcome = m.restart()
    assert not outcome.ok and "Unit nope.service not found" in outcome.detail


def test_identity_refuses_a_pid_that_is_not_the_server(
    fake_services: FakeServices, tmp_path: Path
) -> None:
    """The job runs on another port than the configured server: never signal it."""
    job_port, other_port = free_port(), free_port()
    plist = launchd_job(tmp_path, job_port)
    cfg = server(other_port, manager="launchd", label=LABEL, plist=plist)
    m = LaunchdManager(cfg, System())
    job_pid = until(lambda: listening(job_port), 10, "the job to listen")
    other = psutil.Popen(bad_argv(other_port))
    try:
        until(lambda: listening(other_port), 10, "the other server to listen")
        problem = identity_problem(cfg, m.pid(), ProcessTable())
        assert problem is not None and f"PID {job_pid} does not hold port {other_port}" in problem

        store = Store(None)
        alerter = Alerter([])
        c = Cycle(cfg, m, Checker(cfg), Crew(store, alerter, Ladder(), NoSink()))
        before = len(fake_services.calls())
        assert c.restart("wedged", "wedged: test") is False
        assert not any(c[1] == "kickstart" for c in fake_services.calls()[before:])
        assert [e.kind for e in store.events()] == ["refused"]
        assert store.restarts("s", 0.0) == []
        assert listening(job_port) == job_pid and other.is_running()
    finally:
        other.kill()
        other.wait()


def test_identity_refuses_a_command_line_that_does_not_match() -> None:
    port = free_port()
    proc = psutil.Popen(bad_argv(port))
    try:
        until(lambda: listening(port), 10, "listening")
        cfg = ServerConfig("s", f"http://127.0.0.1:{port}")  # match = "mlx_lm"
        problem = identity_problem(cfg, proc.pid, ProcessTable())
        assert problem is not None and 'does not contain match = "mlx_lm"' in problem
        assert (
            identity_problem(
                ServerConfig("s", cfg.url, match="badserver"), proc.pid, ProcessTable()
            )
            is None
        )
    finally:
        proc.kill()
        proc.wait()


def test_process_manager_runs_restarts_stops_and_adopts(tmp_path: Path) -> None:
    port = free_port()
    cfg = server(
        port,
        manager="process",
        command=tuple(bad_argv(port)),
        log_file=tmp_path / "srv.log",
        env={"EXTRA_VAR": "1"},
    )
    record = tmp_path / "process-s.json"
    m = ProcessManager(cfg, System(), record)
    m.start()
    first = m.pid()
    assert first and until(lambda: listening(port) == first, 10, "the child to listen")
    assert os.getpgid(first) == first  # its own process group
    assert psutil.Process(first).environ().get("EXTRA_VAR") == "1"
    assert m.restart().ok
    second = m.pid()
    assert second and second != first
    until(lambda: listening(port) == second, 10, "the new child to listen")

    # A new watchdog (as after kill -9 of the old one) adopts the verified child.
    again = ProcessManager(cfg, System(), record)
    again.start()
    assert again.pid() == second

    # A record whose start time does not match is a stranger with a reused PID: not adopted.
    record.write_text(f'{{"pid": {second}, "create_time": 1.0}}')
    stranger = ProcessManager(cfg, System(), record)
    assert stranger._adoptable() is None

    again.stop()
    assert until(lambda: not System().alive(second), 10, "the child to stop")
    m.stop()


def test_a_user_unit_needs_a_running_user_manager(fake_services: FakeServices) -> None:
    """Over SSH without a session or lingering there is no user manager to talk to."""
    fake_services.machine(user_managers=[])
    m = SystemdManager(server(free_port(), manager="systemd", unit="mlx.service"), System())
    assert m.pid() is None
    outcome = m.restart()
    assert not outcome.ok and "Failed to connect to bus" in outcome.detail


def test_a_unit_that_keeps_failing_stops_at_its_start_limit(
    fake_services: FakeServices, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    folder = tmp_path / "config" / "systemd" / "user"
    folder.mkdir(parents=True)
    (folder / "crash.service").write_text(
        f"[Unit]\nStartLimitIntervalSec=30\nStartLimitBurst=3\n[Service]\n"
        f"ExecStart={sys.executable} -c 'raise SystemExit(3)'\nRestart=on-failure\n"
        "RestartSec=0.1\n"
    )
    subprocess.run(["systemctl", "--user", "daemon-reload"], check=True)
    subprocess.run(["systemctl", "--user", "start", "crash.service"], check=True)
    until(
        lambda: (fake_services.systemd_unit("user", "crash.service") or {}).get("failed"),
        20,
        "the unit to fail",
    )
    unit = fake_services.systemd_unit("user", "crash.service") or {}
    assert len(unit["starts"]) == 3  # StartLimitBurst, then no more
    active = subprocess.run(
        ["systemctl", "--user", "is-active", "crash.service"], capture_output=True, text=True
    )
    assert (active.returncode, active.stdout.strip()) == (3, "failed")


def test_a_command_that_times_out_is_ended_with_its_children(tmp_path: Path) -> None:
    """A restart_command that is a wrapper: its child must not outlive the timeout."""
    pidfile = tmp_path / "child.pid"
    script = (
        "import subprocess, sys, time\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(child.pid))\n"
        "time.sleep(300)\n"
    )
    code, out = System().run([sys.executable, "-c", script], timeout=2.0)
    assert code == 124 and "no answer within 2s" in out
    child = int(pidfile.read_text())
    until(
        lambda: not psutil.pid_exists(child) or psutil.Process(child).status() == "zombie",
        10,
        "the child to end",
    )


def leader_gone() -> tuple[subprocess.Popen[bytes], int]:
    """A process group whose leader (a wrapper) exited and left its child in the group: the
    exited leader, and the child's PID."""
    wrapper = subprocess.Popen(
        ["sh", "-c", "sleep 300 & echo $!"], start_new_session=True, stdout=subprocess.PIPE
    )
    assert wrapper.stdout is not None
    child = int(wrapper.stdout.readline())
    wrapper.stdout.close()
    wrapper.wait()
    return wrapper, child


def test_commands_a_killed_watchdog_left_are_ended_and_only_those(tmp_path: Path) -> None:
    """The record names each running command's process group and its leader's start time: the
    next watchdog ends a group that is still ours (its leader, or with the leader gone, its
    members), and never a process whose PID only looks the same."""
    record = tmp_path / "commands.json"
    ours = subprocess.Popen(["sleep", "300"], start_new_session=True)
    stranger = subprocess.Popen(["sleep", "300"], start_new_session=True)
    wrapper, orphan = leader_gone()
    try:
        entries = [
            {"pgid": ours.pid, "created": psutil.Process(ours.pid).create_time(), "argv": ["a"]},
            {"pgid": stranger.pid, "created": 12345.0, "argv": ["b"]},  # a reused PID
            {"pgid": wrapper.pid, "created": 1.0, "argv": ["c"]},  # leader gone, member left
            {"pgid": "x"},
            # Planted: the watchdog's own group, everyone, a flag; never signalled.
            {"pgid": 0, "created": 1.0, "argv": ["own"]},
            {"pgid": -1, "created": 1.0, "argv": ["all"]},
            {"pgid": os.getpgrp(), "created": 1.0, "argv": ["mine"]},
            {"pgid": True, "created": 1.0, "argv": ["flag"]},
        ]
        record.write_text(json.dumps(entries))
        record.chmod(0o600)
        said = System(record).settle_left(grace=5.0)
        assert said == [f"a (process group {ours.pid})", f"c (process group {wrapper.pid})"]
        assert ours.wait(5) == -15
        assert stranger.poll() is None
        assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == "zombie"
        assert not record.exists()
    finally:
        for proc in (ours, stranger):
            proc.kill()
            proc.wait()
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, 9)


def test_a_group_whose_leader_left_is_not_signalled_when_a_member_predates_the_record(
    tmp_path: Path,
) -> None:
    """With the leader gone, a member started before the recorded leader cannot be of the
    group recorded: the number now names some other group."""
    record = tmp_path / "commands.json"
    wrapper, member = leader_gone()
    try:
        later = psutil.Process(member).create_time() + 60
        record.write_text(json.dumps([{"pgid": wrapper.pid, "created": later, "argv": ["x"]}]))
        record.chmod(0o600)
        assert System(record).settle_left(grace=1.0) == []
        assert psutil.Process(member).status() != "zombie"
        record.write_text("[" * 100_000)  # deep nesting: read as nothing, no exception
        record.chmod(0o600)
        assert System(record).settle_left(grace=1.0) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(member, 9)


def test_a_token_from_another_process_that_took_the_port_is_not_the_restarted_servers(
    tmp_path: Path,
) -> None:
    """The manager started its server (here one slow to listen); meanwhile another process
    bound the port and answers: its token is not "serving again", and what it was is said."""
    port = free_port()
    slow = [sys.executable, "-c", "import time; time.sleep(120)", "badserver"]
    cfg = server(port, manager="process", command=tuple(slow))
    m = ProcessManager(cfg, System(), tmp_path / "process-s.json")
    m.start()
    other = subprocess.Popen(bad_argv(port), stdout=subprocess.DEVNULL)
    try:
        until(lambda: listening(port) == other.pid, 10, "the other process to listen")
        ladder = Ladder()
        served, foreign = ladder._await_token(cfg, m, Checker(cfg))
        assert served is None and foreign is not None
        assert f"the token came from PID {other.pid}" in foreign
        assert f"the server the manager started is PID {m.pid()}" in foreign
    finally:
        other.kill()
        other.wait()
        m.stop()
