"""The work an abandoned request has left where the log says nothing: its size on the socket,
read on the server's calibrated curve (judge/estimate.py), and the choice made on it."""

from __future__ import annotations

from typing import Any

import pytest

from mlx_watchdog.advice.calibrate import Calibration, Fit, Point
from mlx_watchdog.judge.clearing import MARGIN_S, RestartCost, choose
from mlx_watchdog.judge.estimate import BAND, curve, work_left
from mlx_watchdog.judge.evidence import Evidence


def calibration(bytes_per_token: float | None = 4.0) -> dict[str, Any]:
    """A server that prefills 1,000 tokens a second, its prompts of `bytes_per_token`."""
    points = tuple(
        Point(n, n / 1000, None, None if bytes_per_token is None else int(n * bytes_per_token))
        for n in (1024, 4096, 16384)
    )
    return Calibration("s", 0.0, points, Fit(0.0, 1 / 1000, 0.0), 50.0).to_json()


def test_a_requests_size_reads_as_a_range_of_prefill_on_the_calibrated_curve() -> None:
    found = curve(calibration())
    assert found is not None and found.bytes_per_token == pytest.approx(4.0, rel=0.01)
    left = work_left(80_000, 5.0, found)  # about 20,000 tokens: 10k-40k, 10-40 s; 5 s done
    assert left is not None
    assert (left.lo, left.hi) == pytest.approx(
        (20_000 * BAND[0] / 1000 - 5, 20_000 * BAND[1] / 1000 - 5), rel=0.01
    )
    assert "its ~78 KiB request is 10,000-40,000 tokens, a prefill of 10-40 s" in left.why
    assert "had for 5 s, 5-35 s of it is left" in left.why


@pytest.mark.parametrize(
    "doc",
    [
        None,
        {},
        calibration(bytes_per_token=None),  # made before calibrations kept their sizes
        {"fit": {"a": 0, "b": "x", "c": 0}, "points": []},
        {"fit": {"a": 0, "b": -1.0, "c": 0}, "points": calibration()["points"]},
        {"fit": {"a": 0, "b": 1e-3, "c": 0}, "points": [{"prompt_bytes": 5, "prompt_tokens": 0}]},
        {"fit": [1, 2], "points": 3},
    ],
)
def test_no_usable_calibration_is_no_estimate_never_a_crash(doc: Any) -> None:
    assert curve(doc) is None
    assert work_left(80_000, 5.0, curve(doc)) is None


def big(held: float, **kw: object) -> Evidence:
    values: dict[str, object] = {
        "abandoned_connections": 1,
        "cpu_percent": 100.0,
        "abandoned_bytes": 800_000,  # about 200k tokens here: 100-400 s of prefill
        "abandoned_held_s": held,
    }
    values.update(kw)
    return Evidence(**values)  # type: ignore[arg-type]


def test_a_requests_size_alone_ends_no_wait_its_estimate_is_only_said() -> None:
    """Issue 54: a 2 MiB JSON field the server ignores read as 200k tokens, more than a
    restart, and the server was restarted at once where the wait cleared in a second. A
    request's size is its client's to choose: the unknown-work bound holds."""
    e = big(10.0)
    cure = choose(e, RestartCost(20.0, 2), None, now=100.0, calibrated=curve(calibration()))
    assert cure.wait is not None and cure.wait.until == pytest.approx(100 + 20 + MARGIN_S)
    assert cure.why.startswith("waiting while it costs less than a restart: ")
    assert "(its ~781 KiB request is 100,000-400,000 tokens" in cure.why


def test_unread_work_that_may_end_sooner_is_waited_for_within_the_bound_and_says_so() -> None:
    e = big(10.0, abandoned_bytes=40_000)  # 5k-20k tokens: 5-20 s, 0-10 s left
    cure = choose(e, RestartCost(20.0, 2), None, now=100.0, calibrated=curve(calibration()))
    assert cure.wait is not None and cure.wait.until == pytest.approx(100 + 20 + MARGIN_S)
    assert "(its ~39 KiB request is 5,000-20,000 tokens" in cure.why


def test_a_resent_prompt_is_waited_for_until_its_abandoned_work_must_have_ended() -> None:
    """The retry needs all of that work again, so a restart never costs it less; but the
    resend is a client's bytes, so it stretches the wait only to when the abandoned request's
    prefill must have ended, its bytes read as a token each (judge/credence.py)."""
    e = big(10.0, retry_bytes=800_000, retry_after_s=0.5, retry_held_s=10.0, live_connections=1)
    found = curve(calibration())
    cure = choose(e, RestartCost(20.0, 2), None, now=100.0, calibrated=found)
    assert cure.wait is not None and cure.wait.cost.destroyed == 10.0
    assert cure.wait.until == pytest.approx(100 + 20 + 10 + MARGIN_S)  # the restart, its loss
    # Held 700 s: 800 KB is 801k tokens at the most, 801 s here: 101 s left at the most.
    held = big(700.0, retry_bytes=800_000, retry_after_s=0.5, retry_held_s=700.0)
    long = choose(held, RestartCost(20.0, 2), None, now=1000.0, calibrated=found)
    assert long.wait is not None
    assert long.wait.until == pytest.approx(1000 - 700 + (800_000 + 1024) / 1000 + MARGIN_S)
    # A small abandoned request: its work is done by now, whatever the resend says.
    small = big(60.0, abandoned_bytes=8_000, retry_bytes=8_000, retry_held_s=60.0)
    ended = choose(small, RestartCost(20.0, 2), None, now=1000.0, calibrated=found)
    assert ended.wait is not None and ended.wait.until == pytest.approx(1000 + 20 + MARGIN_S)
