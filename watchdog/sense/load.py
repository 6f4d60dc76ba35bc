"""What the server says about itself: its health route and its own load report (running and
waiting requests, a counter that moves while it computes, the models it holds), read each tick.

A report is evidence next to the sockets: a server that closes the socket but leaks the slot
shows no abandoned connection, yet reports work that does not move.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any

import httpx

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.config.profiles import LoadRoute
from mlx_watchdog.sense.findings import LoadReport
from mlx_watchdog.sense.probe import auth_headers, tls

MAX_REPORT = 1 << 20
REPORT_TIMEOUT = 5.0
ANSWERED_GRACE = 10.0  # an answered request's socket may linger a moment on the server


def parse_prometheus(text: str) -> dict[str, float]:
    """Family (or sample) name -> the sum of its samples. Labels are summed over."""
    sums: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name_end = len(line)
        for i, ch in enumerate(line):
            if ch in "{ \t":
                name_end = i
                break
        name = line[:name_end]
        rest = line[name_end:]
        if rest.startswith("{"):
            close = rest.find("}")
            if close < 0:
                continue
            rest = rest[close + 1 :]
        parts = rest.split()
        if not parts:
            continue
        try:
            value = float(parts[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        sums[name] = sums.get(name, 0.0) + value
    return sums


def json_value(doc: object, path: str) -> float | None:
    """A dotted path into a JSON document: a number, a bool (1/0) or a list's length."""
    node: object = doc
    for key in path.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    if isinstance(node, bool):
        return 1.0 if node else 0.0
    if isinstance(node, (int, float)):
        return float(node)
    if isinstance(node, list):
        return float(len(node))
    return None


def _total(values: Iterable[float | None]) -> int | None:
    found = [v for v in values if v is not None]
    return int(sum(found)) if found else None


def read_report(route: LoadRoute, status: int, body: bytes) -> LoadReport:
    """Interpret one answer of the load route. Never raises: a bad answer is a finding."""
    if status != 200:
        hint = f"; {route.enable}" if route.enable and status in (404, 501) else ""
        return LoadReport(route.path, "http_error", f"HTTP {status}{hint}", status=status)
    text = body.decode(errors="replace")
    if route.format == "prometheus":
        sums = parse_prometheus(text)

        def get(name: str) -> float | None:
            return sums.get(name)

        if not sums:
            return LoadReport(route.path, "invalid", "no metric samples", status=status)
    else:
        try:
            doc = json.loads(text)
        except ValueError:
            return LoadReport(route.path, "invalid", "not JSON", status=status)

        def get(name: str) -> float | None:
            return json_value(doc, name)

    running = _total(get(n) for n in route.running)
    waiting = _total(get(n) for n in route.waiting)
    progress_values = [get(n) for n in route.progress]
    progress = sum(v for v in progress_values if v is not None) if route.progress else None
    if route.progress and all(v is None for v in progress_values):
        progress = None
    loaded = _total([get(route.loaded)]) if route.loaded else None
    wanted = bool(route.running or route.waiting or route.progress or route.loaded)
    if wanted and running is None and waiting is None and progress is None and loaded is None:
        names = ", ".join((*route.running, *route.waiting, *route.progress, route.loaded))
        return LoadReport(route.path, "invalid", f"none of {names.strip(', ')}", status=status)
    return LoadReport(
        route.path,
        "ok",
        "",
        status=status,
        running=running,
        waiting=waiting,
        progress=progress,
        loaded=loaded,
    )


Address = tuple[str, int]


@dataclass
class _Seen:
    value: float | None = None
    since: float | None = None


class LoadReader:
    """Reads a server's load route each tick and remembers when its progress counter last moved.

    `since` on a report is that moment (or the first reading): "running, and not moved since".
    """

    def __init__(
        self,
        server: ServerConfig,
        *,
        clock: Callable[[], float] = time.time,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.server = server
        self.clock = clock
        self.transport = transport
        self._seen = _Seen()
        self._own: dict[Address, float] = {}  # this reader's connections, until when to skip
        self._answered: set[Address] = set()

    def own(self) -> list[Address]:
        """The client addresses of this reader's own requests: a report request the server has
        not closed yet is the watchdog's, never a client's abandoned work."""
        now = self.clock()
        self._own = {a: until for a, until in self._own.items() if until > now}
        self._answered &= set(self._own)
        return list(self._own)

    def unanswered(self) -> list[Address]:
        """Own requests the server has not answered: a caller that exits leaves them behind."""
        return [a for a in self.own() if a not in self._answered]

    def _fetch(self, path: str) -> tuple[int, bytes]:
        """GET `path`, its connection remembered as the watchdog's own: until the hard timeout
        while unanswered (the server may hold it in CLOSE_WAIT), briefly once answered."""
        used: list[Address] = []

        def note(address: Address) -> None:
            used.append(address)
            self._own[address] = self.clock() + self.server.probe.hard_timeout

        answer = fetch(self.server, path, self._timeout, self.transport, on_connect=note)
        for address in used:
            self._own[address] = self.clock() + ANSWERED_GRACE
            self._answered.add(address)
        return answer

    def read(self) -> LoadReport | None:
        """The health route's answer and the load report; None for a kind with neither."""
        profile = self.server.profile
        route, health = profile.load, profile.health
        if route is None and health is None:
            return None
        health_answer: tuple[int | None, str] = (None, "")
        if health is not None and (route is None or route.path != health):
            health_answer = self._health(health)
        if route is None:
            assert health is not None
            status, text = health_answer
            finding = "ok" if status is not None else "error"
            return LoadReport(
                health, finding, "" if status else text, health_status=status, health_body=text
            )
        report = self._load(route)
        if route.path == health:
            health_answer = (report.status, report.detail if report.status is None else "")
        return replace(report, health_status=health_answer[0], health_body=health_answer[1])

    def _load(self, route: LoadRoute) -> LoadReport:
        try:
            status, body = self._fetch(route.path)
        except httpx.TimeoutException:
            return LoadReport(route.path, "timeout", f"no answer within {self._timeout:g}s")
        except httpx.HTTPError as exc:
            return LoadReport(route.path, "error", f"{type(exc).__name__}: {exc}")
        except OSError as exc:
            return LoadReport(route.path, "error", f"cannot read api_key_file: {exc.strerror}")
        report = read_report(route, status, body)
        if report.progress is not None:
            answered = self.clock()
            if report.progress != self._seen.value or self._seen.since is None:
                self._seen = _Seen(report.progress, answered)
            report = replace(report, since=self._seen.since, read_at=answered)
        return report

    def _health(self, path: str) -> tuple[int | None, str]:
        try:
            status, body = self._fetch(path)
        except (httpx.HTTPError, OSError) as exc:
            return None, f"{type(exc).__name__}"
        return status, body[:200].decode(errors="replace")

    @property
    def _timeout(self) -> float:
        return min(self.server.probe.models_timeout, REPORT_TIMEOUT)

    def forget(self) -> None:
        """After a restart or a clock jump: the counter's history says nothing now."""
        self._seen = _Seen()


def fetch(
    server: ServerConfig,
    path: str,
    timeout: float,
    transport: httpx.BaseTransport | None = None,
    on_connect: Callable[[Address], None] | None = None,
) -> tuple[int, bytes]:
    headers: dict[str, Any] = auth_headers(server)

    def trace(event: str, info: dict[str, Any]) -> None:
        if event == "connection.connect_tcp.complete" and on_connect is not None:
            stream = info.get("return_value")
            sock = stream.get_extra_info("socket") if stream is not None else None
            if sock is not None:
                with contextlib.suppress(OSError):
                    on_connect(sock.getsockname()[:2])

    with (
        httpx.Client(timeout=timeout, transport=transport, verify=tls()) as client,
        client.stream(
            "GET", server.url + path, headers=headers, extensions={"trace": trace}
        ) as response,
    ):
        body = b""
        for chunk in response.iter_raw():
            body += chunk
            if len(body) > MAX_REPORT:
                break
        return response.status_code, body
