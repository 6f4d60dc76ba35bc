"""Prometheus metrics in a registry of the watchdog's own (never the global one).

Counters and the time-to-first-token histogram are updated as probes and events happen; the
gauges are read from the status documents at scrape time, so nothing is kept twice.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.exposition import generate_latest
from prometheus_client.registry import Collector

from mlx_watchdog.judge.states import SHOWN_STATES, EventKind
from mlx_watchdog.judge.verdict import Verdict
from mlx_watchdog.record.document import Status

TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

StatusOf = Callable[[], Status]  # the daemon's status document

# Per-server gauges read from the status document at scrape time: (metric, key, help).
GAUGES = (
    ("mlx_watchdog_serving", "serving", "1 while the server can take traffic."),
    (
        "mlx_watchdog_abandoned_connections",
        "abandoned_connections",
        "Client connections the server still owes an answer after the client left.",
    ),
    (
        "mlx_watchdog_live_connections",
        "live_connections",
        "Client connections being served, besides the probe's own.",
    ),
    (
        "mlx_watchdog_server_reported_running",
        "server_running",
        "Requests the server itself reports running (its kind's load report).",
    ),
    (
        "mlx_watchdog_server_reported_waiting",
        "server_waiting",
        "Requests the server itself reports waiting (its kind's load report).",
    ),
    (
        "mlx_watchdog_last_token_timestamp_seconds",
        "last_token_at",
        "Unix time of the last probe that got a token.",
    ),
    (
        "mlx_watchdog_server_resident_memory_bytes",
        "rss_bytes",
        "Resident memory of the server process.",
    ),
    (
        "mlx_watchdog_restart_budget_remaining",
        "budget_left",
        "Restarts left in the current window.",
    ),
)


class Metrics:
    """The Prometheus exposition: counters as things happen, gauges from the status documents."""

    def __init__(self, status: StatusOf) -> None:
        self.registry = CollectorRegistry()
        self.ttft = Histogram(
            "mlx_watchdog_time_to_first_token_seconds",
            "Time from sending a probe to its first token.",
            ["server"],
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self.probes = Counter(
            "mlx_watchdog_probes",
            "Probes judged, by the state they showed.",
            ["server", "state"],
            registry=self.registry,
        )
        self.restarts = Counter(
            "mlx_watchdog_restarts",
            "Restarts begun, by what triggered them.",
            ["server", "reason"],
            registry=self.registry,
        )
        self.clients_gave_up = Counter(
            "mlx_watchdog_clients_gave_up",
            "Clients that left mid-request (their connection turned CLOSE_WAIT): provocations.",
            ["server"],
            registry=self.registry,
        )
        self.probes_skipped = Counter(
            "mlx_watchdog_probes_skipped",
            "Probes not sent because the server's own token counter showed live clients served.",
            ["server"],
            registry=self.registry,
        )
        self.incidents = Counter(
            "mlx_watchdog_incidents",
            "Incidents opened, by the cause named when each opened (unknown is honest).",
            ["server", "cause"],
            registry=self.registry,
        )
        self.events = Counter(
            "mlx_watchdog_events",
            "Events the watchdog reported (detected, restarting, recovered, ...).",
            ["server", "kind"],
            registry=self.registry,
        )
        self.registry.register(_StatusCollector(status))

    def observe(self, server: str, verdict: Verdict) -> None:
        if verdict.evidence.probe_finding == "skipped":
            return  # no probe was sent: counted by probes_skipped
        self.probes.labels(server, verdict.state).inc()
        ttft = verdict.evidence.ttft_s
        if ttft is not None:
            self.ttft.labels(server).observe(float(ttft))

    def event(self, server: str, kind: str, data: dict[str, Any]) -> None:
        self.events.labels(server, kind).inc()
        if kind == EventKind.RESTARTING:
            self.restarts.labels(server, str(data.get("trigger", "unknown"))).inc()
        if kind == EventKind.DETECTED:
            self.incidents.labels(server, str(data.get("cause") or "unknown")).inc()

    def gave_up(self, server: str, n: int) -> None:
        self.clients_gave_up.labels(server).inc(n)

    def skipped(self, server: str) -> None:
        self.probes_skipped.labels(server).inc()

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _StatusCollector(Collector):
    def __init__(self, status: StatusOf) -> None:
        self.status = status

    def collect(self) -> Iterator[Metric]:
        status = self.status()
        docs = status.servers

        def gauge(name: str, doc: str, key: str) -> GaugeMetricFamily:
            family = GaugeMetricFamily(name, doc, labels=["server"])
            for d in docs:
                if (value := getattr(d, key)) is not None:
                    family.add_metric([d.name], float(value))
            return family

        state = GaugeMetricFamily(
            "mlx_watchdog_state",
            "1 for the state the server is in, 0 for the others.",
            labels=["server", "state"],
        )
        for d in docs:
            for s in SHOWN_STATES:
                state.add_metric([d.name, s], 1.0 if d.state == s else 0.0)
        yield state
        for name, key, doc in GAUGES:
            yield gauge(name, doc, key)
        held = GaugeMetricFamily(
            "mlx_watchdog_needs_person",
            "1 while the restart budget is spent and a person is needed.",
            labels=["server"],
        )
        for d in docs:
            held.add_metric([d.name], 1.0 if d.needs_person else 0.0)
        yield held
        yield GaugeMetricFamily(
            "mlx_watchdog_history_in_memory",
            "1 when the history database could not be used and history is kept in memory.",
            value=1.0 if status.watchdog.history_problem else 0.0,
        )
