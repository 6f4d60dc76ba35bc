"""One restart of one server: whether the budget allows it, and from its dump to how it ended.

The cycle decides a restart is due and that the budget and the identity check allow it; an
`Attempt` then takes the server's last words, climbs the ladder (act/ladder.py: drain, the
manager, a token), and hands the cycle's ledger each step: `Dumped`, `RestartBegun` (before the
manager acts, so a watchdog killed meanwhile still counts it), `RestartEnded` and the action.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from mlx_watchdog.act.ladder import Climb, Drain
from mlx_watchdog.act.managers import Outcome
from mlx_watchdog.cycle import incidents
from mlx_watchdog.cycle.cures import settle_for, unloader_for
from mlx_watchdog.cycle.ledger import Acted, Dumped, Held, RestartBegun, RestartEnded
from mlx_watchdog.cycle.phases import Phase
from mlx_watchdog.judge import budget
from mlx_watchdog.judge.cause import Cause, budget_spent
from mlx_watchdog.judge.states import EventKind
from mlx_watchdog.record.store import Ref
from mlx_watchdog.sense.memory import resident

if TYPE_CHECKING:
    from mlx_watchdog.cycle.cycle import Cycle

log = logging.getLogger("mlx_watchdog")


class Attempt:
    """One restart under way: what it is for, and the history row it began."""

    def __init__(
        self, cycle: Cycle, trigger: str, reason: str, pid: int | None, *, manual: bool
    ) -> None:
        self.cycle, self.trigger, self.reason, self.pid = cycle, trigger, reason, pid
        self.manual = manual
        self.row: Ref = None
        self.began = cycle.wall()

    def climb(self) -> Climb:
        c = self.cycle
        dump = c.crew.dump(self.pid, c.server.log_file)  # what the restart throws away
        incident = c.incident.id if c.incident else None
        c.ledger.record(Dumped(dump.at, incident, {**dump.to_json(), "kind": c.server.kind}))
        # A person's drain stays after the restart.
        drains = c.server.restart.drain and not c.draining
        system, v = c.crew.ladder.system, None if self.manual else c.verdict
        # Clients on a server that holds abandoned work cannot finish before it: not waited for.
        behind = v is not None and bool(v.evidence.abandoned_connections)

        def freed() -> int:  # asked only under memory pressure: a manager's pid() may run a command
            return resident(c.manager.pid())

        return c.crew.ladder.climb(
            c.server,
            c.manager,
            c.checker,
            drain=Drain(c.drain, c.undrain, not behind, self._out) if drains else None,
            begin=self._begin,
            settle=settle_for(v, freed, c.crew.machine, system, c.mono),
            unload=unloader_for(v, c.server, self.pid, system, c.mono),
        )

    def _out(self) -> bool:
        return self.cycle.crew.rotation.wait_out(self.cycle.server.name)

    def _begin(self) -> None:
        """Recorded before the manager acts (after the drain)."""
        c = self.cycle
        self.began = c.wall()
        c.left_stopped = None
        if (ended := c.least.restarting(c.mono())) is not None:
            c.record_cure(*ended)
        self.row = c.ledger.record(RestartBegun(self.began, c.mono(), self.trigger))
        how = f"restarting through {c.manager.kind} ({self.reason})"
        c.transition(
            Phase.RESTARTING, EventKind.RESTARTING, how, trigger=self.trigger, pid=self.pid
        )

    def ended(self, climb: Climb) -> bool:
        """How the climb ended, recorded; True when the server serves again."""
        c, started, trigger = self.cycle, self.began, self.trigger
        if climb.result == "served":  # during the drain, before any restart
            action = {"at": c.wall(), "action": "drain", "outcome": "served again"}
            c.ledger.record(Acted(c.incident.id if c.incident else None, action))
            how = "served again during the drain, not restarted"
            incidents.recovered(c, c.wall(), recover_s=None, how=how)
            return True
        served_s = None if climb.served_at is None else climb.served_at - started
        c.ledger.record(RestartEnded(self.row, started, trigger, c.wall(), climb.result, served_s))
        action = climb.action(started, trigger, c.manager.kind)
        c.ledger.record(Acted(c.incident.id if c.incident else None, action))
        if climb.served_at is not None and served_s is not None:
            incidents.recovered(c, climb.served_at, recover_s=served_s, how="restarted")
            return True
        self._not_restarted(climb.result, climb.outcome)
        return False

    def _not_restarted(self, result: str, outcome: Outcome) -> None:
        c = self.cycle
        back = (
            Phase.HELD
            if c.needs_person is not None
            else (Phase.FAILING if c.incident is not None else Phase.NORMAL)
        )
        if result == "interrupted":
            c.transition(back, EventKind.INTERRUPTED, "the watchdog stopped during the restart")
            return
        exited = c.manager.exited()
        if not outcome.ok:
            why = outcome.detail
        elif exited is not None:
            why = f"the server {exited} before it served"
        else:
            why = f"no token within startup_grace ({c.server.probe.startup_grace:g}s)"
        c.transition(back, EventKind.RESTART_FAILED, why, steps=list(outcome.steps))


def budget_allows(c: Cycle, now: float) -> bool:
    """Whether the budget allows a restart now; once spent, the server is held for a person
    (said once), and a backoff is logged once per pause."""
    settings = c.server.restart
    restarts = c.tally.restarts(now, c.mono())
    allowance = budget.allowance(settings, restarts, now)
    if allowance.spent and c.needs_person is None:
        since = now - settings.window
        cured = sum(1 for at in c.tally.restarts_served if at >= since)
        v = c.verdict
        cause = Cause(v.evidence.cause or Cause.UNKNOWN) if v else Cause.UNKNOWN
        refill = min((t for t in restarts if t > since), default=now) + settings.window - now
        asked = sum(1 for at in c.tally.restarts_asked if at >= since)
        said = budget_spent(
            allowance.used, settings.window, cured, cause, max(0.0, refill), asked=asked
        )
        c.needs_person = said
        c.ledger.record(Held(now, said))
        c.transition(Phase.HELD, EventKind.BUDGET_SPENT, said, cause=str(cause))
    elif not allowance.spent and _new_pause(allowance.not_before, c._backoff_said):
        # Said once per pause, not every tick: the restarts' wall times are read anew from the
        # span clock each tick, so the same pause's end moves by microseconds.
        c._backoff_said = allowance.not_before
        wait = (allowance.not_before or now) - now
        log.info("%s backing off: the next restart in %.0f s at the earliest", c.server.name, wait)
    return allowance.allowed and not allowance.spent


def _new_pause(until: float | None, said: float | None) -> bool:
    return until is not None and (said is None or abs(until - said) > 1.0)
