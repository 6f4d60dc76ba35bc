"""The cheaper cure for a wedge, for everyone waiting behind it: cancel, wait, or restart. Pure.

The clients queued behind a wedge are who the cure is for. A restart loads the model again,
drops every client's prompt cache and kills the queued clients' requests too; so each cure is
costed as the time until the queue is served, and the least is chosen:

- wait: what the server's own log says the abandoned prefill has left (plus a margin: rates
  vary). Abandoned work queued behind it is known once its first step is logged (a tiny request
  costs nothing); the wait is judged again then, never given up in advance.
- cancel: where the server's kind cancels requests on demand, the calls and a token after
  them (CANCEL_S), for exactly the requests of clients that left (act/cancel.py picks them).
- restart: this server's measured restart-to-first-token (RestartCost).

A client that gives up behind the wedge is one more victim to serve sooner, never by itself a
reason to restart. The waiting in one incident is bounded by the restart it avoids: from the
first wait, at most the restart's cost plus MARGIN_S.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from mlx_watchdog.judge.evidence import Evidence

DEFAULT_RESTART_S = 30.0  # a restart's cost until one was measured here (a mid-size model)
COSTS_KEPT = 5  # the restarts whose median is the cost
MARGIN_S = 5.0  # past the prefill's expected end, before the wait is given up
MARGIN_SHARE = 0.25  # and a quarter of what its rate says is left: rates vary
STALL_STEPS = 3.0  # a prefill that logged nothing for this many of its steps has stopped
STALL_MIN_S = 10.0
CANCEL_VERIFY_S = 15.0  # after a cancel, a token within this long or a restart
CANCEL_S = 2.0  # a cancel's expected cost: its calls, and a token after them


@dataclass(frozen=True)
class RestartCost:
    """What a restart costs here: from its start to the first token after it."""

    seconds: float  # from the restart's start to the first token after it
    measured: int  # how many restarts here it is the median of; 0: the default

    def describe(self) -> str:
        if self.measured:
            return f"a restart takes about {self.seconds:.0f} s here"
        return f"a restart is taken to take {self.seconds:.0f} s (none measured here yet)"


def restart_cost(served_s: Sequence[float]) -> RestartCost:
    """The median of the last few restarts' times to the first token, oldest first."""
    kept = [s for s in served_s if s > 0][-COSTS_KEPT:]
    if not kept:
        return RestartCost(DEFAULT_RESTART_S, 0)
    return RestartCost(round(statistics.median(kept), 1), len(kept))


@dataclass(frozen=True)
class Clearing:
    """A wait for an abandoned prefill to finish, on the span clock."""

    began: float
    until: float  # its expected end plus the margin
    total: int  # the prompt tokens of the prefill waited for
    cost: RestartCost
    cancel: bool = False  # the abandoned requests were cancelled: waiting for the token
    margin: float = 0.0  # of `until`, past the prefill's expected end

    def waited(self, now: float) -> str:
        if self.cancel:
            return f"{now - self.began:.1f} s after cancelling the abandoned requests"
        return f"waited {now - self.began:.1f} s for the abandoned prefill"


@dataclass(frozen=True)
class Cure:
    """The cure chosen for a wedge: a wait (for a prefill, after a cancel) or a restart now."""

    wait: Clearing | None  # None: restart now
    why: str


def choose(
    e: Evidence,
    cost: RestartCost,
    clearing: Clearing | None,
    now: float,
    *,
    cancel: str | None = None,
) -> Cure:
    """Cancel, wait or restart, for a wedged verdict's evidence; `clearing` is the cure under
    way. `cancel`: the kind's cancel style ("by_id": by request id, so only requests older
    than every live client are cancelled; "abort_all": only when no live client is there)."""
    if clearing is not None and clearing.cancel:
        return _after_cancel(clearing, now)
    live = e.live_connections
    # By id, live clients are told apart by age, so their count and the oldest's age must
    # be known; all at once, only with none.
    by_id = cancel == "by_id" and live is not None and (live == 0 or e.oldest_live_s is not None)
    cancellable = (e.abandoned_connections or 0) >= 1 and (
        by_id or (cancel == "abort_all" and live == 0)
    )
    wait, why_not = _plan_wait(e, clearing, cost, now)
    if wait is not None and (not cancellable or wait.until - now - wait.margin <= CANCEL_S):
        return Cure(wait, _waiting(e, wait, clearing, cost, now))
    if cancellable and cost.seconds > CANCEL_S:
        fresh = Clearing(now, now + CANCEL_VERIFY_S, e.prefill_total or 0, cost, cancel=True)
        return Cure(
            fresh,
            f"cancelling the abandoned requests through the server's own route instead of "
            f"{'waiting: ' + why_not + '; ' if why_not else 'restarting: '}{cost.describe()}; "
            f"restarting if it has not served within {CANCEL_VERIFY_S:.0f} s",
        )
    if wait is not None:
        return Cure(wait, _waiting(e, wait, clearing, cost, now))
    if clearing is not None:
        return Cure(None, f"{clearing.waited(now)}, then {why_not}")
    return Cure(None, f"restarting rather than waiting: {why_not}")


def _plan_wait(
    e: Evidence, clearing: Clearing | None, cost: RestartCost, now: float
) -> tuple[Clearing | None, str]:
    """The wait worth making now (None, and why not), judged afresh each tick from what the log
    says: its end moves with the prefill's rate, within the incident's bound."""
    began = clearing.began if clearing is not None else now
    bound = began + cost.seconds + MARGIN_S  # waiting never costs more than the restart
    if now >= bound:
        return None, f"waiting longer would cost more than the restart; {cost.describe()}"
    late = f"it did not clear by its expected end and a margin; {cost.describe()}"
    if e.prefill_total is None or e.prefill_done is None or e.prefill_done >= e.prefill_total:
        # Nothing new in the log, or the prefill is done and the server decodes for the
        # client that left: the wait goes on to the end it was given.
        if clearing is not None:
            return (clearing, "") if now < clearing.until else (None, late)
        if e.prefill_total is None or e.prefill_done is None:
            return None, _unread(e)
        return None, (
            "the last prefill in the server's log has finished, so it is not what holds the server"
        )
    stalled = _stalled(e)
    if stalled is not None:
        return None, stalled
    left = e.prefill_left_s
    if left is None:  # one step logged: the next one tells its rate; do not give up before
        step = max(STALL_MIN_S, STALL_STEPS * (e.prefill_step_s or 0.0))
        until = now + step
        if clearing is not None and e.prefill_total == clearing.total:
            until = clearing.until
        return Clearing(began, min(until, bound), e.prefill_total, cost), ""
    # Chosen on what waiting is expected to cost (the estimate runs low: measured 12 s said
    # where 15 were left); given up only past a wider margin, and never past the bound.
    expected = left * (1 + MARGIN_SHARE)
    if expected >= cost.seconds:
        return None, (
            f"the abandoned prefill needs about {left:.0f} s more (about {expected:.0f} s as "
            f"such estimates run); {cost.describe()}"
        )
    if now + expected > bound:
        return None, (
            f"waiting about {expected:.0f} s more would make the wait cost more than the "
            f"restart it avoids; {cost.describe()}"
        )
    margin = MARGIN_S + MARGIN_SHARE * left
    until = min(now + left + margin, bound)
    return Clearing(began, until, e.prefill_total, cost, margin=until - now - left), ""


def _waiting(
    e: Evidence, wait: Clearing, clearing: Clearing | None, cost: RestartCost, now: float
) -> str:
    victims = _victims(e)
    if clearing is not None:
        said = clearing.waited(now)
        if wait.total != clearing.total:
            said += f"; now for the next abandoned prompt ({e.server_prefill})"
        return said + victims
    if e.prefill_left_s is None:
        return (
            f"waiting for the abandoned prefill's next step ({e.prefill_done:,}/"
            f"{e.prefill_total:,} prompt tokens, one step logged: its rate is not known yet) "
            f"instead of restarting: {cost.describe()}{victims}"
        )
    return (
        f"waiting for the abandoned prefill to finish ({e.prefill_done:,}/{e.prefill_total:,} "
        f"prompt tokens at {e.prefill_rate_tps or 0:,.0f} tok/s, about "
        f"{e.prefill_left_s:.0f} s left) instead of restarting: {cost.describe()}; restarting "
        f"if it has not served within {wait.until - now:.0f} s{victims}"
    )


def holds(e: Evidence, wait: Clearing | None) -> bool:
    """A token came while a wait is under way, but the abandoned prompt waited for still steps
    in the log: a batched server serves the probe between its steps. The incident stays open
    (one incident for one prefill) until that prompt is done or stops stepping."""
    if wait is None or wait.cancel or e.prefill_total != wait.total or e.prefill_done is None:
        return False
    return e.prefill_done < wait.total and _stalled(e) is None


def _after_cancel(clearing: Clearing, now: float) -> Cure:
    waited = clearing.waited(now)
    if now < clearing.until:
        return Cure(clearing, waited)
    return Cure(None, f"{waited}, no token yet; {clearing.cost.describe()}")


def _victims(e: Evidence) -> str:
    """The clients that gave up behind the wedge: why the cure should be quick, not which."""
    more = (e.abandoned_connections or 0) - 1
    if more <= 0:
        return ""
    return (
        f" ({more} more client{'s' if more > 1 else ''} gave up behind it; "
        "a restart would not serve them sooner)"
    )


def _unread(e: Evidence) -> str:
    if e.progress_problem:
        return f"its progress cannot be read ({e.progress_problem})"
    return (
        "no prefill progress is in the server's log (mlx_lm.server logs none with "
        "--draft-model), so how long the abandoned work runs is unknown"
    )


def _stalled(e: Evidence) -> str | None:
    if e.prefill_age_s is None:
        return None
    bound = max(STALL_MIN_S, STALL_STEPS * (e.prefill_step_s or 0.0))
    if e.prefill_age_s <= bound:
        return None
    return f"its prefill has logged no step for {e.prefill_age_s:.0f} s"
