"""Service files and `install`/`uninstall`/`server install`, against fake launchctl/systemctl
that run the real job processes, in a temporary HOME."""

from __future__ import annotations

import json
import os
import plistlib
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import psutil
import pytest

from mlx_watchdog import service
from mlx_watchdog.act.managers import System
from mlx_watchdog.config import load_config, to_toml
from mlx_watchdog.sense import selfdump
from tests.conftest import FakeServices, User, free_port, gone, mlx_watchdog, until


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("HOME", str(h))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(h / ".config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(h / ".local" / "state"))
    return h


def write_config(home: Path, url: str = "http://127.0.0.1:1") -> Path:
    path = home / ".config" / "mlx-watchdog" / "config.toml"
    path.parent.mkdir(parents=True)
    data = {
        "watchdog": {"interval": "1s", "listen": "127.0.0.1:0"},
        "server": [{"name": "s", "url": url}],
    }
    path.write_text(to_toml(data))
    return path


# -- the files -----------------------------------------------------------------------------


class Mac(System):
    """An ordinary user (uid 501) on a Mac with a GUI login: only `launchctl print` is asked."""

    def uid(self) -> int:
        return 501

    def run(self, argv: Sequence[str], timeout: float) -> tuple[int, str]:
        assert list(argv[:2]) == ["launchctl", "print"], argv
        return 0, "gui/501 = {\n}"


def test_watchdog_plist_has_its_keys_and_absolute_paths(home: Path) -> None:
    config = home / "c.toml"
    plan = service.target("launchd", Mac()).watchdog_plan(
        service.WatchdogJob(config, home, {"PATH": "/usr/bin"}, "/v/bin/python")
    )
    assert plan.domain == "gui/501" and plan.path.parent == home / "Library" / "LaunchAgents"
    assert plan.content is not None
    data = plistlib.loads(plan.content)
    assert data["Label"] == service.WATCHDOG_LABEL and data["Label"].count(".") >= 2
    assert data["ProgramArguments"] == [
        "/v/bin/python",
        "-m",
        "mlx_watchdog",
        "run",
        "--wait-for-config",  # a bad file is waited on, not a respawn loop
        "--config",
        str(config),
    ]
    assert data["RunAtLoad"] is True and data["KeepAlive"] is True
    assert data["ThrottleInterval"] > 0 and data["ProcessType"] in ("Standard", "Adaptive")
    # launchd waits this long after SIGTERM: longer than the watchdog's own bounded stop.
    assert data["ExitTimeOut"] >= service.STOP_BOUND and data["WorkingDirectory"] == str(home)
    log = Path(data["StandardOutPath"])
    assert log.is_absolute() and log.parent == home / "Library" / "Logs" / "mlx-watchdog"
    assert data["StandardErrorPath"] == data["StandardOutPath"]
    assert data["EnvironmentVariables"] == {"PATH": "/usr/bin", "HOME": str(home)}
    assert "UserName" not in data


def test_server_plist_runs_mlx_lm_with_its_model_env(home: Path) -> None:
    env = {"PATH": "/usr/bin", "HF_HOME": "/models/hf", "HF_HUB_CACHE": "", "SECRET": "x"}
    plan, entry = service.target("launchd", Mac()).server_plan(
        name="qwen",
        args=service.server_args("/m/qwen", 8081, "/m/draft"),
        home=home,
        env=env,
        python="/v/bin/python",
    )
    assert plan.content is not None
    data = plistlib.loads(plan.content)
    # through the stack launcher: the server dumps its own stacks, no root needed
    assert data["ProgramArguments"] == [
        "/v/bin/python", str(selfdump.LAUNCHER), "-m", "mlx_lm", "server",
        "--model", "/m/qwen", "--port", "8081", "--draft-model", "/m/draft",
    ]  # fmt: skip
    assert data["ProcessType"] == "Interactive"
    assert data["EnvironmentVariables"] == {
        "PATH": "/usr/bin",
        "HOME": str(home),
        "HF_HOME": "/models/hf",
    }
    assert entry["log_file"] == data["StandardOutPath"] and entry["domain"] == "gui/501"
    assert entry["plist"] == str(plan.path) and entry["label"] == data["Label"]


def test_a_relative_model_folder_is_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """launchd runs a job in `/`: a relative --model would name nothing there."""
    (tmp_path / "models" / "qwen").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    args = service.server_args("models/qwen", 8080, None)
    assert args[:2] == ["--model", str(tmp_path / "models" / "qwen")]
    assert service.server_args("mlx-community/Qwen3-4B-4bit", 8080, None)[1] == (
        "mlx-community/Qwen3-4B-4bit"  # a repo id stays as it is
    )


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.parametrize("which", ["watchdog", "server", "system"])
def test_units_pass_systemd_analyze_verify(
    which: str, home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_CACHE": "/tmp/hub cache/%x", "SUDO_USER": "root"}
    if which == "system":
        import pwd

        if os.getuid() != 0:
            pytest.skip("needs root")
        env["SUDO_USER"] = pwd.getpwuid(0).pw_name  # refused: the job would run as root
        with pytest.raises(service.ServiceError, match="the user who ran sudo"):
            service.target("systemd", System(), system_wide=True).watchdog_plan(
                service.WatchdogJob(home / "c.toml", home, env, sys.executable)
            )
        env["SUDO_USER"] = "nobody"
    tgt = service.target("systemd", System(), system_wide=which == "system")
    if which == "server":
        plan, entry = tgt.server_plan(
            name="qwen",
            args=service.server_args("/m/a model", 8081, None),
            home=home,
            env=env,
            python=sys.executable,
        )
        assert entry == {"unit": service.server_unit("qwen")}
    else:
        env["XDG_STATE_HOME"] = str(tmp_path / "my state")  # the user's own: kept for the job
        plan = tgt.watchdog_plan(
            service.WatchdogJob(home / "my config.toml", home, env, sys.executable)
        )
    assert plan.content is not None
    unit = tmp_path / plan.label
    unit.write_bytes(plan.content)
    text = plan.content.decode()
    assert "Restart=on-failure" in text and "RestartSec=" in text
    assert "StartLimitIntervalSec=" in text.split("[Service]")[0]
    if which == "system":
        assert plan.path.parent == Path("/etc/systemd/system") and "User=nobody" in text
        assert "WantedBy=multi-user.target" in text
        assert [s.argv[0:2] for s in plan.steps] == [("systemctl", "daemon-reload")] + [
            ("systemctl", verb) for verb in ("enable", "restart")
        ]
    else:
        assert "WantedBy=default.target" in text and "User=" not in text
    if which == "watchdog":
        assert f'Environment="XDG_STATE_HOME={tmp_path}/my state"' in text, text
    else:
        assert "XDG_STATE_HOME" not in text
    verify = subprocess.run(
        ["systemd-analyze", "verify", "--recursive-errors=no", str(unit)],
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0, verify.stderr
    assert "Unknown key" not in verify.stderr and "Invalid" not in verify.stderr


# -- install, reinstall, uninstall (systemd; launchd is in test_launchd.py) ------------------


def job_pid(fakes: FakeServices, name: str) -> int | None:
    job = fakes.systemd_unit("user", name) or {}
    pid = job.get("pid")
    return int(pid) if pid and psutil.pid_exists(int(pid)) else None


def test_install_reinstall_uninstall(home: Path, fake_services: FakeServices) -> None:
    config = write_config(home)
    name = service.WATCHDOG_UNIT

    dry = mlx_watchdog("install", "--target", "systemd", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "# would write" in dry.stdout and "# would run (user):" in dry.stdout
    assert fake_services.calls() == [] and not (home / ".config" / "systemd").exists()
    preview = mlx_watchdog("install", "--target", "systemd", "--dry-run", "--json")
    said = json.loads(preview.stdout)
    assert said["dry_run"] is True and said["action"] == "write" and "done" not in said
    assert said["file"].endswith(name) and said["config"] == str(config)
    assert (
        said["steps"][-1] == f"systemctl --user restart {name}" and "[Service]" in said["content"]
    )
    assert fake_services.calls() == []

    first = mlx_watchdog("install", "--target", "systemd")
    assert first.returncode == 0, first.stderr
    path = home / ".config" / "systemd" / "user" / name
    assert [c[1:] for c in fake_services.calls()] == [
        ["--user", "daemon-reload"],
        ["--user", "enable", name],
        ["--user", "restart", name],
    ]
    assert "loginctl enable-linger" in first.stderr
    assert str(config) in path.read_text()
    assert oct(path.stat().st_mode & 0o777) == "0o644" and path.stat().st_uid == os.getuid()

    # The service runs the real watchdog, which status finds.
    pid = until(lambda: job_pid(fake_services, name), 20, "the watchdog job")
    until(lambda: mlx_watchdog("status", "--json").returncode != 3, 60, "the daemon to answer")
    doc = json.loads(mlx_watchdog("status", "--json").stdout)
    assert doc["watchdog"]["running"] is True and doc["watchdog"]["pid"] == pid

    again = mlx_watchdog("install", "--target", "systemd")
    assert again.returncode == 0, again.stderr
    second = until(lambda: job_pid(fake_services, name), 20, "the replaced job")
    assert second != pid and gone(pid)
    assert len([p for p in fake_services.pids() if not gone(p)]) == 2  # the unit, its supervisor

    removed = mlx_watchdog("uninstall", "--target", "systemd", "--json")
    assert removed.returncode == 0, removed.stderr
    done = json.loads(removed.stdout)
    assert done["action"] == "remove" and done["file"] == str(path)
    assert f"systemctl --user disable --now {name}: exit 0" in done["done"], done
    assert f"removed {path}" in done["done"]
    assert not path.exists()
    assert job_pid(fake_services, name) is None
    assert gone(second)
    assert mlx_watchdog("uninstall", "--target", "systemd").returncode == 0  # already gone


def test_uninstall_with_no_user_manager_removes_the_unit(
    home: Path, fake_services: FakeServices
) -> None:
    """Over SSH after the session ended (no lingering): systemctl --user cannot reach a
    manager, and none runs the unit; uninstall still removes its file."""
    write_config(home)
    assert mlx_watchdog("install", "--target", "systemd").returncode == 0
    path = home / ".config" / "systemd" / "user" / service.WATCHDOG_UNIT
    until(lambda: job_pid(fake_services, service.WATCHDOG_UNIT), 20, "the watchdog job")
    subprocess.run(["systemctl", "--user", "stop", service.WATCHDOG_UNIT], check=True)
    fake_services.machine(user_managers=[])
    removed = mlx_watchdog("uninstall", "--target", "systemd")
    assert removed.returncode == 0, removed.stderr
    assert not path.exists()
    assert "no systemd user manager runs; nothing to stop" in removed.stdout
    assert f"removed {path}" in removed.stdout


def test_install_writes_a_config_when_there_is_none(
    home: Path, fake_services: FakeServices
) -> None:
    result = mlx_watchdog("install", "--target", "systemd")
    assert result.returncode == 0, result.stderr
    config = home / ".config" / "mlx-watchdog" / "config.toml"
    assert config.exists() and "wrote a config template" in result.stderr
    assert load_config(config).servers[0].url == "http://127.0.0.1:8080"


def test_install_refuses_a_bad_config(home: Path, fake_services: FakeServices) -> None:
    config = write_config(home)
    config.write_text('[watchdog]\ninterval = "soon"\n')
    result = mlx_watchdog("install", "--target", "systemd")
    assert result.returncode == 3 and 'watchdog.interval = "soon"' in result.stderr
    assert fake_services.calls() == []


# -- server install ------------------------------------------------------------------------


@pytest.mark.real_server
def test_server_install_serves_and_joins_the_config(
    home: Path,
    fake_services: FakeServices,
    tiny_model: Path,
    hf_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    target = "systemd"  # launchd: tests/test_launchd.py, as an ordinary user
    config = write_config(home)
    port = free_port()
    result = mlx_watchdog(
        "server", "install", "--model", str(tiny_model), "--port", str(port), "--target", target
    )
    assert result.returncode == 0, result.stderr
    servers = {s.name: s for s in load_config(config).servers}
    added = servers[f"mlx-{port}"]
    assert added.manager == target and added.url == f"http://127.0.0.1:{port}"
    assert "s" in servers  # what was there stays
    assert added.unit == service.server_unit(f"mlx-{port}")

    def healthy() -> bool:
        probe = mlx_watchdog("probe", "--server", f"mlx-{port}", "--json")
        return probe.returncode == 0 and json.loads(probe.stdout)["state"] == "healthy"

    until(healthy, 120, "the installed server to serve")

    twice = mlx_watchdog(
        "server", "install", "--model", str(tiny_model), "--port", str(port), "--target", target
    )
    assert twice.returncode == 1 and "already has server" in twice.stderr
    assert mlx_watchdog("server", "uninstall", f"mlx-{port}", "--target", target).returncode == 0


def test_system_unit_runs_the_watchdog_as_the_sudo_user(
    tmp_path: Path, user: User, fake_services: FakeServices, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root")
    from click.testing import CliRunner

    from mlx_watchdog.cli import cli
    from mlx_watchdog.service import systemd

    units = tmp_path / "system-units"
    monkeypatch.setattr(systemd, "SYSTEM_UNITS", units)
    fake_services.machine(system_units=str(units))
    config = write_config(user.home)
    user.own(user.home)
    for key, value in user.env().items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("SUDO_USER", user.name)
    result = CliRunner().invoke(
        cli, ["install", "--target", "systemd", "--system", "--config", str(config)]
    )
    assert result.exit_code == 0, result.output
    text = (units / service.WATCHDOG_UNIT).read_text()
    assert f"User={user.name}" in text and "WantedBy=multi-user.target" in text
    unit = until(
        lambda: (fake_services.systemd_unit("system", service.WATCHDOG_UNIT) or {}).get("pid"),
        20,
        "the system unit",
    )
    assert psutil.Process(int(unit)).uids().real == user.uid  # type: ignore[call-overload]
    state = user.home / ".local" / "state" / "mlx-watchdog"
    until(lambda: (state / "daemon.json").exists(), 60, "the watchdog's daemon.json")
    assert ["systemctl", "daemon-reload"] in fake_services.calls()  # the system instance


# -- --system: the job's user, its files, its sandbox ----------------------------------------


def root_home(user: User) -> Path:
    """Root's home as the tests stand it in: root's own, 0700."""
    home = user.home.parent / "root-home"
    home.mkdir(mode=0o700, exist_ok=True)
    os.chmod(home, 0o700)
    return home


def _system_install(
    user: User, monkeypatch: pytest.MonkeyPatch, *args: str, sudo_user: str | None = None
) -> tuple[int, str]:
    """`sudo mlx-watchdog install --system --dry-run` as Ubuntu's sudo runs it: HOME is root's
    (a folder of the test's standing for it: no test reads or writes this machine's /root)."""
    from click.testing import CliRunner

    from mlx_watchdog.cli import cli

    monkeypatch.setenv("HOME", str(root_home(user)))
    for key in ("XDG_CONFIG_HOME", "XDG_STATE_HOME", "MLX_WATCHDOG_CONFIG"):
        monkeypatch.delenv(key, raising=False)
    if sudo_user is None:
        monkeypatch.delenv("SUDO_USER", raising=False)
    else:
        monkeypatch.setenv("SUDO_USER", sudo_user)
    result = CliRunner().invoke(
        cli, ["install", "--target", "systemd", "--system", "--dry-run", *args]
    )
    return result.exit_code, result.output


def test_system_install_under_sudo_uses_the_job_users_home(
    user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sudo's HOME=/root must not leak into the unit: the job's user could not read it."""
    if os.getuid() != 0:
        pytest.skip("needs root")
    code, output = _system_install(user, monkeypatch, sudo_user=user.name)
    assert code == 0, output
    config = user.home / ".config" / "mlx-watchdog" / "config.toml"
    assert f"--config {config}" in output and f"{root_home(user)}/.config" not in output
    assert f"Environment=HOME={user.home}" in output
    assert f"ReadWritePaths=-{user.home}" in output

    config.parent.mkdir(parents=True)
    config.write_text('[[server]]\nurl = "http://127.0.0.1:1"\nlog_file = "/var/log/mlx/s.log"\n')
    user.own(user.home)
    code, output = _system_install(user, monkeypatch, sudo_user=user.name)
    assert code == 0, output
    # The default state folder is the job user's; a log outside the home is made writable.
    assert f"ReadWritePaths=-{user.home} -{user.home}/.local/state/mlx-watchdog -/var/log/mlx" in (
        output
    )

    hidden = root_home(user) / f"mlxwd-{os.getpid()}.toml"
    hidden.write_text('[[server]]\nurl = "http://127.0.0.1:1"\n')
    code, output = _system_install(user, monkeypatch, "--config", str(hidden), sudo_user=user.name)
    assert code == 1 and f"{user.name}, who cannot read {root_home(user)}" in output, output
    assert "Traceback" not in output


def test_system_install_without_sudo_user_is_one_error(
    user: User, monkeypatch: pytest.MonkeyPatch
) -> None:
    if os.getuid() != 0:
        pytest.skip("needs root")
    code, output = _system_install(user, monkeypatch)
    assert code == 1 and "as the user who ran sudo" in output and "Traceback" not in output, output


def test_system_install_writes_the_template_for_the_job_user(
    user: User, fake_services: FakeServices, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Root writes the missing config into the user's home; the user must own it to edit it."""
    if os.getuid() != 0:
        pytest.skip("needs root")
    from click.testing import CliRunner

    from mlx_watchdog.cli import cli
    from mlx_watchdog.service import systemd

    monkeypatch.setattr(systemd, "SYSTEM_UNITS", tmp_path / "system-units")
    fake_services.machine(system_units=str(tmp_path / "system-units"))
    user.own(user.home)
    monkeypatch.setenv("HOME", str(root_home(user)))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.setenv("SUDO_USER", user.name)
    result = CliRunner().invoke(cli, ["install", "--target", "systemd", "--system"])
    assert result.exit_code == 0, result.output
    config = user.home / ".config" / "mlx-watchdog" / "config.toml"
    for made in (config, config.parent, config.parent.parent):
        assert made.stat().st_uid == user.uid, made


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
def test_system_unit_is_hardened(home: Path, tmp_path: Path) -> None:
    """`systemd-analyze security` rates the system unit "OK" (4.0 or below); the user unit keeps
    what a user manager can apply."""
    import re

    if os.getuid() != 0:
        pytest.skip("needs root")
    env = {"PATH": "/usr/bin:/bin", "SUDO_USER": "nobody"}
    scores = {}
    for system_wide in (True, False):
        plan = service.target("systemd", System(), system_wide=system_wide).watchdog_plan(
            service.WatchdogJob(home / "c.toml", home, env, sys.executable)
        )
        assert plan.content is not None
        unit = tmp_path / ("system" if system_wide else "user") / plan.label
        unit.parent.mkdir()
        unit.write_bytes(plan.content)
        text = plan.content.decode()
        assert "KillMode=mixed" in text and "SyslogIdentifier=mlx-watchdog" in text
        assert ("ProtectSystem=strict" in text) is system_wide
        result = subprocess.run(
            ["systemd-analyze", "security", "--offline=true", str(unit)],
            capture_output=True,
            text=True,
        )
        found = re.search(r"Overall exposure level for \S+: (\d+\.\d)", result.stdout)
        assert found, result.stdout + result.stderr
        scores[system_wide] = float(found.group(1))
    assert scores[True] <= 4.0, scores
    assert scores[False] > scores[True]  # the sandbox is what makes the difference


def test_server_install_and_uninstall_say_what_they_would_do_as_json(
    home: Path, fake_services: FakeServices
) -> None:
    config = write_config(home)
    before = config.read_text()
    shown = mlx_watchdog(
        "server", "install", "--model", "some/model", "--port", "8089", "--target", "systemd",
        "--dry-run", "--json",
    )  # fmt: skip
    assert shown.returncode == 0, shown.stderr
    doc = json.loads(shown.stdout)
    assert doc["server"]["name"] == "mlx-8089" and doc["server"]["manager"] == "systemd"
    assert doc["config"] == str(config) and doc["added"] is None and doc["dry_run"] is True
    unit = doc["service"]
    assert unit["action"] == "write" and "--port 8089" in unit["content"]
    assert fake_services.calls() == [] and config.read_text() == before
    gone = mlx_watchdog("server", "uninstall", "mlx-8089", "--target", "systemd", "--json")
    assert gone.returncode == 0, gone.stderr
    assert json.loads(gone.stdout)["action"] == "remove"


def test_uninstall_dry_run_with_nothing_installed_says_so(
    home: Path, fake_services: FakeServices
) -> None:
    shown = mlx_watchdog("uninstall", "--target", "systemd", "--dry-run")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.startswith("# nothing is installed: no "), shown.stdout
    doc = json.loads(mlx_watchdog("uninstall", "--target", "systemd", "--dry-run", "--json").stdout)
    assert doc["installed"] is False and doc["action"] == "remove"
    assert fake_services.calls() == []
    installed = mlx_watchdog("install", "--target", "systemd")
    assert installed.returncode == 0, installed.stderr
    again = mlx_watchdog("uninstall", "--target", "systemd", "--dry-run")
    assert again.stdout.startswith("# would remove "), again.stdout
