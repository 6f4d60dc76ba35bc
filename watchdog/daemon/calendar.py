"""Calendar work on APScheduler: the daily summary and each server's maintenance window.

The probe loop stays on the watchdog's own scheduler (daemon/schedule.py) and the monotonic
clock: APScheduler follows the wall clock (agronholm/apscheduler #351, #339, #752), and a Mac
that sleeps or steps its clock must not stall probing. The calendar is where the wall clock is
right: "08:00" means 08:00 on the wall clock, in local time. APScheduler is imported only when
the daemon starts the calendar.

As APScheduler 3.11's CronTrigger computes it (tests/test_calendar.py checks each):
- spring forward: a time in the skipped hour (02:30 in Europe/Berlin on 29 March 2026) comes
  once, an hour later by the wall (03:30 summer time);
- fall back: a time in the repeated hour comes twice; each job runs once a local date, so the
  second is skipped (and logged);
- the clock stepped forward past a job's time: the scheduler also wakes every WAKE seconds,
  so the job runs within a minute, late, once (coalesced, within MISFIRE_GRACE);
- the clock stepped back: the job runs when its time comes again, at most once a local date.

Local time is the zone tzlocal names; where it names none (`TZ=UTC0`, a POSIX rule such as
`EST5EDT,M3.2.0,M11.1.0`, a zone name this machine lacks), it is the C library's reading of
TZ, as `time.localtime` and every other time the watchdog shows. A reload keeps an unchanged
job's next run: computed afresh inside a daylight-saving shift, today's run would be lost.
"""

from __future__ import annotations

import calendar
import logging
import time
from collections.abc import Callable, Mapping
from datetime import datetime, timedelta, tzinfo
from typing import TYPE_CHECKING, Any

from mlx_watchdog.config import Config, ServerConfig, when_fields
from mlx_watchdog.cycle import Conflict, Cycle
from mlx_watchdog.cycle.shown import Shown
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


class SystemLocal(tzinfo):
    """Local time as the C library reads TZ: for a TZ that names no zone tzlocal knows.

    As PEP 495 has it: a wall time the clock skipped (spring forward) or passed twice (fall
    back) takes the offset from before the change with fold 0, from after it with fold 1."""

    def utcoffset(self, dt: datetime | None) -> timedelta:
        if dt is None:
            return timedelta(seconds=time.localtime().tm_gmtoff)
        return timedelta(seconds=_offset(dt))

    def dst(self, dt: datetime | None) -> timedelta:
        return self.utcoffset(dt) + timedelta(seconds=time.timezone)

    def tzname(self, dt: datetime | None) -> str:
        return time.tzname[1 if self.dst(dt) else 0]

    def fromutc(self, dt: datetime) -> datetime:
        stamp = calendar.timegm(dt.replace(tzinfo=None).timetuple())  # dt holds UTC wall time
        t = time.localtime(stamp)
        wall = datetime(*t[:6], microsecond=dt.microsecond, tzinfo=self)
        return wall if _offset(wall) == t.tm_gmtoff else wall.replace(fold=1)

    def __repr__(self) -> str:
        return f"SystemLocal({time.tzname[0]})"


def _offset(dt: datetime) -> int:
    """The UTC offset of a local wall time, in seconds (see SystemLocal)."""
    wall = calendar.timegm((dt.year, dt.month, dt.day, dt.hour, dt.minute, dt.second))
    before = time.localtime(wall - 43200).tm_gmtoff
    after = time.localtime(wall + 43200).tm_gmtoff
    if before == after:
        return before
    fits = [o for o in (before, after) if time.localtime(wall - o).tm_gmtoff == o]
    if len(fits) == 1:
        return fits[0]
    return after if dt.fold else before


def local_zone() -> tzinfo:
    """The zone local times are read in: tzlocal's, else the C library's reading of TZ."""
    from tzlocal import get_localzone

    try:
        return get_localzone()
    except Exception as exc:  # tzlocal raises its own, ValueError and zoneinfo's for a bad TZ
        log.info("local time from the C library's reading of TZ (%s)", exc)
        return SystemLocal()


class Calendar:
    """Calendar work on the wall clock: the daily summary and each maintenance window."""

    def __init__(
        self,
        store: Store,
        alerter: Alerter,
        cycles: Callable[[], Mapping[str, Cycle]],
        interval: Callable[[], float],
        maintain: Maintain | None,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.store = store
        self.alerter = alerter
        self.cycles = cycles
        self.interval = interval
        self.maintain = maintain
        self.wall = wall
        self._scheduler: BackgroundScheduler | None = None
        self._ran: dict[str, str] = {}  # job id -> the local date it last ran
        self._kept: dict[str, datetime] = {}  # a reload's unchanged jobs: their next runs
        self._fields: dict[str, dict[str, str]] = {}  # each job's times, as scheduled

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
        """Schedule the config's calendar work; a failure is logged and probing goes on."""
        wanted = self.jobs(config)
        if not wanted:
            return
        try:
            self._start(wanted)
        except Exception as exc:  # the calendar must never take the probing down with it
            log.error("calendar work not scheduled (%s: %s)", type(exc).__name__, exc)

    def _start(self, wanted: list[tuple[str, dict[str, str], Callable[[], None]]]) -> None:
        from apscheduler.schedulers.background import BackgroundScheduler
        from apscheduler.triggers.cron import CronTrigger

        zone = local_zone()
        defaults = {"coalesce": True, "misfire_grace_time": MISFIRE_GRACE, "max_instances": 1}
        scheduler = BackgroundScheduler(job_defaults=defaults, daemon=True, timezone=zone)
        scheduler.add_job(lambda: None, "interval", seconds=WAKE, id="wake")
        for job_id, fields, run in wanted:
            trigger = CronTrigger(**fields, timezone=zone)
            if job_id in self._kept:
                scheduler.add_job(run, trigger, id=job_id, next_run_time=self._kept[job_id])
            else:
                scheduler.add_job(run, trigger, id=job_id)
        self._kept, self._fields = {}, {job_id: fields for job_id, fields, _ in wanted}
        scheduler.start()
        self._scheduler = scheduler

    def stop(self) -> None:
        if self._scheduler is not None:
            self._scheduler.shutdown(wait=False)
            self._scheduler = None

    def restart(self, config: Config) -> None:
        """A reload's jobs; what ran today stays ran, and an unchanged job keeps its next run."""
        self._kept = self._next_runs(config)
        self.stop()
        self.start(config)

    def _next_runs(self, config: Config) -> dict[str, datetime]:
        """Each job's next run, where the new config asks for the same times."""
        if self._scheduler is None:
            return {}
        wanted = {job_id: fields for job_id, fields, _ in self.jobs(config)}
        return {
            job.id: job.next_run_time
            for job in self._scheduler.get_jobs()
            if job.next_run_time is not None
            and job.id in wanted
            and self._fields.get(job.id) == wanted[job.id]
        }

    def once(self, job_id: str) -> bool:
        """Each job runs once a local date (a fall-back hour comes twice)."""
        today = time.strftime("%Y-%m-%d", time.localtime(self.wall()))
        if self._ran.get(job_id) == today:
            log.info("%s already ran today (%s); not again", job_id, today)
            return False
        self._ran[job_id] = today
        return True

    def summary(self) -> None:
        if not self.once("summary"):
            return
        now = self.wall()
        for name, cycle in self.cycles().items():
            text, numbers = daily_summary(self.store, name, now)
            self._say(EventKind.SUMMARY, name, text, cycle.shown.state, numbers)

    def maintenance(self, name: str) -> None:
        cycle = self.cycles().get(name)
        if cycle is None or not self.once(f"maintenance:{name}"):
            return
        shown = cycle.shown
        busy = idle_problem(shown, time.monotonic(), self.interval())
        if busy is not None:
            self._say(EventKind.MAINTENANCE, name, f"skipped: {busy}", None, {"done": False})
            return
        done = []
        if self.maintain is not None:
            try:
                done.append(self.maintain(shown.server, self.store))
            except Exception as exc:  # a failed calibration must not end the calendar
                done.append(f"calibration failed: {type(exc).__name__}: {exc}")
        if shown.server.maintenance_restart:
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
        now = self.wall()
        log.info("%s %s: %s", name, kind, text)
        self.store.add_event(name, now, kind, text, data)
        self.alerter.send(Event(kind, name, now, text, state, data))


def idle_problem(shown: Shown, mono: float, interval: float) -> str | None:
    """Why the server is not idle now (calibration would make everyone wait), or None."""
    v = shown.verdict
    blind = shown.blindness(mono, interval)
    if blind is not None or v is None:
        return blind or "no verdict yet"
    if v.state != State.HEALTHY or shown.figures.incident is not None:
        return f"it is {v.state}"
    if shown.restarting or shown.draining:
        return "a restart or a drain is under way"
    live = v.evidence.live_connections
    if live is None:
        return "its connections cannot be seen, so whether clients wait cannot be told"
    if live or v.evidence.abandoned_connections:
        return f"{live} client(s) connected"
    return None
