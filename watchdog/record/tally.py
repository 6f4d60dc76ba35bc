"""The numbers people see about one server: one source for `status`, `/status` and `/metrics`.

A running daemon loads a Tally from the history once and adds to it as things happen; without
a daemon, `status` loads one from the history alone. Both read their numbers through `held`,
so a count means the same thing in both.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.judge.advice import Abandoned
from mlx_watchdog.judge.budget import ASKED, LastRestart
from mlx_watchdog.judge.clearing import COSTS_KEPT, RestartCost, restart_cost
from mlx_watchdog.judge.states import EventKind
from mlx_watchdog.record.document import ShownIncident
from mlx_watchdog.record.store import Store

TTFT_WINDOW = 3600.0
DAY = 86400.0


@dataclass(frozen=True)
class Figures:
    """What a status document needs besides the verdict."""

    # Times to first token over the last TTFT_WINDOW.
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    ttft_samples: int = 0
    restarts: Sequence[float] = ()  # when, over the longer of a day and the budget's window
    incident: ShownIncident | None = None
    needs_person: str | None = None
    last_token_at: float | None = None
    # How often the server was provoked, over the last day: incidents opened, clients that left.
    incidents_24h: int = 0
    gave_up_24h: int = 0
    last_restart: LastRestart | None = None
    restart_cost_s: float | None = None  # a restart's time to the first token here
    restart_cost_measured: int = 0  # restarts it is the median of; 0: the stated default


def restart_span(server: ServerConfig) -> float:
    """How far back the restarts a status document counts go."""
    return max(DAY, server.restart.window)


@dataclass
class Tally:
    """The numbers people see, kept in memory by a cycle (restarts, incidents, clients that
    gave up, budget): one source for status, /status and /metrics."""

    ttfts: deque[tuple[float, float]] = field(default_factory=deque)  # (when, seconds)
    # The same seconds in order, kept beside them: a status's percentiles are two lookups,
    # not a sort of up to an hour of probes each time one is shown.
    ttfts_sorted: list[float] = field(default_factory=list)
    opened: deque[float] = field(default_factory=deque)  # when incidents opened
    gave_up: deque[tuple[float, int]] = field(default_factory=deque)  # (when, how many)
    gave_up_sum: int = 0
    # Earlier runs' restarts as the history has them (wall time); this run's on the span clock,
    # so that a locked history or a clock step changes nothing within a run.
    restarts_before: list[float] = field(default_factory=list)
    restarts_here: deque[float] = field(default_factory=lambda: deque(maxlen=1000))
    last_restart: LastRestart | None = None
    last_token_at: float | None = None
    served_s: deque[float] = field(default_factory=lambda: deque(maxlen=COSTS_KEPT))
    # Kept in memory so that naming a cause or a spent budget never waits on the history:
    # incidents that ended served, with their cause; restarts that brought the server back.
    cured: deque[tuple[float, str]] = field(default_factory=lambda: deque(maxlen=100))
    restarts_served: deque[float] = field(default_factory=lambda: deque(maxlen=100))
    restarts_asked: deque[float] = field(default_factory=lambda: deque(maxlen=100))  # ASKED's

    @classmethod
    def load(cls, store: Store, server: ServerConfig, now: float) -> Tally:
        name = server.name
        restarts = store.restarts(name, now - restart_span(server))
        last = restarts[-1] if restarts else None
        ttfts = store.ttfts(name, now - TTFT_WINDOW)
        gave_up = [
            (e.at, event_count(e.data.get("count")))
            for e in store.events(name, since=now - DAY, kind=EventKind.GAVE_UP)
        ]
        return cls(
            ttfts=deque(ttfts),
            ttfts_sorted=sorted(t for _, t in ttfts),
            opened=deque(
                i.opened_at for i in store.incidents(now - DAY, name) if i.opened_at >= now - DAY
            ),
            gave_up=deque(gave_up),
            gave_up_sum=sum(n for _, n in gave_up),
            restarts_before=[r.at for r in restarts],
            last_restart=None
            if last is None
            else LastRestart(last.at, last.trigger, last.outcome, last.finished_at),
            last_token_at=store.last_token_at(name),
            served_s=deque(store.restart_costs(name, COSTS_KEPT), maxlen=COSTS_KEPT),
            cured=deque(
                (
                    (i.closed_at, str(i.evidence.get("cause")))
                    for i in store.incidents(now - restart_span(server), name)
                    if i.closed_at is not None
                ),
                maxlen=100,
            ),
            restarts_served=deque((r.at for r in restarts if r.outcome == "recovered"), maxlen=100),
            restarts_asked=deque((r.at for r in restarts if r.trigger in ASKED), maxlen=100),
        )

    def restart_cost(self) -> RestartCost:
        return restart_cost(list(self.served_s))

    def restarts(self, wall: float, mono: float) -> list[float]:
        """When the server was restarted, in wall time as of (`wall`, `mono`)."""
        return [*self.restarts_before, *(wall - (mono - m) for m in self.restarts_here)]

    def add_ttft(self, at: float, seconds: float) -> None:
        self.ttfts.append((at, seconds))
        bisect.insort(self.ttfts_sorted, seconds)

    def add_gave_up(self, at: float, count: int) -> None:
        self.gave_up.append((at, count))
        self.gave_up_sum += count

    def forget_old(self, now: float) -> None:
        while self.ttfts and self.ttfts[0][0] < now - TTFT_WINDOW:
            _, seconds = self.ttfts.popleft()
            del self.ttfts_sorted[bisect.bisect_left(self.ttfts_sorted, seconds)]
        while self.gave_up and self.gave_up[0][0] < now - DAY:
            self.gave_up_sum -= self.gave_up.popleft()[1]
        while self.opened and self.opened[0] < now - DAY:
            self.opened.popleft()

    def figures(
        self,
        server: ServerConfig,
        now: float,
        mono: float,
        *,
        incident: ShownIncident | None,
        needs_person: str | None,
    ) -> Figures:
        """The figures as of `now` (what is older than the windows is forgotten first)."""
        self.forget_old(now)
        since = now - restart_span(server)
        last, cost, ttfts = self.last_restart, self.restart_cost(), self.ttfts_sorted
        return Figures(
            ttft_p50_s=statistics.median(ttfts) if ttfts else None,
            ttft_p95_s=ttfts[max(0, math.ceil(0.95 * len(ttfts)) - 1)] if ttfts else None,
            ttft_samples=len(ttfts),
            restarts=tuple(t for t in self.restarts(now, mono) if t >= since),
            incident=incident,
            needs_person=needs_person,
            last_token_at=self.last_token_at,
            last_restart=last,
            incidents_24h=len(self.opened),
            gave_up_24h=self.gave_up_sum,
            restart_cost_s=cost.seconds,
            restart_cost_measured=cost.measured,
        )


def event_count(value: object) -> int:
    """A count as this watchdog writes it; anything else (a row edited by hand) counts 0."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def abandoned_lately(store: Store, server: str, now: float) -> list[Abandoned]:
    """The last day's wedges whose evidence names the prompt in flight, oldest first."""
    seen = (Abandoned.of(i.evidence) for i in store.incidents(now - DAY, server))
    return [a for a in seen if a is not None]
