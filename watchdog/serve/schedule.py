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
    def __init__(self, name: str, interval: float, work: Callable[[], None]) -> None:
        self.name = name
        self.interval = interval
        self.work = work
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"job-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def wake(self) -> None:
        """Run now (or as soon as the run in progress ends)."""
        self._wake.set()

    def stop(self) -> None:
        """No new run starts; a run in progress finishes by itself."""
        self._stopped.set()
        self._wake.set()

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        while not self._stopped.is_set():
            started = time.monotonic()
            try:
                self.work()
            except Exception:  # a fault in one run must not end the job
                log.exception("%s failed; it runs again at its next interval", self.name)
            self._wake.wait(min(MAX_WAIT, max(0.0, self.interval - (time.monotonic() - started))))
            self._wake.clear()


class Schedule:
    """The daemon's jobs by name; `replace` swaps them all (a reload)."""

    def __init__(self) -> None:
        self._jobs: dict[str, Job] = {}
        self._lock = threading.Lock()

    def replace(self, jobs: list[Job]) -> None:
        with self._lock:
            old, self._jobs = self._jobs, {job.name: job for job in jobs}
        for job in old.values():
            job.stop()
        for job in jobs:
            job.start()

    def wake(self, name: str) -> None:
        with self._lock:
            job = self._jobs.get(name)
        if job is not None:
            job.wake()

    def stop(self) -> None:
        self.replace([])
