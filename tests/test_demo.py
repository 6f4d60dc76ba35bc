"""`mlx-watchdog demo`, as a user runs it: a real server wedged, healed and verified."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest


def demo(*args: str, prelude: str = "") -> subprocess.CompletedProcess[str]:
    code = f"{prelude}\nimport sys\nfrom mlx_watchdog.cli import main\nsys.argv = ['mlx-watchdog', 'demo', *{list(args)!r}]\nmain()\n"
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=400,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "COLUMNS": "200"},
    )


@pytest.mark.real_server
def test_demo_shows_a_real_wedge_healed_once() -> None:
    proc = demo()
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = proc.stderr
    order = [
        log.find(s) for s in ("demo healthy", "demo wedged", "demo restarting", "demo recovered")
    ]
    assert -1 not in order and order == sorted(order), log
    assert re.search(r"demo wedged: .* \d+ abandoned requests?", log)
    assert "restarts           1" in proc.stdout or re.search(r"restarts\s+1\n", proc.stdout)
    outage = float(re.search(r"outage\s+([\d.]+) s", proc.stdout).group(1))  # type: ignore[union-attr]
    recover = float(re.search(r"time to recover\s+([\d.]+) s", proc.stdout).group(1))  # type: ignore[union-attr]
    assert 0 < recover < outage


def test_demo_without_the_server_extra_says_what_to_install() -> None:
    proc = demo(prelude="import sys; sys.modules['mlx_lm'] = None")
    assert proc.returncode == 3
    assert 'pip install "mlx-watchdog[server]"' in proc.stderr
    assert "mlx_lm" in proc.stderr
