"""A known last day in a history, and a status document per state: what the status page tests
draw and then count on the page (tests/test_page.py, tests/test_page_browser.py)."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

from mlx_watchdog.judge.states import SHOWN_STATES, UNKNOWN, EventKind
from mlx_watchdog.record.document import Status, WatchdogLine
from mlx_watchdog.record.store import Store
from mlx_watchdog.record.tally import Figures
from mlx_watchdog.serve.day import Days
from mlx_watchdog.serve.page import render
from mlx_watchdog.serve.status import describe
from tests.builders import watched

STEP = 300.0  # a probe every five minutes: 288 in a day, under the page's MAX_POINTS
NOW = 1_780_000_000.0


@dataclass(frozen=True)
class Written:
    """What a_day wrote, as the page should count it."""

    probes_with_token: int
    ttft_lines: int  # stretches of tokens no more than three probes apart
    runs: list[str]  # the states of the stretches, oldest first
    restarts_by_hour: dict[int, int]
    gave_up_by_hour: dict[int, int]
    incidents: int


def a_day(store: Store, server: str, now: float, *, hostile: str = "") -> Written:
    """A day of probes every STEP: healthy, a wedge from 10 h ago lasting 30 min (restarted
    twice in that hour), busy for an hour 4 h ago, an hour not probed 2 h ago (a blank), and
    healthy again; two clients gave up 10 h ago and one 4 h ago; one calibration."""
    since = now - 86400
    with_token, runs, lines, last_token = 0, [], 0, None
    at = since + STEP / 2
    while at < now:
        ago = now - at
        if 2 * 3600 <= ago < 3 * 3600:
            at += STEP  # the watchdog was not running
            continue
        state = "healthy"
        if 10 * 3600 - 1800 <= ago < 10 * 3600:
            state = "wedged"
        elif 4 * 3600 - 3600 <= ago < 4 * 3600:
            state = "busy"
        ttft = None if state == "wedged" else 0.2 + (at * 7919 % 97) / 400
        ttft = ttft + 1.5 if state == "busy" and ttft is not None else ttft  # behind clients
        store.record_probe(server, at, state, "a probe", {"ttft_s": ttft}, step=STEP)
        if ttft is not None:
            with_token += 1
            lines += last_token is None or at - last_token > 3 * STEP
            last_token = at
        if not runs or runs[-1] != state or _after_blank(now, ago):
            runs.append(state)
        at += STEP
    wedge_at = now - 10 * 3600 + 60
    hour = int((wedge_at - since) // 3600)
    incident = store.open_incident(server, wedge_at, "wedged", hostile or "no token in 60 s", {})
    store.add_action(incident, {"action": "restart", "outcome": "recovered"})
    store.close_incident(incident, wedge_at + 1800, "recovered", 20.0)
    store.set_advice(incident, hostile or "raise the client timeout to 120 s")
    for k in range(2):
        r = store.start_restart(server, wedge_at + 60 * k, "wedged")
        store.finish_restart(r, wedge_at + 60 * k + 20, "recovered", 20.0)
    store.add_event(server, wedge_at, EventKind.GAVE_UP, "2 clients gave up", {"count": 2})
    busy_at = now - 4 * 3600 + 60
    store.add_event(server, busy_at, EventKind.GAVE_UP, "1 client gave up", {"count": 1})
    store.save_calibration(server, now - 3600, {**CALIBRATION, "at": now - 3600})
    busy_hour = int((busy_at - since) // 3600)
    return Written(with_token, lines, runs, {hour: 2}, {hour: 2, busy_hour: 1}, 1)


def _after_blank(now: float, ago: float) -> bool:
    """The first probe after the unprobed hour starts a stretch of its own."""
    return 2 * 3600 - STEP <= ago < 2 * 3600


CALIBRATION: dict[str, Any] = {
    "server": "x",
    "at": 0.0,
    "advice": {
        "prompt_tokens": 32000,
        "answer_tokens": 1024,
        "prefill_s": 95.4,
        "answer_s": 20.0,
        "client_s": 150,
        "agent_s": 180,
        "load_balancer_s": 210,
    },
}


def status_doc(now: float, states: tuple[str, ...] = SHOWN_STATES) -> Status:
    """A status document with one server per state, as the daemon builds it."""
    servers = []
    for state in states:
        server = watched(f"http://127.0.0.1:1/{state}", name=f"srv-{state}")
        # The numbers of a_day's last 24 hours.
        wedge = now - 10 * 3600 + 60
        held = Figures(
            ttft_p50_s=0.3,
            ttft_p95_s=0.9,
            ttft_samples=3,
            restarts=[wedge, wedge + 60],
            last_token_at=now - 5,
            incidents_24h=1,
            gave_up_24h=3,
        )
        servers.append(
            describe(
                server,
                now,
                held,
                state=None if state == UNKNOWN else state,
                reason=f"{state}: as the probe saw it",
                at=now - 1,
                evidence=None,
                since=now - 600,
            )
        )
    watchdog = WatchdogLine(pid=1, version="test", interval_s=30.0, running=True)
    return Status(watchdog, tuple(servers))


def changed(doc: Status, i: int, **fields: Any) -> Status:
    """`doc` with its `i`-th server's fields changed."""
    servers = list(doc.servers)
    servers[i] = replace(servers[i], **fields)
    return replace(doc, servers=tuple(servers))


class PageBackend:
    """What the daemon gives the endpoint, from a status document and a history."""

    def __init__(self, store: Store, doc: Status, reload_s: int = 10) -> None:
        self.doc, self.days = doc, Days(store, lambda: STEP, lambda: NOW, time.monotonic)
        self.reload_s = reload_s

    def status(self) -> Status:
        return self.doc

    def prometheus(self) -> tuple[bytes, str]:
        return b"", "text/plain"

    def page(self) -> str:
        names = [s.name for s in self.doc.servers]
        return render(self.doc, self.days.of(names), NOW, self.reload_s)

    def act(self, name: str, action: str) -> str:
        raise KeyError(name)
