"""Log rotation: copy and truncate, so a writer holding the file in append mode goes on."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlx_watchdog.config import ConfigError, parse_config
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.daemon.logs import rotate


def test_rotate_keeps_a_few_copies_newest_first(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("a" * 50)
    assert rotate(log, max_bytes=100, keep=2) is False
    for generation in ("first", "second", "third"):
        log.write_text(generation * 40)
        assert rotate(log, max_bytes=100, keep=2) is True
    assert log.read_bytes() == b""
    assert (tmp_path / "server.log.1").read_text().startswith("third")
    assert (tmp_path / "server.log.2").read_text().startswith("second")
    assert not (tmp_path / "server.log.3").exists()
    assert rotate(tmp_path / "missing.log", 1, 1) is False


def test_a_writer_in_append_mode_goes_on_at_the_start(tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    with log.open("ab") as writer:  # what launchd and the process manager hold
        writer.write(b"x" * 5000)
        writer.flush()
        assert rotate(log, max_bytes=1000, keep=1)
        writer.write(b"after\n")
        writer.flush()
    assert log.read_bytes() == b"after\n"  # not 5000 NUL bytes then "after"
    assert (tmp_path / "w.log.1").read_bytes() == b"x" * 5000


def own_log_of_child(stderr: object) -> str:
    code = "from mlx_watchdog.daemon.logs import own_log; print(own_log())"
    return subprocess.run(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=stderr, text=True, check=True
    ).stdout.strip()


def test_own_log_is_the_append_mode_file_stderr_goes_to(tmp_path: Path) -> None:
    path = tmp_path / "watchdog.log"
    with path.open("ab") as fh:
        assert own_log_of_child(fh) == str(path)
    with path.open("wb") as fh:  # not append: truncating would strand the writer's offset
        assert own_log_of_child(fh) == "None"
    assert own_log_of_child(subprocess.PIPE) == "None"


def test_the_daemon_rotates_each_server_log_file(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_bytes(b"y" * 3000)
    config = parse_config(
        {
            "watchdog": {
                "state_dir": str(tmp_path / "state"),
                "listen": "off",
                "log_max_size": "1KB",
                "log_keep": 1,
            },
            "server": [{"url": "http://127.0.0.1:1", "log_file": str(log)}],
        }
    )
    daemon = Daemon(config).open()
    try:
        daemon.rotate_logs()
    finally:
        daemon.close()
    assert log.read_bytes() == b"" and (tmp_path / "server.log.1").stat().st_size == 3000


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("10", 'watchdog.log_max_size = "10" is not a size'),
        (10, 'write "10MB"'),
        ("0MB", "must be larger than zero"),
        ("ten", 'like "10MB"'),
    ],
)
def test_log_max_size_errors_name_the_key_and_value(value: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_config({"watchdog": {"log_max_size": value}})


def test_log_max_size_units() -> None:
    assert parse_config({"watchdog": {"log_max_size": "10MB"}}).watchdog.log_max_size == 10**7
    assert parse_config({"watchdog": {"log_max_size": "2MiB"}}).watchdog.log_max_size == 2 * 2**20
