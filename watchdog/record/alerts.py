"""Alerts: Apprise URLs and an optional hook command, delivered off the probing path.

`send()` only queues. One worker thread delivers, each channel with a time limit, so a hung
webhook delays other alerts by at most that limit and never a probe. A failing channel is
logged and forgotten. Events carry states, reasons and numbers, never a secret.
"""

from __future__ import annotations

import json
import logging
import queue
import subprocess
import threading
import warnings
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from mlx_watchdog.config import mask_url
from mlx_watchdog.judge.states import EventKind

log = logging.getLogger("mlx_watchdog.alerts")
# Apprise logs the URLs it cannot parse or reach, and those URLs carry tokens: keep it quiet and
# report failures ourselves, with the URL masked.
logging.getLogger("apprise").setLevel(logging.CRITICAL + 1)

TITLES: dict[EventKind, str] = {
    EventKind.DETECTED: "{server} is {state}",
    EventKind.RESTARTING: "restarting {server}",
    EventKind.RECOVERED: "{server} recovered",
    EventKind.RESTART_FAILED: "restart of {server} failed",
    EventKind.BUDGET_SPENT: "{server} needs a person",
    EventKind.CLEARING: "waiting for {server} to clear",
    EventKind.REFUSED: "refused to signal {server}",
    EventKind.INTERRUPTED: "restart of {server} interrupted",
    EventKind.BLIND: "the watchdog cannot see {server}",
    EventKind.SEEING: "the watchdog sees {server} again",
    EventKind.SUMMARY: "{server}: the last 24 hours",
    EventKind.MAINTENANCE: "maintenance of {server}",
    EventKind.TEST: "a test alert from {server}",
}


@dataclass(frozen=True)
class Event:
    """Something that happened to a server, as alerts and the history carry it."""

    kind: EventKind
    server: str
    at: float
    message: str
    state: str | None = None
    data: dict[str, Any] = field(default_factory=dict)

    @property
    def title(self) -> str:
        return TITLES[self.kind].format(server=self.server, state=self.state or "")

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "title": self.title}, default=str)


Notify = Callable[[str, str, str], bool]  # (url, title, body) -> delivered


def apprise_notify(url: str, title: str, body: str) -> bool:
    # Apprise loads its plugins on first use, and one imports the deprecated imghdr.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import apprise

        sender = apprise.Apprise()
        if not sender.add(url):
            log.error("alert URL %s is not one Apprise knows", mask_url(url))
            return False
        return bool(sender.notify(title=title, body=body))


class Channel(Protocol):
    """Somewhere events go. `deliver` may block; the Alerter bounds it by its time limit."""

    @property
    def name(self) -> str: ...

    def deliver(self, event: Event, timeout: float) -> bool: ...


@dataclass(frozen=True)
class AppriseChannel:
    """One Apprise URL; its name is masked (URLs carry tokens)."""

    url: str
    notify: Notify = apprise_notify

    @property
    def name(self) -> str:
        return f"alert {mask_url(self.url)}"

    def deliver(self, event: Event, timeout: float) -> bool:
        return self.notify(self.url, event.title, event.message)


@dataclass(frozen=True)
class HookChannel:
    """The on_event command: the event's JSON on its stdin; exit 0 means delivered."""

    argv: tuple[str, ...]
    name: str = "on_event hook"

    def deliver(self, event: Event, timeout: float) -> bool:
        try:
            proc = subprocess.run(
                list(self.argv),
                input=event.to_json(),
                text=True,
                capture_output=True,
                timeout=timeout,
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.error("on_event hook %s failed: %s", self.argv[0], exc)
            return False
        if proc.returncode != 0:
            log.error(
                "on_event hook %s exited %d: %s",
                self.argv[0],
                proc.returncode,
                proc.stderr.strip()[:200],
            )
        return proc.returncode == 0


class Alerter:
    """Sends events to the configured channels off the ticks' path, each bounded in time."""

    def __init__(
        self,
        urls: Sequence[str],
        hook: Sequence[str] = (),
        *,
        timeout: float = 15.0,
        notify: Notify = apprise_notify,
    ) -> None:
        self._notify = notify
        self.channels: list[Channel] = []
        self.use(urls, hook)
        self.timeout = timeout
        # The last deliveries (channel, event kind), bounded: a long-running daemon keeps no more.
        self.delivered: deque[tuple[str, str]] = deque(maxlen=100)
        # An Event to deliver, a threading.Event to set once all before it are delivered, or
        # None to stop.
        self._queue: queue.Queue[Event | threading.Event | None] = queue.Queue()
        self._worker = threading.Thread(target=self._work, name="alerts", daemon=True)
        self._worker.start()

    def use(self, urls: Sequence[str], hook: Sequence[str] = ()) -> None:
        """Send to these channels from now on (a reload): one assignment, so the sending thread
        sees the old list or the new one, never a list being changed."""
        channels: list[Channel] = [AppriseChannel(u, self._notify) for u in urls]
        if hook:
            channels.append(HookChannel(tuple(hook)))
        self.channels = channels

    def send(self, event: Event) -> None:
        self._queue.put(event)

    def close(self, timeout: float = 5.0) -> None:
        """Deliver what is queued, for at most about `timeout` seconds."""
        self._queue.put(None)
        self._worker.join(timeout)

    def flush(self, timeout: float = 30.0) -> None:
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def _work(self) -> None:
        while True:
            event = self._queue.get()
            if event is None:
                return
            if isinstance(event, threading.Event):
                event.set()
                continue
            for channel in self.channels:
                self._deliver(channel, event)

    def each(self, event: Event) -> list[tuple[str, bool]]:
        """Deliver `event` now, on this thread, through each channel in turn (each bounded by
        the timeout): whether each reached, by name. For a test; events go through `send`."""
        return [(channel.name, self._deliver(channel, event)) for channel in self.channels]

    def _deliver(self, channel: Channel, event: Event) -> bool:
        result: list[bool] = []

        def run() -> None:
            try:
                result.append(channel.deliver(event, self.timeout))
            except Exception as exc:  # a channel's failure is never the watchdog's
                log.error("%s failed: %s: %s", channel.name, type(exc).__name__, exc)
                result.append(False)

        thread = threading.Thread(target=run, name=channel.name, daemon=True)
        thread.start()
        thread.join(self.timeout)
        if thread.is_alive():
            log.error("%s timed out after %gs", channel.name, self.timeout)
        elif result and result[0]:
            self.delivered.append((channel.name, event.kind))
            return True
        elif result:
            log.error("%s was not delivered", channel.name)
        return False
