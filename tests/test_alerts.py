"""Alerts leave the probing path at once; a hung or failing channel is logged, never fatal."""

from __future__ import annotations

import json
import logging
import socket
import time
from pathlib import Path

import pytest

from mlx_watchdog.record.alerts import Alerter, Event
from tests.conftest import Receiver


def event(kind: str = "detected") -> Event:
    return Event(
        kind, "qwen", 1000.0, "wedged: no token for 61 s", "wedged", {"abandoned_connections": 3}
    )


def test_json_webhook_and_hook_get_the_event(
    receiver: Receiver, hook: tuple[list[str], Path]
) -> None:
    argv, out = hook
    alerter = Alerter([receiver.url("a")], argv)
    alerter.send(event())
    alerter.flush()
    assert receiver.received[0]["title"] == "qwen is wedged"
    assert receiver.received[0]["message"] == "wedged: no token for 61 s"
    doc = json.loads(out.read_text())
    assert doc["kind"] == "detected" and doc["data"]["abandoned_connections"] == 3
    assert ("on_event hook", "detected") in alerter.delivered
    alerter.close()


def test_a_url_that_never_answers_times_out_and_others_still_get_alerts(
    receiver: Receiver, caplog: pytest.LogCaptureFixture
) -> None:
    tarpit = socket.socket()
    tarpit.bind(("127.0.0.1", 0))
    tarpit.listen(8)  # accepts connections, never answers
    port = tarpit.getsockname()[1]
    try:
        alerter = Alerter([f"json://127.0.0.1:{port}/x?rto=30&cto=30", receiver.url()], timeout=1.0)
        started = time.monotonic()
        alerter.send(event())
        alerter.send(event("recovered"))
        assert time.monotonic() - started < 0.1  # send() only queues
        with caplog.at_level(logging.ERROR):
            alerter.flush(timeout=30)
        assert receiver.titles() == ["qwen is wedged", "qwen recovered"]
        assert caplog.text.count("timed out after 1s") == 2
        assert "json://***" in caplog.text and str(port) not in caplog.text
        alerter.close()
    finally:
        tarpit.close()


def test_failing_hook_and_unknown_url_are_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    script = tmp_path / "fail.sh"
    script.write_text("#!/bin/sh\necho broken >&2\nexit 4\n")
    script.chmod(0o755)
    alerter = Alerter(["nosuchscheme://token123"], [str(script)])
    with caplog.at_level(logging.ERROR):
        alerter.send(event())
        alerter.flush()
    assert "exited 4: broken" in caplog.text
    assert "is not one Apprise knows" in caplog.text and "token123" not in caplog.text
    assert list(alerter.delivered) == []
    alerter.close()


def test_alert_test_says_which_channel_reached(
    receiver: Receiver, hook: tuple[list[str], Path], tmp_path: Path
) -> None:
    """`mlx-watchdog alert test` sends one test alert through each channel of the config and
    says which reached: the webhook and the hook do, a URL nobody listens on does not (exit 1);
    no channel at all is exit 3."""
    from tests.conftest import free_port, mlx_watchdog

    argv, got = hook
    cfg = tmp_path / "c.toml"
    dead = f"json://127.0.0.1:{free_port()}/x?rto=2&cto=2"
    body = (
        f'[watchdog]\nstate_dir = "{tmp_path / "s"}"\nalerts = ["{receiver.url("a")}", "{dead}"]\n'
    )
    cfg.write_text(body + f"on_event = {json.dumps(argv)}\n")
    done = mlx_watchdog("alert", "test", "--config", str(cfg), timeout=120)
    assert done.returncode == 1, done.stderr
    lines = done.stdout.splitlines()
    assert sum("NOT delivered" in line for line in lines) == 1 and len(lines) == 3, lines
    assert "on_event hook: delivered" in lines
    assert receiver.received[0]["title"] == "a test alert from mlx-watchdog"
    assert json.loads(got.read_text())["kind"] == "test"
    cfg.write_text(f'[watchdog]\nstate_dir = "{tmp_path / "s"}"\n')
    none = mlx_watchdog("alert", "test", "--config", str(cfg))
    assert none.returncode == 3 and "no channel to test" in none.stderr
