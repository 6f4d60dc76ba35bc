"""Calendar work on APScheduler: the daily summary and maintenance windows, daylight saving and
clock steps read from APScheduler's own trigger arithmetic (no sleeping until a date)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import pytest
from apscheduler.triggers.cron import CronTrigger

from mlx_watchdog.config import ConfigError, parse_config, when_fields
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.daemon.calendar import MISFIRE_GRACE, WAKE, Calendar, idle_problem
from mlx_watchdog.judge.states import EventKind
from mlx_watchdog.record.alerts import Alerter, Event
from mlx_watchdog.record.store import Store
from mlx_watchdog.record.summary import daily_summary
from tests.builders import command_server, watchdog_config
from tests.conftest import BadByPidfile, DaemonThread, until

BERLIN = ZoneInfo("Europe/Berlin")
UTC = UTC


@pytest.fixture
def berlin() -> Iterator[None]:
    """Local time is Berlin's for the test (time.localtime follows TZ)."""
    old = os.environ.get("TZ")
    os.environ["TZ"] = "Europe/Berlin"
    time.tzset()
    yield
    if old is None:
        del os.environ["TZ"]
    else:
        os.environ["TZ"] = old
    time.tzset()


def fires(when: str, start: datetime, n: int) -> list[datetime]:
    """The next `n` fire times APScheduler computes for a parsed "when", in UTC."""
    trigger = CronTrigger(**when_fields(when), timezone=BERLIN)
    out: list[datetime] = []
    previous, now = None, start
    for _ in range(n):
        fire = trigger.get_next_fire_time(previous, now)
        assert fire is not None
        out.append(fire.astimezone(UTC))
        previous, now = fire, fire
    return out


def test_spring_forward_a_time_in_the_skipped_hour_comes_once_an_hour_later() -> None:
    at = fires("02:30", datetime(2026, 3, 28, 12, tzinfo=BERLIN), 3)
    # 29 March: 02:30 does not exist; it fires at 01:30 UTC, which is 03:30 summer time.
    assert at[0] == datetime(2026, 3, 29, 1, 30, tzinfo=UTC)
    assert at[0].astimezone(BERLIN).strftime("%H:%M %Z") == "03:30 CEST"
    assert at[1:] == [datetime(2026, 3, d, 0, 30, tzinfo=UTC) for d in (30, 31)]


def test_fall_back_a_time_in_the_repeated_hour_comes_twice_and_runs_once(berlin: None) -> None:
    at = fires("02:30", datetime(2026, 10, 24, 12, tzinfo=BERLIN), 3)
    assert at == [
        datetime(2026, 10, 25, 0, 30, tzinfo=UTC),  # 02:30 summer time
        datetime(2026, 10, 25, 1, 30, tzinfo=UTC),  # 02:30 again, winter time
        datetime(2026, 10, 26, 1, 30, tzinfo=UTC),
    ]
    now = [at[0].timestamp()]
    cal = Calendar(Store(None), Alerter([]), dict, lambda: 1.0, None, wall=lambda: now[0])
    assert cal.once("summary") is True
    now[0] = at[1].timestamp()
    assert cal.once("summary") is False  # the same local date: not twice
    now[0] = at[2].timestamp()
    assert cal.once("summary") is True


def test_a_weekly_window_fires_on_its_day() -> None:
    at = fires("sun 04:00", datetime(2026, 12, 4, 12, tzinfo=BERLIN), 2)
    local = [a.astimezone(BERLIN) for a in at]
    assert [d.strftime("%a %H:%M") for d in local] == ["Sun 04:00", "Sun 04:00"]
    assert local[1] - local[0] == timedelta(days=7)


def test_the_scheduler_wakes_every_minute_and_a_missed_time_still_runs_once(
    tmp_path: Path,
) -> None:
    """A clock stepped forward past a job's time: the wake job makes the scheduler look within a
    minute; the missed run is in its grace and coalesced."""
    config = parse_config(
        {
            "watchdog": {"daily_summary": "08:00", "state_dir": str(tmp_path)},
            "server": [{"url": "http://127.0.0.1:1", "maintenance": "Sun 04:00"}],
        }
    )
    cal = Calendar(Store(None), Alerter([]), dict, lambda: 1.0, None)
    cal.start(config)
    try:
        assert cal._scheduler is not None
        jobs = {j.id: j for j in cal._scheduler.get_jobs()}
        assert set(jobs) == {"wake", "summary", f"maintenance:{config.servers[0].name}"}
        assert jobs["wake"].trigger.interval == timedelta(seconds=WAKE)
        for job in jobs.values():
            assert (job.coalesce, job.misfire_grace_time, job.max_instances) == (
                True,
                MISFIRE_GRACE,
                1,
            )
        fields = {f.name: str(f) for f in jobs["summary"].trigger.fields}
        assert (fields["hour"], fields["minute"]) == ("8", "0")
    finally:
        cal.stop()
    assert cal._scheduler is None


@pytest.mark.parametrize(
    ("section", "value", "said"),
    [
        ("watchdog", "Sun 08:00", 'watchdog.daily_summary = "Sun 08:00" must be a time of day'),
        ("watchdog", "25:00", "must be a local time"),
        ("server", "Sunday 04:00", 'maintenance = "Sunday 04:00" must be a local time'),
        ("server", "4", "must be a local time"),
        ("server", "sun 4:60", "must be a local time"),
    ],
)
def test_a_bad_time_names_the_key_and_the_value(section: str, value: str, said: str) -> None:
    doc: dict[str, Any] = {"server": [{"url": "http://127.0.0.1:1"}]}
    if section == "watchdog":
        doc["watchdog"] = {"daily_summary": value}
    else:
        doc["server"][0]["maintenance"] = value
    with pytest.raises(ConfigError, match=said):
        parse_config(doc)


def test_the_daily_summary_counts_the_last_24_hours(tmp_path: Path) -> None:
    store = Store(tmp_path / "history.db")
    now = time.time()
    old = store.open_incident("mac", now - 2 * 86400, "wedged", "old", {})
    store.close_incident(old, now - 2 * 86400 + 60, "restarted", 5.0)
    for at, outage in ((now - 3600, 30.0), (now - 600, 12.5)):
        i = store.open_incident("mac", at, "wedged", "wedged: ...", {}, began_at=at)
        store.close_incident(i, at + outage, "restarted", 3.0)
    store.set_advice(i, "raise their timeouts to at least 120 s")
    r = store.start_restart("mac", now - 600, "wedged")
    store.finish_restart(r, now - 590, "recovered", 9.0)
    store.add_event("mac", now - 700, EventKind.GAVE_UP, "2 gave up", {"count": 2})
    store.add_event("mac", now - 650, EventKind.GAVE_UP, "edited", {"count": "lots"})
    for t in (0.1, 0.2, 0.3, 2.0):
        store.record_probe("mac", now - 100, "healthy", "ok", {"ttft_s": t})
    text, numbers = daily_summary(store, "mac", now)
    assert numbers["incidents"] == 2 and numbers["restarts"] == 1 and numbers["gave_up"] == 2
    assert text == (
        "2 incidents, 1 restart, outage 42 s in all, 2 clients gave up mid-request, TTFT p95 "
        "2.00 s. Advice: raise their timeouts to at least 120 s"
    )
    store.close()


class Told(Alerter):
    def __init__(self) -> None:
        super().__init__([])
        self.told: list[Event] = []

    def send(self, event: Event) -> None:
        self.told.append(event)


def idle_config(tmp_path: Path, bad: BadByPidfile, **server: object) -> dict[str, object]:
    return {
        "watchdog": {"interval": "300ms", "listen": "127.0.0.1:0", "state_dir": str(tmp_path)},
        "server": [{"name": "bad", "url": bad.url, "match": "badserver", **server}],
    }


@pytest.fixture
def healthy(tmp_path: Path) -> Iterator[BadByPidfile]:
    bad = BadByPidfile(tmp_path, "ok")
    yield bad
    bad.kill()


def test_maintenance_calibrates_an_idle_server_and_asks_for_a_planned_restart(
    tmp_path: Path,
    healthy: BadByPidfile,
    run_daemon: Callable[[object], DaemonThread],
) -> None:
    asked: list[str] = []

    def maintain(server: object, store: Store) -> str:
        asked.append(getattr(server, "name", "?"))
        return "calibrated: a 32,768-token prompt needs about 20 s here"

    server = {
        **command_server(healthy.url, healthy.pidfile, healthy.port),
        "maintenance": "Sun 04:00",
        "maintenance_restart": True,
    }
    config = parse_config(watchdog_config(tmp_path / "state", [server], interval="300ms"))
    daemon = Daemon(config, maintain=maintain).open()
    t = run_daemon(daemon)
    w = daemon.cycles["bad"]
    until(lambda: w.verdict is not None and w.verdict.state == "healthy", 30, "healthy")
    told = Told()
    daemon.calendar.alerter = told
    daemon.calendar.maintenance("bad")
    assert asked == ["bad"]
    until(lambda: daemon.store.restarts("bad", 0.0), 30, "the planned restart")
    (event,) = told.told
    assert event.kind == EventKind.MAINTENANCE and event.server == "bad"
    assert event.message.startswith("calibrated: a 32,768-token prompt")
    assert "a planned restart is asked" in event.message
    restart = daemon.store.restarts("bad", 0.0)[0]
    assert restart.trigger == "maintenance"  # not "manual": nobody asked
    said = [e.message for e in daemon.store.events() if e.kind == "restarting"]
    assert said and "the maintenance window's planned restart" in said[0], said
    assert not any("a person asked" in m for m in said)
    # The same day again: not twice.
    daemon.calendar.maintenance("bad")
    assert asked == ["bad"] and len(told.told) == 1
    t.stop()


def test_maintenance_is_skipped_while_clients_are_served(
    tmp_path: Path, hanging: BadByPidfile, run_daemon: Callable[[object], DaemonThread]
) -> None:
    config = parse_config(idle_config(tmp_path, hanging, maintenance="04:00"))
    calls: list[str] = []
    daemon = Daemon(config, maintain=lambda s, st: calls.append("x") or "").open()
    run_daemon(daemon)
    w = daemon.cycles["bad"]
    until(lambda: w.verdict is not None, 30, "a verdict")
    assert idle_problem(w.shown, time.monotonic(), 0.3) is not None
    told = Told()
    daemon.calendar.alerter = told
    daemon.calendar.maintenance("bad")
    assert calls == []
    (event,) = told.told
    assert event.message.startswith("skipped: ")
    recorded = [e for e in daemon.store.events("bad") if e.kind == EventKind.MAINTENANCE]
    assert len(recorded) == 1 and recorded[0].message == event.message


CALENDAR_UNDER_TZ = """
import json, sys
from datetime import datetime, timezone
from apscheduler.triggers.cron import CronTrigger
from mlx_watchdog.config import parse_config
from mlx_watchdog.daemon.calendar import Calendar, local_zone
from mlx_watchdog.record.alerts import Alerter
from mlx_watchdog.record.store import Store

config = parse_config({"watchdog": {"daily_summary": "08:00", "state_dir": sys.argv[1]},
                       "server": [{"url": "http://127.0.0.1:1"}]})
cal = Calendar(Store(None), Alerter([]), dict, lambda: 1.0, None)
cal.start(config)
cal.stop()
zone = local_zone()
fires = []
for day in ((2026, 3, 28), (2026, 10, 24)):
    trigger = CronTrigger(hour=2, minute=30, timezone=zone)
    at = trigger.get_next_fire_time(None, datetime(*day, 12, tzinfo=timezone.utc))
    for _ in range(3):
        fires.append(at.astimezone(timezone.utc).isoformat())
        at = trigger.get_next_fire_time(at, at)
print(json.dumps(fires))
"""


@pytest.mark.parametrize(
    ("tz", "same_as"),
    [
        ("CET-1CEST,M3.5.0,M10.5.0/3", "Europe/Berlin"),  # a POSIX rule: Berlin's, spelled out
        ("UTC0", "UTC"),
        ("Nowhere/Atlantis", "UTC"),  # a zone this machine lacks: the C library reads UTC
    ],
)
def test_the_calendar_runs_under_a_tz_that_names_no_zone(
    tz: str, same_as: str, tmp_path: Path
) -> None:
    """tzlocal refuses such a TZ (the daemon exited 1 where `config check` passed); local time
    is then the C library's reading of it, daylight saving included, as zoneinfo computes."""
    import json
    import subprocess
    import sys

    run = subprocess.run(
        [sys.executable, "-c", CALENDAR_UNDER_TZ, str(tmp_path)],
        env={**os.environ, "TZ": tz},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    zone = ZoneInfo(same_as)
    expected = []
    for day in ((2026, 3, 28), (2026, 10, 24)):
        trigger = CronTrigger(hour=2, minute=30, timezone=zone)
        at = trigger.get_next_fire_time(None, datetime(*day, 12, tzinfo=UTC))
        for _ in range(3):
            assert at is not None
            expected.append(at.astimezone(UTC).isoformat())
            at = trigger.get_next_fire_time(at, at)
    assert json.loads(run.stdout) == expected


def test_a_reload_keeps_an_unchanged_jobs_next_run(tmp_path: Path) -> None:
    """Computed afresh after a daylight-saving shift, a job's run for today would be lost: a
    reload that leaves its time alone keeps the run it had; a changed time is computed anew."""

    def config(summary: str) -> Any:
        return parse_config(
            {
                "watchdog": {"daily_summary": summary, "state_dir": str(tmp_path)},
                "server": [{"url": "http://127.0.0.1:1", "maintenance": "Sun 04:00"}],
            }
        )

    cal = Calendar(Store(None), Alerter([]), dict, lambda: 1.0, None)
    cal.start(config("08:00"))
    try:
        assert cal._scheduler is not None
        pending = datetime.now(UTC) + timedelta(minutes=5)  # today's shifted run, still due
        cal._scheduler.modify_job("summary", next_run_time=pending)
        cal.restart(config("08:00"))
        jobs = {j.id: j for j in cal._scheduler.get_jobs()}
        assert jobs["summary"].next_run_time == pending
        cal.restart(config("09:15"))
        jobs = {j.id: j for j in cal._scheduler.get_jobs()}
        assert jobs["summary"].next_run_time != pending
        assert jobs["summary"].next_run_time.strftime("%H:%M") == "09:15"
    finally:
        cal.stop()
