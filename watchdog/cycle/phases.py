"""Where a server stands in the incident cycle, and the moves between: each with its events."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from mlx_watchdog.judge.advice import incident_advice
from mlx_watchdog.judge.states import EventKind
from mlx_watchdog.record.store import Ref


class Phase(StrEnum):
    """The states of Supervisor's process model, for one server."""

    NORMAL = "normal"  # no incident open
    FAILING = "failing"  # an incident is open and no restart is running
    RESTARTING = "restarting"  # the manager is replacing the server
    HELD = "held"  # the restart budget is spent: a person is needed; probing goes on


# Each allowed move, and the events it may fire: the one place incident events come from.
TRANSITIONS: dict[tuple[Phase, Phase], frozenset[EventKind | None]] = {
    # A wedged, dead or down verdict opens an incident.
    (Phase.NORMAL, Phase.FAILING): frozenset({EventKind.DETECTED}),
    # A wedge whose abandoned prefill ends sooner than a restart would bring the server back.
    (Phase.FAILING, Phase.FAILING): frozenset({EventKind.CLEARING}),
    # A trigger the budget allows; or a person's restart, held or not, incident or not.
    (Phase.FAILING, Phase.RESTARTING): frozenset({EventKind.RESTARTING}),
    (Phase.HELD, Phase.RESTARTING): frozenset({EventKind.RESTARTING}),
    (Phase.NORMAL, Phase.RESTARTING): frozenset({EventKind.RESTARTING}),
    # A token after the restart; or a person's restart of a server with no incident open,
    # whatever its end (a server that does not serve afterwards gets its incident next tick).
    (Phase.RESTARTING, Phase.NORMAL): frozenset(
        {EventKind.RECOVERED, None, EventKind.RESTART_FAILED, EventKind.INTERRUPTED}
    ),
    # No token by startup_grace, a manager that failed, or the watchdog stopping meanwhile.
    (Phase.RESTARTING, Phase.FAILING): frozenset({EventKind.RESTART_FAILED, EventKind.INTERRUPTED}),
    (Phase.RESTARTING, Phase.HELD): frozenset({EventKind.RESTART_FAILED, EventKind.INTERRUPTED}),
    # The budget is spent: nothing more is tried until a person acts or the server serves.
    (Phase.FAILING, Phase.HELD): frozenset({EventKind.BUDGET_SPENT}),
    # A token without a restart: it recovered by itself, which also ends a hold.
    (Phase.FAILING, Phase.NORMAL): frozenset({EventKind.RECOVERED}),
    (Phase.HELD, Phase.NORMAL): frozenset({EventKind.RECOVERED, None}),
    # A hold outlives its incident (a person's restart that did not cure, a history written in
    # part): a failure then opens one, and the server stays held.
    (Phase.HELD, Phase.HELD): frozenset({EventKind.DETECTED}),
}


@dataclass
class OpenIncident:
    """An incident lives here, in memory; its history row is optional (a locked or lost
    database must not make the watchdog announce it again at every tick, nor forget to close it).
    """

    began_at: float  # wall time serving stopped, as the probes saw it
    state: str  # the state that opened it
    id: Ref = None  # its row in the history (written behind: its id once written)
    advised_waits: list[float] = field(default_factory=list)  # what the advice says
    loop: str | None = None  # a retry loop named when it opened
    told: bool = False  # its advice was given (when it opened)
    waited: bool = False  # for an abandoned prefill: once an incident, then restarts only
    earlier: int = 0  # wedges from abandoned requests in the budget's window, each cured
    cause: str = "unknown"  # the cause it was named for (the first named, or the last)
    # When serving stopped on the span clock: the outage is measured there, so a wall clock
    # stepped meanwhile does not make it negative (None: one reopened from the history).
    began_mono: float | None = None

    def advice(
        self,
        waits: Sequence[float],
        calibration: Callable[[], dict[str, Any] | None],
        gone: int = 0,
    ) -> str | None:
        """What to tell people, when more clients gave up than they were told of (and when
        it opened): the retry loop it opened with, then the timeouts clients need. `gone`:
        the clients that left in all (some may have come and gone between two looks)."""
        told_of = [*waits, gone]
        if self.told and (not waits or told_of == self.advised_waits):
            return None
        self.told, self.advised_waits = True, told_of
        told = incident_advice(waits, calibration(), gone) if waits else None
        return "; ".join(p for p in (self.loop, told) if p) or None
