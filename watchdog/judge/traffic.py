"""When real traffic proves a server and the probe may be skipped. Pure.

A server whose own counter of generated tokens grew since the last look, while live clients
are connected and none has left, is serving: a probe would only add load. But a counter can
lie (one that counts requests at their end, or a stuck one that is still read), so at most
SKIP_MAX probes in a row are skipped: every few intervals the probe goes anyway, and a wedge
is seen at most that many intervals later than it would be.
"""

from __future__ import annotations

from dataclasses import replace

from mlx_watchdog.judge.states import State
from mlx_watchdog.judge.verdict import Verdict
from mlx_watchdog.sense.findings import LoadReport

SKIP_MAX = 2  # probes skipped in a row at most


def proves(last: Verdict | None, report: LoadReport | None, skipped: int) -> str | None:
    """Why this tick's probe may be skipped, or None: probe."""
    if skipped >= SKIP_MAX or last is None or last.state != State.HEALTHY:
        return None
    if report is None or not report.ok or not report.delivered_since:
        return None
    e = last.evidence
    if not e.live_connections or e.abandoned_connections != 0:
        return None
    clients = f"{e.live_connections} live client{'s' if e.live_connections != 1 else ''}"
    return f"{report.delivered_since:,.0f} tokens delivered to {clients} since the last look"


def skipped_verdict(last: Verdict, report: LoadReport, why: str) -> Verdict:
    """The verdict of a skipped probe: healthy, on the server's word and the last look."""
    evidence = replace(
        last.evidence,
        waited_s=None,
        ttft_s=None,
        bytes=0,
        tokens=0,
        keepalives=0,
        probe_finding="skipped",
        probe_detail=why,
        server_report=report.describe(),
    )
    return Verdict(State.HEALTHY, f"{State.HEALTHY}: {why} (probe skipped)", evidence)
