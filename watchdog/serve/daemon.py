"""The daemon: one scheduled job per server, transitions, triggers, signals and reloads.

Signal handlers only set a flag; the main loop does the work (stop, reload the config), so
nothing heavy ever runs inside a handler.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

from mlx_watchdog import __version__
from mlx_watchdog.act.check import Checker
from mlx_watchdog.act.heal import Healer, OpenIncident, Phase, Watch
from mlx_watchdog.act.managers import System, make_manager
from mlx_watchdog.config import Config, ConfigError, ServerConfig, load_config
from mlx_watchdog.judge import triggers
from mlx_watchdog.judge.advice import incident_advice
from mlx_watchdog.judge.states import BAD_STATES, EventKind, State
from mlx_watchdog.judge.triggers import Streak, Trigger
from mlx_watchdog.judge.verdict import Verdict
from mlx_watchdog.record.alerts import Alerter, Notify, apprise_notify
from mlx_watchdog.record.left import left_probes
from mlx_watchdog.record.private import UnsafeState, hold_lock, private_dir, write_private
from mlx_watchdog.record.store import HISTORY_FILE, Store, row_id
from mlx_watchdog.sense.evidence import ProcessTable
from mlx_watchdog.sense.findings import OwnFault
from mlx_watchdog.serve.bounds import INTERRUPT_TIMEOUT, STOP_TIMEOUT, fresh_for
from mlx_watchdog.serve.client import DAEMON_FILE, TOKEN_FILE
from mlx_watchdog.serve.endpoint import Conflict, ensure_token
from mlx_watchdog.serve.endpoint import start as start_endpoint
from mlx_watchdog.serve.heartbeat import EXIT_STALLED, STALL_MARGIN, Notifier, stalled
from mlx_watchdog.serve.logs import own_log, rotate
from mlx_watchdog.serve.metrics import Metrics
from mlx_watchdog.serve.schedule import Schedule
from mlx_watchdog.serve.status import (
    DAY,
    GAVE_UP,
    TTFT_WINDOW,
    Held,
    describe,
    restart_span,
)

log = logging.getLogger("mlx_watchdog")

LOG_CHECK = 60.0  # seconds between log size checks
LOCK_FILE = "daemon.lock"
STALLED_SETTLE = 2.0  # a stalled daemon's wait for its jobs before it interrupts them
RECENT_RESTART = 10.0  # a person's restart this soon after one that worked is a repeat
COMMANDS_FILE = "commands.json"  # the commands running now (restart_command, drain hooks)


JUMP = 10.0  # seconds the clocks may part between two ticks before it counts as a jump


class Daemon:
    def __init__(
        self,
        config: Config,
        *,
        config_path: Path | None = None,
        system: System | None = None,
        table: ProcessTable | None = None,
        notify: Notify = apprise_notify,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        notifier: Notifier | None = None,
    ) -> None:
        self.config = config
        self.config_path = config_path
        # Before anything is read or written: a second daemon on this state folder would
        # settle the first one's restart as interrupted, probe beside it and restart twice.
        private_dir(config.watchdog.state_dir)  # UnsafeState: refused, as ssh does
        self._lock = hold_lock(config.watchdog.state_dir / LOCK_FILE)
        self.system = system or System()
        # Only now, holding the lock: what a killed predecessor left running is ours to end.
        self.system.record = config.watchdog.state_dir / COMMANDS_FILE
        for left in self.system.settle_left():
            log.warning("ended a command the previous watchdog left running: %s", left)
        self.table = table or ProcessTable()
        self.clock = clock  # wall time, for what is recorded and shown
        self.monotonic = monotonic  # spans: probe waits, down and busy times
        self.left = left_probes(config.watchdog.state_dir)
        self.state_dir = config.watchdog.state_dir
        self.store = Store(self.state_dir / HISTORY_FILE, clock=clock, behind=True)
        self.alerter = Alerter(config.watchdog.alerts, config.watchdog.on_event, notify=notify)
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._wake = threading.Event()
        self._active = 0
        self._active_cv = threading.Condition()
        self.metrics = Metrics(self.status)
        self.healer = Healer(
            self.store,
            self.alerter,
            system=self.system,
            table=self.table,
            clock=clock,
            monotonic=monotonic,
            stopping=self._stop.is_set,
            on_event=self.metrics.event,
        )
        self.started_at = clock()
        self.own_log = own_log()
        self.endpoint: ThreadingHTTPServer | None = None
        self.watches: dict[str, Watch] = {}
        self.schedule = Schedule()
        self._running = False
        self.notifier = notifier if notifier is not None else Notifier()
        for server in config.servers:
            self.watches[server.name] = self._watch(server)

    # -- one server, one tick ---------------------------------------------------------------

    def _watch(self, server: ServerConfig) -> Watch:
        w = Watch(
            server=server,
            manager=make_manager(server, self.system, self.state_dir),
            checker=Checker(
                server,
                left=self.left,
                table=self.table,
                clock=self.monotonic,
                wall=self.clock,
                announce_probe=True,
            ),
        )
        w.watched_since = w.tick_moved = self.monotonic()
        now = self.clock()
        incident = self.store.open_incident_for(server.name)
        if incident is not None:
            w.incident = OpenIncident(incident.began_at, incident.state, incident.id)
        w.ttfts.extend(self.store.ttfts(server.name, now - TTFT_WINDOW))
        w.opened.extend(
            i.opened_at
            for i in self.store.incidents(now - DAY, server.name)
            if i.opened_at >= now - DAY
        )
        w.gave_up.extend(
            (e.at, int(e.data.get("count", 0)))
            for e in self.store.events(server.name, since=now - DAY, kind=GAVE_UP)
        )
        w.restarts_before = [
            r.at for r in self.store.restarts(server.name, now - restart_span(server))
        ]
        w.last_token_at = self.store.last_token_at(server.name)
        w.needs_person = self.store.held(server.name)
        if w.needs_person is not None:
            w.phase = Phase.HELD  # held by a watchdog before this one: still a person's to end
        elif w.incident is not None:
            w.phase = Phase.FAILING
        for r in self.store.interrupt_unfinished(server.name, now):
            self.healer.emit(
                w,
                EventKind.INTERRUPTED,
                f"a restart begun at {time.ctime(r.at)} never "
                "finished (the watchdog stopped); it counts against the budget",
            )
        return w

    def tick(self, name: str) -> Verdict | None:
        """Judge one server once: start a probe, or judge the age of the one in flight."""
        w = self.watches[name]
        try:
            self._tick(w)
        finally:
            # Even after a fault: the next tick measures its gap from here, not from the
            # last good tick (that would read as a clock jump every time).
            w.last_tick = (self.clock(), self.monotonic())
        return w.verdict

    def _tick(self, w: Watch) -> None:
        server = w.server
        if w.new_config is not None:
            self._reconfigure(w, w.new_config)
        while w.requests:
            self._carry_out(w, w.requests.popleft())
        self._notice_jump(w)
        if w.checker.probe is None:
            # Most probes end in milliseconds; judge those in this tick.
            w.checker.start().wait(min(server.probe.slow_after, self.config.watchdog.interval / 2))
        verdict = w.checker.judge(w.manager.pid(), fresh_since=w.fresh_since)
        if verdict is not None:
            w.verdict_mono = self.monotonic()
            self.store.record_probe(
                server.name, self.clock(), verdict.state, verdict.reason, verdict.evidence.to_json()
            )
            self.metrics.observe(server.name, verdict)
            self._keep_ttft(w, verdict)
            self._transition(w, verdict)
        self._keep_gave_up(w)

    def _keep_ttft(self, w: Watch, v: Verdict) -> None:
        now = self.clock()
        if v.evidence.ttft_s is not None:
            w.ttfts.append((now, v.evidence.ttft_s))
        while w.ttfts and w.ttfts[0][0] < now - TTFT_WINDOW:
            w.ttfts.popleft()

    def _keep_gave_up(self, w: Watch) -> None:
        """Clients seen leaving since the last tick: history, a metric and the status counts."""
        now = self.clock()
        n = w.checker.inspector.gave_up - w.gave_up_counted
        if n > 0:
            w.gave_up_counted += n
            w.gave_up.append((now, n))
            self.metrics.gave_up.labels(w.server.name).inc(n)
            self.store.add_event(
                w.server.name, now, GAVE_UP, f"{n} client(s) gave up mid-request", {"count": n}
            )
        while w.gave_up and w.gave_up[0][0] < now - DAY:
            w.gave_up.popleft()
        while w.opened and w.opened[0] < now - DAY:
            w.opened.popleft()

    def _notice_jump(self, w: Watch) -> None:
        """A Mac that slept, a clock step or a suspended watchdog: judge afresh after it.

        Between two ticks the wall clock and the span clock advance alike, by about one
        interval. When they part, or the span is far longer than the interval, what was measured
        across the gap says nothing about the server: streaks end and probes count from now.
        """
        if w.last_tick is None:
            return
        wall, mono = self.clock(), self.monotonic()
        d_wall, d_mono = wall - w.last_tick[0], mono - w.last_tick[1]
        late = d_mono - 3 * self.config.watchdog.interval
        if abs(d_wall - d_mono) <= JUMP and late <= JUMP:
            return
        w.fresh_since = mono
        w.checker.load.forget()
        w.streak = Streak()
        log.warning(
            "%s: the clock moved %+.0f s against the %.0f s the watchdog measured "
            "(a sleep, a clock change or a suspended process); judging afresh",
            w.server.name,
            d_wall,
            d_mono,
        )

    def _transition(self, w: Watch, v: Verdict) -> None:
        before = w.verdict.state if w.verdict else None
        w.verdict = v
        now = self.clock()
        w.judged_at = now
        if before != v.state:
            w.state_since = now
            log.info("%s %s", w.server.name, v.reason)
        if v.state in (State.HEALTHY, State.SLOW):
            # Recovered only on a token: "slow" also means no token yet, before wedge_after.
            if v.evidence.tokens > 0:
                self.healer.recovered(w, now, recover_s=None, how="recovered by itself")
            return
        exited = w.manager.exited() if v.state == State.DOWN else None
        w.streak, trigger = triggers.decide(
            w.streak, v.state, self.monotonic(), w.server.probe, exited=exited is not None
        )
        if v.state not in BAD_STATES:
            return
        advice = self._advice(w, v)
        if w.incident is None:
            # The outage began when the unanswered probe was sent, not when it was judged.
            self.healer.detected(w, v, now - (v.evidence.waited_s or 0.0), advice)
        elif advice:
            self.store.set_advice(w.incident.id, advice)  # more clients may have given up since
        if trigger is not None:
            reason = f"the server {exited}" if trigger is Trigger.CRASHED else v.reason
            self.healer.heal(w, trigger.value, reason)

    def _carry_out(self, w: Watch, action: str) -> None:
        log.info("%s %s asked for through the endpoint", w.server.name, action)
        if action == "restart":
            self.healer.heal(w, "manual", "a person asked for a restart", manual=True)
        elif action == "drain":
            self.healer.drain(w)
        elif action == "undrain":
            self.healer.undrain(w)

    # -- what the endpoint and `status` show -------------------------------------------------

    def status(self) -> dict[str, Any]:
        now = self.clock()
        servers = []
        mono = self.monotonic()
        for w in list(self.watches.values()):
            v = w.verdict
            blind = self.blindness(w, mono)
            servers.append(
                describe(
                    w.server,
                    now,
                    self._held(w, now),
                    state=v.state if v and not blind else None,
                    reason=blind or (v.reason if v else "no verdict yet"),
                    at=w.judged_at,
                    evidence=v.evidence if v else None,
                    since=w.state_since,
                    draining=w.draining,
                    restarting=w.restarting,
                    blind=blind is not None,
                    age=None if w.verdict_mono is None else mono - w.verdict_mono,
                )
            )
        return {
            "watchdog": {
                "pid": os.getpid(),
                "version": __version__,
                "started_at": self.started_at,
                "interval_s": self.config.watchdog.interval,
                "running": True,
                # Set when the history fell back to memory (or skipped a locked write).
                "history_problem": self.store.problem,
            },
            "servers": servers,
        }

    def _held(self, w: Watch, now: float) -> Held:
        since = now - restart_span(w.server)
        incident = w.incident
        return Held(
            ttfts=[t for at, t in list(w.ttfts) if at >= now - TTFT_WINDOW],
            restarts=[t for t in w.restarts(now, self.monotonic()) if t >= since],
            incident=None
            if incident is None
            else {
                "id": row_id(incident.id),
                "state": incident.state,
                "began_at": incident.began_at,
            },
            needs_person=w.needs_person,
            last_token_at=w.last_token_at,
            last_restart=None if w.last_restart is None else dataclasses.asdict(w.last_restart),
            incidents_24h=len([at for at in list(w.opened) if at >= now - DAY]),
            gave_up_24h=sum(n for at, n in list(w.gave_up) if at >= now - DAY),
        )

    def prometheus(self) -> tuple[bytes, str]:
        return self.metrics.exposition()

    def act(self, name: str, action: str) -> str:
        w = self.watches[name]  # KeyError: no such server
        if action == "restart":
            self._no_second_restart(w)
        w.requests.append(action)
        self.schedule.wake(name)
        return f"{action} of {name} queued; it runs at the server's next tick"

    def _no_second_restart(self, w: Watch) -> None:
        """A person's restart while one runs, is queued, or just brought the server back would
        be a second restart for one cause: refused, saying what happened instead."""
        name, last, now = w.server.name, w.last_restart, self.clock()
        if "restart" in w.requests:
            raise Conflict(f"a restart of {name} is already asked for")
        if last is None:
            return
        if w.restarting:
            raise Conflict(
                f"{name} is being restarted already ({last.trigger}, begun "
                f"{now - last.at:.0f} s ago); `status` shows how it ends"
            )
        recent = max(RECENT_RESTART, 2 * self.config.watchdog.interval)
        if last.outcome == "recovered" and last.finished_at and now - last.finished_at < recent:
            raise Conflict(
                f"{name} was restarted {now - last.at:.0f} s ago ({last.trigger}) and serves "
                f"again; if it needs another, ask again in {recent - (now - last.finished_at):.0f} s"
            )

    def _advice(self, w: Watch, v: Verdict) -> str | None:
        waits = list(v.evidence.gave_up_after_s)
        told = w.incident.advised_waits if w.incident else []
        if not waits or waits == told:
            return None
        if w.incident is not None:
            w.incident.advised_waits = list(waits)
        return incident_advice(waits, self.store.last_calibration(w.server.name))

    def blindness(self, w: Watch, mono: float) -> str | None:
        """Why the verdict on `w` is too old to be served as current, or None while fresh.

        A tick that failed, blocked or overran leaves the last verdict standing; past a few
        intervals it says nothing about the server now. A restart or a drain in progress is
        the watchdog at work, shown as such."""
        if w.restarting or w.draining:
            return None
        limit = self._fresh_for(w)
        age = mono - (w.verdict_mono if w.verdict_mono is not None else w.watched_since)
        if age <= limit:
            return None
        began = w.tick_began
        if w.tick_problem:
            why = w.tick_problem
        elif began is not None:
            why = f"a tick has run for {mono - began:.0f} s"
        else:
            why = "no tick has given a verdict"
        return f"no fresh verdict (watchdog blind for {age:.0f} s: {why})"

    def _fresh_for(self, w: Watch) -> float:
        probe = w.server.probe
        return fresh_for(self.config.watchdog.interval, probe.slow_after, probe.models_timeout)

    def stalled(self) -> str | None:
        """Why this daemon's ticks have stopped (see serve/heartbeat.py), or None. A restart or
        a drain in progress is bounded by its own steps and counts as progress."""
        mono = self.monotonic()
        progress, limits = {}, {}
        for name, w in list(self.watches.items()):
            if w.retired:
                continue
            progress[name] = mono if w.restarting or w.draining else w.tick_moved
            limits[name] = self._fresh_for(w) + STALL_MARGIN
        return stalled(progress, limits, mono)

    def look_at_sight(self) -> None:
        """Say once when a server's verdict goes stale, and once when it is fresh again."""
        mono = self.monotonic()
        for w in list(self.watches.values()):
            blind = self.blindness(w, mono)
            if blind is not None and not w.blind_said:
                w.blind_said = True
                self.healer.emit(w, EventKind.BLIND, blind)
            elif blind is None and w.blind_said and w.verdict_mono is not None:
                w.blind_said = False
                state = w.verdict.state if w.verdict else "unknown"
                self.healer.emit(w, EventKind.SEEING, f"a fresh verdict again: {state}")

    # -- running ----------------------------------------------------------------------------

    def _job(self, name: str) -> None:
        if self._stop.is_set():
            return
        w = self.watches.get(name)
        if w is None or w.retired:
            return
        with self._active_cv:
            self._active += 1
        w.tick_began = w.tick_moved = self.monotonic()
        try:
            self.tick(name)
            w.tick_problem = None
        except Exception as exc:  # a fault in one tick must not stop the probing
            problem = (
                str(exc)
                if isinstance(exc, OwnFault)
                else (f"the last tick failed: {type(exc).__name__}: {exc}")
            )
            if problem != w.tick_problem:  # once per run of the same fault, not every tick
                log.exception("%s tick failed; probing goes on", name)
                with contextlib.suppress(Exception):
                    self.store.add_event(
                        name, self.clock(), EventKind.TICK_FAILED, problem[:500], {}
                    )
            w.tick_problem = problem[:500]
        finally:
            w.tick_began = None
            w.tick_moved = self.monotonic()
            with self._active_cv:
                self._active -= 1
                self._active_cv.notify_all()

    def rotate_logs(self) -> None:
        settings = self.config.watchdog
        paths = [w.server.log_file for w in self.watches.values() if w.server.log_file]
        if self.own_log is not None:
            paths.append(self.own_log)
        for path in paths:
            try:
                if rotate(path, settings.log_max_size, settings.log_keep):
                    log.info("rotated %s (over %d bytes)", path, settings.log_max_size)
            except OSError as exc:
                log.error("cannot rotate %s: %s", path, exc.strerror or exc)

    def _schedule(self) -> None:
        interval = self.config.watchdog.interval
        jobs = {name: (interval, functools.partial(self._job, name)) for name in self.watches}
        self.schedule.keep({"logs": (LOG_CHECK, self.rotate_logs), **jobs})

    def run(self, *, install_signals: bool = True) -> int:
        """Run in the foreground until SIGTERM/SIGINT (or `stop()`); SIGHUP reloads.

        The signal handlers only set flags; this loop, on the main thread, does the work.
        """
        if install_signals:
            signal.signal(signal.SIGTERM, lambda *_: self.stop())
            signal.signal(signal.SIGINT, lambda *_: self.stop())
            signal.signal(signal.SIGHUP, lambda *_: self.request_reload())
        for w in self.watches.values():
            w.manager.start()
        self._serve_endpoint()
        self._running = True
        self._schedule()
        log.info("watching %s every %gs", ", ".join(self.watches), self.config.watchdog.interval)
        self.notifier.send("READY=1", f"STATUS=watching {len(self.watches)} servers")
        code = 0
        try:
            while not self._stop.is_set():
                if self._wake.wait(1.0):
                    self._wake.clear()
                try:
                    self.look_at_sight()
                except Exception:
                    log.exception("cannot tell whether the verdicts are fresh")
                stall = self.stalled()
                if stall is not None:
                    code = self._give_up(stall)
                    break
                self.notifier.send("WATCHDOG=1")
                if self._reload.is_set() and not self._stop.is_set():
                    self._reload.clear()
                    self.reload()
        finally:
            self.notifier.send("STOPPING=1")
            self.schedule.stop()
            # Ticks that stopped will not end by themselves: no long wait for them.
            self._finish(STALLED_SETTLE if code == EXIT_STALLED else STOP_TIMEOUT)
        return code

    def _give_up(self, why: str) -> int:
        """Ticks that stopped are a fault of this process: end it, so that the service manager
        starts a fresh one (launchd's KeepAlive, systemd's Restart=; systemd's WatchdogSec
        would end it anyway, as the heartbeat stops). If the stop itself hangs, exit at once."""
        log.error("%s: the watchdog ends so that its service manager starts it afresh", why)
        backstop = threading.Timer(
            STOP_TIMEOUT + INTERRUPT_TIMEOUT + 60.0, os._exit, (EXIT_STALLED,)
        )
        backstop.daemon = True
        backstop.start()
        self._stop.set()
        return EXIT_STALLED

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    def request_reload(self) -> None:
        self._reload.set()
        self._wake.set()

    def reload(self) -> bool:
        """Read the config again. Each server keeps its job (never two ticks of one server, no
        new threads for an unchanged one); new settings are handed to the server's own job,
        which applies them at its next tick, between two ticks."""
        try:
            new = load_config(self.config_path)
        except ConfigError as exc:
            log.error("reload refused, keeping the running config: %s", exc)
            return False
        old = {s.name: s for s in self.config.servers}
        fresh = {s.name: s for s in new.servers}
        for name in old.keys() - fresh.keys():
            gone = self.watches.pop(name)
            gone.retired = True
            gone.manager.stop()
        for name, server in fresh.items():
            if name not in self.watches:
                self.watches[name] = self._watch(server)
                self.watches[name].manager.start()
            elif old.get(name) != server:
                self.watches[name].new_config = server
                self.schedule.wake(name)
        self.config = new
        if self._running:
            self._schedule()
        log.info("config reloaded: watching %s", ", ".join(self.watches))
        return True

    def _reconfigure(self, w: Watch, server: ServerConfig) -> None:
        """Apply a reload's settings in the server's own job. The running process is left
        alone unless what runs it changed (a `process` server's command, environment or log);
        then it is restarted through the one restart path: recorded, alerted, budgeted."""
        before = w.server
        w.new_config = None
        if server.manager != before.manager:
            w.manager.stop()
            w.manager = make_manager(server, self.system, self.state_dir)
            w.manager.start()
        else:
            w.manager.server = server
        w.server = server
        w.checker.reconfigure(server)
        if server.manager == before.manager == "process" and _runs(server) != _runs(before):
            self.healer.heal(w, "reload", "its command changed in the config", manual=True)

    def _finish(self, settle: float = STOP_TIMEOUT) -> None:
        self._stop.set()
        if not self._settle(settle):
            # A restart still running: kill its command so it ends, recorded as interrupted.
            log.warning("a restart is still running after %gs; interrupting it", settle)
            self.system.interrupt()
            self._settle(INTERRUPT_TIMEOUT)
            self.system.resume()  # the managed servers still get their stop grace
        for w in self.watches.values():
            w.checker.abort()
            w.manager.stop()
        if self.endpoint is not None:
            self.endpoint.shutdown()
            self.endpoint.server_close()
            (self.state_dir / DAEMON_FILE).unlink(missing_ok=True)
        self.alerter.close(timeout=5.0)
        self.store.close()
        log.info("stopped")
        os.close(self._lock)

    def _serve_endpoint(self) -> None:
        """Start /healthz, /status, /metrics; without them the watchdog still probes and heals."""
        settings = self.config.watchdog
        if settings.listen_port is None:
            return
        try:
            token = ensure_token(self.state_dir / TOKEN_FILE)
            self.endpoint, _ = start_endpoint(
                self, settings.listen_host, settings.listen_port, token, settings.open_routes
            )
        except (OSError, UnsafeState) as exc:
            log.error(
                "cannot serve the endpoint on %s:%s (%s); probing goes on without it",
                settings.listen_host,
                settings.listen_port,
                getattr(exc, "strerror", None) or exc,
            )
            return
        host, port = str(self.endpoint.server_address[0]), self.endpoint.server_address[1]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        record = {"pid": os.getpid(), "url": url, "started_at": self.started_at}
        write_private(self.state_dir / DAEMON_FILE, json.dumps(record))
        log.info("endpoint at %s (/healthz, /status, /metrics)", url)

    def _settle(self, timeout: float) -> bool:
        """Wait for the running jobs to end; False when some are still running."""
        deadline = time.monotonic() + timeout
        with self._active_cv:
            while self._active and time.monotonic() < deadline:
                self._active_cv.wait(deadline - time.monotonic())
            return not self._active


def _runs(server: ServerConfig) -> tuple[object, ...]:
    """What a `process` manager runs: a change of it is a restart, of anything else not."""
    return (server.command, dict(server.env), server.log_file)
