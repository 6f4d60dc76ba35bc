"""What one look at a server gathered (the probe, the process, its answers, its log, the signs
of a cause), as the sensing round (sense/round.py) hands it to the judge. No judging here."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_watchdog.sense.findings import (
    LoadReport,
    ModelsCheck,
    Prefill,
    ProbeSnapshot,
    ProcessSample,
    WorkSign,
)
from mlx_watchdog.sense.signs import Signs


@dataclass(frozen=True)
class Observation:
    """Everything one look at a server gathered: the probe, the process, its answers, its log."""

    probe: ProbeSnapshot
    process: ProcessSample
    models: ModelsCheck | None = None
    load: LoadReport | None = None  # what the server says about itself (its profile's routes)
    leak_since: float | None = None  # since when every look showed requests with no client
    loading_since: float | None = None  # since when every probe got "loading" (no process seen)
    fans_out: bool = False  # the server counts each of a request's n choices as a request
    prefill: Prefill | None = None  # the prefill the server's log tells of
    progress_problem: str | None = None  # why the server's log could not be read
    signs: Signs | None = None  # stacks, log errors, CPU over the wait, memory: for a cause
    kind: str = ""  # the server's kind: which stacks and answers mean what
    served: bool = False  # this process served a probe: it is no longer starting
    live_seen: float | None = None  # when live clients were last seen during this probe's wait
    work: WorkSign | None = None  # the sign that it works, where its work runs (sense/work.py)


def leaked_requests(load: LoadReport | None, proc: ProcessSample, *, fans_out: bool = False) -> int:
    """Requests the server reports beyond its connected clients and the probe: work for
    nobody, a slot leaked behind a closed socket. 0 when either side is unknown, and, for a
    server that reports a request with n > 1 choices as n (vLLM), while any client is live:
    one client may then hold any number."""
    if load is None or not load.ok or load.queued is None or proc.live is None:
        return 0
    if fans_out and proc.live:
        return 0
    return max(0, load.queued - (proc.live + (proc.abandoned or 0) + 1))
