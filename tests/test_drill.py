"""`mlx-watchdog drill` against the real server, serial and batched."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import Running, mlx_watchdog, wait_until_idle


def drill(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return mlx_watchdog("drill", "--url", url, *args, timeout=600)


def test_drill_without_yes_says_what_it_would_do_and_sends_nothing() -> None:
    proc = drill("http://127.0.0.1:1", "--prompt", "8k", "--give-up-after", "5s")
    assert proc.returncode == 1
    assert "about 8192 tokens" in proc.stderr and "after 5 s" in proc.stderr
    assert "--yes" in proc.stderr  # and nothing was sent: port 1 would have made it fail


@pytest.mark.real_server
def test_drill_measures_the_wedge_serial_longer_than_batched(
    serial_server: Running, batched_server: Running
) -> None:
    stalls = {}
    for name, server in (("serial", serial_server), ("batched", batched_server)):
        # 16k tokens: its client leaves at 2 s with seconds of prefill left, on a fast machine
        # too (a 6k-token prompt ended with its client here: 3,400 tok/s batched).
        proc = drill(server.url, "--prompt", "16k", "--give-up-after", "2s", "--yes", "--json")
        assert proc.returncode == 0, proc.stderr
        doc = json.loads(proc.stdout)
        assert doc["stall_s"] is not None and doc["restarted"] is False
        assert doc["abandoned_seen"] >= 1 and doc["models_status"] == 200
        assert abs(doc["prompt_tokens"] - 16384) < 1600
        stalls[name] = doc["stall_s"]
        wait_until_idle(server)  # the drill left it serving
    assert stalls["serial"] > 2.0, stalls  # a tiny request waited for the departed client
    assert stalls["batched"] < stalls["serial"], stalls
