"""How fresh the watchdog's view of one server is: the span-clock readings of its ticks."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mlx_watchdog.judge import bounds
from mlx_watchdog.judge.states import EventKind

log = logging.getLogger("mlx_watchdog")


@dataclass
class Sight:
    """How fresh a cycle's view of its server is: when it last ticked and whether it said so."""

    watched_since: float  # when watching began
    tick_moved: float  # when a tick last began or ended: the job makes progress
    verdict_mono: float | None = None  # when the last verdict came
    tick_began: float | None = None  # when the running tick began
    tick_problem: str | None = None  # why the last tick gave no verdict
    blind_said: bool = False
    # (wall, span) at the end of the last tick, to notice a sleep or a clock jump.
    last_tick: tuple[float, float] | None = None
    fresh_since: float | None = None  # after a jump, probes count as sent no earlier than this

    def blindness(self, mono: float, limit: float) -> str | None:
        """Why the last verdict is too old to be served as current, or None while fresh."""
        age = mono - (self.verdict_mono if self.verdict_mono is not None else self.watched_since)
        running = None if self.tick_began is None else mono - self.tick_began
        return bounds.blindness(age, limit, self.tick_problem, running)

    def jump(self, wall: float, mono: float, interval: float) -> tuple[float, float] | None:
        """(wall, span) seconds since the last tick when the two clocks parted, else None."""
        if self.last_tick is None:
            return None
        d_wall, d_mono = wall - self.last_tick[0], mono - self.last_tick[1]
        return (d_wall, d_mono) if bounds.jumped(d_wall, d_mono, interval) else None

    def notice_jump(self, name: str, wall: float, mono: float, interval: float) -> bool:
        """After a sleep, a clock step or a suspension, probes count from now: True then."""
        moved = self.jump(wall, mono, interval)
        if moved is None:
            return False
        self.fresh_since = mono
        log.warning(
            "%s: the clock moved %+.0f s against the %.0f s the watchdog measured "
            "(a sleep, a clock change or a suspended process); judging afresh",
            name,
            *moved,
        )
        return True

    def look(self, blind: str | None, state: str) -> tuple[EventKind, str] | None:
        """The event to say when the verdict went stale, or fresh again; said once each."""
        if blind is not None and not self.blind_said:
            self.blind_said = True
            return EventKind.BLIND, blind
        if blind is None and self.blind_said and self.verdict_mono is not None:
            self.blind_said = False
            return EventKind.SEEING, f"a fresh verdict again: {state}"
        return None
