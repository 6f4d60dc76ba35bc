"""The cheaper cure for a wedge: cancel the abandoned work, wait for it, or restart. Pure.

A restart loads the model again and drops every client's prompt cache. When the only abandoned
work is the prefill in flight and the server's own log says it ends sooner than a restart would
bring the server back, waiting costs less: the server is "clearing", judged again each tick,
and restarted if it has not served by the prefill's expected end plus a margin. With no progress
to read (mlx-lm logs none under --draft-model), a prefill that stopped stepping, or abandoned
requests queued behind the one in flight, the cure is a restart, and its reason says why.
Cheaper still, where the server's kind cancels requests on demand and only clients that left
are connected: cancel their requests, and restart only if no token follows.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from mlx_watchdog.judge.verdict import Evidence

DEFAULT_RESTART_S = 30.0  # a restart's cost until one was measured here (a mid-size model)
COSTS_KEPT = 5  # the restarts whose median is the cost
MARGIN_S = 5.0  # past the prefill's expected end, before the wait is given up
MARGIN_SHARE = 0.25  # and a quarter of what its rate says is left: rates vary
STALL_STEPS = 3.0  # a prefill that logged nothing for this many of its steps has stopped
STALL_MIN_S = 10.0
CANCEL_VERIFY_S = 15.0  # after a cancel, a token within this long or a restart


@dataclass(frozen=True)
class RestartCost:
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

    def waited(self, now: float) -> str:
        if self.cancel:
            return f"{now - self.began:.1f} s after cancelling the abandoned requests"
        return f"waited {now - self.began:.1f} s for the abandoned prefill"


@dataclass(frozen=True)
class Cure:
    wait: Clearing | None  # None: restart now
    why: str


def choose(
    e: Evidence,
    cost: RestartCost,
    clearing: Clearing | None,
    now: float,
    *,
    can_cancel: bool = False,
) -> Cure:
    """Cancel, wait or restart, for a wedged verdict's evidence; `clearing` is the wait under
    way. `can_cancel`: the server's kind cancels requests on demand."""
    if clearing is not None:
        return _still(e, clearing, now)
    if can_cancel and e.live_connections == 0 and (e.abandoned_connections or 0) >= 1:
        # Only clients that left are connected: whatever the server works on is theirs.
        wait = Clearing(now, now + CANCEL_VERIFY_S, e.prefill_total or 0, cost, cancel=True)
        return Cure(
            wait,
            f"cancelling the abandoned requests through the server's own route instead of "
            f"restarting ({cost.describe()}); restarting if it has not served within "
            f"{CANCEL_VERIFY_S:.0f} s",
        )
    if (e.abandoned_connections or 0) > 1:
        return Cure(None, f"restarting rather than waiting: {_queued(e)}")
    if e.prefill_total is None or e.prefill_done is None:
        return Cure(None, f"restarting rather than waiting: {_unread(e)}")
    if e.prefill_done >= e.prefill_total:
        return Cure(
            None,
            "restarting rather than waiting: the last prefill in the server's log has finished, "
            "so it is not what holds the server",
        )
    stalled = _stalled(e)
    if stalled is not None:
        return Cure(None, f"restarting rather than waiting: {stalled}")
    left = e.prefill_left_s
    if left is None:
        return Cure(
            None,
            "restarting rather than waiting: one prefill step logged so far, no rate to tell "
            "its end by",
        )
    margin = MARGIN_S + MARGIN_SHARE * left
    if left + margin >= cost.seconds:
        return Cure(
            None,
            f"restarting rather than waiting: the abandoned prefill needs about {left:.0f} s "
            f"more (and a {margin:.0f} s margin); {cost.describe()}",
        )
    wait = Clearing(now, now + left + margin, e.prefill_total, cost)
    return Cure(
        wait,
        f"waiting for the abandoned prefill to finish ({e.prefill_done:,}/{e.prefill_total:,} "
        f"prompt tokens at {e.prefill_rate_tps or 0:,.0f} tok/s, about {left:.0f} s left) "
        f"instead of restarting: {cost.describe()}; restarting if it has not served within "
        f"{left + margin:.0f} s",
    )


def _still(e: Evidence, clearing: Clearing, now: float) -> Cure:
    """The wait goes on until the server serves, unless it is plainly not clearing."""
    waited = clearing.waited(now)
    if clearing.cancel:
        if now < clearing.until:
            return Cure(clearing, waited)
        return Cure(None, f"{waited}, no token yet; {clearing.cost.describe()}")
    if (e.abandoned_connections or 0) > 1:
        return Cure(None, f"{waited}, then {_queued(e)}")
    if now >= clearing.until:
        return Cure(
            None,
            f"{waited}: it did not clear by its expected end and a margin; "
            f"{clearing.cost.describe()}",
        )
    waiting_for = e.prefill_total == clearing.total and e.prefill_done != e.prefill_total
    stalled = _stalled(e) if waiting_for else None
    if stalled is not None:
        return Cure(None, f"{waited}, then {stalled}")
    return Cure(clearing, waited)


def _queued(e: Evidence) -> str:
    return (
        f"{e.abandoned_connections} clients left requests behind, so more abandoned work "
        "waits behind the one in flight"
    )


def _unread(e: Evidence) -> str:
    if e.progress_problem:
        return f"its progress cannot be read ({e.progress_problem})"
    return (
        "no prefill progress can be read (from the server's log: `log_file` under manager = "
        '"process", or a launchd job\'s StandardErrorPath; none was found, or no prefill is in '
        "it: mlx_lm.server logs none with --draft-model)"
    )


def _stalled(e: Evidence) -> str | None:
    if e.prefill_age_s is None:
        return None
    bound = max(STALL_MIN_S, STALL_STEPS * (e.prefill_step_s or 0.0))
    if e.prefill_age_s <= bound:
        return None
    return f"its prefill has logged no step for {e.prefill_age_s:.0f} s"
