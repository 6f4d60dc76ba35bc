"""What the server says about itself: its health route and its own load report (running and
waiting requests, a counter that moves while it computes, the models it holds), read each tick.

A report is evidence next to the sockets: a server that closes the socket but leaks the slot
shows no abandoned connection, yet reports work that does not move.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace

import httpx

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.config.profiles import LoadRoute
from mlx_watchdog.sense.bounded import TooLarge, get
from mlx_watchdog.sense.findings import REPORT_TIMEOUT, Address, LoadReport
from mlx_watchdog.sense.own_connections import OwnConnections
from mlx_watchdog.sense.request import auth_headers, tls
from mlx_watchdog.sense.text import BadJson, finite_count, load_json

MAX_REPORT = 1 << 20


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
        # +Inf, or a sum that overflows, stays inf here: read_report names it as not a count.
        sums[name] = sums.get(name, 0.0) + value
    return sums


COUNT_LIMIT = 1e9  # requests or models: more is not a count
PROGRESS_LIMIT = 1e18  # a counter of steps or tokens over a long uptime


class BadValue(ValueError):
    """A metric or field that is there but cannot be a count."""


def json_value(doc: object, path: str) -> object:
    """A dotted path into a JSON document: the value there (a list counts by its length),
    or None when the path is not there."""
    node: object = doc
    for key in path.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    if isinstance(node, list):
        return len(node)
    return node


def _count(name: str, value: object, limit: float) -> float | None:
    """None when absent; BadValue when present and not a finite count within `limit`."""
    if value is None:
        return None
    number = finite_count(value, limit)
    if number is None:
        shown = repr(value) if isinstance(value, (int, float, bool)) else type(value).__name__
        raise BadValue(f"{name} = {shown[:40]} is not a count")
    return number


def _total(values: Iterable[float | None], limit: float = COUNT_LIMIT) -> float | None:
    found = [v for v in values if v is not None]
    if not found:
        return None
    total = sum(found)
    if not math.isfinite(total) or total > limit:
        raise BadValue(f"their sum {total:g} is not a count")
    return total


def read_report(route: LoadRoute, status: int, body: bytes) -> LoadReport:
    """Interpret one answer of the load route. Never raises: a bad answer is a finding."""
    if status != 200:
        hint = f"; {route.enable}" if route.enable and status in (404, 501) else ""
        return LoadReport(route.path, "http_error", f"HTTP {status}{hint}", status=status)
    text = body.decode(errors="replace")
    if route.format == "prometheus":
        sums = parse_prometheus(text)

        def get(name: str) -> object:
            return sums.get(name)

        if not sums:
            return LoadReport(route.path, "invalid", "no metric samples", status=status)
    else:
        try:
            doc = load_json(body)
        except BadJson as exc:
            return LoadReport(
                route.path, "invalid", f"not JSON the watchdog reads: {exc}", status=status
            )

        def get(name: str) -> object:
            return json_value(doc, name)

    try:
        running = _total(_count(n, get(n), COUNT_LIMIT) for n in route.running)
        waiting = _total(_count(n, get(n), COUNT_LIMIT) for n in route.waiting)
        progress = _total(
            (_count(n, get(n), PROGRESS_LIMIT) for n in route.progress), PROGRESS_LIMIT
        )
        loaded = _count(route.loaded, get(route.loaded), COUNT_LIMIT) if route.loaded else None
        delivered = _total(
            (_count(n, get(n), PROGRESS_LIMIT) for n in route.delivered), PROGRESS_LIMIT
        )
    except BadValue as exc:
        return LoadReport(route.path, "invalid", str(exc), status=status)
    wanted = bool(route.running or route.waiting or route.progress or route.loaded)
    if wanted and running is None and waiting is None and progress is None and loaded is None:
        names = ", ".join((*route.running, *route.waiting, *route.progress, route.loaded))
        return LoadReport(route.path, "invalid", f"none of {names.strip(', ')}", status=status)
    return LoadReport(
        route.path,
        "ok",
        "",
        status=status,
        running=None if running is None else int(running),
        waiting=None if waiting is None else int(waiting),
        progress=progress,
        loaded=None if loaded is None else int(loaded),
        delivered=delivered,
    )


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
        mono: Callable[[], float] = time.monotonic,
        transport: httpx.BaseTransport | None = None,
        own: OwnConnections | None = None,
    ) -> None:
        self.server = server
        self.mono = mono
        self.transport = transport
        self._seen = _Seen()
        self._delivered: float | None = None  # the counter at the last answer that showed it
        self.own = own or OwnConnections(server.probe.hard_timeout, mono)

    def _fetch(self, path: str) -> tuple[int, bytes]:
        """GET `path`, its connection kept as the watchdog's own: until the hard timeout
        while unanswered (the server may hold it in CLOSE_WAIT), briefly once answered."""
        used: list[Address] = []

        def note(address: Address) -> None:
            used.append(address)
            self.own.connected(address)

        answer = fetch(self.server, path, self._timeout, self.transport, on_connect=note)
        for address in used:
            self.own.answered(address)
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
        except TooLarge:
            return LoadReport(route.path, "too_large", f"more than {MAX_REPORT} bytes")
        except httpx.TimeoutException:
            return LoadReport(route.path, "timeout", f"no whole answer within {self._timeout:g}s")
        except httpx.HTTPError as exc:
            return LoadReport(route.path, "error", f"{type(exc).__name__}: {exc}")
        except OSError as exc:
            return LoadReport(route.path, "error", f"cannot read api_key_file: {exc.strerror}")
        report = read_report(route, status, body)
        if report.progress is not None:
            answered = self.mono()
            if report.progress != self._seen.value or self._seen.since is None:
                self._seen = _Seen(report.progress, answered)
            report = replace(report, since=self._seen.since, read_at=answered)
        if report.delivered is not None:
            before, self._delivered = self._delivered, report.delivered
            grown = None if before is None else report.delivered - before
            # A counter that went back was reset (a restarted server): it proves nothing.
            report = replace(report, delivered_since=grown if grown and grown > 0 else 0.0)
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
        """After a restart or a clock jump: the counters' history says nothing now."""
        self._seen = _Seen()
        self._delivered = None


def fetch(
    server: ServerConfig,
    path: str,
    timeout: float,
    transport: httpx.BaseTransport | None = None,
    on_connect: Callable[[Address], None] | None = None,
) -> tuple[int, bytes]:
    """GET `path` within `timeout` in all and MAX_REPORT bytes (TooLarge, Overdue otherwise)."""
    return get(
        server.url + path,
        headers=auth_headers(server),
        deadline=timeout,
        cap=MAX_REPORT,
        transport=transport,
        verify=tls(),
        on_connect=on_connect,
    )
