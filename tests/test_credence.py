"""What a client sends sizes nothing alone (issue 54): progress lines, a request's size and a
resend count only where the kernel's bytes, the calibration and the process agree."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_watchdog.judge.clearing import MARGIN_S, RestartCost, choose
from mlx_watchdog.judge.credence import progress_doubt
from mlx_watchdog.judge.estimate import Curve
from mlx_watchdog.judge.evidence import Evidence

COST = RestartCost(25.0, 3)
CALIBRATED = Curve(0.0, 1 / 1000, 0.0, 4.0)  # 1,000 tok/s; 4 bytes of a request a token


def stepping(done: int, total: int, rate: float = 1000.0, **kw: object) -> Evidence:
    """An abandoned prefill in the log, its request of 4 bytes a token, the process working."""
    values: dict[str, object] = {
        "abandoned_connections": 1,
        "abandoned_bytes": 4 * total,
        "abandoned_held_s": 5.0,
        "cpu_percent": 100.0,
        "prefill_done": done,
        "prefill_total": total,
        "prefill_rate_tps": rate,
        "prefill_left_s": (total - done) / rate,
        "prefill_age_s": 1.0,
        "prefill_step_s": 2.0,
        "server_prefill": f"{done}/{total} prompt tokens",
    }
    values.update(kw)
    return Evidence(**values)  # type: ignore[arg-type]


def test_a_prefill_that_agrees_with_every_sign_may_end_the_wait_early() -> None:
    e = stepping(2_000, 40_000)
    assert progress_doubt(e, CALIBRATED, True) is None
    cure = choose(e, COST, None, now=100.0, calibrated=CALIBRATED)
    assert cure.wait is None and "needs about 38 s more" in cure.why


@pytest.mark.parametrize(
    ("evidence", "works", "doubt"),
    [
        # The forgery: lines of 400,000 tokens during a wait on a 10 KB request.
        (
            stepping(4_000, 400_000, abandoned_bytes=10_000),
            True,
            "its 400,000-token prompt is not the abandoned ~9.8 KiB request (625-11,024 tokens",
        ),
        # Padding: a real 5k-token prompt in a 2 MiB request.
        (
            stepping(1_000, 5_000, abandoned_bytes=2 << 20),
            True,
            "its 5,000-token prompt is not the abandoned ~2,048 KiB request",
        ),
        (stepping(2_000, 40_000, rate=20.0), True, "its steps come at 20 tok/s where this"),
        (stepping(2_000, 40_000, rate=90_000.0), True, "its steps come at 90,000 tok/s where"),
        (stepping(2_000, 40_000, abandoned_bytes=None), True, "size cannot be read"),
        (stepping(2_000, 40_000), None, "the process's work cannot be read"),
        (stepping(2_000, 40_000), False, "the process is idle"),
    ],
)
def test_a_prefill_that_disagrees_with_a_sign_no_client_writes_is_unknown_work(
    evidence: Evidence, works: bool | None, doubt: str
) -> None:
    said = progress_doubt(evidence, CALIBRATED, works)
    assert said is not None and doubt in said


def test_forged_lines_that_would_outlast_the_restart_are_waited_within_its_bound() -> None:
    """Before: "needs about 41561 s more", restarted at once, the queued client failed."""
    forged = stepping(4_000, 400_000, abandoned_bytes=10_000)
    cure = choose(forged, COST, None, now=100.0, calibrated=CALIBRATED)
    assert cure.wait is not None and cure.wait.total == 0
    assert cure.wait.until == pytest.approx(100.0 + COST.seconds + MARGIN_S)
    assert "but no sign a client cannot write agrees: its 400,000-token prompt" in cure.why
    assert "so the work left is unknown" in cure.why


def test_without_a_calibration_the_logs_pace_ends_no_wait() -> None:
    cure = choose(stepping(2_000, 40_000), COST, None, now=100.0)
    assert cure.wait is not None and cure.wait.total == 0
    assert "no calibration of this server to hold its pace against" in cure.why


def test_a_prefill_that_ends_sooner_is_still_waited_for_whatever_its_doubt() -> None:
    """A doubted line that says "soon" is a wait, never a restart: the bound still holds it."""
    e = stepping(39_000, 40_000, abandoned_bytes=100)
    cure = choose(e, COST, None, now=100.0, calibrated=CALIBRATED)
    assert cure.wait is not None and cure.wait.until <= 100.0 + COST.seconds + MARGIN_S


client_lines = st.builds(
    stepping,
    done=st.integers(0, 10**6),
    total=st.integers(1, 10**6),
    rate=st.floats(0.01, 1e6),
    abandoned_bytes=st.one_of(st.none(), st.integers(0, 1 << 24)),
    prefill_age_s=st.floats(0.0, 5.0),
    prefill_step_s=st.one_of(st.none(), st.floats(0.01, 10.0)),
)


@settings(max_examples=300, deadline=None)
@given(e=client_lines, calibrated=st.sampled_from([None, CALIBRATED]))
def test_nothing_a_client_writes_cuts_the_wait_short_of_its_bound_or_stretches_it(
    e: Evidence, calibrated: Curve | None
) -> None:
    """Lines whose totals the request's bytes cannot hold, or at a pace the calibration does
    not know, and any request size with no line at all: while the process works, the cure at
    the wedge's first look is a wait, ending at the restart's bound at the latest."""
    if calibrated is not None and progress_doubt(e, calibrated, True) is None:
        return  # every sign agrees: the log may end the wait early (tested above)
    for evidence in (e, Evidence(abandoned_connections=1, cpu_percent=100.0, **_size(e))):
        cure = choose(evidence, COST, None, now=100.0, calibrated=calibrated)
        assert cure.wait is not None, cure.why
        assert cure.wait.until <= 100.0 + COST.seconds + MARGIN_S + 1e-9


def _size(e: Evidence) -> dict[str, object]:
    return {"abandoned_bytes": e.abandoned_bytes, "abandoned_held_s": e.abandoned_held_s}
