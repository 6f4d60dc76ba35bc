"""The states a server can be in and what each means to a monitoring system.

Nothing heavy is imported here: `status` and the endpoint read these without the probe's httpx.
"""

from __future__ import annotations

from enum import StrEnum


class State(StrEnum):
    """A server's state as the watchdog judges it (docs/servers.md, States)."""

    STARTING = "starting"  # (re)started, not serving yet
    HEALTHY = "healthy"  # a token within slow_after
    SLOW = "slow"  # a token, late; or none yet, before wedge_after
    BUSY = "busy"  # the probe waits while live clients are served
    WEDGED = "wedged"  # up, serving nobody
    DEAD = "dead"  # answers generation wrongly
    DOWN = "down"  # nothing listening, or no process


class EventKind(StrEnum):
    """What the watchdog tells: history events, alerts and the hook, the events metric's label."""

    DETECTED = "detected"  # an incident opened
    RESTARTING = "restarting"
    CLEARING = "clearing"  # waiting for an abandoned prefill to finish instead of restarting
    RECOVERED = "recovered"
    RESTART_FAILED = "restart_failed"
    BUDGET_SPENT = "budget_spent"  # a person is needed
    REFUSED = "refused"  # not restarting: the identity check, or manager = "none"
    INTERRUPTED = "interrupted"  # the watchdog stopped during a restart
    BLIND = "blind"  # no fresh verdict
    SEEING = "seeing"  # a fresh verdict again
    TICK_FAILED = "tick_failed"  # history only: a fault in a tick
    GAVE_UP = "gave_up"  # history only: clients that left mid-request
    SUMMARY = "summary"  # the daily summary
    MAINTENANCE = "maintenance"  # a maintenance window: calibrated, restarted, or skipped
    TEST = "test"  # `mlx-watchdog alert test`: the channels reach someone


ALERTS = frozenset(EventKind) - {EventKind.TICK_FAILED, EventKind.GAVE_UP}


STATES: tuple[State, ...] = tuple(State)
UNKNOWN = "unknown"  # shown when there is no fresh verdict; never a verdict itself
SHOWN_STATES: tuple[str, ...] = (*STATES, UNKNOWN)  # what a status document's "state" may be
SERVING_STATES = (State.HEALTHY, State.SLOW, State.BUSY)  # a balancer may route to these
BAD_STATES = (State.WEDGED, State.DEAD, State.DOWN)  # an incident is open

# The monitoring-plugin convention: 0 ok, 1 warning, 2 critical, 3 unknown.
EXIT_CODES: dict[str, int] = {
    State.HEALTHY: 0,
    State.SLOW: 1,
    State.BUSY: 1,
    State.STARTING: 1,
    State.WEDGED: 2,
    State.DEAD: 2,
    State.DOWN: 2,
}
UNKNOWN_EXIT = 3
