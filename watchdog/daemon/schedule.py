"""Run each job every `interval` on a thread of its own: never two runs of one job at once, a
late run is not made up for (coalesced), and a job can be woken to run now. Small on purpose:
the daemon needs exactly this, and a scheduler library cost it 4 MiB of memory."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger("mlx_watchdog")

MAX_WAIT = 86400.0  # a timer cannot wait for any float: past this, wake and wait again


class Job:
    """One job's thread: runs its work every interval, never twice at once."""

    def __init__(self, name: str, interval: float, work: Callable[[], None]) -> None:
        self.name = name
        self.interval = interval
        self.work = work
        self._wake = threading.Event()
        self._now = False  # the wake asks for a run now, not only a new look at the interval
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"job-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Run now (or as soon as the run in progress ends)."""
        self._now = True
        self._wake.set()

    def retime(self) -> None:
        """The interval changed: the next run comes at the new interval from the last one's
        start (at once only when that time has passed), never earlier."""
        self._wake.set()

    def stop(self) -> None:
        """No new run starts; a run in progress finishes by itself."""
        self._stopped.set()
        self._wake.set()

    def _run(self) -> None:
        while not self._stopped.is_set():
            started = time.monotonic()
            try:
                self.work()
            except Exception:  # a fault in one run must not end the job
                log.exception("%s failed; it runs again at its next interval", self.name)
            self._pause(started)

    def _pause(self, started: float) -> None:
        """Until the interval from `started` is over, or a wake asks for a run now."""
        while not self._stopped.is_set():
            left = self.interval - (time.monotonic() - started)
            if left <= 0:
                return
            woken = self._wake.wait(min(MAX_WAIT, left))
            self._wake.clear()
            if woken and self._now:
                self._now = False
                return


class Schedule:
    """The daemon's jobs by name; `keep` makes them exactly those wanted (start, a reload)."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()

    def keep(self, wanted: dict[str, tuple[float, Callable[[], None]]]) -> None:
        """Run exactly `wanted` (name -> interval, work): a job already running under its name
        keeps its thread (its interval updated), so one job's runs never overlap and a reload
        adds no thread; a job no longer wanted stops after its run in progress."""
        with self._lock:
            old = self._jobs
            kept = {n: j for n, j in old.items() if n in wanted}
            moved = [j for n, j in kept.items() if j.interval != wanted[n][0]]
            for name, job in kept.items():
                job.interval, job.work = wanted[name]
            started = {n: Job(n, *wanted[n]) for n in wanted if n not in kept}
            self._jobs = {**kept, **started}
        for name, job in old.items():
            if name not in wanted:
                job.stop()
        for job in started.values():
            job.start()
        for job in moved:
            job.retime()  # a new interval takes effect now, not after the old one

    def wake(self, name: str) -> None:
        with self._lock:
            job = self._jobs.get(name)
        if job is not None:
            job.wake()

    def stop(self) -> None:
        self.keep({})
