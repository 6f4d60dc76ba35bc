"""The daemon heals through fake launchctl/systemctl that run real job processes."""

from __future__ import annotations

import os
import plistlib
import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from mlx_watchdog.config import Config, parse_config
from mlx_watchdog.daemon import Daemon
from tests.builders import QUICK_TOML, badserver_argv, watchdog_config
from tests.conftest import DaemonThread, FakeServices, Receiver, free_port, until

LABEL = "com.example.mlx-server"
UNIT = "mlx-server.service"


def job_argv(port: int) -> list[str]:
    # Serves two requests per process, then never releases its slot: a restart really heals it.
    return badserver_argv(port, "hang_later", "--ok-requests", "2")


def install_job(kind: str, fakes: FakeServices, tmp_path: Path, port: int) -> dict[str, object]:
    """Load the job in the fake service manager and start it; the server's config keys."""
    if kind == "launchd":
        plist = tmp_path / f"{LABEL}.plist"
        plist.write_bytes(plistlib.dumps({"Label": LABEL, "ProgramArguments": job_argv(port)}))
        plist.chmod(0o644)
        domain = f"gui/{os.getuid()}"
        subprocess.run(["launchctl", "bootstrap", domain, str(plist)], check=True)
        start = ["launchctl", "kickstart", f"{domain}/{LABEL}"]
        keys: dict[str, object] = {
            "manager": "launchd",
            "label": LABEL,
            "plist": str(plist),
            "domain": domain,
        }
    else:
        folder = tmp_path / "config" / "systemd" / "user"
        folder.mkdir(parents=True)
        (folder / UNIT).write_text(
            f"[Service]\nExecStart={shlex.join(job_argv(port))}\n"
            f"Environment=PATH={os.environ['PATH']}\nRestart=on-failure\n"
        )
        env = {**os.environ, "XDG_CONFIG_HOME": str(tmp_path / "config")}
        subprocess.run(["systemctl", "--user", "daemon-reload"], check=True, env=env)
        start = ["systemctl", "--user", "start", UNIT]
        keys = {"manager": "systemd", "unit": UNIT}
    subprocess.run(start, check=True)
    return keys


def config(
    tmp_path: Path,
    port: int,
    keys: dict[str, object],
    alerts: tuple[str, ...] = (),
    **server: object,
) -> Config:
    svc = {
        "name": "svc",
        "url": f"http://127.0.0.1:{port}",
        "match": "badserver",
        "probe": QUICK_TOML,
        "restart": {"max_restarts": 5, "backoff": "1s"},
        **keys,
        **server,
    }
    return parse_config(watchdog_config(tmp_path / "state", [svc], alerts=list(alerts)))


def listener(port: int) -> int | None:
    for c in psutil.net_connections("tcp"):
        if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN:
            return c.pid
    return None


@pytest.mark.parametrize("kind", ["launchd", "systemd"])
def test_a_wedge_is_healed_through_the_service_manager(
    kind: str,
    tmp_path: Path,
    fake_services: FakeServices,
    run_daemon: Callable[[object], DaemonThread],
) -> None:
    port = free_port()
    keys = install_job(kind, fake_services, tmp_path, port)
    first = until(lambda: listener(port), 10, "the job to listen")
    t = run_daemon(Daemon(config(tmp_path, port, keys)).open())
    store = t.daemon.store
    until(lambda: any(i.closed_at for i in store.incidents(0.0)), 30, "the first incident to close")
    incident = store.incidents(0.0)[0]
    assert incident.state == "wedged" and "no other client" in incident.reason
    assert incident.outcome == "restarted" and incident.recover_s is not None
    restart = store.restarts("svc", 0.0)[0]
    assert (restart.trigger, restart.outcome) == ("wedged", "recovered")
    assert not psutil.pid_exists(first) or psutil.Process(first).status() == psutil.STATUS_ZOMBIE
    assert listener(port) not in (None, first)
    calls = fake_services.calls()
    if kind == "launchd":
        assert ["launchctl", "kickstart", "-k", f"gui/{os.getuid()}/{LABEL}"] in calls
    else:
        assert ["systemctl", "--user", "restart", UNIT] in calls


@pytest.mark.parametrize("kind", ["launchd", "systemd"])
def test_a_pid_that_is_not_the_server_is_never_signalled(
    kind: str,
    tmp_path: Path,
    fake_services: FakeServices,
    receiver: Receiver,
    run_daemon: Callable[[object], DaemonThread],
) -> None:
    port = free_port()
    keys = install_job(kind, fake_services, tmp_path, port)
    pid = until(lambda: listener(port), 10, "the job to listen")
    cfg = config(
        tmp_path, port, keys, (receiver.url(),), match="mlx_lm"
    )  # the job runs badserver.py, not mlx_lm
    t = run_daemon(Daemon(cfg).open())
    store = t.daemon.store
    until(lambda: any(e.kind == "refused" for e in store.events()), 30, "the refusal")
    t.daemon.alerter.flush()
    (refused,) = [e for e in store.events() if e.kind == "refused"]
    assert f"PID {pid}" in refused.message and 'match = "mlx_lm"' in refused.message
    assert receiver.titles() == ["svc is wedged", "refused to signal svc"]
    assert store.restarts("svc", 0.0) == []
    assert listener(port) == pid  # still the same process
    verbs = {c[1] for c in fake_services.calls()} | {
        c[2] for c in fake_services.calls() if len(c) > 2
    }
    assert not verbs & {"restart", "bootout"} and "-k" not in verbs
