"""One server's cycle: its verdicts, phase, open incident, advice and events, tick by tick.

The only writer of incident rows (with its LeastCost, cycle/least_cost.py). Each server has one
Cycle, touched only by its own job (the endpoint's and the calendar's asks are queued, under a
lock, for the next tick). A restart climbs the ladder (act/ladder.py); what it means for the
incident is decided here."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
import time
from collections.abc import Callable

from mlx_watchdog.act.check import judged
from mlx_watchdog.act.managers import Manager, NoManager
from mlx_watchdog.config import ServerConfig
from mlx_watchdog.config.programs import server_unrunnable
from mlx_watchdog.cycle import incidents
from mlx_watchdog.cycle.asks import Asks
from mlx_watchdog.cycle.crew import Crew
from mlx_watchdog.cycle.cures import OWNING, named_throttled, port_held
from mlx_watchdog.cycle.least_cost import LeastCost
from mlx_watchdog.cycle.ledger import (
    Acted,
    FirstToken,
    GaveUp,
    Ledger,
    Probed,
    Said,
    Skipped,
    TickFailed,
    Unfinished,
)
from mlx_watchdog.cycle.phases import TRANSITIONS, OpenIncident, Phase
from mlx_watchdog.cycle.restart import Attempt, budget_allows
from mlx_watchdog.cycle.shown import view_of
from mlx_watchdog.cycle.sight import Sight
from mlx_watchdog.judge import triggers
from mlx_watchdog.judge.cause import (
    NO_PROGRESS,
    WORDS,
    Cause,
)
from mlx_watchdog.judge.clearing import Clearing
from mlx_watchdog.judge.estimate import curve
from mlx_watchdog.judge.states import BAD_STATES, EventKind, State
from mlx_watchdog.judge.triggers import Streak, Trigger
from mlx_watchdog.judge.verdict import Verdict
from mlx_watchdog.record.tally import Tally
from mlx_watchdog.sense.memory import memory_holders
from mlx_watchdog.sense.round import Checker

log = logging.getLogger("mlx_watchdog")


def _runs(server: ServerConfig) -> tuple[object, ...]:
    """What a `process` manager runs: a change of it is a restart, of anything else not."""
    return (server.command, dict(server.env), server.log_file)


class Cycle:
    """One server's life under the watchdog: its verdicts, phase, open incident, restarts
    and events. The only writer of that server's incident rows. Other threads read `shown`
    (published after each change) and queue asks; nothing else of it."""

    def __init__(
        self, server: ServerConfig, manager: Manager, checker: Checker, crew: Crew
    ) -> None:
        self.server = server
        self.manager = manager
        self.checker = checker
        self.crew = crew
        self.store = crew.store  # read here; written only through the ledger
        self.ledger = Ledger(server.name, crew)
        self.wall, self.mono = crew.wall, crew.mono
        self.verdict: Verdict | None = None
        self.streak = Streak()
        self.phase = Phase.NORMAL
        self.incident: OpenIncident | None = None
        self.needs_person: str | None = None  # why, while the phase is HELD
        self.draining = False
        self.gave_up_counted = 0  # of the inspector's running count
        self.least = LeastCost()
        self.state_since: float | None = None
        self.judged_at: float | None = None
        self.interval = 1.0  # the last tick's: how late a connection may first be seen
        self.started_mono: float | None = None  # the watchdog started the server itself then
        self.sight = Sight(watched_since=self.mono(), tick_moved=self.mono())
        self.refused_said = False  # the identity refusal is said once until the server serves
        self._turn_said = False  # "not restarting while another is out" said once a wait
        # Asked for through the endpoint; carried out at the next tick, in the server's own job.
        self.asks = Asks()
        # Whether a reload removed the server (its job ends).
        self.retired = False
        self.left_stopped: str | None = None  # a predecessor's restart never finished
        # A retirement and a restart are one owner's: a reload (the main thread) that removes
        # the server while its job climbs a restart leaves the stop to the climb's end.
        self._owner = threading.Lock()
        self._climbing = False
        self._backoff_said: float | None = None
        self.shown = view_of(self)

    def publish(self) -> None:
        """Replace the view other threads read, in one assignment (after each change)."""
        self.shown = view_of(self)

    @property
    def tally(self) -> Tally:
        """The numbers people see, written by the ledger."""
        return self.ledger.tally

    # -- what the daemon asks of it (each change of its state goes through here) -----------

    def start_server(self) -> None:
        """The daemon starts: a server the watchdog runs is started (or adopted)."""
        try:
            self.manager.start()
        except OSError as exc:  # its log is a FIFO, say: probing finds it down, a restart says why
            log.error("%s: cannot start the server: %s", self.server.name, exc)
            return
        if self.manager.spawned:
            self.server_started()

    def reconfigure_later(self, server: ServerConfig) -> None:
        """A reload's settings, applied by this server's own job at its next tick (which comes
        at its interval: a reload is no reason to probe sooner)."""
        self.asks.reconfigure(server)

    def retire(self) -> None:
        """A reload removed the server: its job ends, and a server the watchdog ran stops: now,
        or, while a restart is under way, once it ends (what it starts stops with it)."""
        with self._owner:
            self.retired = True
            climbing = self._climbing
        if not climbing:
            self.manager.stop()

    def apply_new_config(self, make: Callable[[ServerConfig], Manager]) -> None:
        """Apply a reload's settings, in this server's own job. The running process is left
        alone unless what runs it changed (a `process` server's command, environment or log);
        then it is restarted through the one restart path: recorded, alerted, budgeted."""
        server, before = self.asks.new_settings(), self.server
        if server is None:
            return
        self.server = server
        if server.manager != before.manager:
            self.manager.stop()
            self.manager = make(server)
            self.start_server()
        else:
            self.manager.server = server
        self.checker.reconfigure(server)
        self.publish()
        if server.manager == before.manager == "process" and _runs(server) != _runs(before):
            self.restart("reload", "its command changed in the config", manual=True)

    def tick_begins(self) -> None:
        self.sight.tick_began = self.sight.tick_moved = self.mono()
        self.publish()

    def tick_ends(self, problem: str | None) -> bool:
        """The tick is over (`problem`: why it failed); True when that failure is new (said
        once per run of the same fault, not every tick)."""
        new = False
        if problem is not None and problem != self.sight.tick_problem:
            new = True
            with contextlib.suppress(Exception):
                self.ledger.record(TickFailed(self.wall(), problem))
        self.sight.tick_problem = problem
        self.sight.tick_began = None
        self.sight.tick_moved = self.mono()
        self.publish()
        return new

    def ticked(self) -> None:
        """Even after a fault: the next tick measures its gap from here, not from the last
        good one (that would read as a clock jump every time)."""
        self.sight.last_tick = (self.wall(), self.mono())

    def load(self) -> None:
        """Take up where the history left off: an open incident, a hold, the day's numbers,
        and restarts an earlier watchdog began and never finished."""
        name, now = self.server.name, self.wall()
        row = self.store.open_incident_for(name)
        if row is not None:
            self.incident = OpenIncident(row.began_at, row.state, row.id)
        self.needs_person = self.store.hold_reason(name)
        if self.needs_person is not None:
            self.phase = Phase.HELD  # held by a watchdog before this one: a person's to end
        elif self.incident is not None:
            self.phase = Phase.FAILING
        for r in self.ledger.record(Unfinished(now)):
            self.emit(
                EventKind.INTERRUPTED,
                f"a restart begun at {time.ctime(r.at)} never "
                "finished (the watchdog stopped); it counts against the budget",
            )
            # A predecessor killed between its stop and its start left the server stopped:
            # found down, it is started at once, not after startup_grace.
            self.left_stopped = f"was left stopped by a restart begun at {time.ctime(r.at)}"

        self.ledger.tally = Tally.load(self.store, self.server, now)
        self.publish()

    def server_started(self) -> None:
        """The daemon started the server itself: its first token measures what a restart
        costs until one is measured (the wait-or-restart choice needs a true cost, not the
        30 s default: a small model is back in seconds, a large one in minutes)."""
        self.started_mono = self.mono()

    @property
    def restarting(self) -> bool:
        return self.phase is Phase.RESTARTING

    # -- one tick ---------------------------------------------------------------------------

    def tick(self, interval: float) -> Verdict | None:
        """Judge the server once: start a probe, or judge the age of the one in flight."""
        self.interval = interval
        while (action := self.asks.take()) is not None:
            try:
                self._carry_out(action)
            finally:
                self.asks.done()
        self._notice_jump(interval)
        v, pid = self._proven_by_traffic() if self.checker.probe is None else None, None
        if v is None:
            if self.checker.probe is None:
                # Most probes end in milliseconds; judge those in this tick.
                self.checker.start().wait(min(self.server.probe.slow_after, interval / 2))
            pid = self.manager.pid()
            v = judged(self.checker, pid, fresh_since=self.sight.fresh_since)
        if v is not None:
            v = port_held(v, self.server, pid, self.crew.ladder.stranger)
            self.sight.verdict_mono = self.mono()
            self.ledger.record(Probed(self.wall(), v, interval))
            self._judged(v)
        self._count_gave_up()
        self.publish()
        return self.verdict

    def _judged(self, v: Verdict) -> None:
        calibration = functools.partial(self.store.last_calibration, self.server.name)
        v = named_throttled(
            incidents.recurring_named(self, v), calibration, self.server.probe.idle_cpu_percent
        )
        before = self.verdict.state if self.verdict else None
        self.verdict = v
        now = self.judged_at = self.wall()
        if before != v.state:
            self.state_since = now
            log.info("%s %s", self.server.name, v.reason)
        if v.state in (State.HEALTHY, State.SLOW):
            # Recovered only on a token: "slow" also means no token yet, before wedge_after.
            how = self._how_served(v)
            if v.evidence.tokens > 0 and self.started_mono is not None:
                self.ledger.record(FirstToken(round(self.mono() - self.started_mono, 1)))
                self.started_mono = None
            if v.evidence.tokens > 0 and not self.least.held_down(v, now, self.mono()):
                incidents.recovered(self, self.least.first_served or now, recover_s=None, how=how)
            return
        exited = self._exited(v)
        self.streak, trigger = triggers.step(
            self.streak, v.state, self.mono(), self.server.probe, exited=exited is not None
        )
        if v.state not in BAD_STATES:
            return
        if self.incident is None:
            # The outage began when the unanswered probe was sent, not when it was judged.
            incidents.opened(self, v, now - (v.evidence.waited_s or 0.0))
        else:  # more clients may have given up
            incidents.advise(self, v)
            if v.evidence.cause not in (None, Cause.UNKNOWN):
                self.incident.cause = str(v.evidence.cause)
        if trigger is not None:
            reason = f"the server {exited}" if trigger is Trigger.CRASHED else v.reason
            least_cost = self.server.restart.least_cost
            cause = Cause(v.evidence.cause or Cause.UNKNOWN)
            if cause is Cause.MEMORY_PRESSURE and (holders := self._memory_holders()):
                reason = f"{reason}; {holders}"
            e = v.evidence
            if cause in NO_PROGRESS and trigger is Trigger.WEDGED:
                reason = f"{reason}; restarting at once: waiting cannot cure {WORDS[cause]}"
            elif self.server.restart.drain and e.live_connections and e.abandoned_connections:
                # Waiting costs the clients behind the abandoned work every second; a restart
                # frees them for the balancer's other server at once (what a restart cuts off
                # before any byte came back, the balancer sends again: docs/endpoint.md).
                reason = (
                    f"{reason}; restarting at once: {e.live_connections} client(s) wait behind "
                    "work nobody waits for, and the balancer has another server (restart.drain)"
                )
            elif trigger is Trigger.WEDGED and self.phase is Phase.FAILING and least_cost:
                why = self._cheaper_cure(v)
                if why is None:
                    return
                reason = f"{reason}; {why}" if why else reason
            self.restart(trigger.value, reason)

    def _how_served(self, v: Verdict) -> str:
        """How the server serves again. A server this watchdog started (at its own start) did
        not recover by itself; a child the server left holding the port is not the server."""
        how = "recovered by itself" if self.started_mono is None else "started by the watchdog"
        if v.evidence.tokens > 0 and self.incident is not None:
            return self._answered_by_stranger() or how
        return how

    def _answered_by_stranger(self) -> str | None:
        """Who answered, when the port's holder is not the server the manager runs (a child
        it left holding the port): said as what it is, never "recovered by itself"."""
        if self.server.manager not in OWNING:
            return None
        ours = self.manager.pid()
        held = self.crew.ladder.stranger(self.server, ours)
        if held is None:
            return None
        running = f"PID {ours}" if ours is not None else "none runs now"
        return (
            f"answered by PID {held[0]} ({held[1][:80]}), which holds port {self.server.port}: "
            f"not the server {self.server.manager} runs ({running}); end it yourself "
            f"(kill {held[0]}) and restart the server"
        )

    def _exited(self, v: Verdict) -> str | None:
        """How a down server ended, when that is known at once: the manager saw its process
        exit, or a predecessor's restart left it stopped (until it answers or is restarted)."""
        exited = self.manager.exited() if v.state == State.DOWN else None
        if v.state == State.DOWN and exited is None:
            exited = self.left_stopped
        if v.state not in (State.DOWN, State.STARTING):
            self.left_stopped = None
        return exited

    def _proven_by_traffic(self) -> Verdict | None:
        """A verdict without a probe when the server's own counter proves it serves."""
        route = self.server.profile.load
        wants = self.server.probe.skip_on_traffic and route is not None and route.delivered
        report = self.checker.look_at_load() if wants else None
        v = self.least.traffic(self.verdict, report)
        if v is not None:
            self.ledger.record(Skipped())
        return v

    def _cheaper_cure(self, v: Verdict) -> str | None:
        """Cancel or wait (None), or why a restart is the cure ("" when none was weighed)."""
        acts = not isinstance(self.manager, NoManager)
        plan = self.least.plan(
            v.evidence,
            self.tally.restart_cost(),
            self.mono(),
            waited_before=self.incident is None or self.incident.waited,
            cancel=self.server.profile.cancel if acts else None,
            cap=self.server.probe.max_busy,
            calibrated=curve(self.store.last_calibration(self.server.name)),
        )
        for ended in plan.ended:
            self.record_cure(*ended)
        if plan.goes_on and (wait := self.least.clearing) is not None:  # said: it lasts longer
            within = round(wait.until - wait.began, 1)
            self.transition(Phase.FAILING, EventKind.CLEARING, plan.goes_on, within_s=within)
        if plan.begins is None or self.incident is None:
            return plan.restart_why
        self.incident.waited = True
        said = plan.why
        if plan.begins.cancel:
            e = v.evidence
            live = None if not e.live_connections else (e.oldest_live_s or 0.0) + self.interval
            done = self.crew.cancel(self.server, e.waited_s or 0.0, live)
            self.record_cure(plan.begins, "sent" if done.ok else "failed", done.detail)
            if not done.ok:
                self.least.cancel_failed()
                return f"cancelling failed ({done.detail})"
            said = f"{said}; {done.detail}"
        within = round(plan.begins.until - plan.begins.began, 1)
        self.transition(Phase.FAILING, EventKind.CLEARING, said, within_s=within)
        return None

    def record_cure(self, wait: Clearing, outcome: str, detail: str) -> None:
        action = {
            "at": self.wall(),
            "action": "cancel" if wait.cancel else "wait",
            "outcome": outcome,
            "detail": detail,
        }
        self.ledger.record(Acted(self.incident.id if self.incident else None, action))

    def _count_gave_up(self) -> None:
        """Clients seen leaving since the last tick: history, a metric and the day's count."""
        n = self.checker.inspector.gave_up - self.gave_up_counted
        if n <= 0:
            return
        self.gave_up_counted += n
        self.ledger.record(GaveUp(self.wall(), n))

    def _notice_jump(self, interval: float) -> None:
        """After a jump, streaks end and what the server said of its load is forgotten."""
        if self.sight.notice_jump(self.server.name, self.wall(), self.mono(), interval):
            self.checker.load.forget()
            self.streak = Streak()

    # -- events -----------------------------------------------------------------------------

    def transition(self, to: Phase, kind: EventKind | None, message: str, **data: object) -> None:
        """Move to `to` and fire the event of that move (none for None)."""
        if kind not in TRANSITIONS.get((self.phase, to), frozenset()):
            raise AssertionError(
                f"{self.server.name}: no {kind or 'silent'} move {self.phase} -> {to}"
            )
        self.phase = to
        self.publish()
        if kind:
            self.emit(kind, message, **data)

    def emit(self, kind: EventKind, message: str, **data: object) -> None:
        """Record, log and send one event; incident events come through `transition`."""
        state = self.verdict.state if self.verdict else None
        self.ledger.record(Said(self.wall(), kind, message, state, dict(data)))

    # -- restarts ---------------------------------------------------------------------------

    def restart(self, trigger: str, reason: str, *, manual: bool = False) -> bool:
        """Restart the server if the budget and the identity check allow; True when it serves.

        A manual restart (a person asked) is not held back by the budget, but counts against it
        and passes the same identity check.
        """
        if isinstance(self.manager, NoManager):
            if manual:
                self.emit(EventKind.REFUSED, 'not restarting: manager = "none" observes only')
            return False
        # A program that cannot run makes every restart fail: said once, the budget kept.
        env = {**os.environ, **self.server.env}
        if cannot := server_unrunnable(self.server, env, restart_only=True):
            if manual or not self.refused_said:
                self.refused_said = True
                self.emit(EventKind.REFUSED, f"not restarting: {cannot[0]}; fix it and reload")
            return False
        if not manual and not budget_allows(self, self.wall()):
            return False
        pid, problem = self.crew.ladder.identity(self.server, self.manager)
        if problem is not None:
            if manual or not self.refused_said:
                self.refused_said = True
                self.emit(EventKind.REFUSED, f"not restarting: {problem}", pid=pid)
            return False
        turn = self.server.restart.drain and not manual
        if turn and (others := self.crew.turns.take(self.server.name, self.mono())):
            if not self._turn_said:
                self._turn_said = True
                log.info(
                    "%s: not restarting while %s is out: the balancer keeps this server, and "
                    "its requests wait in the balancer's queue instead of failing",
                    self.server.name,
                    ", ".join(others),
                )
            return False
        self._turn_said = False
        with self._owner:
            if self.retired:
                if turn:
                    self.crew.turns.give_back(self.server.name, self.mono())
                return False
            self._climbing = True
        try:
            attempt = Attempt(self, trigger, reason, pid, manual=manual)
            climb = attempt.climb()
        finally:
            if turn:
                self.crew.turns.give_back(self.server.name, self.mono())
            # The verdict is as old as the restart now; its freshness counts from here.
            self.sight.acted_mono = self.mono()
            with self._owner:
                self._climbing, retired = False, self.retired
            if retired:  # removed meanwhile: nothing this restart started runs on unsupervised
                self.manager.stop()
        return attempt.ended(climb)

    def _memory_holders(self) -> str:
        machine = self.crew.machine()
        return memory_holders(self.crew.residents(), machine.total) if machine else ""

    def drain(self) -> None:
        """Turn the server's /healthz to 503 and run drain_command."""
        self.draining = True
        self.publish()
        self.crew.ladder.run_hook(self.server, "drain_command", self.server.restart.drain_command)

    def undrain(self) -> None:
        hook = self.server.restart.undrain_command
        self.crew.ladder.run_hook(self.server, "undrain_command", hook)
        self.draining = False
        self.publish()

    # -- a person's asks --------------------------------------------------------------------

    def ask(self, action: str, interval: float) -> None:
        """Queue a person's restart, drain or undrain for the next tick, from any thread
        (Conflict: refused, saying why)."""
        self.asks.ask(action, self.shown, interval, self.wall())

    def _carry_out(self, action: str) -> None:
        log.info("%s %s asked for through the endpoint", self.server.name, action)
        if action == "restart":
            self.restart("manual", "a person asked for a restart", manual=True)
        elif action == "planned-restart":
            self.restart("maintenance", "the maintenance window's planned restart", manual=True)
        elif action == "drain":
            self.drain()
        elif action == "undrain":
            self.undrain()
