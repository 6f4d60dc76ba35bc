"""The watchdog's own connections to one server: never a client, live or abandoned.

Every request the watchdog makes (the probe, /v1/models, the health route and load report, the
restart check's probes) can leave a socket on the server: ESTABLISHED while it waits, CLOSE_WAIT
after a deadline closed it while the server still owes the answer. Counted as a client, a
watchdog's own traces make a busy server look wedged, or a stuck one busy.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from mlx_watchdog.sense.findings import Address

ANSWERED_GRACE = 10.0  # an answered request's socket may linger a moment on the server


class OwnConnections:
    """Client addresses, each kept until the server can no longer hold it: `keep` seconds while
    unanswered (the probe's hard timeout), ANSWERED_GRACE once answered."""

    def __init__(self, keep: float, mono: Callable[[], float] = time.monotonic) -> None:
        self.keep = keep
        self.mono = mono
        self._until: dict[Address, float] = {}
        self._answered: set[Address] = set()
        self._lock = threading.Lock()

    def connected(self, address: Address) -> None:
        with self._lock:
            self._until[(address[0], int(address[1]))] = self.mono() + self.keep

    def answered(self, address: Address) -> None:
        address = (address[0], int(address[1]))
        with self._lock:
            self._until[address] = self.mono() + ANSWERED_GRACE
            self._answered.add(address)

    def addresses(self) -> list[Address]:
        with self._lock:
            now = self.mono()
            self._until = {a: until for a, until in self._until.items() if until > now}
            self._answered &= set(self._until)
            return list(self._until)

    def unanswered(self) -> list[Address]:
        """What a caller that exits now leaves on the server."""
        answered = set(self._answered)
        return [a for a in self.addresses() if a not in answered]
