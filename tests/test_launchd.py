"""launchd as it is, through the stand-in launchctl (tests/fakes/fakelaunchd.py): domains that
exist or not, asynchronous bootout, a job's bare environment, a reboot with nobody logged in.
`install` runs as an ordinary user in a process of its own; `--system` as root."""

from __future__ import annotations

import json
import os
import plistlib
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from click.testing import CliRunner

from mlx_watchdog import service
from mlx_watchdog.act.managers import System
from mlx_watchdog.act.managers.launchd import LaunchdManager, parse_print
from mlx_watchdog.config import parse_config, to_toml
from tests.builders import badserver_argv
from tests.conftest import FakeServices, User, free_port, gone, listens, until

LABEL = service.WATCHDOG_LABEL


def write_config(home: Path, url: str = "http://127.0.0.1:1") -> Path:
    path = home / ".config" / "mlx-watchdog" / "config.toml"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {
        "watchdog": {"interval": "1s", "listen": "127.0.0.1:0"},
        "server": [{"name": "s", "url": url}],
    }
    path.write_text(to_toml(data))
    return path


def running_pid(fakes: FakeServices, domain: str) -> int | None:
    job = fakes.launchd_job(domain, LABEL)
    pid = job.get("pid") if job else None
    return int(pid) if pid and psutil.pid_exists(int(pid)) else None


@pytest.mark.parametrize("gui", [True, False], ids=["gui-login", "ssh-only"])
def test_install_twice_and_uninstall_as_an_ordinary_user(
    gui: bool, user: User, user_services: FakeServices
) -> None:
    if gui:
        user_services.machine(gui=[user.uid])
    write_config(user.home)
    user.own(user.home)
    env = user.env(**user_services.env())
    domain = f"{'gui' if gui else 'user'}/{user.uid}"
    cli = [sys.executable, "-m", "mlx_watchdog"]

    first = user.run([*cli, "install", "--target", "launchd"], env)
    assert first.returncode == 0, first.stderr
    assert (f"user/{user.uid}" in first.stderr) is not gui  # said when there is no GUI login
    assert "--system" in first.stderr or gui
    plist = user.home / "Library" / "LaunchAgents" / f"{LABEL}.plist"
    data = plistlib.loads(plist.read_bytes())
    assert data["WorkingDirectory"] == str(user.home) and data["ExitTimeOut"] >= 45
    assert data["EnvironmentVariables"]["HOME"] == str(user.home)
    assert plist.stat().st_uid == user.uid and plist.stat().st_mode & 0o777 == 0o644

    # The job runs the real watchdog with only the plist's environment; it writes daemon.json.
    state = user.home / ".local" / "state" / "mlx-watchdog"
    pid = until(lambda: running_pid(user_services, domain), 30, "the watchdog job")
    until(lambda: (state / "daemon.json").exists(), 60, "the job's daemon.json")
    status = user.run([*cli, "status", "--json"], env)
    assert json.loads(status.stdout)["watchdog"]["pid"] == pid, status.stderr
    assert psutil.Process(pid).uids().real == user.uid

    # Again: bootout returns at once, the old job is torn down in the background, and the
    # bootstrap is retried until launchd lets the label be loaded again.
    again = user.run([*cli, "install", "--target", "launchd"], env)
    assert again.returncode == 0, again.stderr
    assert f"{domain}/{LABEL} is gone" in again.stdout
    second = until(lambda: running_pid(user_services, domain), 30, "the new job")
    assert second != pid and gone(pid)

    removed = user.run([*cli, "uninstall", "--target", "launchd"], env)
    assert removed.returncode == 0, removed.stderr
    assert not plist.exists() and user_services.launchd_job(domain, LABEL) is None
    assert gone(second)
    assert [p for p in user_services.pids() if not gone(p)] == []  # nothing left running
    assert user.run([*cli, "uninstall", "--target", "launchd"], env).returncode == 0


def test_an_agent_installed_as_root_is_refused_with_the_way_to_do_it(
    tmp_path: Path, fake_services: FakeServices, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root")
    monkeypatch.setenv("HOME", str(tmp_path))
    result = CliRunner().invoke(_cli(), ["install", "--target", "launchd"])
    assert result.exit_code == 1 and "--system" in result.output
    assert fake_services.calls() == []


def test_system_install_serves_after_a_reboot_with_nobody_logged_in(
    tmp_path: Path, user: User, fake_services: FakeServices, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root")
    from mlx_watchdog.service import launchd

    daemons = tmp_path / "LaunchDaemons"
    logs = user.home / "Logs"
    monkeypatch.setattr(launchd, "DAEMONS", daemons)
    monkeypatch.setattr(launchd, "SYSTEM_LOGS", logs)
    fake_services.machine(gui=[], daemons=str(daemons))
    config = write_config(user.home)
    user.own(user.home)
    for key, value in user.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SUDO_USER", user.name)
    result = CliRunner().invoke(
        _cli(), ["install", "--target", "launchd", "--system", "--config", str(config)]
    )
    assert result.exit_code == 0, result.output
    plist = daemons / f"{LABEL}.plist"
    data = plistlib.loads(plist.read_bytes())
    assert data["UserName"] == user.name and data["EnvironmentVariables"]["HOME"] == str(user.home)
    assert plist.stat().st_uid == 0 and plist.stat().st_mode & 0o777 == 0o644
    assert logs.stat().st_uid == user.uid  # the job's user writes its log there

    first = until(lambda: running_pid(fake_services, "system"), 30, "the system job")
    assert psutil.Process(first).uids().real == user.uid

    # A reboot: every job ends, nobody logs in; launchd loads the LaunchDaemons again.
    subprocess_run(["launchctl", "reboot"])
    assert gone(first)
    back = until(lambda: running_pid(fake_services, "system"), 30, "the job after the reboot")
    state = user.home / ".local" / "state" / "mlx-watchdog"
    until(lambda: daemon_pid(state) == back, 60, "the watchdog up again")


def test_the_restart_escalation_survives_an_asynchronous_teardown(
    tmp_path: Path, fake_services: FakeServices
) -> None:
    """A job in the middle of a bootout: kickstart fails (113), bootout says 36, bootstrap says
    5 until launchd has cleaned up. The escalation waits it out and ends loaded and serving."""
    port = free_port()
    label = "test.bad"
    plist = tmp_path / f"{label}.plist"
    argv = badserver_argv(port, "ok")
    plist.write_bytes(
        plistlib.dumps(
            {
                "Label": label,
                "ProgramArguments": argv,
                "RunAtLoad": True,
                "KeepAlive": True,
                "ExitTimeOut": 2,
            }
        )
    )
    plist.chmod(0o644)
    domain = f"gui/{os.getuid()}"
    subprocess_run(["launchctl", "bootstrap", domain, str(plist)])
    until(lambda: listens(port), 20, "the job to serve")
    first = fake_services.launchd_job(domain, label)["pid"]  # type: ignore[index]
    subprocess_run(["launchctl", "bootout", f"{domain}/{label}"])  # torn down in the background
    server = parse_config(
        {
            "server": [
                {
                    "url": f"http://127.0.0.1:{port}",
                    "manager": "launchd",
                    "label": label,
                    "plist": str(plist),
                    "domain": domain,
                    "match": "badserver",
                }
            ]
        }
    ).servers[0]
    outcome = LaunchdManager(server, System()).restart()
    assert outcome.ok, outcome
    assert any("bootstrap" in s and "exit 0" in s for s in outcome.steps), outcome.steps
    job = fake_services.launchd_job(domain, label)
    assert job is not None and job["pid"] != first
    until(lambda: listens(port), 20, "the job to serve again")


@pytest.mark.parametrize(
    ("text", "pid", "running", "problem"),
    [
        ("x = {\n\tstate = running\n\tjetsam = {\n\t\tpid = 1\n\t}\n\tpid = 42\n}", 42, True, None),
        ("x = {\n\tstate = running\n\tjetsam = {\n\t\tpid = 1\n\t}\n}", None, False, "no `pid"),
        ("x = {\n\tstate = not running\n\tlast exit code = 1\n}", None, False, None),
        ("x = {\n\tpid = 7\n}", None, False, "no `state ="),
        ("", None, False, "no `state ="),
    ],
)
def test_launchctl_print_is_read_defensively(
    text: str, pid: int | None, running: bool, problem: str | None
) -> None:
    info = parse_print(text)
    assert (info.pid, info.running) == (pid, running)
    assert (problem is None and info.problem is None) or (
        problem and problem in (info.problem or "")
    )


def daemon_pid(state: Path) -> int | None:
    try:
        return int(json.loads((state / "daemon.json").read_text())["pid"])
    except (OSError, ValueError, KeyError):
        return None  # not written yet, or being written


def _cli() -> Any:
    from mlx_watchdog.cli import cli

    return cli


def subprocess_run(argv: list[str]) -> None:
    import subprocess

    done = subprocess.run(argv, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("target", ["launchd", "systemd"])
def test_a_system_install_is_previewed_without_sudo(
    target: str, user: User, user_services: FakeServices
) -> None:
    """--dry-run changes nothing, so it needs no root: the plan is shown, as the ordinary user
    running it, with the note that doing it needs sudo; without --dry-run it is refused."""
    write_config(user.home)
    user.own(user.home)
    env = user.env(**user_services.env())
    cli = [sys.executable, "-m", "mlx_watchdog", "install", "--target", target, "--system"]
    preview = user.run([*cli, "--dry-run"], env)
    assert preview.returncode == 0, preview.stderr
    assert "a preview: installing it needs sudo" in preview.stderr
    assert "# would write" in preview.stdout and user.name in preview.stdout
    assert user_services.calls() == []
    refused = user.run(cli, env)
    assert refused.returncode != 0 and "sudo" in refused.stderr
