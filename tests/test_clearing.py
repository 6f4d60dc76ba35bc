"""The cheaper cure, chosen in the pure judge: wait for an abandoned prefill, or restart."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_watchdog.judge import clearing
from mlx_watchdog.judge.clearing import (
    DEFAULT_RESTART_S,
    MARGIN_S,
    Clearing,
    Cure,
    RestartCost,
    restart_cost,
)
from mlx_watchdog.judge.estimate import Curve
from mlx_watchdog.judge.evidence import Evidence

COST = RestartCost(25.0, 3)
# A calibrated server that prefills 1,000 tokens a second, 4 bytes of a request a token: the
# progress lines below agree with it, and with their requests' sizes (judge/credence.py).
CALIBRATED = Curve(0.0, 1 / 1000, 0.0, 4.0)


def choose(e: Evidence, cost: RestartCost, wait: Clearing | None, **kw: object) -> Cure:
    """clearing.choose, on the calibrated server unless told otherwise."""
    kw.setdefault("calibrated", CALIBRATED)
    return clearing.choose(e, cost, wait, **kw)  # type: ignore[arg-type]


def prefilling(done: int, total: int, rate: float | None = 1000.0, **kw: object) -> Evidence:
    left = None if rate is None else (total - done) / rate
    values: dict[str, object] = {
        "abandoned_connections": 1,
        "abandoned_bytes": 4 * total,
        "cpu_percent": 100.0,
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
        (
            prefilling(2_000, 40_000),
            "needs about 38 s more (about 48 s as such estimates run); a restart takes",
        ),
        (
            prefilling(16_000, 20_000, prefill_age_s=30.0, cpu_percent=0.0),
            "logged no step for 30 s",
        ),
    ],
)
def test_a_restart_is_the_cure_when_the_work_left_is_known_to_cost_more(
    evidence: Evidence, why: str
) -> None:
    cure = choose(evidence, COST, None, now=100.0)
    assert cure.wait is None
    assert cure.why.startswith("restarting rather than waiting: ")
    assert why in cure.why


@pytest.mark.parametrize(
    ("evidence", "why"),
    [
        (Evidence(abandoned_connections=1), "no prefill progress is in the server's log"),
        (
            Evidence(abandoned_connections=1, progress_problem="cannot read the log: denied"),
            "the work left cannot be read (cannot read the log: denied)",
        ),
        (prefilling(20_000, 20_000), "the last prefill in the server's log has finished"),
    ],
)
def test_unknown_work_is_waited_for_while_the_wait_costs_less_than_a_restart(
    evidence: Evidence, why: str
) -> None:
    """Unknown is no reason to act at once: the wait is bounded by the restart it avoids."""
    cure = choose(evidence, COST, None, now=100.0)
    assert cure.wait is not None and cure.wait.total == 0
    assert cure.wait.until == pytest.approx(100.0 + 25.0 + MARGIN_S)
    assert cure.why.startswith("waiting while it costs less than a restart: ")
    assert why in cure.why and "a restart takes about 25 s here" in cure.why
    assert "restarting if it has not served within 30 s" in cure.why
    going = choose(evidence, COST, cure.wait, now=129.0)
    assert going.wait is not None and going.wait.began == 100.0
    assert going.why == "waited 29.0 s for the abandoned work"
    over = choose(evidence, COST, going.wait, now=130.0)
    assert over.wait is None
    assert over.why == (
        "waited 30.0 s for the abandoned work, then waiting longer would cost more than the "
        "restart; a restart takes about 25 s here"
    )


def resent(held: float, cpu: float | None = 100.0, **kw: object) -> Evidence:
    values: dict[str, object] = {
        "abandoned_connections": 1,
        "live_connections": 1,
        "cpu_percent": cpu,
        "retry_bytes": 65_536,
        "retry_after_s": 0.4,
        "retry_held_s": held,
    }
    values.update(kw)
    return Evidence(**values)  # type: ignore[arg-type]


def test_a_restart_costs_the_work_it_destroys_when_a_client_resends_the_prompt() -> None:
    """The seed's loop: the agent resends its prompt; what the server has done on the
    abandoned one answers it, a restart redoes it all. 15 s done: the bound grows by 15 s."""
    cheap = RestartCost(3.0, 2)  # a restart cheaper than the prompt's prefill
    cure = choose(resent(15.0), cheap, None, now=100.0)
    assert cure.wait is not None
    assert cure.wait.until == pytest.approx(100.0 + 3.0 + 15.0 + MARGIN_S)
    assert cure.wait.cost.destroyed == 15.0
    assert (
        "a restart takes about 3 s here, and costs the retry 15 s more: a client resends the "
        "abandoned ~64 KiB request 0 s after giving up; the 15 s of work already done on it "
        "will answer it, where a restart would start it again from zero" in cure.why
    )
    # Judged again: each second waited is a second more of work a restart would throw away,
    # so while the resent prompt is worked on, the wait never costs more than the restart.
    going = choose(resent(20.0), cheap, cure.wait, now=105.0)
    assert going.wait is not None and going.wait.until == pytest.approx(100 + 3 + 20 + MARGIN_S)
    # The resend gone (served, or it left too): what was counted stays counted, so the wait
    # ends within a restart's cost of it.
    later = choose(Evidence(abandoned_connections=1), cheap, going.wait, now=110.0)
    assert later.wait is not None and later.wait.until == going.wait.until
    assert choose(Evidence(abandoned_connections=1), cheap, later.wait, now=128.0).wait is None
    # Without the resent prompt the same restart bounds the wait at its own cost.
    alone = choose(Evidence(abandoned_connections=1), cheap, None, now=100.0).wait
    assert alone is not None and alone.until == pytest.approx(100.0 + 3.0 + MARGIN_S)


def test_a_resent_prompt_worked_on_forever_is_waited_for_no_longer_than_max_busy() -> None:
    wait = None
    for now in range(100, 400):
        cure = choose(resent(float(now - 90)), COST, wait, now=float(now), cap=120.0)
        if cure.wait is None:
            break
        wait = cure.wait
    assert now == 220
    assert cure.why.startswith(
        "waited 120.0 s for the abandoned work, then the wait reached max_busy"
    )


def test_one_idle_look_is_a_pause_not_a_stop() -> None:
    cure = choose(resent(15.0, cpu=0.0, idle_looks=2), RestartCost(3.0, 2), None, now=100.0)
    assert cure.wait is not None and cure.wait.cost.destroyed == 0.0


def test_work_not_known_to_run_is_not_counted() -> None:
    """A process whose CPU is not known yet does no work a restart could be said to destroy."""
    cure = choose(resent(15.0, cpu=None), RestartCost(3.0, 2), None, now=100.0)
    assert cure.wait is not None and cure.wait.cost.destroyed == 0.0
    assert cure.wait.until == pytest.approx(100.0 + 3.0 + MARGIN_S)


@pytest.mark.parametrize(
    ("evidence", "why"),
    [
        (
            resent(15.0, cpu=0.0, idle_looks=3),
            "the process is idle (3 looks in a row, CPU 0.0% now), so no abandoned work is running",
        ),
        (prefilling(16_000, 20_000, idle_looks=4), "the process is idle (4 looks in a row"),
        (Evidence(live_connections=0), "no client left work behind (no abandoned request)"),
    ],
)
def test_with_no_work_running_unknown_is_no_reason_to_wait(evidence: Evidence, why: str) -> None:
    """Nothing runs that could end by itself: an idle process, or a wedge no client left work
    in (a server that serves nobody). Waiting would cure nothing: the restart, at once."""
    cure = choose(evidence, COST, None, now=100.0)
    assert cure.wait is None and cure.why.startswith("restarting rather than waiting: ")
    assert why in cure.why


def test_work_that_ends_during_the_wait_gives_the_server_the_waits_end_to_serve() -> None:
    """The abandoned request's socket is gone mid-wait: its work ended, and a serial server
    serves the probe next. Not "nothing to wait for": the wait keeps its end, and only a
    server that has not served by then is restarted."""
    wait = Clearing(100.0, 110.0, 20_000, COST, margin=6.0)
    ended = Evidence(live_connections=0, abandoned_connections=0, waited_s=5.0)
    goes_on = choose(ended, COST, wait, now=104.0)
    assert goes_on.wait == wait
    late = choose(ended, COST, wait, now=110.0)
    assert late.wait is None and "no client left work behind" in late.why


@settings(max_examples=200, deadline=None)
@given(
    left=st.floats(min_value=0.0, max_value=600.0),
    restart=st.floats(min_value=1.0, max_value=300.0),
)
def test_unknown_work_keeps_any_outage_within_twice_the_least_possible(
    left: float, restart: float
) -> None:
    """Ski rental, ticked each second: the work ends `left` s after the wait began (unknown to
    the judge), or the restart serves `restart` s after it begins. The outage from the wait's
    start is at most twice the lesser, plus the margin and a tick."""
    cost = RestartCost(restart, 1)
    wait: Clearing | None = None
    now = 0.0
    while True:
        if wait is not None and now >= left:
            outage = now  # served by the work's own end, noticed at this tick
            break
        cure = choose(Evidence(abandoned_connections=1), cost, wait, now=now)
        if cure.wait is None:
            outage = now + restart
            break
        wait = cure.wait
        now += 1.0
    assert outage <= 2 * min(left, restart) + MARGIN_S + 1.0


def test_the_margin_counts_against_the_restart() -> None:
    """A prefill's time left runs about a quarter low: 20 s said is 25 s expected, no cheaper
    than a 25 s restart; 16 s said (20 expected) is, and its wait may run to the bound."""
    assert choose(prefilling(2_000, 22_000), COST, None, now=0.0).wait is None
    wait = choose(prefilling(4_000, 20_000), COST, None, now=0.0).wait
    assert wait is not None and wait.until == 0.0 + 16 + 5 + 4
    assert choose(prefilling(4_000, 20_000), RestartCost(26.0, 1), None, now=0.0).wait


def test_a_wait_goes_on_while_the_prefill_steps_and_after_it_ends() -> None:
    first = choose(prefilling(16_000, 20_000), COST, None, now=100.0).wait
    assert first is not None
    going = choose(prefilling(18_000, 20_000), COST, first, now=102.0)
    assert going.wait is not None and (going.wait.began, going.wait.total) == (100.0, 20_000)
    assert going.why == "waited 2.0 s for the abandoned prefill"
    # Prefilled: the server now decodes for the client that left, then serves the probe.
    ended = choose(prefilling(20_000, 20_000, prefill_age_s=9.0), COST, first, now=108.0)
    assert ended.wait is first


def test_a_wait_is_given_up_past_its_bound_or_on_a_stall() -> None:
    wait = Clearing(100.0, 110.0, 20_000, COST, margin=6.0)
    # Prefilled, then decoding for the client that left past the end it was given: how
    # long that runs is unknown, so it is waited for within the restart's cost.
    late = choose(prefilling(20_000, 20_000), COST, wait, now=110.0)
    assert late.wait is not None and late.wait.until == pytest.approx(100.0 + 25.0 + MARGIN_S)
    assert late.why.startswith("waited 10.0 s for the abandoned prefill; waiting up to 20 s more")
    over = choose(prefilling(20_000, 20_000), COST, late.wait, now=130.0)
    assert over.wait is None and "waiting longer would cost more than the restart" in over.why
    still = prefilling(19_000, 20_000, prefill_age_s=12.0, cpu_percent=0.0)
    stalled = choose(still, COST, wait, now=105.0)
    assert stalled.wait is None and "logged no step for 12 s" in stalled.why
    # Quiet in the log while the process works (a batched server steps its prompts in turn):
    # not a stop, but work of unknown length, waited for within the bound.
    quiet = prefilling(19_000, 20_000, prefill_age_s=12.0, cpu_percent=100.0)
    going = choose(quiet, COST, wait, now=105.0)
    assert going.wait is not None and going.wait.until == pytest.approx(100.0 + 25 + MARGIN_S)
    fresh = choose(quiet, COST, None, now=105.0)
    assert fresh.wait is not None and "has logged no step for 12 s while the process works" in (
        fresh.why
    )
    # A stall is measured against the prefill's own steps: 3 steps of 5 s are no stall.
    slow = choose(
        prefilling(19_000, 20_000, prefill_age_s=12.0, prefill_step_s=5.0), COST, wait, now=105.0
    )
    assert slow.wait is not None and slow.wait.began == wait.began


def test_clients_that_give_up_behind_the_wedge_are_victims_not_a_reason_to_restart() -> None:
    """The field case: 3 s of prefill left, a load balancer's 5 s health check gives up behind
    it. A restart (25 s) would serve nobody sooner, and would kill the queued requests too."""
    cure = choose(prefilling(16_000, 20_000, abandoned_connections=2), COST, None, now=100.0)
    assert cure.wait is not None
    assert "1 more client gave up behind it; a restart would not serve them sooner" in cure.why
    going = choose(prefilling(18_000, 20_000, abandoned_connections=4), COST, cure.wait, now=102.0)
    assert going.wait is not None and going.wait.began == cure.wait.began
    assert going.why.startswith("waited 2.0 s for the abandoned prefill (3 more clients")


def test_a_long_abandoned_prompt_queued_behind_is_judged_when_it_is_logged() -> None:
    first = choose(prefilling(16_000, 20_000), COST, None, now=100.0).wait
    assert first is not None
    # The next abandoned prompt (8,000 tokens) starts: 6 s left, within the incident's bound.
    nxt = choose(prefilling(2_000, 8_000), COST, first, now=106.0)
    assert nxt.wait is not None and nxt.wait.total == 8_000 and nxt.wait.began == 100.0
    assert nxt.wait.until == pytest.approx(106.0 + 6.0 + 5.0 + 1.5)
    assert "now for the next abandoned prompt" in nxt.why
    # One step of a third one logged: its rate is not known yet, so the wait goes on (it is
    # not given up in advance), bounded by the restart's cost from the first wait.
    third = choose(prefilling(2_048, 30_000, rate=None), COST, nxt.wait, now=119.0)
    assert third.wait is not None and third.wait.until <= 100.0 + COST.seconds + 5.0
    # Its rate says 20 s more: the waiting in all would pass the restart it avoids.
    given_up = choose(prefilling(10_000, 30_000), COST, third.wait, now=121.0)
    assert given_up.wait is None
    assert "restart" in given_up.why and given_up.why.startswith("waited 21.0 s")


def test_the_waiting_in_one_incident_never_passes_the_restart_plus_a_margin() -> None:
    wait = choose(prefilling(16_000, 20_000), COST, None, now=0.0).wait
    now, rounds = 0.0, 0
    # Prompt after prompt, each 4 s from its end when first judged: a chain that never ends.
    while wait is not None and rounds < 100:
        now += 3.0
        rounds += 1
        cure = choose(prefilling(16_000 + rounds, 20_000 + rounds), COST, wait, now=now)
        wait = cure.wait
    assert wait is None and now <= COST.seconds + 5.0 + 3.0


def test_a_prefill_that_slows_is_waited_for_past_its_first_end_while_cheaper() -> None:
    """Measured on the real server: a long prompt's prefill slows as its context grows (2,533
    tok/s at 10k tokens, 1,284 at 22k), so its first expected end passes with it still
    stepping. 2 s more is waited, not given up for a 25 s restart."""
    first = choose(prefilling(10_240, 25_407, rate=2533.0), COST, None, now=100.0).wait
    assert first is not None and first.until == pytest.approx(100.0 + 6.0 + 5.0 + 1.5, abs=0.1)
    later = choose(prefilling(22_528, 25_407, rate=1284.0), COST, first, now=113.0)
    assert later.wait is not None and later.wait.until == pytest.approx(113.0 + 2.2 + 5.6, abs=0.1)


def test_one_step_logged_waits_for_the_next_instead_of_giving_up() -> None:
    cure = choose(prefilling(2_048, 24_000, rate=None), COST, None, now=100.0)
    assert cure.wait is not None and cure.wait.until == pytest.approx(110.0)
    assert "one step logged: its rate is not known yet" in cure.why
    # The second step tells the rate: 20 s more and its margin pass the restart: restart then.
    later = choose(prefilling(4_000, 24_000, rate=1000.0), COST, cure.wait, now=102.0)
    assert later.wait is None and "needs about 20 s more" in later.why


@pytest.mark.parametrize(
    ("cancel", "live", "cancels"),
    [
        ("by_id", 0, True),
        ("by_id", 1, True),  # only the requests older than every live client are cancelled
        ("abort_all", 0, True),
        ("abort_all", 1, False),  # it would end the live client's request too
        (None, 0, False),
    ],
)
def test_cancel_is_the_cure_when_the_wait_is_long_or_unknown(
    cancel: str | None, live: int, cancels: bool
) -> None:
    e = Evidence(
        abandoned_connections=1, live_connections=live, oldest_live_s=3.0 if live else None
    )
    cure = choose(e, COST, None, now=100.0, cancel=cancel)
    assert (cure.wait is not None and cure.wait.cancel) == cancels, cure.why
    if not cancels:  # the unknown work is waited for, within the restart's cost
        assert cure.wait is not None and cure.wait.total == 0
        assert cure.why.startswith("waiting while it costs less than a restart")


def test_a_wait_with_less_left_than_a_cancel_costs_is_waited() -> None:
    near = prefilling(19_000, 20_000, live_connections=0)
    assert not choose(near, COST, None, now=0.0, cancel="by_id").wait.cancel  # type: ignore[union-attr]
    far = prefilling(10_000, 20_000, live_connections=0)
    assert choose(far, COST, None, now=0.0, cancel="by_id").wait.cancel  # type: ignore[union-attr]


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


def test_a_token_between_the_steps_of_the_prompt_waited_for_holds_the_incident_open() -> None:
    from mlx_watchdog.judge.clearing import holds

    wait = Clearing(100.0, 120.0, 20_000, COST, margin=6.0)
    assert holds(prefilling(18_000, 20_000), wait, 110.0)  # the same prompt still steps
    assert not holds(prefilling(20_000, 20_000), wait, 110.0)  # done: the incident can close
    stopped = prefilling(18_000, 20_000, prefill_age_s=30.0)
    assert not holds(stopped, wait, 110.0)  # stopped stepping
    assert not holds(prefilling(1_000, 9_000), wait, 110.0)  # another prompt
    assert not holds(prefilling(18_000, 20_000), None, 110.0)  # no wait under way
    cancel = Clearing(100.0, 115.0, 20_000, COST, cancel=True)
    assert not holds(prefilling(18_000, 20_000), cancel, 110.0)
    # Steps a client wrote into the log hold nothing open past the wait's end, or once the
    # abandoned request is gone (issue 54: forged steps held an incident open 70 s).
    assert not holds(prefilling(18_000, 20_000), wait, 120.0)
    assert not holds(prefilling(18_000, 20_000, abandoned_connections=0), wait, 110.0)


def test_a_resend_first_seen_during_a_wait_is_said_once_as_the_wait_grows() -> None:
    """A loaded machine may judge the wedge before the client's first resend arrives: the wait
    begins on what is unknown, then the resend is seen and the wait lasts longer. That is said
    (the cycle records it as a clearing event) once, not at each judgement after."""
    from mlx_watchdog.cycle.least_cost import LeastCost

    cheap, least = RestartCost(3.0, 2), LeastCost()
    alone = Evidence(abandoned_connections=1, cpu_percent=100.0)
    first = least.plan(alone, cheap, 100.0, waited_before=False, cancel=None)
    assert first.begins is not None and "resends" not in first.why
    seen = least.plan(resent(6.0), cheap, 102.0, waited_before=False, cancel=None)
    assert seen.begins is None and seen.restart_why is None
    assert "a client resends the abandoned ~64 KiB request" in seen.goes_on
    assert least.clearing is not None and least.clearing.until > first.begins.until
    again = least.plan(resent(7.0), cheap, 103.0, waited_before=False, cancel=None)
    assert again.begins is None and again.goes_on == "" and again.restart_why is None
