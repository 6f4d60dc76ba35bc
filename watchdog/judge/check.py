"""One check of one server: a probe, the /v1/models check, and the process watched meanwhile."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from mlx_watchdog.config import ProbeSettings, ServerConfig
from mlx_watchdog.judge.verdict import Observation, Verdict, judge
from mlx_watchdog.sense.evidence import Address, Inspector
from mlx_watchdog.sense.probe import Probe, check_models

POLL = 0.25


@dataclass(frozen=True)
class CheckResult:
    server: ServerConfig
    verdict: Verdict
    observation: Observation


def with_wedge_after(settings: ProbeSettings, seconds: float) -> ProbeSettings:
    """Move the wedge threshold and keep the others in order around it."""
    return replace(
        settings,
        wedge_after=seconds,
        slow_after=min(settings.slow_after, seconds),
        max_busy=max(settings.max_busy, seconds),
        hard_timeout=max(settings.hard_timeout, seconds * 2),
    )


class LeftProbes:
    """Client addresses of probes a short-lived `mlx-watchdog probe` left waiting at exit.

    When such a process exits, its probe's socket turns CLOSE_WAIT on the server: abandoned,
    but a one-token request, not a client's prompt. Remembering the addresses keeps the next
    check from counting the watchdog's own leftovers as abandoned work.
    """

    def __init__(self, path: Path | None, clock: Callable[[], float] = time.time) -> None:
        self.path = path
        self.clock = clock
        self._lock = threading.Lock()

    def load(self) -> list[Address]:
        return [(ip, port) for ip, port, _ in self._entries()]

    def add(self, address: Address, keep_for: float) -> None:
        if self.path is None:
            return
        with self._lock:
            self._write([*self._entries(), (address[0], address[1], self.clock() + keep_for)])

    def _write(self, entries: list[tuple[str, int, float]]) -> None:
        assert self.path is not None
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(entries))
            tmp.replace(self.path)
        except OSError:
            pass  # losing this only makes a later check count one tiny request as abandoned

    def _entries(self) -> list[tuple[str, int, float]]:
        if self.path is None:
            return []
        try:
            raw = json.loads(self.path.read_text())
            now = self.clock()
            return [(str(ip), int(port), float(until)) for ip, port, until in raw if until > now]
        except (OSError, ValueError, TypeError):
            return []


def check_once(
    server: ServerConfig,
    *,
    inspector: Inspector | None = None,
    pid: int | None = None,
    left: LeftProbes | None = None,
    clock: Callable[[], float] = time.time,
    sleep: Callable[[float], None] = time.sleep,
) -> CheckResult:
    """Probe until a token comes or the wait reaches `wedge_after`, then judge.

    A probe still waiting at the threshold is left to run up to its hard timeout: closing it
    would add one more abandoned request to a server that has too many. `left` records it for
    a caller that exits before the probe ends.
    """
    settings = server.probe
    inspector = inspector or Inspector(server, clock=clock)
    inspector.sample(pid)  # the first CPU reading only starts psutil's interval
    probe = Probe(server, clock=clock).start()
    models = check_models(server, clock=clock)
    while True:
        snap = probe.snapshot()
        if snap.done or snap.waited(clock()) >= settings.wedge_after:
            break
        sleep(POLL)
    left = left or LeftProbes(None)
    exclude = left.load() + ([probe.local_address] if probe.local_address else [])
    process = inspector.sample(pid, exclude=exclude)
    observation = Observation(probe=probe.snapshot(), process=process, models=models)
    now = clock()
    verdict = judge(observation, settings, now)
    assert verdict is not None, "a finished probe or one past wedge_after is always judged"
    if not probe.snapshot().done and probe.local_address:
        left.add(probe.local_address, keep_for=settings.hard_timeout)
    return CheckResult(server, verdict, observation)
