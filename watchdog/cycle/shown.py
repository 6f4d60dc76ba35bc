"""What one cycle shows the other threads: a frozen view, replaced whole by one assignment.

A server's cycle is written by its own job only. The endpoint, the calendar and the daemon's
loop read `Cycle.shown` and nothing else of it: the job publishes a new view after each
change it makes, so a reader sees one moment, never a deque or a flag mid-update. How fresh
the view's verdict is belongs to the reader's clock: `blindness` takes it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.judge import bounds
from mlx_watchdog.judge.clearing import Clearing
from mlx_watchdog.judge.states import EventKind
from mlx_watchdog.judge.verdict import Verdict
from mlx_watchdog.record.document import ShownIncident
from mlx_watchdog.record.store import row_id
from mlx_watchdog.record.tally import Figures

if TYPE_CHECKING:
    from mlx_watchdog.cycle.cycle import Cycle


@dataclass(frozen=True)
class Shown:
    """One cycle as of its last change."""

    server: ServerConfig
    figures: Figures
    watched_since: float  # span clock, as the rest
    tick_moved: float  # when a tick last began or ended: the job makes progress
    verdict: Verdict | None = None
    judged_at: float | None = None
    state_since: float | None = None
    verdict_mono: float | None = None
    acted_mono: float | None = None  # when its own restart or drain last ended
    tick_began: float | None = None
    tick_problem: str | None = None
    draining: bool = False
    restarting: bool = False
    clearing: Clearing | None = None
    local: bool = True  # its process can be looked at on this machine

    @property
    def state(self) -> str | None:
        return self.verdict.state if self.verdict else None

    @property
    def pid(self) -> int | None:
        return self.verdict.evidence.pid if self.verdict else None

    def fresh_for(self, interval: float) -> float:
        probe = self.server.probe
        return bounds.fresh_for(interval, probe.slow_after, probe.models_timeout)

    def blindness(self, mono: float, interval: float) -> str | None:
        """Why the verdict is too old to be served as current at `mono`, or None while fresh.

        A tick that failed, blocked or overran leaves the last verdict standing; past a few
        intervals it says nothing about the server now. A restart or a drain in progress is
        the watchdog at work, shown as such."""
        if self.restarting or self.draining:
            return None
        seen = self.verdict_mono if self.verdict_mono is not None else self.watched_since
        # A restart of its own is the watchdog at work: the wait after it counts from its end.
        seen = max(seen, self.acted_mono if self.acted_mono is not None else seen)
        running = None if self.tick_began is None else mono - self.tick_began
        return bounds.blindness(mono - seen, self.fresh_for(interval), self.tick_problem, running)

    def progress(self, mono: float) -> float:
        """When the job last made progress; a restart or a drain is bounded by its own steps."""
        return mono if self.restarting or self.draining else self.tick_moved


def sight_said(shown: Shown, blind: str | None, said: bool) -> tuple[EventKind, str] | None:
    """The event to say when the verdict went stale (`said`: that was said already), or
    fresh again; each said once."""
    if blind is not None and not said:
        return EventKind.BLIND, blind
    if blind is None and said and shown.verdict_mono is not None:
        return EventKind.SEEING, f"a fresh verdict again: {shown.state}"
    return None


def view_of(c: Cycle) -> Shown:
    """The cycle as of now, for `Cycle.publish` (its own job only)."""
    i, now, s = c.incident, c.wall(), c.sight
    figures = c.tally.figures(
        c.server,
        now,
        c.mono(),
        incident=None if i is None else ShownIncident(row_id(i.id), i.state, i.began_at),
        needs_person=c.needs_person,
    )
    return Shown(
        c.server,
        figures,
        watched_since=s.watched_since,
        tick_moved=s.tick_moved,
        verdict=c.verdict,
        judged_at=c.judged_at,
        state_since=c.state_since,
        verdict_mono=s.verdict_mono,
        acted_mono=s.acted_mono,
        tick_began=s.tick_began,
        tick_problem=s.tick_problem,
        draining=c.draining,
        restarting=c.restarting,
        clearing=c.least.clearing,
        local=c.checker.inspector.local,
    )
