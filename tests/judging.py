"""Shared builders for tests of the pure judge: probe snapshots, process samples, settings."""

from __future__ import annotations

from mlx_watchdog.config import ProbeSettings
from mlx_watchdog.sense.findings import Client, ProcessSample
from mlx_watchdog.sense.probe import ModelsCheck, ProbeSnapshot

S = ProbeSettings(slow_after=10, wedge_after=60, max_busy=900, startup_grace=120, hard_timeout=1800)
T0 = 1_000_000.0
MODELS_OK = ModelsCheck(200, True, "ok", "1 models listed", ("m",), 0.01)
MODELS_EMPTY = ModelsCheck(200, False, "empty_body", "200 with an empty body", (), 0.01)


def proc(
    live: int = 0,
    abandoned: int = 0,
    cpu: float | None = 100.0,
    age: float = 3600.0,
    pid: int | None = 42,
) -> ProcessSample:
    clients = tuple(
        Client(("127.0.0.1", 50000 + i), "live", T0, None) for i in range(live)
    ) + tuple(Client(("127.0.0.1", 60000 + i), "abandoned", T0, T0) for i in range(abandoned))
    return ProcessSample(
        pid=pid,
        create_time=T0 - age,
        cmdline=("mlx_lm.server",),
        matches=True,
        cpu_percent=cpu,
        rss_bytes=1,
        abandoned=abandoned,
        live=live,
        clients=clients,
    )


def token(after: float) -> ProbeSnapshot:
    return ProbeSnapshot(
        started_at=T0,
        headers_at=T0 + after,
        first_token_at=T0 + after,
        done_at=T0 + after,
        status=200,
        bytes=900,
        tokens=1,
        finding="ok",
    )


def waiting(bytes_: int = 0) -> ProbeSnapshot:
    return ProbeSnapshot(started_at=T0, bytes=bytes_)


def finished(finding: str, detail: str = "") -> ProbeSnapshot:
    return ProbeSnapshot(started_at=T0, done_at=T0 + 0.01, finding=finding, detail=detail)
