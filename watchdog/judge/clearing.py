"""The cheaper cure for a wedge, for everyone waiting behind it: cancel, wait, or restart. Pure.

The clients queued behind a wedge are who the cure is for. A restart loads the model again,
drops every client's prompt cache and kills the queued clients' requests too; so each cure is
costed as the time until the queue is served, and the least is chosen:

- wait: what the server's own log says the abandoned prefill has left (plus a margin: rates
  vary). Abandoned work queued behind it is known once its first step is logged (a tiny request
  costs nothing); the wait is judged again then, never given up in advance.
- cancel: where the server's kind cancels requests on demand, the calls and a token after
  them (CANCEL_S), for exactly the requests of clients that left (act/cancel.py picks them).
- restart: this server's measured restart-to-first-token (RestartCost), plus the work it
  destroys that a client behind needs: when a live request resends the abandoned prompt
  (judge/retry.py) and the process works, everything done on it so far is prefilled again.

A client that gives up behind the wedge is one more victim to serve sooner, never by itself a
reason to restart. The waiting in one incident is bounded by the restart it avoids: from the
first wait, at most the restart's cost plus MARGIN_S. Where the work left cannot be read (a
serial server under --draft-model logs no progress), that bound is the whole rule: wait while
the wait has cost less than the restart (ski rental), which keeps any outage within twice the
least possible, where restarting at once never ends a loop of clients that resend their prompt.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, replace

from mlx_watchdog.judge import retry
from mlx_watchdog.judge.cause import MIN_IDLE_READINGS
from mlx_watchdog.judge.credence import progress_doubt, resend_end
from mlx_watchdog.judge.estimate import Curve, WorkLeft, work_left
from mlx_watchdog.judge.evidence import Evidence

DEFAULT_RESTART_S = 30.0  # a restart's cost until one was measured here (a mid-size model)
COSTS_KEPT = 5  # the restarts whose median is the cost
MARGIN_S = 5.0  # past the prefill's expected end, before the wait is given up
MARGIN_SHARE = 0.25  # and a quarter of what its rate says is left: rates vary
STALL_STEPS = 3.0  # a prefill that logged nothing for this many of its steps has stopped
STALL_MIN_S = 10.0
CANCEL_VERIFY_S = 15.0  # after a cancel, a token within this long or a restart
CANCEL_S = 2.0  # a cancel's expected cost: its calls, and a token after them
IDLE_CPU = 1.0  # at or below this share (of a core, or of the GPU's time where the server
# computes there: judge/evidence.py's work sign) the process is not working


@dataclass(frozen=True)
class RestartCost:
    """What a restart costs here: from its start to the first token after it."""

    seconds: float  # from the restart's start to the first token after it
    measured: int  # how many restarts here it is the median of; 0: the default
    destroyed: float = 0.0  # work a restart throws away that a client behind needs again
    destroyed_why: str = ""

    @property
    def total(self) -> float:
        return self.seconds + self.destroyed

    def describe(self) -> str:
        if self.measured:
            said = f"a restart takes about {self.seconds:.0f} s here"
        else:
            said = f"a restart is taken to take {self.seconds:.0f} s (none measured here yet)"
        if self.destroyed:
            said += f", and costs the retry {self.destroyed:.0f} s more: {self.destroyed_why}"
        return said


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
    total: int  # the prompt tokens of the prefill waited for; 0: work the log does not show
    cost: RestartCost
    cancel: bool = False  # the abandoned requests were cancelled: waiting for the token
    margin: float = 0.0  # of `until`, past the prefill's expected end

    def waited(self, now: float) -> str:
        if self.cancel:
            return f"{now - self.began:.1f} s after cancelling the abandoned requests"
        what = "prefill" if self.total else "work"
        return f"waited {now - self.began:.1f} s for the abandoned {what}"


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
    cap: float | None = None,
    calibrated: Curve | None = None,
) -> Cure:
    """Cancel, wait or restart, for a wedged verdict's evidence; `clearing` is the cure under
    way. `cancel`: the kind's cancel style ("by_id": by request id, so only requests older
    than every live client are cancelled; "abort_all": only when no live client is there).
    `cap`: the longest one incident waits whatever the costs say (the server's max_busy);
    `calibrated`: the server's last calibration, which what clients send is held against
    (judge/credence.py) and the work left read from, where the log says nothing of it."""
    if clearing is not None and clearing.cancel:
        return _after_cancel(clearing, now)
    cost = counting_work(cost, e, clearing)
    said = e.prefill_total is not None
    estimate = None if said else work_left(e.abandoned_bytes, e.abandoned_held_s, calibrated)
    doubt = progress_doubt(e, calibrated, working(e)) if said else None
    resent_by = resend_end(e, calibrated, now) if cost.destroyed else None
    live = e.live_connections
    # By id, live clients are told apart by age, so their count and the oldest's age must
    # be known; all at once, only with none.
    by_id = cancel == "by_id" and live is not None and (live == 0 or e.oldest_live_s is not None)
    cancellable = (e.abandoned_connections or 0) >= 1 and (
        by_id or (cancel == "abort_all" and live == 0)
    )
    wait, why_not = _plan_wait(e, clearing, cost, now, cap, doubt, resent_by)
    if wait is not None and (not cancellable or wait.until - now - wait.margin <= CANCEL_S):
        return Cure(wait, _waiting(e, wait, clearing, cost, now, estimate, doubt))
    if cancellable and cost.seconds > CANCEL_S:
        fresh = Clearing(now, now + CANCEL_VERIFY_S, e.prefill_total or 0, cost, cancel=True)
        return Cure(
            fresh,
            f"cancelling the abandoned requests through the server's own route instead of "
            f"{'waiting: ' + why_not + '; ' if why_not else 'restarting: '}{cost.describe()}; "
            f"restarting if it has not served within {CANCEL_VERIFY_S:.0f} s",
        )
    if wait is not None:
        return Cure(wait, _waiting(e, wait, clearing, cost, now, estimate, doubt))
    if clearing is not None:
        return Cure(None, f"{clearing.waited(now)}, then {why_not}")
    return Cure(None, f"restarting rather than waiting: {why_not}")


def _plan_wait(
    e: Evidence,
    clearing: Clearing | None,
    cost: RestartCost,
    now: float,
    cap: float | None,
    doubt: str | None,
    resent_by: float | None,
) -> tuple[Clearing | None, str]:
    """The wait worth making now (None, and why not), judged afresh each tick from what the log
    says: its end moves with the prefill's rate, within the incident's bound. `doubt`: why the
    log's prefill cannot end the wait early; `resent_by`: when the abandoned work a resend
    needs must have ended (the resend stretches the bound no further)."""
    began = clearing.began if clearing is not None else now
    bound, over = _bound(began, cost, cap, resent_by)
    if now >= bound:
        return None, over
    # Progress lines count only while an abandoned request exists and the process works: a
    # client can write such lines into the log (a logged body), the process's CPU it cannot.
    idle = _idle(e)
    if idle is not None:
        kept = _ended_during(e, clearing, now)
        return (kept, "") if kept is not None else (None, idle)
    if e.prefill_total is None or e.prefill_done is None or e.prefill_done >= e.prefill_total:
        # Nothing new in the log, or the prefill is done and the server decodes for the
        # client that left: a wait for a prefill goes on to the end it was given; past it, or
        # for work the log does not show, the work left is unknown, and is waited for while
        # the wait costs less than the restart.
        # A request's size alone (padding) ends no wait: the estimate on it is said, not acted on.
        if clearing is not None and clearing.total and now < clearing.until:
            return clearing, ""
        return Clearing(began, bound, 0, cost, margin=MARGIN_S), ""
    stalled = _stalled(e)
    if stalled is not None:
        if working(e) is not False:
            # The log went quiet, the process did not (a batched server steps its prompts in
            # turn), or where its work runs cannot be read: what it works on is unknown, and
            # waited for within the bound.
            return Clearing(began, bound, 0, cost, margin=MARGIN_S), ""
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
    if doubt is not None and (expected >= cost.total or now + expected > bound):
        # Only lines a client could have written say it would outlast the restart: unknown,
        # or the prefill waited for so far, while its end is to come.
        if clearing is not None and clearing.total and now < clearing.until:
            return clearing, ""
        return Clearing(began, bound, 0, cost, margin=MARGIN_S), ""
    if expected >= cost.total:
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


def _bound(
    began: float, cost: RestartCost, cap: float | None, resent_by: float | None
) -> tuple[float, str]:
    """When the waiting in one incident ends, whatever the log says, and why then."""
    bound = began + cost.total + MARGIN_S  # waiting never costs more than the restart
    if resent_by is not None:
        bound = min(bound, max(began + cost.seconds, resent_by) + MARGIN_S)
    if cap is not None and began + cap < bound:
        return began + cap, f"the wait reached max_busy ({cap:.0f} s); {cost.describe()}"
    return bound, f"waiting longer would cost more than the restart; {cost.describe()}"


def _waiting(
    e: Evidence,
    wait: Clearing,
    clearing: Clearing | None,
    cost: RestartCost,
    now: float,
    estimate: WorkLeft | None,
    doubt: str | None,
) -> str:
    victims = _victims(e)
    if clearing is not None:
        said = clearing.waited(now)
        if wait.total != clearing.total and wait.total:
            said += f"; now for the next abandoned prompt ({e.server_prefill})"
        elif wait.until > clearing.until + 1.0:
            said += f"; waiting up to {wait.until - now:.0f} s more: {cost.describe()}"
        return said + victims
    if not wait.total:
        guess = f" ({estimate.why})" if estimate is not None else ""
        return (
            f"waiting while it costs less than a restart: {_unknown(e, doubt)}{guess}; "
            f"{cost.describe()}; "
            f"restarting if it has not served within {wait.until - now:.0f} s (so the outage "
            f"stays within twice the least possible){victims}"
        )
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


def holds(e: Evidence, wait: Clearing | None, now: float) -> bool:
    """A token came while a wait is under way, but the abandoned prompt waited for still steps
    in the log: a batched server serves the probe between its steps. The incident stays open
    (one incident for one prefill) until that prompt is done or stops stepping, its request is
    gone, or the wait's end: steps a client wrote into the log hold no incident open."""
    if wait is None or wait.cancel or e.prefill_total != wait.total or e.prefill_done is None:
        return False
    if not e.abandoned_connections or now >= wait.until:
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


def counting_work(cost: RestartCost, e: Evidence, clearing: Clearing | None) -> RestartCost:
    """The restart's cost with the work it would destroy that a client behind needs: all the
    server has done on the resent prompt so far (the least of what the retry would need again),
    while the process works. Once the resend is no longer seen, what was counted stays."""
    before = clearing.cost if clearing is not None else None
    held = e.retry_held_s
    if held is None or not working(e) or e.retry_bytes is None:
        if before is not None and before.destroyed:
            return replace(cost, destroyed=before.destroyed, destroyed_why=before.destroyed_why)
        return cost
    # Each second waited is a second more of the resent prompt's work a restart would throw
    # away, so while it runs the wait never costs more than the restart would: the bound is
    # the incident's cap (max_busy), or the resend's end.
    why = retry.Retry(e.retry_bytes, e.retry_after_s or 0.0, held).describe()
    return replace(cost, destroyed=round(max(0.0, held), 1), destroyed_why=why)


def _ended_during(e: Evidence, clearing: Clearing | None, now: float) -> Clearing | None:
    """The wait under way, kept to its end when the work it waited for ended (the abandoned
    request's socket is gone): a serial server serves the probe next, which under load can
    take longer than one look; one that has not served by the wait's end is restarted there
    (seen: restarted 1.3 s after the abandoned prefill ended, on a loaded machine)."""
    if clearing is None or e.abandoned_connections or now >= clearing.until:
        return None
    return clearing


def _idle(e: Evidence) -> str | None:
    """Why no work is running that a wait could see end, or None: there may be."""
    if not e.abandoned_connections:
        return "no client left work behind (no abandoned request), so waiting would end nothing"
    if e.idle_looks >= MIN_IDLE_READINGS:  # one idle look is a pause, not a stop
        now = e.work_percent if e.work_percent is not None else e.cpu_percent
        where = "the process is" if e.work_on == "cpu" else "its GPU is"
        return (
            f"{where} idle ({e.idle_looks} looks in a row, {e.work_on.upper()} {now or 0:.1f}% "
            "now), so no abandoned work is running that waiting would see end"
        )
    return None


def working(e: Evidence) -> bool | None:
    """Whether the process works now, read where its work runs; None: that cannot be read (a
    GPU with no reading), which is never taken for idle. On the CPU, no reading yet is taken
    as not working, as it always was here."""
    if e.work_on == "cpu":
        return e.cpu_percent is not None and e.cpu_percent > IDLE_CPU
    if e.work_percent is None:
        return None
    return e.work_percent > IDLE_CPU


def _unknown(e: Evidence, doubt: str | None = None) -> str:
    if doubt is not None and e.server_prefill:
        return (
            f"the server's log tells of a prefill that would outlast the restart "
            f"({e.server_prefill}), but no sign a client cannot write agrees: {doubt}; so the "
            "work left is unknown"
        )
    if e.progress_problem:
        return f"the work left cannot be read ({e.progress_problem})"
    if e.prefill_total is not None and e.prefill_done is not None:
        if e.prefill_done < e.prefill_total:
            return (
                f"the prefill in the server's log has logged no step for "
                f"{e.prefill_age_s or 0:.0f} s while the process works, so what it works on "
                "is unknown"
            )
        return (
            "the last prefill in the server's log has finished, and what holds the server "
            "now is not in its log"
        )
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
