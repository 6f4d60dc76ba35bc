"""The one restart path, for the daemon's triggers and a manual restart alike.

budget -> identity check -> drain -> restart through the manager -> wait for a token -> undrain
-> record. The restart is written to the history *before* the manager acts, so a watchdog killed
mid-restart still counts it against the budget when it comes back.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum

from mlx_watchdog.act.check import Checker
from mlx_watchdog.act.managers import (
    Manager,
    ManagerError,
    NoManager,
    Outcome,
    System,
    identity_problem,
)
from mlx_watchdog.config import ServerConfig
from mlx_watchdog.judge.budget import decide
from mlx_watchdog.judge.states import EventKind
from mlx_watchdog.judge.triggers import Streak
from mlx_watchdog.judge.verdict import Verdict
from mlx_watchdog.record.alerts import Alerter, Event
from mlx_watchdog.record.store import Ref, Store
from mlx_watchdog.sense.evidence import Inspector, ProcessTable
from mlx_watchdog.sense.probe import DOWN_FINDINGS, OK, Probe, ProbeFinding

log = logging.getLogger("mlx_watchdog")

RETRY_PAUSE = 0.5


class Phase(StrEnum):
    """Where a server stands in the incident cycle (the states of Supervisor's process model)."""

    NORMAL = "normal"  # no incident open
    FAILING = "failing"  # an incident is open and no restart is running
    RESTARTING = "restarting"  # the manager is replacing the server
    HELD = "held"  # the restart budget is spent: a person is needed; probing goes on


# Each allowed move, and the events it may fire: the one place incident events come from.
E = EventKind
TRANSITIONS: dict[tuple[Phase, Phase], frozenset[EventKind | None]] = {
    # A wedged, dead or down verdict opens an incident.
    (Phase.NORMAL, Phase.FAILING): frozenset({E.DETECTED}),
    # A trigger the budget allows; or a person's restart, held or not, incident or not.
    (Phase.FAILING, Phase.RESTARTING): frozenset({E.RESTARTING}),
    (Phase.HELD, Phase.RESTARTING): frozenset({E.RESTARTING}),
    (Phase.NORMAL, Phase.RESTARTING): frozenset({E.RESTARTING}),
    # A token after the restart; or a person's restart of a server with no incident open,
    # whatever its end (a server that does not serve afterwards gets its incident next tick).
    (Phase.RESTARTING, Phase.NORMAL): frozenset(
        {E.RECOVERED, None, E.RESTART_FAILED, E.INTERRUPTED}
    ),
    # No token by startup_grace, a manager that failed, or the watchdog stopping meanwhile.
    (Phase.RESTARTING, Phase.FAILING): frozenset({E.RESTART_FAILED, E.INTERRUPTED}),
    (Phase.RESTARTING, Phase.HELD): frozenset({E.RESTART_FAILED, E.INTERRUPTED}),
    # The budget is spent: nothing more is tried until a person acts or the server serves.
    (Phase.FAILING, Phase.HELD): frozenset({E.BUDGET_SPENT}),
    # A token without a restart: it recovered by itself, which also ends a hold.
    (Phase.FAILING, Phase.NORMAL): frozenset({E.RECOVERED}),
    (Phase.HELD, Phase.NORMAL): frozenset({E.RECOVERED, None}),
}


@dataclass(frozen=True)
class LastRestart:
    """The last restart as people see it; `outcome` None while it runs."""

    at: float
    trigger: str
    outcome: str | None = None  # recovered, failed, interrupted
    finished_at: float | None = None


@dataclass
class OpenIncident:
    """An incident lives here, in memory; its history row is optional (a locked or lost
    database must not make the watchdog announce it again at every tick, nor forget to close it).
    """

    began_at: float  # wall time serving stopped, as the probes saw it
    state: str  # the state that opened it
    id: Ref = None  # its row in the history (written behind: its id once written)
    advised_waits: list[float] = field(default_factory=list)  # what the advice says


@dataclass
class Watch:
    """What the daemon keeps about one server between ticks. Only its own job touches it."""

    server: ServerConfig
    manager: Manager
    checker: Checker
    verdict: Verdict | None = None
    streak: Streak = field(default_factory=Streak)
    phase: Phase = Phase.NORMAL
    incident: OpenIncident | None = None
    needs_person: str | None = None  # why, while the phase is HELD
    draining: bool = False
    last_token_at: float | None = None
    ttfts: deque[tuple[float, float]] = field(default_factory=deque)  # (when, seconds)
    # The last day's provocations: when incidents opened, and (when, how many) clients left.
    opened: deque[float] = field(default_factory=deque)
    gave_up: deque[tuple[float, int]] = field(default_factory=deque)
    gave_up_counted: int = 0  # of the inspector's running count
    state_since: float | None = None
    judged_at: float | None = None
    # Span-clock readings at the end of the last tick, to notice a sleep or a clock jump.
    last_tick: tuple[float, float] | None = None
    fresh_since: float | None = None  # after a jump, probes count as sent no earlier than this
    refused_said: bool = False  # the identity refusal is said once until the server serves
    # Asked for through the endpoint; the server's own job carries them out at its next tick.
    requests: deque[str] = field(default_factory=deque)
    # Span-clock readings for the verdict's age: when this watch began, when the last verdict
    # came, when the running tick began; and why the last tick gave none.
    watched_since: float = 0.0
    verdict_mono: float | None = None
    tick_began: float | None = None
    tick_moved: float = 0.0  # when a tick last began or ended: the job makes progress
    tick_problem: str | None = None
    blind_said: bool = False
    # A reload's settings, for the server's own job to apply at its next tick; and whether a
    # reload removed the server (its job ends).
    new_config: ServerConfig | None = None
    retired: bool = False
    # The budget's restarts: earlier runs' as the history has them (wall time), this run's on
    # the span clock, so that a locked history or a clock step changes nothing within a run.
    restarts_before: list[float] = field(default_factory=list)
    last_restart: LastRestart | None = None
    restarts_here: deque[float] = field(default_factory=lambda: deque(maxlen=1000))

    def restarts(self, wall: float, mono: float) -> list[float]:
        """When the server was restarted, in wall time as of (`wall`, `mono`)."""
        return [*self.restarts_before, *(wall - (mono - m) for m in self.restarts_here)]

    @property
    def inspector(self) -> Inspector:
        return self.checker.inspector

    @property
    def restarting(self) -> bool:
        return self.phase is Phase.RESTARTING


class Healer:
    def __init__(
        self,
        store: Store,
        alerter: Alerter,
        *,
        system: System | None = None,
        table: ProcessTable | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        stopping: Callable[[], bool] = lambda: False,
        on_event: Callable[[str, str, dict[str, object]], None] = lambda *_: None,
    ) -> None:
        self.store = store
        self.alerter = alerter
        self.system = system or System()
        self.table = table or ProcessTable()
        self.clock = clock
        self.monotonic = monotonic
        self.stopping = stopping
        self.on_event = on_event

    def transition(
        self, w: Watch, to: Phase, kind: EventKind | None, message: str, **data: object
    ) -> None:
        """Move the server to `to` and fire the event of that move (none for None)."""
        allowed = TRANSITIONS.get((w.phase, to), frozenset())
        if kind not in allowed:
            raise AssertionError(f"{w.server.name}: no {kind or 'silent'} move {w.phase} -> {to}")
        w.phase = to
        if kind:
            self.emit(w, kind, message, **data)

    def emit(self, w: Watch, kind: EventKind, message: str, **data: object) -> None:
        """Record, log and send one event; incident events come through `transition`."""
        now = self.clock()
        state = w.verdict.state if w.verdict else None
        log.log(
            logging.ERROR
            if kind in (E.RESTART_FAILED, E.BUDGET_SPENT, E.REFUSED)
            else logging.WARNING,
            "%s %s: %s",
            w.server.name,
            kind,
            message,
        )
        self.store.add_event(w.server.name, now, kind, message, dict(data))
        self.on_event(w.server.name, kind, dict(data))
        self.alerter.send(Event(kind, w.server.name, now, message, state, dict(data)))

    def heal(self, w: Watch, trigger: str, reason: str, *, manual: bool = False) -> bool:
        """Restart the server if the budget and the identity check allow; True when it serves.

        A manual restart (a person asked) is not held back by the budget, but counts against it
        and passes the same identity check.
        """
        server = w.server
        now = self.clock()
        if isinstance(w.manager, NoManager):
            if manual:
                self.emit(w, E.REFUSED, 'not restarting: manager = "none" observes only')
            return False
        if not manual and not self._budget_allows(w, now):
            return False

        pid = w.manager.pid()
        if pid is None and w.manager.kind == "command":
            pid = self.table.listener(server.port)
        problem = identity_problem(server, pid, self.table)
        if problem is not None:
            if manual or not w.refused_said:
                w.refused_said = True
                self.emit(w, E.REFUSED, f"not restarting: {problem}", pid=pid)
            return False

        drained_here = server.restart.drain and not w.draining  # a person's drain stays
        if drained_here:
            self._drain(w)
        w.checker.abort()  # its server is about to be replaced
        started = self.clock()
        w.restarts_here.append(self.monotonic())
        w.last_restart = LastRestart(started, trigger)
        rid = self.store.start_restart(server.name, started, trigger)
        self.transition(
            w,
            Phase.RESTARTING,
            E.RESTARTING,
            f"restarting through {w.manager.kind} ({reason})",
            trigger=trigger,
            pid=pid,
        )
        try:
            try:
                outcome = w.manager.restart()
            except (ManagerError, OSError) as exc:
                outcome = Outcome(False, str(exc))
            served_at = self._await_token(w) if outcome.ok else None
        finally:
            if drained_here:
                self.undrain(w)
        done = self.clock()
        result = "recovered" if served_at else ("interrupted" if self.stopping() else "failed")
        w.last_restart = LastRestart(started, trigger, result, done)
        self.store.finish_restart(rid, done, result)
        self.store.add_action(
            w.incident.id if w.incident else None,
            {
                "at": started,
                "action": f"restart ({w.manager.kind})",
                "trigger": trigger,
                "outcome": result,
                "detail": outcome.detail,
                "steps": list(outcome.steps),
            },
        )
        if served_at is not None:
            self.recovered(w, served_at, recover_s=served_at - started, how="restarted")
            return True
        back = (
            Phase.HELD
            if w.needs_person is not None
            else (Phase.FAILING if w.incident is not None else Phase.NORMAL)
        )
        if result == "interrupted":
            self.transition(w, back, E.INTERRUPTED, "the watchdog stopped during the restart")
        else:
            exited = w.manager.exited()
            if not outcome.ok:
                why = outcome.detail
            elif exited is not None:
                why = f"the server {exited} before it served"
            else:
                why = f"no token within startup_grace ({server.probe.startup_grace:g}s)"
            self.transition(w, back, E.RESTART_FAILED, why, steps=list(outcome.steps))
        return False

    def _budget_allows(self, w: Watch, now: float) -> bool:
        server = w.server
        decision = decide(server.restart, w.restarts(now, self.monotonic()), now)
        if decision.spent:
            if w.needs_person is None:
                w.needs_person = (
                    f"{decision.used} restarts in the last {server.restart.window:g}s did not help"
                )
                self.store.hold(server.name, now, w.needs_person)
                self.transition(
                    w,
                    Phase.HELD,
                    E.BUDGET_SPENT,
                    f"{w.needs_person}; a person is needed "
                    f"(still probing; a healthy probe ends the hold)",
                )
            return False
        if not decision.allowed:
            log.info(
                "%s backing off: next restart not before %.0f s from now",
                server.name,
                (decision.not_before or now) - now,
            )
            return False
        return True

    def detected(self, w: Watch, v: Verdict, began: float, advice: str | None) -> None:
        """Open the incident: in memory always, in the history when it can be written."""
        w.incident = OpenIncident(began, v.state)
        w.opened.append(self.clock())
        w.incident.id = self.store.open_incident(
            w.server.name, self.clock(), v.state, v.reason, v.evidence.to_json(), began_at=began
        )
        if advice:
            self.store.set_advice(w.incident.id, advice)
        message = f"{v.reason}. {advice}" if advice else v.reason
        self.transition(w, Phase.FAILING, E.DETECTED, message, advice=advice, **_brief(v))

    def recovered(self, w: Watch, at: float, *, recover_s: float | None, how: str) -> None:
        w.streak = Streak()
        w.refused_said = False
        w.last_token_at = at
        if w.needs_person is not None:
            self.store.release(w.server.name)
            w.needs_person = None
        incident, w.incident = w.incident, None
        if incident is None:
            if w.phase is not Phase.NORMAL:
                self.transition(w, Phase.NORMAL, None, "")
            return
        outage = at - incident.began_at
        if incident.id is not None:
            self.store.close_incident(incident.id, at, how, recover_s)
        timing = f"outage {outage:.1f} s" + (
            f", time to recover {recover_s:.1f} s" if recover_s is not None else ""
        )
        self.transition(
            w,
            Phase.NORMAL,
            E.RECOVERED,
            f"serving again ({how}); {timing}",
            outage_s=round(outage, 3),
            recover_s=None if recover_s is None else round(recover_s, 3),
        )

    def _await_token(self, w: Watch) -> float | None:
        """Probe until a token comes (also warming the prompt cache) or startup_grace ends;
        the wall time of the token. A server the manager saw exit again has not started: a
        process counts as started only once it serves."""
        server = w.server
        deadline = self.monotonic() + server.probe.startup_grace
        while not self.stopping():
            left = deadline - self.monotonic()
            if left <= 0 or w.manager.exited() is not None:
                return None
            probing = replace(server, probe=replace(server.probe, hard_timeout=left))
            # Its connections are the watchdog's own: a probe that times out on a server
            # still starting must not count as a client that gave up.
            probe = Probe(probing, clock=self.monotonic, on_connect=w.checker.connected).start()
            while not probe.wait(0.2):
                if self.stopping():
                    probe.abort()
                    return None
            snap = probe.snapshot()
            if snap.finding == OK:
                token = snap.first_token_at or self.monotonic()
                return self.clock() - (self.monotonic() - token)
            if snap.finding in DOWN_FINDINGS or snap.finding == ProbeFinding.RESET:
                self.system.sleep(RETRY_PAUSE)  # not listening yet
            else:
                self.system.sleep(RETRY_PAUSE * 2)
        return None

    def drain(self, w: Watch) -> None:
        """Turn the server's /healthz to 503 and run drain_command."""
        w.draining = True
        settings = w.server.restart
        if settings.drain_command:
            code, out = self.system.run(settings.drain_command, settings.command_timeout)
            if code != 0:
                log.error("%s drain_command exited %d: %s", w.server.name, code, out[-200:])

    def _drain(self, w: Watch) -> None:
        """Drain, then wait (bounded) for live clients to finish before a restart."""
        self.drain(w)
        settings = w.server.restart
        deadline = self.monotonic() + settings.drain_timeout
        while self.monotonic() < deadline and not self.stopping():
            live = w.inspector.sample(w.manager.pid(), exclude=w.checker.own.addresses()).live
            if not live:
                return
            self.system.sleep(1.0)
        log.warning("%s drain_timeout reached with clients still connected", w.server.name)

    def undrain(self, w: Watch) -> None:
        settings = w.server.restart
        if settings.undrain_command:
            code, out = self.system.run(settings.undrain_command, settings.command_timeout)
            if code != 0:
                log.error("%s undrain_command exited %d: %s", w.server.name, code, out[-200:])
        w.draining = False


def _brief(v: Verdict) -> dict[str, object]:
    keys = (
        "waited_s",
        "bytes",
        "tokens",
        "abandoned_connections",
        "live_connections",
        "cpu_percent",
        "models_status",
        "pid",
    )
    return {k: getattr(v.evidence, k) for k in keys}
