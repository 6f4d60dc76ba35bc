"""How fresh the watchdog's view of one server is: the span-clock readings of its ticks,
kept by its job (other threads read them in the cycle's published view, cycle/shown.py)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from mlx_watchdog.judge import bounds

log = logging.getLogger("mlx_watchdog")


@dataclass
class Sight:
    """How fresh a cycle's view of its server is: when it last ticked, and why it failed."""

    watched_since: float  # when watching began
    tick_moved: float  # when a tick last began or ended: the job makes progress
    verdict_mono: float | None = None  # when the last verdict came
    tick_began: float | None = None  # when the running tick began
    tick_problem: str | None = None  # why the last tick gave no verdict
    # (wall, span) at the end of the last tick, to notice a sleep or a clock jump.
    last_tick: tuple[float, float] | None = None
    fresh_since: float | None = None  # after a jump, probes count as sent no earlier than this
    acted_mono: float | None = None  # when a restart or a drain of its own last ended

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
