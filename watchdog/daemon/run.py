"""The daemon is wiring: one scheduled job per server (its Cycle), signals, reloads, the endpoint.

Signal handlers only set a flag; the main loop does the work (stop, reload the config), so
nothing heavy ever runs inside a handler.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import logging
import os
import signal
import socketserver
import threading
import time
from collections.abc import Callable
from http.server import ThreadingHTTPServer
from pathlib import Path

from mlx_watchdog import __version__
from mlx_watchdog.act.ladder import Ladder
from mlx_watchdog.act.managers import Manager, System, make_manager
from mlx_watchdog.config import Config, ConfigError, ServerConfig, load_config
from mlx_watchdog.cycle import Crew, Cycle
from mlx_watchdog.cycle.crew import Sinks
from mlx_watchdog.cycle.ledger import Said
from mlx_watchdog.cycle.shown import sight_said
from mlx_watchdog.daemon.calendar import Calendar, Maintain
from mlx_watchdog.daemon.heartbeat import EXIT_STALLED, STALL_MARGIN, Notifier, stalled
from mlx_watchdog.daemon.logs import own_log, rotate_all
from mlx_watchdog.daemon.schedule import Schedule
from mlx_watchdog.judge.bounds import INTERRUPT_TIMEOUT, STOP_TIMEOUT
from mlx_watchdog.judge.states import EventKind
from mlx_watchdog.judge.verdict import Verdict
from mlx_watchdog.record.alerts import Alerter, Notify, apprise_notify
from mlx_watchdog.record.document import Status, WatchdogLine
from mlx_watchdog.record.left_probes import LeftProbes, left_probes
from mlx_watchdog.record.metrics import Metrics
from mlx_watchdog.record.private import (
    UnsafeState,
    hold_lock,
    lock_lost,
    private_dir,
    write_private,
)
from mlx_watchdog.record.store import HISTORY_FILE, Store
from mlx_watchdog.sense.findings import OwnFault
from mlx_watchdog.sense.memory import MemoryWatch, read_machine, resident
from mlx_watchdog.sense.process import ProcessTable
from mlx_watchdog.sense.round import Checker
from mlx_watchdog.sense.signs import Machine
from mlx_watchdog.sense.text import printable
from mlx_watchdog.serve.agent import start as start_agent
from mlx_watchdog.serve.client import DAEMON_FILE, TOKEN_FILE
from mlx_watchdog.serve.day import Days
from mlx_watchdog.serve.endpoint import ensure_token
from mlx_watchdog.serve.endpoint import start as start_endpoint
from mlx_watchdog.serve.page import refresh_s, render
from mlx_watchdog.serve.status import of_shown

log = logging.getLogger("mlx_watchdog")

LOG_CHECK = 60.0  # seconds between log size checks
LOCK_FILE = "daemon.lock"
# Signals whose default would end the process with no "stopped" said: ignored on purpose.
IGNORED_SIGNALS = (signal.SIGUSR2, signal.SIGALRM, signal.SIGVTALRM, signal.SIGPROF)
STALLED_SETTLE = 2.0  # a stalled daemon's wait for its jobs before it interrupts them
COMMANDS_FILE = "commands.json"  # the commands running now (restart_command, drain hooks)


# What a reload cannot change under a running watchdog: its endpoint, its agent check and its
# state folder.
NEEDS_RESTART = ("listen_host", "listen_port", "open_routes", "agent", "state_dir")


class Daemon:
    """The running watchdog: one job per server, the endpoint, signals, reloads and a
    bounded stop. Wiring only: what each server's cycle decides is in cycle/."""

    def __init__(
        self,
        config: Config,
        *,
        config_path: Path | None = None,
        system: System | None = None,
        table: ProcessTable | None = None,
        notify: Notify = apprise_notify,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
        notifier: Notifier | None = None,
        stop_timeout: float = STOP_TIMEOUT,
        maintain: Maintain | None = None,
        machine: Callable[[], Machine | None] = read_machine,
    ) -> None:
        self.config = config
        self.config_path = config_path
        self.system = system or System()
        self.table = table or ProcessTable()
        self.wall = wall  # wall time, for what is recorded and shown
        self.mono = mono  # spans: probe waits, down and busy times
        self.stop_timeout = stop_timeout  # for a restart in progress to finish by itself
        self.state_dir = config.watchdog.state_dir
        self._notify, self._maintain, self._machine = notify, maintain, machine
        self._stop = threading.Event()
        self._reload = threading.Event()
        self._signals: collections.deque[str] = collections.deque()  # noted by the handlers
        self._wake = threading.Event()
        self._active = 0
        self._active_cv = threading.Condition()
        self._page_lock = threading.Lock()
        self._page: tuple[float, str] = (0.0, "")  # (when rendered, monotonic; the page)
        self.started_at = wall()
        self.own_log = own_log()
        self.endpoint: ThreadingHTTPServer | None = None
        self.agent: socketserver.TCPServer | None = None
        self.cycles: dict[str, Cycle] = {}
        self._blind: set[str] = set()  # servers whose stale verdict was said (the main thread's)
        self.schedule = Schedule()
        self._running = False
        self.notifier = notifier if notifier is not None else Notifier()
        self._lock: int | None = None  # the state folder's lock, while open
        # Set by open(): what reads and writes the state folder.
        self.left: LeftProbes
        self.store: Store
        self.alerter: Alerter
        self.metrics: Metrics
        self.days: Days
        self.crew: Crew
        self.calendar: Calendar

    def open(self) -> Daemon:
        """Take the state folder (its lock, then what a killed predecessor left running), open
        the history and load each server's; `close()` undoes it in reverse. Returns itself."""
        if self._lock is not None:
            return self
        config, wall, mono = self.config, self.wall, self.mono
        # Before anything is read or written: a second daemon on this state folder would
        # settle the first one's restart as interrupted, probe beside it and restart twice.
        private_dir(self.state_dir)  # UnsafeState: refused, as ssh does
        self._lock = hold_lock(self.state_dir / LOCK_FILE)
        with contextlib.ExitStack() as undo:  # a part that fails undoes those before it
            undo.callback(self._unlock)
            # Only now, holding the lock: what a killed predecessor left running is ours to end.
            self.system.record = self.state_dir / COMMANDS_FILE
            for left in self.system.settle_left():
                log.warning("ended a command the previous watchdog left running: %s", left)
            self.left = left_probes(self.state_dir)
            self.store = Store(self.state_dir / HISTORY_FILE, wall=wall, behind=True)
            undo.callback(self.store.close)
            self.alerter = Alerter(
                config.watchdog.alerts, config.watchdog.on_event, notify=self._notify
            )
            undo.callback(self.alerter.close, timeout=5.0)
            self.metrics = Metrics(self.status)
            self.days = Days(self.store, lambda: self.interval, wall, mono)
            ladder = Ladder(
                system=self.system,
                table=self.table,
                wall=wall,
                mono=mono,
                stopping=self._stop.is_set,
            )
            sinks = Sinks(self.metrics, self.days)  # the page's day is kept as probes are recorded
            self.crew = Crew(self.store, self.alerter, ladder, sinks, wall, mono)
            self.crew.residents, self.crew.machine = self._residents, self._machine
            cycles, interval = (lambda: self.cycles), (lambda: self.interval)
            self.calendar = Calendar(
                self.store, self.alerter, cycles, interval, self._maintain, wall
            )
            undo.callback(self.cycles.clear)
            for server in config.servers:
                self.cycles[server.name] = self._cycle(server)
            undo.pop_all()
        return self

    def _unlock(self) -> None:
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None

    def close(self) -> None:
        """Undo `open()` in reverse: the alerts sent, the history written and closed, the state
        folder's lock released. A daemon that ran closes itself as it stops."""
        if self._lock is None:
            return
        self.alerter.close(timeout=5.0)
        self.store.close()
        self._unlock()

    def __enter__(self) -> Daemon:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _residents(self) -> list[tuple[str, int]]:
        """Each local server's resident memory, for a restart under memory pressure."""
        shown = [c.shown for c in list(self.cycles.values())]
        return [(s.server.name, resident(s.pid)) for s in shown if s.local]

    @property
    def interval(self) -> float:
        return self.config.watchdog.interval

    def _cycle(self, server: ServerConfig) -> Cycle:
        checker = Checker(
            server,
            left=self.left,
            table=self.table,
            mono=self.mono,
            wall=self.wall,
            announce_probe=True,
            memory=MemoryWatch(self.crew.machine),
        )
        manager = make_manager(server, self.system, self.state_dir)
        cycle = Cycle(server, manager, checker, self.crew)
        cycle.load()
        return cycle

    def tick(self, name: str) -> Verdict | None:
        """Judge one server once: its own job's work, after a reload's settings are applied."""
        c = self.cycles[name]
        try:
            c.apply_new_config(self._manager)
            return c.tick(self.interval)
        finally:
            c.ticked()

    # -- what the endpoint and `status` show -------------------------------------------------

    def status(self, only: str | None = None) -> Status:
        """Every server's document, or `only` that one's (none when no such server is watched:
        HAProxy's agent asks about one server a check, every second)."""
        now, mono = self.wall(), self.mono()
        named = list(self.cycles.items())
        cycles = [c for name, c in named if only is None or name == only]
        line = WatchdogLine(
            pid=os.getpid(),
            version=__version__,
            started_at=self.started_at,
            interval_s=self.interval,
            running=True,
            history_problem=self.store.problem,
        )
        return Status(line, tuple(of_shown(c.shown, now, mono, self.interval) for c in cycles))

    def page(self) -> str:
        """The status page, rendered at most once per its own reload period (one render at a
        time; whoever asks meanwhile gets the last): reloads, however many, cost the probing
        one render a period, not one each. The page says the time it was rendered."""
        with self._page_lock:
            at, html = self._page
            mono, every = self.mono(), refresh_s(self.interval)
            if html and 0 <= mono - at < every:
                return html
            doc, days = self.status(), self.days.of(list(self.cycles))
            config = None if self.config_path is None else str(self.config_path)
            html = render(doc, days, self.wall(), every, config)
            self._page = (self.mono(), html)
            return html

    def prometheus(self) -> tuple[bytes, str]:
        return self.metrics.exposition()

    def act(self, name: str, action: str) -> str:
        """Queue a person's action for the server's next tick (Conflict: refused; KeyError:
        no such server)."""
        self.cycles[name].ask(action, self.interval)
        self.schedule.wake(name)
        return f"{action} of {name} queued; it runs at the server's next tick"

    def stalled(self) -> str | None:
        """Why this daemon's ticks have stopped (see daemon/heartbeat.py), or None. A restart
        or a drain in progress is bounded by its own steps and counts as progress."""
        mono = self.mono()
        progress, limits = {}, {}
        for name, c in list(self.cycles.items()):
            if c.retired:
                continue
            shown = c.shown
            progress[name] = shown.progress(mono)
            limits[name] = shown.fresh_for(self.interval) + STALL_MARGIN
        return stalled(progress, limits, mono)

    def folder_lost(self) -> str | None:
        """Why this daemon no longer holds its state folder, or None. A folder removed under
        it takes its lock, history and endpoint record along: `status` would say no watchdog
        runs and a second `run` would start beside it. It ends instead, and its service
        manager starts it afresh on a new folder."""
        if self._lock is None:
            return None
        return lock_lost(self._lock, self.state_dir / LOCK_FILE)

    def look_at_sight(self) -> None:
        """Say once when a server's verdict goes stale, and once when it is fresh again."""
        mono = self.mono()
        for name, c in list(self.cycles.items()):
            shown = c.shown
            blind = shown.blindness(mono, self.interval)
            said = sight_said(shown, blind, name in self._blind)
            if said is None:
                continue
            kind, message = said
            (self._blind.add if kind is EventKind.BLIND else self._blind.discard)(name)
            c.ledger.record(Said(self.wall(), kind, message, shown.state))

    # -- running ----------------------------------------------------------------------------

    def _job(self, name: str) -> None:
        c = self.cycles.get(name)
        if self._stop.is_set() or c is None or c.retired:
            return
        with self._active_cv:
            self._active += 1
        c.tick_begins()
        problem: str | None = None
        error: Exception | None = None
        try:
            self.tick(name)
        except Exception as exc:  # a fault in one tick must not stop the probing
            error, fault = exc, printable(f"{type(exc).__name__}: {exc}")
            problem = (
                printable(str(exc))
                if isinstance(exc, OwnFault)
                else f"the last tick failed: {fault}"
            )[:500]
        finally:
            if c.tick_ends(problem):  # said once per run of the same fault, not every tick
                if isinstance(error, OwnFault):  # the watchdog's own setting: no traceback to read
                    log.error("%s cannot be probed: %s; probing goes on", name, problem)
                else:
                    log.error("%s tick failed; probing goes on", name, exc_info=error)
            with self._active_cv:
                self._active -= 1
                self._active_cv.notify_all()

    def rotate_logs(self) -> None:
        settings = self.config.watchdog
        servers = [c.shown.server for c in list(self.cycles.values())]
        paths = [s.log_file for s in servers if s.log_file]
        paths += [self.own_log] if self.own_log is not None else []
        rotate_all(paths, settings.log_max_size, settings.log_keep)

    def _schedule(self) -> None:
        interval = self.config.watchdog.interval
        jobs = {name: (interval, functools.partial(self._job, name)) for name in self.cycles}
        self.schedule.keep({"logs": (LOG_CHECK, self.rotate_logs), **jobs})

    def run(self, *, install_signals: bool = True) -> int:
        """Run in the foreground until SIGTERM/SIGINT (or `stop()`); SIGHUP reloads.

        The signal handlers only set flags; this loop, on the main thread, does the work.
        """
        self.open()
        if install_signals:
            signal.signal(signal.SIGTERM, lambda *_: self.stop())
            signal.signal(signal.SIGINT, lambda *_: self.stop())
            signal.signal(signal.SIGHUP, lambda *_: self.request_reload())
            # Every other signal whose default ends a process, on purpose: SIGUSR1 rotates the
            # logs now (logrotate's `postrotate kill -USR1`); the rest are said and ignored.
            signal.signal(signal.SIGUSR1, lambda *_: self._signalled("SIGUSR1"))
            for sig in IGNORED_SIGNALS:
                signal.signal(sig, lambda n, _: self._signalled(signal.Signals(n).name))
        for c in self.cycles.values():
            c.start_server()
        self.days.seed(list(self.cycles))
        self._serve_endpoint()
        self._serve_agent()
        self._running = True
        self._schedule()
        self.calendar.start(self.config)
        log.info("watching %s every %gs", ", ".join(self.cycles), self.config.watchdog.interval)
        self.notifier.send("READY=1", f"STATUS=watching {len(self.cycles)} servers")
        code, stall = 0, None
        try:
            while not self._stop.is_set():
                if self._wake.wait(1.0):
                    self._wake.clear()
                try:
                    self.look_at_sight()
                except Exception:
                    log.exception("cannot tell whether the verdicts are fresh")
                stall = self.stalled()
                why = stall or self.folder_lost()
                if why is not None:
                    code = self._give_up(why)
                    break
                self.notifier.send("WATCHDOG=1")
                self._answer_signals()
                if self._reload.is_set() and not self._stop.is_set():
                    self._reload.clear()
                    self.reload()
        finally:
            self.notifier.send("STOPPING=1")
            self.schedule.stop()
            self.calendar.stop()
            # Ticks that stopped will not end by themselves: no long wait for them.
            self._finish(STALLED_SETTLE if stall is not None else self.stop_timeout)
        return code

    def _give_up(self, why: str) -> int:
        """Ticks that stopped are a fault of this process: end it, so that the service manager
        starts a fresh one (launchd's KeepAlive, systemd's Restart=; systemd's WatchdogSec
        would end it anyway, as the heartbeat stops). If the stop itself hangs, exit at once."""
        log.error("%s: the watchdog ends so that its service manager starts it afresh", why)
        backstop = threading.Timer(
            self.stop_timeout + INTERRUPT_TIMEOUT + 60.0, os._exit, (EXIT_STALLED,)
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

    def _signalled(self, name: str) -> None:
        self._signals.append(name)
        self._wake.set()

    def _answer_signals(self) -> None:
        """On the main loop, what the handlers only noted."""
        while self._signals:
            name = self._signals.popleft()
            if name == "SIGUSR1":
                log.info("SIGUSR1: rotating the logs now")
                try:
                    self.rotate_logs()
                except OSError as exc:
                    log.error("cannot rotate the logs: %s", exc)
            else:
                log.warning("%s ignored (SIGTERM stops the watchdog, SIGHUP reloads it)", name)

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
            self.cycles.pop(name).retire()
        for name, server in fresh.items():
            if name not in self.cycles:
                self.cycles[name] = self._cycle(server)
                self.cycles[name].start_server()
            elif old.get(name) != server:
                self.cycles[name].reconfigure_later(server)
        before, self.config = self.config.watchdog, new
        after = new.watchdog
        if (before.alerts, before.on_event) != (after.alerts, after.on_event):
            self.alerter.use(after.alerts, after.on_event)
        if self._running:
            self._schedule()
            self.calendar.restart(new)
        log.info("config reloaded: watching %s", ", ".join(self.cycles))
        for key in NEEDS_RESTART:
            if getattr(before, key) != getattr(after, key):
                log.warning(
                    "watchdog.%s changed (%s -> %s): it takes effect when the watchdog restarts",
                    key,
                    getattr(before, key),
                    getattr(after, key),
                )
        return True

    def _manager(self, server: ServerConfig) -> Manager:
        return make_manager(server, self.system, self.state_dir)

    def _finish(self, settle: float) -> None:
        self._stop.set()
        if not self._settle(settle):
            # A restart still running: kill its command so it ends, recorded as interrupted.
            log.warning("a restart is still running after %gs; interrupting it", settle)
            self.system.interrupt()
            self._settle(INTERRUPT_TIMEOUT)
            self.system.resume()  # the managed servers still get their stop grace
        for c in self.cycles.values():
            c.checker.abort()
            c.manager.stop()
        if self.endpoint is not None:
            (self.state_dir / DAEMON_FILE).unlink(missing_ok=True)
        for served in (self.endpoint, self.agent):
            if served is not None:
                served.shutdown()
                served.server_close()
        self.close()
        log.info("stopped")

    def _serve_agent(self) -> None:
        """Answer HAProxy's agent check per server (`watchdog.agent`), if asked for."""
        where = self.config.watchdog.agent
        if where is None:
            return
        try:
            self.agent = start_agent(where[0], where[1], self.status, self.crew.rotation)
        except OSError as exc:
            log.error("cannot serve the agent check on %s:%s (%s)", *where, exc)
            return
        log.info("agent check at %s:%s", *self.agent.server_address[:2])

    def _serve_endpoint(self) -> None:
        """Start /healthz, /status, /metrics; without them the watchdog still probes and heals."""
        settings = self.config.watchdog
        if settings.listen_port is None:
            return
        try:
            token = ensure_token(self.state_dir / TOKEN_FILE)
            endpoint, _ = start_endpoint(
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
        host, port = str(endpoint.server_address[0]), endpoint.server_address[1]
        url = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        record = {"pid": os.getpid(), "url": url, "started_at": self.started_at}
        try:
            write_private(self.state_dir / DAEMON_FILE, json.dumps(record))
        except OSError as exc:
            log.error("cannot write %s (%s); the CLI will not find the endpoint", DAEMON_FILE, exc)
        # Published after the record: whoever sees the endpoint finds the CLI's way to it too.
        self.endpoint = endpoint
        log.info("endpoint at %s (/healthz, /status, /metrics)", url)

    def _settle(self, timeout: float) -> bool:
        """Wait for the running jobs to end; False when some are still running."""
        with self._active_cv:
            return self._active_cv.wait_for(lambda: not self._active, timeout)
