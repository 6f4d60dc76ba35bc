"""Service files and `install`/`uninstall`/`server install`, against fake launchctl/systemctl
that run the real job processes, in a temporary HOME."""

from __future__ import annotations

import json
import os
import plistlib
import shutil
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from mlx_watchdog import service
from mlx_watchdog.config import load_config, to_toml
from tests.conftest import FakeServices, free_port, gone, mlx_watchdog, until


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


def test_watchdog_plist_has_its_keys_and_absolute_paths(home: Path) -> None:
    config = home / "c.toml"
    data = plistlib.loads(
        service.watchdog_content(
            "launchd", config=config, home=home, env={"PATH": "/usr/bin"}, python="/v/bin/python"
        )
    )
    assert data["Label"] == service.WATCHDOG_LABEL and data["Label"].count(".") >= 2
    assert data["ProgramArguments"] == [
        "/v/bin/python",
        "-m",
        "mlx_watchdog",
        "run",
        "--config",
        str(config),
    ]
    assert data["RunAtLoad"] is True and data["KeepAlive"] is True
    assert data["ThrottleInterval"] > 0 and data["ProcessType"] in ("Standard", "Adaptive")
    log = Path(data["StandardOutPath"])
    assert log.is_absolute() and log.parent == home / "Library" / "Logs" / "mlx-watchdog"
    assert data["StandardErrorPath"] == data["StandardOutPath"]
    assert data["EnvironmentVariables"] == {"PATH": "/usr/bin"}


def test_server_plist_runs_mlx_lm_with_its_model_env(home: Path) -> None:
    env = {"PATH": "/usr/bin", "HF_HOME": "/models/hf", "HF_HUB_CACHE": "", "SECRET": "x"}
    content, log = service.server_content(
        "launchd",
        name="qwen",
        args=service.server_args("/m/qwen", 8081, "/m/draft"),
        home=home,
        env=env,
        python="/v/bin/python",
    )
    data = plistlib.loads(content)
    assert data["ProgramArguments"] == [
        "/v/bin/python", "-m", "mlx_lm", "server",
        "--model", "/m/qwen", "--port", "8081", "--draft-model", "/m/draft",
    ]  # fmt: skip
    assert data["ProcessType"] == "Interactive"
    assert data["EnvironmentVariables"] == {"PATH": "/usr/bin", "HF_HOME": "/models/hf"}
    assert log == Path(data["StandardOutPath"]) and log.is_absolute()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")
@pytest.mark.parametrize("which", ["watchdog", "server"])
def test_units_pass_systemd_analyze_verify(which: str, home: Path, tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HF_HUB_CACHE": "/tmp/hub cache/%x"}
    if which == "watchdog":
        content = service.watchdog_content(
            "systemd", config=home / "my config.toml", home=home, env=env, python=sys.executable
        )
        name = service.WATCHDOG_UNIT
    else:
        content, _ = service.server_content(
            "systemd",
            name="qwen",
            args=service.server_args("/m/a model", 8081, None),
            home=home,
            env=env,
            python=sys.executable,
        )
        name = service.server_unit("qwen")
    unit = tmp_path / name
    unit.write_bytes(content)
    text = content.decode()
    assert "Restart=on-failure" in text and "RestartSec=" in text
    assert "StartLimitIntervalSec=" in text.split("[Service]")[0]
    assert "WantedBy=default.target" in text
    verify = subprocess.run(
        ["systemd-analyze", "verify", "--recursive-errors=no", str(unit)],
        capture_output=True,
        text=True,
    )
    assert verify.returncode == 0, verify.stderr
    assert "Unknown key" not in verify.stderr and "Invalid" not in verify.stderr


# -- install, reinstall, uninstall ---------------------------------------------------------


def job_pid(fakes: FakeServices, kind: str, name: str) -> int | None:
    job = fakes.table().get(kind, {}).get(name, {})
    pid = job.get("pid")
    return int(pid) if pid and psutil.pid_exists(int(pid)) else None


@pytest.mark.parametrize("target", ["launchd", "systemd"])
def test_install_reinstall_uninstall(target: str, home: Path, fake_services: FakeServices) -> None:
    config = write_config(home)
    kind, name = (
        ("launchd", service.WATCHDOG_LABEL)
        if target == "launchd"
        else ("systemd", service.WATCHDOG_UNIT)
    )

    dry = mlx_watchdog("install", "--target", target, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "# would write" in dry.stdout and "# would run:" in dry.stdout
    assert fake_services.calls() == [] and not (home / "Library").exists()
    assert not (home / ".config" / "systemd").exists()

    first = mlx_watchdog("install", "--target", target)
    assert first.returncode == 0, first.stderr
    if target == "launchd":
        path = home / "Library" / "LaunchAgents" / f"{name}.plist"
        uid = os.getuid()
        assert [c[1:] for c in fake_services.calls()] == [
            ["bootout", f"gui/{uid}/{name}"],
            ["enable", f"gui/{uid}/{name}"],
            ["bootstrap", f"gui/{uid}", str(path)],
        ]
        assert plistlib.loads(path.read_bytes())["ProgramArguments"][-1] == str(config)
    else:
        path = home / ".config" / "systemd" / "user" / name
        assert [c[1:] for c in fake_services.calls()] == [
            ["--user", "daemon-reload"],
            ["--user", "enable", name],
            ["--user", "restart", name],
        ]
        assert "loginctl enable-linger" in first.stderr
    assert oct(path.stat().st_mode & 0o777) == "0o644" and path.stat().st_uid == os.getuid()

    # The service runs the real watchdog, which status finds.
    pid = until(lambda: job_pid(fake_services, kind, name), 20, "the watchdog job")
    until(lambda: mlx_watchdog("status", "--json").returncode != 3, 60, "the daemon to answer")
    doc = json.loads(mlx_watchdog("status", "--json").stdout)
    assert doc["watchdog"]["running"] is True and doc["watchdog"]["pid"] == pid

    again = mlx_watchdog("install", "--target", target)
    assert again.returncode == 0, again.stderr
    second = until(lambda: job_pid(fake_services, kind, name), 20, "the replaced job")
    assert second != pid and gone(pid)
    assert len([p for p in fake_services.pids() if psutil.pid_exists(p)]) == 1

    removed = mlx_watchdog("uninstall", "--target", target)
    assert removed.returncode == 0, removed.stderr
    assert not path.exists()
    assert job_pid(fake_services, kind, name) is None
    assert gone(second)
    assert mlx_watchdog("uninstall", "--target", target).returncode == 0  # already gone: fine


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
    result = mlx_watchdog("install", "--target", "launchd")
    assert result.returncode == 3 and 'watchdog.interval = "soon"' in result.stderr
    assert fake_services.calls() == []


def test_a_disabled_launchd_job_is_enabled_by_install(
    home: Path, fake_services: FakeServices
) -> None:
    write_config(home)
    subprocess.run(
        ["launchctl", "disable", f"gui/{os.getuid()}/{service.WATCHDOG_LABEL}"], check=True
    )
    result = mlx_watchdog("install", "--target", "launchd")
    assert result.returncode == 0, result.stderr
    until(lambda: job_pid(fake_services, "launchd", service.WATCHDOG_LABEL), 20, "the job")


# -- server install ------------------------------------------------------------------------


@pytest.mark.real_server
@pytest.mark.parametrize("target", ["launchd", "systemd"])
def test_server_install_serves_and_joins_the_config(
    target: str,
    home: Path,
    fake_services: FakeServices,
    tiny_model: Path,
    hf_cache: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(hf_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
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
    if target == "launchd":
        assert added.label == service.server_label(f"mlx-{port}") and added.plist is not None
        assert added.log_file is not None
    else:
        assert added.unit == service.server_unit(f"mlx-{port}")

    def healthy() -> bool:
        probe = mlx_watchdog("probe", "--server", f"mlx-{port}", "--json")
        return probe.returncode == 0 and json.loads(probe.stdout)["state"] == "healthy"

    until(healthy, 120, "the installed server to serve")
    if target == "launchd":
        assert added.log_file is not None and added.log_file.exists()

    twice = mlx_watchdog(
        "server", "install", "--model", str(tiny_model), "--port", str(port), "--target", target
    )
    assert twice.returncode == 1 and "already has server" in twice.stderr
    assert mlx_watchdog("server", "uninstall", f"mlx-{port}", "--target", target).returncode == 0
