"""How long each server served, day by day: the page's uptime over 30 days, when the probes
themselves are kept only for a week or less (PROBES_KEPT).

Gathered in memory as the probes are recorded (the time from one probe to the next counts as
the earlier probe's state; a gap longer than a few intervals, the watchdog away, counts for
nothing) and written as one row per server and UTC day, added to, about once a minute.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_watchdog.judge.states import SERVING_STATES

DAY_S = 86400
GAP_PROBES = 3  # intervals without a probe after which the time is not counted (as the page)
WRITE_EVERY = 60.0  # seconds of probed time gathered before a row is written
KEEP_DAYS = 400


@dataclass
class Gathered:
    """One server's probed and serving seconds of one day, not written yet."""

    day: int
    last_at: float
    was_serving: bool
    probed_s: float = 0.0
    serving_s: float = 0.0


class ServingTime:
    """Each server's serving time since the last write, and what to write when."""

    def __init__(self) -> None:
        self.gathered: dict[str, Gathered] = {}

    def probe(self, server: str, at: float, state: str, step: float) -> Gathered | None:
        """Count the time since the server's last probe; a day's gathering to write (and
        then start again from zero) when it is due or the day has changed, else None."""
        serving = state in SERVING_STATES
        day = int(at // DAY_S)
        g = self.gathered.get(server)
        if g is None:
            self.gathered[server] = Gathered(day, at, serving)
            return None
        since = at - g.last_at
        if 0 < since <= GAP_PROBES * step:
            g.probed_s += since
            g.serving_s += since if g.was_serving else 0.0
        g.last_at, g.was_serving = at, serving
        if g.day == day and g.probed_s < WRITE_EVERY:
            return None
        self.gathered[server] = Gathered(day, at, serving)
        return g if g.probed_s > 0 else None

    def unwritten(self, server: str) -> Gathered | None:
        return self.gathered.get(server)

    def drain(self) -> list[tuple[str, Gathered]]:
        """Everything gathered and not written (at close)."""
        out = [(name, g) for name, g in self.gathered.items() if g.probed_s > 0]
        self.gathered.clear()
        return out
