"""What a cycle does to spend the least: the probes real traffic makes needless, and the
cheaper cures it tries before a restart (cancel the abandoned requests, or wait out their
prefill). The choices are the judge's (judge/traffic.py, judge/clearing.py); this carries them
out for one cycle and records each as an incident action.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from mlx_watchdog.act.managers import NoManager
from mlx_watchdog.cycle.phases import Phase
from mlx_watchdog.judge import clearing, traffic
from mlx_watchdog.judge.clearing import Clearing
from mlx_watchdog.judge.states import EventKind
from mlx_watchdog.judge.verdict import Verdict

if TYPE_CHECKING:
    from mlx_watchdog.cycle.cycle import Cycle


class LeastCost:
    """The cheaper cures a cycle tries before a restart: proof from real traffic, a cancel,
    or waiting out an abandoned prefill."""

    def __init__(self, cycle: Cycle) -> None:
        self.cycle = cycle
        self.clearing: Clearing | None = None  # a cancel or a wait under way
        self.skipped = 0  # probes skipped in a row: real traffic proved the server
        self.first_served: float | None = None  # a token between an abandoned prompt's steps

    def traffic(self) -> Verdict | None:
        """A verdict without a probe, when the server's own counter shows live clients
        served (a few ticks in a row at most); else None: probe."""
        c = self.cycle
        route = c.server.profile.load
        wants = c.server.probe.skip_on_traffic and route is not None and route.delivered
        report = c.checker.look_at_load() if wants else None
        why = traffic.proves(c.verdict, report, self.skipped)
        if why is None or report is None or c.verdict is None:
            self.skipped = 0
            return None
        self.skipped += 1
        c.crew.sink.skipped(c.server.name)
        return traffic.skipped_verdict(c.verdict, report, why)

    def cure(self, v: Verdict) -> str | None:
        """Cancel or wait (None), or why a restart is the cure ("" when none was weighed)."""
        c = self.cycle
        if self.clearing is None and (c.incident is None or c.incident.waited):
            return ""  # one cure an incident: after one given up, restarts only
        acts = not isinstance(c.manager, NoManager)
        cure = clearing.choose(
            v.evidence,
            c.tally.restart_cost(),
            self.clearing,
            c.monotonic(),
            cancel=c.server.profile.cancel if acts else None,
        )
        began, self.clearing = self.clearing, cure.wait
        if cure.wait is None:
            if began is not None:
                self.record(began, "gave up", cure.why)
            return cure.why
        if c.incident is None or (began is not None and began.cancel == cure.wait.cancel):
            return None  # the cure goes on
        if began is not None:  # a wait that would now cost more than a cancel
            self.record(began, "gave up", cure.why)
        c.incident.waited = True
        said = cure.why
        if cure.wait.cancel:
            e = v.evidence
            live = None if not e.live_connections else (e.oldest_live_s or 0.0) + c.interval
            done = c.crew.cancel(c.server, e.waited_s or 0.0, live)
            self.record(cure.wait, "sent" if done.ok else "failed", done.detail)
            if not done.ok:
                self.clearing = None
                return f"cancelling failed ({done.detail})"
            said = f"{said}; {done.detail}"
        within = round(cure.wait.until - cure.wait.began, 1)
        c.transition(Phase.FAILING, EventKind.CLEARING, said, within_s=within)
        return None

    def held_down(self, v: Verdict, at: float) -> bool:
        """A token during a wait whose prompt still steps: the incident stays open (the
        outage ends at this first token, recorded when the prompt is done)."""
        if not clearing.holds(v.evidence, self.clearing):
            return False
        self.first_served = at if self.first_served is None else self.first_served
        return True

    def served(self) -> str | None:
        """The server serves again: how, if a cancel or a wait brought it back."""
        self.first_served = None
        wait, self.clearing = self.clearing, None
        if wait is None:
            return None
        how = "served again" if wait.cancel else "cleared without a restart:"
        how = f"{how} {wait.waited(self.cycle.monotonic())}"
        self.record(wait, "cleared", f"{how}; {wait.cost.describe()}")
        return how

    def restarting(self) -> None:
        """A restart begins (a person's, during a wait): the wait ends with it."""
        wait, self.clearing = self.clearing, None
        if wait is not None:
            self.record(wait, "ended by a restart", wait.waited(self.cycle.monotonic()))

    def record(self, wait: Clearing, outcome: str, detail: str) -> None:
        c = self.cycle
        action = {
            "at": c.clock(),
            "action": "cancel" if wait.cancel else "wait",
            "outcome": outcome,
            "detail": detail,
        }
        c.store.add_action(c.incident.id if c.incident else None, action)
