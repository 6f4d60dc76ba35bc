"""What every server's cycle shares, and what it tells the rest of the daemon."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mlx_watchdog.act.cancel import Cancelled, cancel_abandoned
from mlx_watchdog.act.ladder import Ladder
from mlx_watchdog.act.rotation import Rotation
from mlx_watchdog.config import ServerConfig
from mlx_watchdog.judge.verdict import Verdict
from mlx_watchdog.record.alerts import Alerter
from mlx_watchdog.record.store import Store
from mlx_watchdog.sense.dump import Dump, take
from mlx_watchdog.sense.memory import read_machine
from mlx_watchdog.sense.signs import Machine


class Conflict(Exception):
    """A person's ask that would repeat what is under way or just done."""


class Sink(Protocol):
    """What counts verdicts and events as they happen (the daemon's metrics)."""

    def observe(self, server: str, verdict: Verdict) -> None: ...
    def event(self, server: str, kind: str, data: dict[str, Any]) -> None: ...
    def gave_up(self, server: str, n: int) -> None: ...
    def skipped(self, server: str) -> None: ...


class Sinks:
    """Several sinks told the same (the metrics, and the page's day as probes come)."""

    def __init__(self, *sinks: Sink) -> None:
        self.sinks = sinks

    def observe(self, server: str, verdict: Verdict) -> None:
        for sink in self.sinks:
            sink.observe(server, verdict)

    def event(self, server: str, kind: str, data: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.event(server, kind, data)

    def gave_up(self, server: str, n: int) -> None:
        for sink in self.sinks:
            sink.gave_up(server, n)

    def skipped(self, server: str) -> None:
        for sink in self.sinks:
            sink.skipped(server)


class NoSink:
    """A Sink that counts nothing (tests, commands run by hand)."""

    def observe(self, server: str, verdict: Verdict) -> None:
        pass

    def event(self, server: str, kind: str, data: dict[str, Any]) -> None:
        pass

    def gave_up(self, server: str, n: int) -> None:
        pass

    def skipped(self, server: str) -> None:
        pass


# s a server back must have served before another goes out: HAProxy takes a server back only
# after `rise` checks pass (the docs' `rise 2` at `inter 1s`); until then both would be out.
SETTLE_S = 3.0


class Turns:
    """Servers behind one balancer (`restart.drain`) go out one at a time. Two wedged at once
    and both drained and restarted left HAProxy no server, and every request got a 503; kept
    in, the second holds its queue (its `maxconn 1` slot is taken) while the first restarts,
    then takes its own turn, once the balancer has had time to take the first back
    (`settle_s`: HAProxy's `rise` checks)."""

    def __init__(self, settle_s: float = SETTLE_S) -> None:
        self._lock = threading.Lock()
        self._out: set[str] = set()
        self._back: dict[str, float] = {}  # when each came back, on the span clock
        self.settle_s = settle_s

    def take(self, name: str, now: float) -> list[str]:
        """Take `name` out at `now`, or the others out now or just back (not its turn yet)."""
        with self._lock:
            back = {n for n, at in self._back.items() if now - at < self.settle_s}
            others = sorted((self._out | back) - {name})
            if not others:
                self._out.add(name)
            return others

    def give_back(self, name: str, now: float) -> None:
        with self._lock:
            self._out.discard(name)
            self._back[name] = now


@dataclass
class Crew:
    """What every server's cycle shares."""

    store: Store
    alerter: Alerter
    ladder: Ladder
    sink: Sink
    wall: Callable[[], float] = time.time  # wall time, for what is recorded and shown
    mono: Callable[[], float] = time.monotonic  # spans: probe waits, down and busy times
    # The server's last words before a restart (stacks, log tail, sockets), within 2 s.
    dump: Callable[[int | None, Path | None], Dump] = take
    # Cancelling the requests of clients that left, where the server's kind can.
    cancel: Callable[[ServerConfig, float, float | None], Cancelled] = cancel_abandoned
    # The machine's memory, and each local server's resident memory (name, bytes), for a
    # restart under memory pressure.
    machine: Callable[[], Machine | None] = read_machine
    residents: Callable[[], list[tuple[str, int]]] = list
    turns: Turns = field(default_factory=Turns)
    rotation: Rotation = field(default_factory=Rotation)
