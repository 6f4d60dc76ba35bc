"""A person's asks of one server (a restart, a drain, an undrain) and a reload's settings,
queued from any thread.

The endpoint and the calendar ask on their own threads; the server's job carries the asks out
at its next tick. Whether an ask is a second one for one cause is judged on the cycle's
published view (cycle/shown.py) and the queue, under one lock with the queueing.
"""

from __future__ import annotations

import threading
from collections import deque

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.cycle.crew import Conflict
from mlx_watchdog.cycle.shown import Shown
from mlx_watchdog.judge import budget
from mlx_watchdog.judge.advice import nobody_restarts

RESTARTS = ("restart", "planned-restart")  # a person's, the maintenance window's
DRAINS = ("drain", "undrain")


class Asks:
    """The queue of one server's asks and the one being carried out."""

    def __init__(self) -> None:
        self.queued: deque[str] = deque()
        self._lock = threading.Lock()
        self._carrying: str | None = None
        self._settings: ServerConfig | None = None

    def ask(self, action: str, shown: Shown, interval: float, now: float) -> None:
        """Queue `action`, or raise Conflict saying why not: a restart while one runs, is
        queued, or just brought the server back would be a second restart for one cause."""
        name = shown.server.name
        with self._lock:
            if action in RESTARTS and shown.server.manager == "none":
                raise Conflict(nobody_restarts(name))
            if action in RESTARTS:
                # One being carried out has left the queue but not yet begun: still asked for.
                queued = self._carrying in RESTARTS or any(a in RESTARTS for a in self.queued)
                why = budget.repeat_restart(
                    name,
                    shown.figures.last_restart,
                    queued=queued,
                    running=shown.restarting,
                    now=now,
                    interval=interval,
                )
                if why is not None:
                    raise Conflict(why)
            elif action in DRAINS:
                pending = [a for a in (self._carrying, *self.queued) if a in DRAINS]
                drained = pending[-1] == "drain" if pending else shown.draining
                if drained == (action == "drain"):
                    raise Conflict(
                        f"{name} is drained already; `undrain` ends it"
                        if drained
                        else f"{name} is not drained; nothing to undrain"
                    )
            self.queued.append(action)

    def take(self) -> str | None:
        """The next ask to carry out (it counts as asked until `done`)."""
        with self._lock:
            self._carrying = self.queued.popleft() if self.queued else None
            return self._carrying

    def done(self) -> None:
        with self._lock:
            self._carrying = None

    def reconfigure(self, server: ServerConfig) -> None:
        """A reload's settings, for the next tick; a later reload's replace them."""
        with self._lock:
            self._settings = server

    def new_settings(self) -> ServerConfig | None:
        """The latest reload's settings not yet applied, taken: a reload while they are
        applied is kept for the next tick, never lost."""
        with self._lock:
            server, self._settings = self._settings, None
            return server
