"""What a verdict was judged from: the `Evidence` kept of one look's `Observation`
(sense/observation.py), which `status`, the alerts and the history show. Pure: no I/O, `now`
comes in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from mlx_watchdog.judge.cause import Diagnosis
from mlx_watchdog.judge.retry import Retry, retry_of
from mlx_watchdog.sense.findings import (
    Client,
    Prefill,
    WorkSign,
)
from mlx_watchdog.sense.observation import Observation

BRIEF = (
    "waited_s",
    "bytes",
    "tokens",
    "abandoned_connections",
    "live_connections",
    "cpu_percent",
    "models_status",
    "pid",
    "cause",
)


@dataclass(frozen=True)
class Evidence:
    """What a verdict was judged from: shown by `status`, alerts and history. Times in seconds."""

    waited_s: float | None = None  # how long the probe has waited (None: no probe yet)
    ttft_s: float | None = None
    bytes: int = 0
    tokens: int = 0
    keepalives: int = 0
    http_status: int | None = None
    probe_finding: str = "waiting"
    probe_detail: str = ""
    model: str | None = None  # the model the probe named (None: the server's default)
    phases: Mapping[str, float | None] = field(default_factory=dict)
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    models_status: int | None = None
    models_ok: bool | None = None
    models_finding: str | None = None
    pid: int | None = None
    cmdline_matches: bool | None = None
    process_age_s: float | None = None
    cpu_percent: float | None = None
    idle_looks: int = 0  # the last looks over the probe's wait in a row that found it idle
    # The sign that it works, where its work runs (sense/work.py): the CPU, or on a Mac the GPU.
    work_on: str = "cpu"
    work_percent: float | None = None  # None: not read (see work_unknown), or a first reading
    work_unknown: str | None = None  # why it cannot be read
    rss_bytes: int | None = None
    abandoned_connections: int | None = None
    live_connections: int | None = None
    oldest_live_s: float | None = None  # since the watchdog first saw the oldest live client
    oldest_abandoned_s: float | None = None
    gave_up_after_s: tuple[float, ...] = ()  # how long each departed client had waited
    # A live request resending an abandoned one (judge/retry.py): its size, how soon after
    # its client left, and how long the server has had the abandoned one.
    abandoned_bytes: int | None = None  # the oldest abandoned request's size, where read
    abandoned_held_s: float | None = None  # and how long the server has had it
    retry_bytes: int | None = None
    retry_after_s: float | None = None
    retry_held_s: float | None = None
    process_error: str | None = None
    server_report: str | None = None  # what the server says of itself (its load route)
    server_running: int | None = None
    server_waiting: int | None = None
    server_progress_still_s: float | None = None  # its progress counter has not moved for
    health_status: int | None = None
    # The prefill the server's own log tells of (mlx_lm.server), and why it could not be read.
    server_prefill: str | None = None
    prefill_done: int | None = None
    prefill_total: int | None = None
    prefill_rate_tps: float | None = None
    prefill_left_s: float | None = None
    prefill_age_s: float | None = None
    prefill_step_s: float | None = None
    progress_problem: str | None = None
    clamp: str | None = None  # how the operating system holds the process back
    others_cpu_percent: float | None = None  # the rest of the machine's CPU, % of one core
    cause: str | None = None  # why a failing server fails (judge/cause.py); None: not failing
    cause_because: str | None = None  # the evidence that named it

    def brief(self) -> dict[str, object]:
        """What an alert about this evidence carries."""
        return {k: getattr(self, k) for k in BRIEF}

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["gave_up_after_s"] = list(self.gave_up_after_s)
        return doc

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> Evidence:
        """From a stored document; keys it does not know (or lacks) are left out."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in doc.items() if k in known}
        if "gave_up_after_s" in values:
            values["gave_up_after_s"] = tuple(values["gave_up_after_s"] or ())
        return cls(**values)


def evidence(
    obs: Observation, now: float, found: Diagnosis | None = None, *, idle_below: float = 1.0
) -> Evidence:
    probe, proc, models, load = obs.probe, obs.process, obs.models, obs.load
    readings = obs.signs.work if obs.signs is not None else ()
    work = obs.work if obs.work is not None else WorkSign("cpu", proc.cpu_percent)
    return Evidence(
        ttft_s=_r(probe.ttft),
        waited_s=_r(probe.waited(now)),
        bytes=probe.bytes,
        tokens=probe.tokens,
        keepalives=probe.keepalives,
        http_status=probe.status,
        probe_finding=probe.finding or "waiting",
        probe_detail=probe.detail,
        model=probe.model,
        phases=probe.phases(),
        prompt_tokens=probe.prompt_tokens,
        cached_tokens=probe.cached_tokens,
        models_status=models.status if models else None,
        models_ok=models.ok if models else None,
        models_finding=models.finding if models else None,
        pid=proc.pid,
        cmdline_matches=proc.matches,
        process_age_s=_r(proc.age(now)),
        cpu_percent=_r(proc.cpu_percent),
        idle_looks=_idle_looks(readings, idle_below),
        work_on=work.on,
        work_percent=_r(work.percent),
        work_unknown=work.unknown or None,
        rss_bytes=proc.rss_bytes,
        abandoned_connections=proc.abandoned,
        live_connections=proc.live,
        oldest_live_s=_r(proc.oldest_live(now)),
        oldest_abandoned_s=_r(proc.oldest_abandoned(now)),
        gave_up_after_s=tuple(proc.gave_up_after()),
        **_retry(retry_of(proc.clients, now)),
        **_oldest_abandoned(proc.clients, now),
        process_error=proc.error or None,
        server_report=load.describe() if load else None,
        server_running=load.running if load else None,
        server_waiting=load.waiting if load else None,
        server_progress_still_s=_r(load.stalled()) if load else None,
        health_status=load.health_status if load else None,
        **_prefill(obs.prefill, obs.progress_problem),
        clamp=obs.signs.clamp if obs.signs is not None else None,
        others_cpu_percent=_r(obs.signs.others_cpu) if obs.signs is not None else None,
        cause=str(found.cause) if found else None,
        cause_because=found.because or None if found else None,
    )


def _idle_looks(readings: tuple[float, ...], below: float) -> int:
    """How many of the last CPU readings in a row were idle."""
    n = 0
    for cpu in reversed(readings):
        if cpu >= below:
            break
        n += 1
    return n


def _oldest_abandoned(clients: tuple[Client, ...], now: float) -> dict[str, Any]:
    sized = [c for c in clients if c.status == "abandoned" and c.received is not None]
    if not sized:
        return {}
    oldest = min(sized, key=lambda c: c.sent)
    return {"abandoned_bytes": oldest.received, "abandoned_held_s": _r(max(0.0, now - oldest.sent))}


def _retry(found: Retry | None) -> dict[str, Any]:
    if found is None:
        return {}
    return {
        "retry_bytes": found.bytes,
        "retry_after_s": _r(found.after_s),
        "retry_held_s": _r(found.held_s),
    }


def _prefill(said: Prefill | None, problem: str | None) -> dict[str, Any]:
    if said is None:
        return {"progress_problem": problem}
    return {
        "server_prefill": said.describe(),
        "prefill_done": said.done,
        "prefill_total": said.total,
        "prefill_rate_tps": said.rate_tps,
        "prefill_left_s": _r(said.left_s),
        "prefill_age_s": said.age_s,
        "prefill_step_s": said.step_s,
        "progress_problem": problem,
    }


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
