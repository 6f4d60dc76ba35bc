from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_watchdog.config import RestartSettings
from mlx_watchdog.judge.budget import allowance
from tests.conftest import DaemonThread, Running, until

R = RestartSettings(max_restarts=3, window=3600, backoff=30)


def test_first_restart_is_allowed() -> None:
    d = allowance(R, [], 1000.0)
    assert d.allowed and (d.used, d.left) == (0, 3)


def test_backoff_grows() -> None:
    assert not allowance(R, [1000.0], 1029.0).allowed
    assert allowance(R, [1000.0], 1030.0).allowed
    d = allowance(R, [1000.0, 1030.0], 1080.0)
    assert not d.allowed and d.not_before == 1090.0  # 2 x 30 s after the second
    assert allowance(R, [1000.0, 1030.0], 1090.0).allowed


def test_spent_budget_needs_a_person_until_the_window_passes() -> None:
    times = [1000.0, 1030.0, 1090.0]
    d = allowance(R, times, 2000.0)
    assert not d.allowed and d.spent and d.left == 0
    assert allowance(R, times, 1000.0 + 3600 + 91).allowed


def test_zero_restarts_means_observe_only() -> None:
    d = allowance(RestartSettings(max_restarts=0), [], 0.0)
    assert not d.allowed and d.spent


@given(st.lists(st.floats(0, 10_000), max_size=10), st.floats(0, 10_000))
def test_never_more_than_max_in_a_window(times: list[float], now: float) -> None:
    d = allowance(R, times, now)
    in_window = [t for t in times if t > now - R.window]
    if d.allowed:
        assert len(in_window) < R.max_restarts


def test_a_clock_stepped_back_costs_one_pause_not_the_step() -> None:
    # Restarted at 5000; the clock is then stepped back an hour, to 1400.
    d = allowance(R, [5000.0], 1400.0)
    assert d.allowed and (d.used, d.left) == (1, 2)  # counted, but no hour-long pause
    # the pause still follows the restarts made since the step
    assert not allowance(R, [5000.0, 1400.0], 1420.0).allowed
    # and the budget still counts what was spent before the step
    assert allowance(R, [5000.0, 5040.0, 5100.0], 1400.0).spent


def test_a_backoff_is_logged_once_per_pause_not_every_tick(
    tmp_path: Path,
    bad_server: Callable[..., Running],
    run_daemon: Callable[[object], DaemonThread],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 54: "backing off" was logged at every tick of a pause: the restarts' wall times
    are read anew from the span clock each tick, and the same pause's end moved by
    microseconds. A server that stays hung after each restart: one line per pause."""
    from mlx_watchdog.config import parse_config
    from mlx_watchdog.daemon import Daemon
    from tests.builders import watchdog_config

    srv = bad_server("hang")
    server = {
        "name": "h",
        "url": srv.url,
        "manager": "command",
        "match": "badserver",
        "restart_command": ["true"],
        "probe": {"slow_after": "200ms", "wedge_after": "500ms", "startup_grace": "500ms"},
        "restart": {"max_restarts": 4, "window": "1h", "backoff": "2s"},
    }
    caplog.set_level(logging.INFO, logger="mlx_watchdog")
    config = parse_config(watchdog_config(tmp_path / "state", [server], interval="100ms"))
    t = run_daemon(Daemon(config).open())
    try:
        until(lambda: len(t.daemon.store.restarts("h", 0.0)) >= 3, 30, "three restarts")
    except AssertionError:
        raise AssertionError([e.message for e in t.daemon.store.events()]) from None
    t.stop()
    from mlx_watchdog.record.store import Store

    history = Store(tmp_path / "state" / "history.db")
    pauses = len(history.restarts("h", 0.0))  # each pause follows a restart
    history.close()
    said = [r.getMessage() for r in caplog.records if "backing off" in r.getMessage()]
    assert 1 <= len(said) <= pauses, said
