"""What the balancer was last told of each server through the agent check.

A restart behind HAProxy kills the server's connections; HAProxy takes a server out only at
its next agent check. Restarted before that, every request it had queued for the server was
dispatched into a closed port, and 33 of ~110 got a 503 within 0.25 s (two servers wedged at
once through the docs' HAProxy). So a restart first waits, briefly, until the balancer has
been told this server is out."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

OUT_WAIT_MAX = 10.0  # s: a balancer that checks less often than this is not waited for
FIRST_GAP = 2.0  # s: HAProxy's default agent-inter, until two checks measure it
POLL_S = 0.05


class Rotation:
    """Owns what the agent check told the balancer last, per server, and when it asks; a
    drain reads it to wait until its server is out."""

    def __init__(self, mono: Callable[[], float] = time.monotonic) -> None:
        self._mono = mono
        self._changed = threading.Condition()
        self._last: dict[str, tuple[bool, float]] = {}  # name: (told in, when)
        self._gap: dict[str, float] = {}  # name: the time between its last two checks
        self._asked: dict[str, int] = {}

    def told(self, name: str, serving: bool) -> None:
        """The agent check told the balancer `name` is in (`serving`) or out."""
        now = self._mono()
        with self._changed:
            if (before := self._last.get(name)) is not None:
                self._gap[name] = now - before[1]
            self._last[name] = (serving, now)
            self._asked[name] = self._asked.get(name, 0) + 1
            self._changed.notify_all()

    def said(self, name: str) -> tuple[bool, int] | None:
        """What the balancer was last told of `name` (in or not) and how many checks asked."""
        with self._changed:
            last = self._last.get(name)
            return None if last is None else (last[0], self._asked.get(name, 0))

    def wait_out(self, name: str) -> bool:
        """Until the balancer was last told `name` is out: at once where no balancer asks of it,
        else for two of its check intervals at most. True when it is out (or none asks)."""
        with self._changed:
            if name not in self._last:
                return True
            bound = min(OUT_WAIT_MAX, 2 * self._gap.get(name, FIRST_GAP) + 0.5)
            deadline = self._mono() + bound
            while self._last[name][0]:
                left = deadline - self._mono()
                if left <= 0:
                    return False
                self._changed.wait(min(left, POLL_S))  # on `mono`, which tests may set
            return True
