"""The watchdog watched: a daemon whose ticks stop ends itself for its service manager to start
afresh, and under systemd a frozen one is killed by `WatchdogSec` (the stand-in models
`Type=notify`, `NotifyAccess=main`, SIGABRT and `Restart=on-failure` as systemd does)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from mlx_watchdog import service
from mlx_watchdog.config import to_toml
from mlx_watchdog.daemon.heartbeat import EXIT_STALLED, STALL_MARGIN, Notifier, stalled
from mlx_watchdog.judge.bounds import fresh_for
from tests.conftest import FakeServices, Running, mlx_watchdog, until

FAULTS = Path(__file__).parent / "faults"
PROBE = {"slow_after": "1s", "wedge_after": "2s", "models_timeout": "1s"}


def test_stalled_names_the_latest_job_and_only_past_its_limit() -> None:
    limits = {"a": 20.0, "b": 20.0, "c": 20.0}
    assert stalled({"a": 100.0, "b": 100.0, "c": 100.0}, limits, now=120.0) is None
    why = stalled({"a": 90.0, "b": 70.0, "c": 119.0}, limits, now=120.0)
    assert why == "no tick of b has begun or ended for 50 s (and 1 more)"


def test_notifier_takes_its_socket_out_of_the_environment() -> None:
    """A server the watchdog starts must not speak for it to systemd."""
    env = {"NOTIFY_SOCKET": "@sd", "WATCHDOG_USEC": "30000000", "PATH": "/bin"}
    notifier = Notifier(env)
    assert env == {"PATH": "/bin"} and notifier.address == "\0sd"
    assert Notifier({}).address == "" and Notifier({}).send("READY=1") is False


def _config(tmp_path: Path, url: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(
        to_toml(
            {
                "watchdog": {
                    "interval": "1s",
                    "listen": "off",
                    "state_dir": str(tmp_path / "state"),
                },
                "server": [{"name": "s", "url": url, "match": "badserver", "probe": PROBE}],
            }
        )
    )
    return path


def test_a_daemon_whose_ticks_hang_ends_itself_for_its_manager(
    tmp_path: Path, bad_server: Callable[..., Running]
) -> None:
    """A tick that never returns (injected from outside: tests/faults/sitecustomize.py): the
    daemon exits EXIT_STALLED within its stall limit, saying why; launchd's KeepAlive or
    systemd's Restart= then start a fresh one."""
    srv = bad_server("ok")
    config = _config(tmp_path, srv.url)
    hang = tmp_path / "hang"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(FAULTS), os.environ.get("PYTHONPATH", "")]),
        "MLXWD_FAULT_HANG_TICK": str(hang),
    }
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_watchdog", "run", "--config", str(config)],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        history = tmp_path / "state" / "history.db"
        until(lambda: proc.poll() is not None or _probes(history) >= 2, 20, "two ticks")
        assert proc.poll() is None  # ticking
        hang.touch()
        hung_at = time.monotonic()
        limit = fresh_for(1.0, 1.0, 1.0) + STALL_MARGIN
        code = proc.wait(timeout=limit + 30)
        took = time.monotonic() - hung_at
    finally:
        if proc.poll() is None:
            proc.kill()
        _, stderr = proc.communicate(timeout=10)
    assert code == EXIT_STALLED, stderr[-2000:]
    assert took >= limit - 2  # not before the ticks are really overdue
    assert "no tick of s has begun or ended for" in stderr
    assert "service manager starts it afresh" in stderr


def test_systemd_kills_a_frozen_watchdog_and_starts_it_again(
    tmp_path: Path,
    bad_server: Callable[..., Running],
    fake_services: FakeServices,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The installed unit is Type=notify with WatchdogSec: the stand-in waits for READY=1, then
    a SIGSTOPped watchdog sends no WATCHDOG=1 and is aborted, killed and restarted."""
    home = tmp_path / "home"
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(home / ".config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(home / ".local" / "state"))
    srv = bad_server("ok")
    config = _config(tmp_path, srv.url)
    installed = mlx_watchdog("install", "--target", "systemd", "--config", str(config))
    assert installed.returncode == 0, installed.stderr
    unit = home / ".config" / "systemd" / "user" / service.WATCHDOG_UNIT
    text = unit.read_text()
    assert "Type=notify" in text and "WatchdogSec=" in text and "NotifyAccess=main" in text

    def job() -> dict[str, object]:
        return fake_services.systemd_unit("user", service.WATCHDOG_UNIT) or {}

    assert job().get("ready") is True  # install returned after READY=1, as systemctl does
    # The test's own short bounds (the shipped ones are tens of seconds).
    for key, value in {"WatchdogSec": "3", "RestartSec": "1", "TimeoutStopSec": "5"}.items():
        text = "\n".join(
            f"{key}={value}" if line.startswith(f"{key}=") else line for line in text.splitlines()
        )
    unit.write_text(text + "\nTimeoutAbortSec=2\n")
    for verb in ("daemon-reload", "restart"):
        ran = subprocess.run(["systemctl", "--user", verb, *([] if verb == "daemon-reload" else [
            service.WATCHDOG_UNIT])], capture_output=True, text=True)  # fmt: skip
        assert ran.returncode == 0, ran.stderr
    first = int(str(job()["pid"]))
    time.sleep(5)  # fed every second: longer than WatchdogSec and still the same process
    assert job().get("pid") == first and not job().get("watchdog_timeouts")

    os.kill(first, signal.SIGSTOP)
    until(lambda: job().get("watchdog_timeouts") == 1, 20, "the watchdog timeout")
    until(lambda: not psutil.pid_exists(first) or psutil.Process(first).status() == "zombie",
          20, "the frozen watchdog killed")  # fmt: skip
    until(lambda: job().get("ready") and job().get("pid") not in (None, first), 30, "a new one")
    assert job().get("notify_refused", 0) == 0


def _probes(db: Path) -> int:
    """Probes the daemon has recorded so far (0 before its history exists)."""
    import sqlite3

    if not db.exists():
        return 0
    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=1)
    try:
        return int(con.execute("SELECT COUNT(*) FROM probes").fetchone()[0])
    except sqlite3.Error:
        return 0
    finally:
        con.close()
