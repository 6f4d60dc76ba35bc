"""Calendar work on APScheduler: the daily summary and each server's maintenance window.

The probe loop stays on the watchdog's own scheduler (daemon/schedule.py) and the monotonic
clock: APScheduler follows the wall clock (agronholm/apscheduler #351, #339, #752), and a Mac
that sleeps or steps its clock must not stall probing. The calendar is where the wall clock is
right: "08:00" means 08:00 on the wall clock, in local time. APScheduler is imported only when
the daemon starts the calendar.

As APScheduler 3.11's CronTrigger computes it (tests/test_calendar.py checks each):
- spring forward: a time in the skipped hour (02:30 in Europe/Berlin on 29 March 2026) comes
  once, an hour later by the clock (03:30 summer time);
- fall back: a time in the repeated hour comes twice; each job runs once a local date, so the
  second is skipped (and logged);
- the clock stepped forward past a job's time: the scheduler also wakes every WAKE seconds,
  so the job runs within a minute, late, once (coalesced, within MISFIRE_GRACE);
- the clock stepped back: the job runs when its time comes again, at most once a local date.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from mlx_watchdog.config import Config, ServerConfig, when_fields
from mlx_watchdog.cycle import Conflict, Cycle
from mlx_watchdog.judge.states import EventKind, State
from mlx_watchdog.record.alerts import Alerter, Event
from mlx_watchdog.record.store import Store
from mlx_watchdog.record.summary import daily_summary

if TYPE_CHECKING:
    from apscheduler.schedulers.background import BackgroundScheduler

log = logging.getLogger("mlx_watchdog")

WAKE = 60.0  # s: the scheduler looks at the wall clock at least this often
MISFIRE_GRACE = 3600  # s: a job whose time was missed (a sleep, a clock step) still runs
Maintain = Callable[[ServerConfig, Store], str]  # calibrate, keep it, say what was found


class Calendar:
    def __init__(
        self,
        store: Store,
        alerter: Alerter,
        cycles: Callable[[], Mapping[str, Cycle]],
        interval: Callable[[], float],
        maintain: Maintain | None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.alerter = alerter
        self.cycles = cycles
        self.interval = interval
        self.maintain = maintain
        self.clock = clock
        self._scheduler: BackgroundScheduler | None = None
        self._ran: dict[str, str] = {}  # job id -> the local date it last ran

    def jobs(self, config: Config) -> list[tuple[str, dict[str, str], Callable[[], None]]]:
        """(id, cron fields, what runs) for each job the config asks for."""
        wanted: list[tuple[str, dict[str, str], Callable[[], None]]] = []
        if config.watchdog.daily_summary:
            wanted.append(("summary", when_fields(config.watchdog.daily_summary), self.summary))
        for server in config.servers:
            if server.maintenance:

                def run(name: str = server.name) -> None:
                    self.maintenance(name)

                wanted.append((f"maintenance:{server.name}", when_fields(server.maintenance), run))
        return wanted

    def start(self, config: Config) -> None:
        wanted = self.jobs(config)
        if not wanted:
            return
        from apscheduler.schedulers.background import BackgroundScheduler
        from apscheduler.triggers.cron import CronTrigger

        defaults = {"coalesce": True, "misfire_grace_time": MISFIRE_GRACE, "max_instances": 1}
        scheduler = BackgroundScheduler(job_defaults=defaults, daemon=True)
        scheduler.add_job(lambda: None, "interval", seconds=WAKE, id="wake")
        for job_id, fields, run in wanted:
            scheduler.add_job(run, CronTrigger(**fields), id=job_id)
        scheduler.start()
        self._scheduler = scheduler

    def stop(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=False)
            self._scheduler = None

    def restart(self, config: Config) -> None:
        """A reload's jobs; what ran today stays ran."""
        self.stop()
        self.start(config)

    def once(self, job_id: str) -> bool:
        """Each job runs once a local date (a fall-back hour comes twice)."""
        today = time.strftime("%Y-%m-%d", time.localtime(self.clock()))
        if self._ran.get(job_id) == today:
            log.info("%s already ran today (%s); not again", job_id, today)
            return False
        self._ran[job_id] = today
        return True

    def summary(self) -> None:
        if not self.once("summary"):
            return
        now = self.clock()
        for name, cycle in self.cycles().items():
            text, numbers = daily_summary(self.store, name, now)
            state = cycle.verdict.state if cycle.verdict else None
            self._say(EventKind.SUMMARY, name, text, state, numbers)

    def maintenance(self, name: str) -> None:
        cycle = self.cycles().get(name)
        if cycle is None or not self.once(f"maintenance:{name}"):
            return
        busy = idle_problem(cycle, time.monotonic(), self.interval())
        if busy is not None:
            self._say(EventKind.MAINTENANCE, name, f"skipped: {busy}", None, {"done": False})
            return
        done = []
        if self.maintain is not None:
            try:
                done.append(self.maintain(cycle.server, self.store))
            except Exception as exc:  # a failed calibration must not end the calendar
                done.append(f"calibration failed: {type(exc).__name__}: {exc}")
        if cycle.server.maintenance_restart:
            try:
                cycle.ask("planned-restart", self.interval())
                done.append("a planned restart is asked of the server's cycle")
            except Conflict as exc:
                done.append(f"no planned restart: {exc}")
        said = "; ".join(done) or "nothing to do"
        self._say(EventKind.MAINTENANCE, name, said, State.HEALTHY, {"done": True})

    def _say(
        self, kind: EventKind, name: str, text: str, state: str | None, data: dict[str, Any]
    ) -> None:
        now = self.clock()
        log.info("%s %s: %s", name, kind, text)
        self.store.add_event(name, now, kind, text, data)
        self.alerter.send(Event(kind, name, now, text, state, data))


def idle_problem(cycle: Cycle, mono: float, interval: float) -> str | None:
    """Why the server is not idle now (calibration would make everyone wait), or None."""
    v = cycle.verdict
    blind = cycle.blindness(mono, interval)
    if blind is not None or v is None:
        return blind or "no verdict yet"
    if v.state != State.HEALTHY or cycle.incident is not None:
        return f"it is {v.state}"
    if cycle.restarting or cycle.draining:
        return "a restart or a drain is under way"
    live = v.evidence.live_connections
    if live is None:
        return "its connections cannot be seen, so whether clients wait cannot be told"
    if live or v.evidence.abandoned_connections:
        return f"{live} client(s) connected"
    return None
