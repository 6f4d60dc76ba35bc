"""One server's ledger: the only writer of what its cycle learns.

The cycle decides; it hands each thing it learns here as a small frozen fact (a probe judged,
an incident opened, a restart begun or ended, ...). Each fact's history row, its numbers
(the Tally), the sinks (metrics, the page's day) and its alert are written in one place, in
one order. A new kind of fact is one dataclass below and one branch of `Ledger.record`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, overload

from mlx_watchdog.cycle.crew import Crew
from mlx_watchdog.judge.budget import ASKED, LastRestart
from mlx_watchdog.judge.states import EventKind
from mlx_watchdog.judge.verdict import Verdict
from mlx_watchdog.record.alerts import Event
from mlx_watchdog.record.store import Ref, Restart
from mlx_watchdog.record.tally import Tally

log = logging.getLogger("mlx_watchdog")

LOUD = (EventKind.RESTART_FAILED, EventKind.BUDGET_SPENT, EventKind.REFUSED)


@dataclass(frozen=True)
class Probed:
    """A verdict on the server now (`step`: the interval it stands for)."""

    at: float
    verdict: Verdict
    step: float


@dataclass(frozen=True)
class Skipped:
    """No probe this tick: the server's own counter proved it serves."""


@dataclass(frozen=True)
class GaveUp:
    """Clients seen leaving mid-request since the last tick."""

    at: float
    count: int


@dataclass(frozen=True)
class Said:
    """An event: logged, recorded, counted and alerted (`state`: the server's then)."""

    at: float
    kind: EventKind
    message: str
    state: str | None = None
    data: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TickFailed:
    """A tick that raised: recorded only (said in the log by the daemon, once per fault)."""

    at: float
    problem: str


@dataclass(frozen=True)
class Opened:
    """An incident opened (`began`: when serving stopped, as the probes saw it)."""

    at: float
    began: float
    state: str
    reason: str
    evidence: dict[str, Any]


@dataclass(frozen=True)
class Advised:
    """What to tell people, for the incident `ref`."""

    ref: Ref
    advice: str


@dataclass(frozen=True)
class Acted:
    """An action on the incident `ref` (a cancel, a wait, a restart): its history row."""

    ref: Ref
    action: dict[str, Any]


@dataclass(frozen=True)
class Served:
    """A token: the last one seen, and the incident (`ref`, with its cause) it closes."""

    at: float
    ref: Ref = None
    how: str = ""
    recover_s: float | None = None
    cause: str | None = None  # None: no incident was open
    outage_s: float | None = None  # on the span clock (None: the walls' difference)


@dataclass(frozen=True)
class Held:
    """The restart budget is spent: a person is needed, and why."""

    at: float
    reason: str


@dataclass(frozen=True)
class Released:
    """The hold is over (a token, or a person's restart that served)."""


@dataclass(frozen=True)
class Dumped:
    """The server's last words before a restart, for the incident `ref`."""

    at: float
    ref: Ref
    doc: dict[str, Any]


@dataclass(frozen=True)
class RestartBegun:
    """A restart recorded before the manager acts: a watchdog killed meanwhile still counts it."""

    at: float
    mono: float
    trigger: str


@dataclass(frozen=True)
class RestartEnded:
    """How the restart begun as `row` ended; `served_s`: its time to a token, where it served."""

    row: Ref
    began: float
    trigger: str
    at: float
    result: str
    served_s: float | None = None


@dataclass(frozen=True)
class Unfinished:
    """At start: the restarts a watchdog before this one began and never finished, now
    recorded as interrupted (they count against the budget); `record` returns them."""

    at: float


@dataclass(frozen=True)
class FirstToken:
    """The first token of a server the watchdog started itself: what a restart costs here."""

    took_s: float


Fact = (
    Probed
    | Skipped
    | GaveUp
    | Said
    | TickFailed
    | Opened
    | Advised
    | Acted
    | Served
    | Held
    | Released
    | Dumped
    | RestartBegun
    | RestartEnded
    | FirstToken
)


class Ledger:
    """Writes one server's facts: its history rows, its Tally, the sinks and its alerts. Runs
    on the server's own job, but for the daemon's loop saying the verdict went stale (a `Said`:
    the history, sinks and alerter take any thread; only the job touches the Tally). `record`
    returns the row a fact opened (an incident, a restart)."""

    def __init__(self, name: str, crew: Crew, tally: Tally | None = None) -> None:
        self.name = name
        self.crew = crew  # its store, sinks and alerter, read at each fact (tests swap them)
        self.tally = tally or Tally()

    @overload
    def record(self, fact: Unfinished) -> list[Restart]: ...
    @overload
    def record(self, fact: Fact) -> Ref: ...

    def record(self, fact: Fact | Unfinished) -> Ref | list[Restart]:  # noqa: C901, PLR0912, PLR0915 - a branch a fact
        name, store, tally, sink = self.name, self.crew.store, self.tally, self.crew.sink
        match fact:
            case Probed(at, v, step):
                store.record_probe(name, at, v.state, v.reason, v.evidence.to_json(), step=step)
                sink.observe(name, v)
                if v.evidence.ttft_s is not None:
                    tally.add_ttft(at, v.evidence.ttft_s)
                tally.forget_old(at)
            case Skipped():
                sink.skipped(name)
            case GaveUp(at, n):
                tally.add_gave_up(at, n)
                tally.forget_old(at)
                sink.gave_up(name, n)
                message = f"{n} client(s) gave up mid-request"
                store.add_event(name, at, EventKind.GAVE_UP, message, {"count": n})
            case Said(at, kind, message, state, data):
                log.log(
                    logging.ERROR if kind in LOUD else logging.WARNING,
                    "%s %s: %s",
                    name,
                    kind,
                    message,
                )
                store.add_event(name, at, kind, message, dict(data))
                sink.event(name, kind, dict(data))
                self.crew.alerter.send(Event(kind, name, at, message, state, dict(data)))
            case TickFailed(at, problem):
                store.add_event(name, at, EventKind.TICK_FAILED, problem, {})
            case Opened(at, began, state, reason, evidence):
                tally.opened.append(at)
                return store.open_incident(name, at, state, reason, evidence, began_at=began)
            case Advised(ref, advice):
                store.set_advice(ref, advice)
            case Acted(ref, action):
                store.add_action(ref, action)
            case Served(at, ref, how, recover_s, cause, outage_s):
                tally.last_token_at = at
                if cause is not None:
                    tally.cured.append((at, cause))
                    if ref is not None:
                        store.close_incident(ref, at, how, recover_s, outage_s)
            case Held(at, reason):
                store.hold(name, at, reason)
            case Released():
                store.release(name)
            case Dumped(at, ref, doc):
                store.add_dump(name, ref, at, doc)
            case RestartBegun(at, mono, trigger):
                tally.restarts_here.append(mono)
                if trigger in ASKED:
                    tally.restarts_asked.append(at)
                tally.last_restart = LastRestart(at, trigger)
                return store.start_restart(name, at, trigger)
            case RestartEnded(row, began, trigger, at, result, served_s):
                tally.last_restart = LastRestart(began, trigger, result, at)
                store.finish_restart(row, at, result, served_s)
                if served_s is not None:
                    tally.served_s.append(served_s)
                    tally.restarts_served.append(began)
            case FirstToken(took):
                if not tally.served_s:
                    tally.served_s.append(took)
            case Unfinished(at):
                return store.interrupt_unfinished(name, at)
        return None
