"""The cheaper cure, chosen in the pure judge: wait for an abandoned prefill, or restart."""

from __future__ import annotations

import pytest

from mlx_watchdog.judge.clearing import (
    DEFAULT_RESTART_S,
    Clearing,
    RestartCost,
    choose,
    restart_cost,
)
from mlx_watchdog.judge.verdict import Evidence

COST = RestartCost(25.0, 3)


def prefilling(done: int, total: int, rate: float | None = 1000.0, **kw: object) -> Evidence:
    left = None if rate is None else (total - done) / rate
    values: dict[str, object] = {
        "abandoned_connections": 1,
        "prefill_done": done,
        "prefill_total": total,
        "prefill_rate_tps": rate,
        "prefill_left_s": left,
        "prefill_age_s": 1.0,
        "prefill_step_s": 2.0,
    }
    values.update(kw)
    return Evidence(**values)  # type: ignore[arg-type]


def test_a_prefill_that_ends_sooner_than_a_restart_is_waited_for() -> None:
    cure = choose(prefilling(16_000, 20_000), COST, None, now=100.0)
    assert cure.wait is not None
    # 4 s left, a 5 s + 1 s margin: given up 10 s from now if it has not served.
    assert cure.wait.until == pytest.approx(110.0)
    assert (cure.wait.began, cure.wait.total) == (100.0, 20_000)
    assert cure.why == (
        "waiting for the abandoned prefill to finish (16,000/20,000 prompt tokens at "
        "1,000 tok/s, about 4 s left) instead of restarting: a restart takes about 25 s here; "
        "restarting if it has not served within 10 s"
    )


@pytest.mark.parametrize(
    ("evidence", "why"),
    [
        (prefilling(2_000, 40_000), "needs about 38 s more (and a 14 s margin); a restart takes"),
        (prefilling(16_000, 20_000, abandoned_connections=2), "2 clients left requests behind"),
        (Evidence(abandoned_connections=1), "no prefill progress can be read"),
        (
            Evidence(abandoned_connections=1, progress_problem="cannot read the log: denied"),
            "its progress cannot be read (cannot read the log: denied)",
        ),
        (prefilling(20_000, 20_000), "the last prefill in the server's log has finished"),
        (prefilling(16_000, 20_000, prefill_age_s=30.0), "logged no step for 30 s"),
        (prefilling(2_048, 20_000, rate=None), "one prefill step logged so far"),
    ],
)
def test_a_restart_is_the_cure_otherwise_and_says_why(evidence: Evidence, why: str) -> None:
    cure = choose(evidence, COST, None, now=100.0)
    assert cure.wait is None
    assert cure.why.startswith("restarting rather than waiting: ")
    assert why in cure.why


def test_the_margin_counts_against_the_restart() -> None:
    """16 s left plus a 9 s margin is 25 s: no cheaper than a 25 s restart."""
    assert choose(prefilling(4_000, 20_000), COST, None, now=0.0).wait is None
    assert choose(prefilling(4_000, 20_000), RestartCost(26.0, 1), None, now=0.0).wait


def test_a_wait_goes_on_while_the_prefill_steps_and_after_it_ends() -> None:
    first = choose(prefilling(16_000, 20_000), COST, None, now=100.0).wait
    assert first is not None
    going = choose(prefilling(18_000, 20_000), COST, first, now=102.0)
    assert going.wait is first and going.why == "waited 2.0 s for the abandoned prefill"
    # Prefilled: the server now decodes for the client that left, then serves the probe.
    ended = choose(prefilling(20_000, 20_000, prefill_age_s=9.0), COST, first, now=108.0)
    assert ended.wait is first


def test_a_wait_is_given_up_past_its_bound_on_more_abandoned_work_or_a_stall() -> None:
    wait = Clearing(100.0, 110.0, 20_000, COST)
    late = choose(prefilling(19_000, 20_000), COST, wait, now=110.0)
    assert late.wait is None
    assert late.why == (
        "waited 10.0 s for the abandoned prefill: it did not clear by its expected end and "
        "a margin; a restart takes about 25 s here"
    )
    more = choose(prefilling(19_000, 20_000, abandoned_connections=3), COST, wait, now=103.0)
    assert more.wait is None and more.why.startswith(
        "waited 3.0 s for the abandoned prefill, then 3"
    )
    stalled = choose(prefilling(19_000, 20_000, prefill_age_s=12.0), COST, wait, now=105.0)
    assert stalled.wait is None and "logged no step for 12 s" in stalled.why
    # A stall is measured against the prefill's own steps: 3 steps of 5 s are no stall.
    slow = choose(
        prefilling(19_000, 20_000, prefill_age_s=12.0, prefill_step_s=5.0), COST, wait, now=105.0
    )
    assert slow.wait is wait


def test_a_restarts_cost_is_the_median_of_the_last_few_measured_here() -> None:
    assert restart_cost([]) == RestartCost(DEFAULT_RESTART_S, 0)
    assert "none measured here yet" in restart_cost([]).describe()
    assert restart_cost([100.0, 0.0, 3.0, 4.0, 5.0, 6.0, 40.0]) == RestartCost(5.0, 5)
    assert restart_cost([12.34]).describe() == "a restart takes about 12 s here"


# -- retry loops, named in numbers --------------------------------------------------------


def wedge(tokens: int, waited: float, rate: float | None = 312.0) -> dict[str, object]:
    """An incident's evidence as the history keeps it."""
    return {"prefill_total": tokens, "gave_up_after_s": [waited], "prefill_rate_tps": rate}


def test_the_same_prompt_abandoned_at_the_same_point_again_is_a_retry_loop_in_numbers() -> None:
    from mlx_watchdog.judge.advice import Abandoned, retry_loop

    seen = [Abandoned.of(wedge(t, w)) for t, w in ((43_118, 55.0), (43_120, 54.0), (43_200, 56.5))]
    assert all(seen)
    assert retry_loop([a for a in seen if a]) == (
        "a client resends a ~43k-token prompt and gives up after ~55 s each time (3 times); "
        "at 312 tok/s it needs ~138 s; it will never succeed until its timeout is above 170 s"
    )
    # Twice is not yet a loop; another prompt size or another wait is another client.
    assert retry_loop([a for a in seen[:2] if a]) is None
    other = [Abandoned.of(wedge(12_000, 55.0)), Abandoned.of(wedge(43_100, 20.0))]
    assert retry_loop([*(a for a in seen[:2] if a), *(a for a in other if a)]) is None
    # No rate read: said without the figure it cannot know.
    norate = [Abandoned.of(wedge(43_118, 55.0, None)) for _ in range(3)]
    assert retry_loop([a for a in norate if a]) == (
        "a client resends a ~43k-token prompt and gives up after ~55 s each time (3 times); "
        "it will never succeed until its timeout is well above 55 s"
    )


@pytest.mark.parametrize(
    "evidence",
    [
        {},
        {"prefill_total": 43_118, "gave_up_after_s": []},
        {"prefill_total": "43k", "gave_up_after_s": [55.0]},
        {"prefill_total": 43_118, "gave_up_after_s": ["soon"]},
        {"prefill_total": -1, "gave_up_after_s": [55.0]},
    ],
)
def test_an_incident_without_a_prompt_and_a_wait_says_nothing_of_loops(
    evidence: dict[str, object],
) -> None:
    from mlx_watchdog.judge.advice import Abandoned

    assert Abandoned.of(evidence) is None
