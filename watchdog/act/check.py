"""One check of one server, judged: `check_once` probes until a token comes or the wait
reaches `wedge_after` (the commands' check); `judged` judges one look of a daemon's round.
The looking itself is sense/round.py's."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.judge.verdict import Verdict, judge
from mlx_watchdog.record.left_probes import LeftProbes
from mlx_watchdog.sense.observation import Observation
from mlx_watchdog.sense.process import Inspector
from mlx_watchdog.sense.round import Checker

POLL = 0.25
LOOK = 1.0


@dataclass(frozen=True)
class CheckResult:
    """One finished check of one server: its verdict and what it was judged from."""

    server: ServerConfig
    verdict: Verdict
    observation: Observation


def judged(
    checker: Checker, pid: int | None, *, fresh_since: float | None = None
) -> Verdict | None:
    """One look of the round, judged (None: the probe is too young to say anything)."""
    return judge(
        checker.observe(pid, fresh_since=fresh_since), checker.server.probe, checker.mono()
    )


def check_once(
    server: ServerConfig,
    *,
    inspector: Inspector | None = None,
    pid: int | None = None,
    left: LeftProbes | None = None,
    mono: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> CheckResult:
    """Probe until a token comes or the wait reaches `wedge_after`, then judge.

    A probe still waiting at the threshold is left to run up to its hard timeout: closing it
    would add one more abandoned request to a server that has too many. `left` records it for
    a caller that exits before the probe ends.
    """
    checker = Checker(
        server, left=left, inspector=inspector, mono=mono, short_lived=left is not None
    )
    checker.inspector.sample(pid)  # the first CPU reading only starts psutil's interval
    probe = checker.start()
    looked = mono()
    observation: Observation | None = None
    while True:
        snap = probe.snapshot()
        if snap.done or snap.waited(mono()) >= server.probe.wedge_after:
            break
        if mono() - looked >= LOOK:  # as the daemon's ticks: what persists is not a race
            observation, looked = checker.observe(pid), mono()
            if checker.probe is None:
                break  # the probe ended during this look: that look is the last
            observation = None
        sleep(POLL)
    if observation is None:
        observation = checker.observe(pid)
    verdict = judge(observation, server.probe, mono())
    assert verdict is not None, "a finished probe or one past wedge_after is always judged"
    checker.leave()
    return CheckResult(server, verdict, observation)
