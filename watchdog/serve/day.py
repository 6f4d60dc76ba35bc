"""A server's last day as the status page draws it, read from the history.

The page may be asked for often (a tab left open, a wall screen, someone holding F5); the
history is read at most once per server every `Days.fresh_s`, so a page view never competes
with the probing for the database. The live part of the page (state, reason, numbers) comes
from the daemon's memory at each request; only the charts may be that many seconds old.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlx_watchdog.cycle.crew import NoSink
from mlx_watchdog.judge.states import SHOWN_STATES, UNKNOWN, EventKind, State
from mlx_watchdog.judge.verdict import Verdict
from mlx_watchdog.record.rows import calibration_advice
from mlx_watchdog.record.serving import GAP_PROBES
from mlx_watchdog.record.store import Incident, Store
from mlx_watchdog.record.tally import DAY, event_count

HOUR = 3600.0
MAX_POINTS = 720  # TTFT points drawn; more probes than that are shown as each span's slowest
MAX_RUNS = 720  # stretches of the timeline; a state that flips more often shows each span's worst
# Worst last: a span of the timeline where a server was both healthy and wedged shows wedged.
SEVERITY: tuple[str, ...] = (
    State.HEALTHY,
    State.BUSY,
    State.SLOW,
    State.STARTING,
    UNKNOWN,
    State.DOWN,
    State.DEAD,
    State.WEDGED,
)
INCIDENTS_SHOWN = 10
STRIP = 60  # the last probes, one mark each (a heartbeat bar)
MONTH = 30 * DAY
TOKEN_BUCKET = 60.0  # s: probes with a token are counted per minute (a day is 1,440 counts)


@dataclass(frozen=True)
class Run:
    """A stretch of the day spent in one state, as the probes saw it."""

    state: str
    start: float
    end: float


@dataclass(frozen=True)
class Day:
    """A server's last day as the status page draws it."""

    since: float
    until: float
    step: float = 30.0  # the probe interval: a longer gap between two probes is no data
    runs: tuple[Run, ...] = ()
    ttfts: tuple[tuple[float, float], ...] = ()  # (when, seconds), oldest first
    probes_with_token: int = 0  # before any thinning to MAX_POINTS
    restarts: tuple[int, ...] = (0,) * 24  # per hour, oldest hour first
    gave_up: tuple[int, ...] = (0,) * 24
    incidents: tuple[Incident, ...] = ()  # newest first
    advice: dict[str, Any] | None = None  # the last calibration's: at, prompt and timeouts
    problem: str | None = None  # the history could not be read as expected
    last_probes: tuple[tuple[float, str], ...] = ()  # (when, state) of the last STRIP, oldest first
    month: tuple[float, float] = (0.0, 0.0)  # seconds probed and serving over 30 days


def lines_of(points: Sequence[tuple[float, float]], step: float) -> list[list[tuple[float, float]]]:
    """The TTFT points cut where no token came for more than three probe intervals (a wedge,
    or the watchdog away): a line drawn across would show times nobody measured."""
    lines: list[list[tuple[float, float]]] = []
    for point in points:
        if lines and point[0] - lines[-1][-1][0] <= GAP_PROBES * step:
            lines[-1].append(point)
        else:
            lines.append([point])
    return lines


def runs_of(probes: Sequence[tuple[float, str]], until: float, step: float) -> list[Run]:
    """Consecutive probes of one state as one run; a run lasts to the next probe, or `step`
    past its last one when the next is more than three steps away (the watchdog was not
    running: that time is left blank, not drawn as the state it had before)."""
    runs: list[Run] = []
    for i, (at, state) in enumerate(probes):
        nxt = probes[i + 1][0] if i + 1 < len(probes) else None
        end = nxt if nxt is not None and nxt - at <= GAP_PROBES * step else at + step
        end = min(end, until)
        shown = state if state in SHOWN_STATES else UNKNOWN
        if runs and runs[-1].state == shown and runs[-1].end >= at:
            runs[-1] = Run(shown, runs[-1].start, max(runs[-1].end, end))
        else:
            runs.append(Run(shown, at, max(at, end)))
    return runs


def thin(
    points: Sequence[tuple[float, float]], since: float, until: float
) -> list[tuple[float, float]]:
    """About MAX_POINTS: beyond that, the slowest TTFT of each span of a MAX_POINTSth of the
    window (a spike must stay visible; an average would hide it). The spans are multiples of
    their width from time 0, so thinning what was thinned before keeps it (the page's day is
    kept as probes come, thinned as it goes): a window not on a span's edge has one more."""
    if len(points) <= MAX_POINTS:
        return list(points)
    width = (until - since) / MAX_POINTS
    slowest: dict[int, tuple[float, float]] = {}
    for at, s in points:
        k = int(at // width)
        if k not in slowest or s > slowest[k][1]:
            slowest[k] = (at, s)
    return [slowest[k] for k in sorted(slowest)]


def per_hour(times: Sequence[tuple[float, int]], since: float) -> tuple[int, ...]:
    counts = [0] * 24
    for at, n in times:
        if at >= since:
            counts[min(23, int((at - since) // HOUR))] += n
    return tuple(counts)


def clipped(runs: Sequence[Run], since: float, until: float) -> list[Run]:
    """The runs within [since, until], cut at its edges."""
    return [
        Run(r.state, max(r.start, since), min(r.end, until))
        for r in runs
        if r.end > since and r.start < until
    ]


def coarsen(runs: Sequence[Run], since: float, until: float, *, always: bool = False) -> list[Run]:
    """About MAX_RUNS: beyond that, each span of a MAX_RUNSth of the window shows the worst
    state seen in it (a server flapping every probe would otherwise be thousands of shapes,
    and a wedge among them must not vanish). Spans are multiples of their width from time 0,
    as thin's: coarsening what was coarsened before keeps it."""
    if len(runs) <= MAX_RUNS and not always:
        return list(runs)
    width = (until - since) / MAX_RUNS
    lowest, highest = int(since // width), int((until - 1e-6) // width)
    worst: dict[int, int] = {}
    for r in runs:
        first = max(lowest, int(r.start // width))
        last = min(highest, int(max(r.start, r.end - 1e-6) // width))
        rank = SEVERITY.index(r.state) if r.state in SEVERITY else SEVERITY.index(UNKNOWN)
        for k in range(first, last + 1):
            worst[k] = max(worst.get(k, -1), rank)
    out: list[Run] = []
    for k in sorted(worst):
        state = SEVERITY[worst[k]]
        start, end = max(since, k * width), min(until, (k + 1) * width)
        if out and out[-1].state == state and out[-1].end >= start - 1e-6:
            out[-1] = Run(state, out[-1].start, end)
        else:
            out.append(Run(state, start, end))
    return out


class Summary:
    """One server's last day of probes as the page draws them, kept up to date as each probe
    is recorded: its runs of one state, its TTFTs, its last probes. Bounded: past a few times
    what is drawn, the runs are coarsened and the TTFTs thinned as the page would."""

    def __init__(self) -> None:
        self.runs: list[Run] = []  # closed, oldest first
        self.open: tuple[str, float, float] | None = None  # state, start, last probe's time
        self.ttfts: collections.deque[tuple[float, float]] = collections.deque()
        # Probes with a token, counted per minute: bounded whatever the interval (one time per
        # probe was a float a probe for a day: +32 MiB a server at 100 ms).
        self.tokens: collections.deque[list[float]] = collections.deque()  # [minute, count]
        self.last: collections.deque[tuple[float, str]] = collections.deque(maxlen=STRIP)
        self.coarse = False  # runs were coarsened on the way: the drawing coarsens all alike

    def add(self, at: float, state: str, ttft: float | None, step: float) -> None:
        """One probe, as runs_of would place it: a run lasts to the next probe, or `step`
        past its last one when the next is more than three steps away."""
        shown = state if state in SHOWN_STATES else UNKNOWN
        if self.open is not None:
            was, start, last = self.open
            end = at if at - last <= GAP_PROBES * step else last + step
            if was == shown and end >= at:
                self.open = (was, start, at)
            else:
                self.runs.append(Run(was, start, max(start, end)))
                self.open = (shown, at, at)
        else:
            self.open = (shown, at, at)
        if ttft is not None:
            self.ttfts.append((at, ttft))
            minute = at // TOKEN_BUCKET * TOKEN_BUCKET
            if self.tokens and self.tokens[-1][0] == minute:
                self.tokens[-1][1] += 1
            else:
                self.tokens.append([minute, 1])
        self.last.append((at, state))
        self._bound(at)

    def _bound(self, now: float) -> None:
        since = now - DAY
        while self.ttfts and self.ttfts[0][0] < since:
            self.ttfts.popleft()
        while self.tokens and self.tokens[0][0] + TOKEN_BUCKET <= since:
            self.tokens.popleft()
        if len(self.runs) > 4 * MAX_RUNS:
            self.runs = coarsen(clipped(self.runs, since, now), since, now)
            self.coarse = True
        if len(self.ttfts) > 4 * MAX_POINTS:
            self.ttfts = collections.deque(thin(list(self.ttfts), since, now))

    def drawn(self, now: float, step: float) -> tuple[list[Run], list[tuple[float, float]], int]:
        """The day's runs (at most MAX_RUNS), TTFT points (at most MAX_POINTS) and how many
        probes got a token."""
        since = now - DAY
        runs = list(self.runs)
        if self.open is not None:
            state, start, last = self.open
            runs.append(Run(state, start, max(start, last + step)))
        drawn = coarsen(clipped(runs, since, now), since, now, always=self.coarse)
        ttfts = [p for p in self.ttfts if p[0] >= since]
        # The minute the window begins in counts whole: at most a minute's probes more.
        tokens = int(sum(n for minute, n in self.tokens if minute + TOKEN_BUCKET > since))
        return drawn, thin(ttfts, since, now), tokens


def summary_from(store: Store, server: str, now: float, step: float) -> Summary:
    """A server's summary from its history: read once, then kept as probes come."""
    kept = Summary()
    for at, state, ttft in store.states(server, now - DAY):
        kept.add(at, state, ttft, step)
    return kept


def read_day(
    store: Store, server: str, now: float, step: float, summary: Summary | None = None
) -> Day:
    """A server's day: its probes from `summary` (read from the history when none is kept),
    the rest (incidents, restarts, clients that gave up, advice) from the history."""
    since = now - DAY
    summary = summary or summary_from(store, server, now, step)
    runs, ttfts, tokens = summary.drawn(now, step)
    gave_up = [
        (e.at, event_count(e.data.get("count")))
        for e in store.events(server, since=since, kind=EventKind.GAVE_UP)
    ]
    incidents = store.incidents(since, server)[-INCIDENTS_SHOWN:]
    return Day(
        since=since,
        until=now,
        step=step,
        runs=tuple(runs),
        ttfts=tuple(ttfts),
        probes_with_token=tokens,
        restarts=per_hour([(r.at, 1) for r in store.restarts(server, since)], since),
        gave_up=per_hour(gave_up, since),
        incidents=tuple(reversed(incidents)),
        advice=calibration_advice(store.last_calibration(server)),
        last_probes=tuple(p for p in summary.last if p[0] >= since),
        month=store.serving(server, now - MONTH),
    )


@dataclass
class Days(NoSink):
    """Each server's Day for the page. Its probes come from a `Summary` kept as the daemon
    records them (this is one of the daemon's sinks: `observe`), read from the history once;
    the rest of the day (incidents, restarts, advice: a few rows) is read again once it is
    `fresh_s` old. One reader at a time."""

    store: Store
    step: Callable[[], float]  # the probe interval
    wall: Callable[[], float]
    mono: Callable[[], float]
    fresh_s: float = 10.0
    _kept: dict[str, tuple[float, Day]] = field(default_factory=dict)
    _summaries: dict[str, Summary] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def seed(self, servers: Sequence[str]) -> None:
        """Read each server's probes of the last day from the history now (the daemon does,
        before its first tick), so no page request ever reads them while probes are due."""
        with self._lock:
            now, step = self.wall(), self.step()
            for name in servers:
                if name not in self._summaries:
                    try:
                        self._summaries[name] = summary_from(self.store, name, now, step)
                    except (ValueError, TypeError):
                        continue  # read again, and said, when the page asks

    def observe(self, server: str, verdict: Verdict) -> None:
        """A probe just recorded: into the server's summary, once there is one."""
        with self._lock:
            kept = self._summaries.get(server)
            if kept is not None:
                kept.add(self.wall(), verdict.state, verdict.evidence.ttft_s, self.step())

    def of(self, servers: Sequence[str]) -> dict[str, Day]:
        """Each server's day. A server not read yet is read now; of those older than fresh_s,
        only the stalest is read again per call: twenty servers' days are never all read at
        once (the probing shares the interpreter with this)."""
        with self._lock:
            now, mono = self.wall(), self.mono()
            stale = [
                (mono - kept[0], name)
                for name in servers
                if (kept := self._kept.get(name)) is not None
                and not 0 <= mono - kept[0] < self.fresh_s
            ]
            if stale:
                self._read(max(stale)[1], now, mono)
            for name in servers:
                if name not in self._kept:
                    self._read(name, now, mono)
            return {name: self._kept[name][1] for name in servers}

    def _read(self, server: str, now: float, mono: float) -> Day:
        try:
            step = self.step()
            if server not in self._summaries:
                self._summaries[server] = summary_from(self.store, server, now, step)
            day = read_day(self.store, server, now, step, self._summaries[server])
        except (ValueError, TypeError) as exc:  # a value in the history of the wrong type
            day = Day(since=now - DAY, until=now, problem=f"history unreadable: {exc}")
        self._kept[server] = (mono, day)
        return day
