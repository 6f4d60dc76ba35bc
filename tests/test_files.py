"""What is planted where a log should be (a FIFO, a link, another file behind a link) never
hangs the watchdog and is never written through: the one way it opens such files."""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from mlx_watchdog.act.managers import System
from mlx_watchdog.act.managers.process import ProcessManager
from mlx_watchdog.config import ServerConfig, parse_config
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.daemon.logs import rotate
from mlx_watchdog.sense.files import NotAFile, open_append, open_regular
from tests.builders import QUICK_TOML, badserver_argv
from tests.conftest import DaemonThread, free_port, until


def soon(action: Callable[[], object]) -> BaseException | object:
    """`action`'s result or exception, failing the test (not hanging it) if it blocks."""
    got: list[object] = []

    def run() -> None:
        try:
            got.append(action())
        except BaseException as exc:
            got.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "blocked"
    return got[0]


def test_a_fifo_is_refused_without_blocking(tmp_path: Path) -> None:
    fifo = tmp_path / "server.log"
    os.mkfifo(fifo)
    assert isinstance(soon(lambda: open_append(fifo)), NotAFile)
    assert isinstance(soon(lambda: open_regular(fifo)), OSError)


def test_a_link_is_never_written_through(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("key")
    secret.chmod(0o600)
    (tmp_path / "server.log").symlink_to(secret)
    with pytest.raises(NotAFile, match="symbolic link"):
        open_append(tmp_path / "server.log")
    with pytest.raises(NotAFile, match="symbolic link"):
        open_regular(tmp_path / "server.log", follow=False)
    assert secret.read_text() == "key"


def test_rotation_keeps_the_mode_and_replaces_a_planted_link(tmp_path: Path) -> None:
    log, target = tmp_path / "server.log", tmp_path / "elsewhere"
    log.write_bytes(b"x" * 2000)
    log.chmod(0o600)
    target.write_text("untouched")
    (tmp_path / "server.log.1").symlink_to(target)
    assert rotate(log, 1000, 2)
    copy = tmp_path / "server.log.1"
    assert not copy.is_symlink() and copy.read_bytes() == b"x" * 2000
    assert stat.S_IMODE(copy.stat().st_mode) == 0o600
    assert log.read_bytes() == b"" and target.read_text() == "untouched"
    assert (tmp_path / "server.log.2").is_symlink()  # the planted link moved up, not followed


def test_a_log_that_is_a_link_is_not_rotated(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * 5000)
    (tmp_path / "server.log").symlink_to(secret)
    with pytest.raises(NotAFile):
        rotate(tmp_path / "server.log", 1000, 2)
    assert secret.read_bytes() == b"s" * 5000
    assert not (tmp_path / "server.log.1").exists()


def test_a_fifo_log_fails_the_start_and_the_restart_says_why(tmp_path: Path) -> None:
    port = free_port()
    fifo = tmp_path / "srv.log"
    os.mkfifo(fifo)
    cfg = ServerConfig(
        name="s",
        url=f"http://127.0.0.1:{port}",
        match="badserver",
        manager="process",
        command=tuple(badserver_argv(port)),
        log_file=fifo,
    )
    m = ProcessManager(cfg, System(), tmp_path / "process-s.json")
    assert isinstance(soon(m.start), NotAFile)
    outcome = soon(m.restart)
    assert not outcome.ok  # type: ignore[attr-defined]
    assert "a FIFO or a device" in outcome.detail and str(fifo) in outcome.detail  # type: ignore[attr-defined]
    assert m.pid() is None


def test_the_daemon_serves_its_endpoint_with_a_fifo_for_a_log(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    port = free_port()
    fifo = tmp_path / "srv.log"
    os.mkfifo(fifo)
    config = parse_config(
        {
            "watchdog": {
                "interval": "200ms",
                "listen": "127.0.0.1:0",
                "state_dir": str(tmp_path / "state"),
            },
            "server": [
                {
                    "name": "s",
                    "url": f"http://127.0.0.1:{port}",
                    "manager": "process",
                    "match": "badserver",
                    "command": badserver_argv(port),
                    "log_file": str(fifo),
                    "probe": {**QUICK_TOML, "startup_grace": "1s"},
                    "restart": {"max_restarts": 1, "window": "1h"},
                }
            ],
        }
    )
    t = run_daemon(Daemon(config).open())
    until(lambda: t.daemon.endpoint is not None, 20, "the endpoint")
    assert t.daemon.endpoint is not None
    url = f"http://127.0.0.1:{t.daemon.endpoint.server_address[1]}"
    status = until(
        lambda: (
            (doc := httpx.get(url + "/status", timeout=5).json())["servers"][0]["state"]
            in ("down", "dead", "wedged")
            and doc
        ),
        30,
        "the server found down",
    )
    assert status
    said = until(
        lambda: [e for e in t.daemon.store.events("s") if "a FIFO or a device" in e.message],
        30,
        "the failed restart to say why",
    )
    assert str(fifo) in said[0].message  # type: ignore[index]
