"""Writing behind: the daemon's ticks queue each history write and go on.

One writer thread carries the writes out in order and waits out another process's lock or a
full disk, a write at a time, so a locked database neither stalls a tick nor loses a row.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from collections import deque
from collections.abc import Callable

from mlx_watchdog.record.db import RETRY_LOCKED, Database, Later

log = logging.getLogger("mlx_watchdog.store")

QUEUE_MAX = 10_000  # writes waiting; past this the newest are lost, and that is reported
BATCH = 200  # writes carried out in one transaction: one commit (one sync) for all of them
FLUSH_TIMEOUT = 5.0  # at close, for the queued writes

Work = Callable[[sqlite3.Connection], None]


class Behind:
    """The daemon's write-behind queue to the history: a slow or locked database never
    holds a tick."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.lost = 0  # writes given up (the queue full, or still waiting at close)
        self._queue: deque[Work] = deque()
        self._queued = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="history", daemon=True)
        self._thread.start()

    def put(self, work: Work) -> None:
        with self._queued:
            if self._closed or len(self._queue) >= QUEUE_MAX:
                self.lost += 1
                self.db.report(f"history: {self.lost} writes lost (the queue is full or closed)")
                return
            self._queue.append(work)
            self._queued.notify()

    def writing(self) -> bool:
        """Whether the caller is the writer thread itself."""
        return threading.current_thread() is self._thread

    def _run(self) -> None:
        said_locked = False
        while True:
            with self._queued:
                while not self._queue and not self._closed:
                    self._queued.wait()
                if not self._queue:
                    return
                batch = [self._queue[i] for i in range(min(BATCH, len(self._queue)))]

            def work(db: sqlite3.Connection, batch: list[Work] = batch) -> None:
                with self.db.tx(db):
                    for each in batch:
                        each(db)

            try:
                self.db.guard(None, work, wait=True)
            except Later as exc:
                if not said_locked:
                    said_locked = True
                    self.db.report(f"history database cannot be written now ({exc}); writes wait")
                with self._queued:
                    self._queued.wait(RETRY_LOCKED)
                continue
            if said_locked:
                said_locked = False
                log.info("history database is written again")
                self.db.problem = None
            with self._queued:
                for _ in batch:
                    self._queue.popleft()
                self._queued.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait until the queued writes are done; False when some still wait."""
        with self._queued:
            return self._queued.wait_for(lambda: not self._queue, timeout)

    def close(self) -> None:
        if not self.flush(FLUSH_TIMEOUT):
            with self._queued:
                self.lost += len(self._queue)
                self._queue.clear()
            self.db.report(
                f"history: {self.lost} writes lost at close (the database stayed locked)"
            )
        with self._queued:
            self._closed = True
            self._queued.notify_all()
        self._thread.join(FLUSH_TIMEOUT)
