"""One status document per server: what `/status`, `/healthz`, `/metrics` and `status` show.

The daemon builds it from each cycle's published view (cycle/shown.py) and its own clock;
`mlx-watchdog status` without a running daemon builds the same document from the history
database, so both print alike.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.config.programs import server_unrunnable
from mlx_watchdog.judge.budget import allowance
from mlx_watchdog.judge.evidence import Evidence
from mlx_watchdog.judge.states import (
    BAD_STATES,
    EXIT_CODES,
    SERVING_STATES,
    UNKNOWN,
    UNKNOWN_EXIT,
)
from mlx_watchdog.record.document import ServerStatus, ShownIncident, Waiting
from mlx_watchdog.record.store import Ref, Store, row_id
from mlx_watchdog.record.tally import DAY, Figures, Tally

if TYPE_CHECKING:
    from mlx_watchdog.cycle.shown import Shown
    from mlx_watchdog.judge.clearing import Clearing


def describe(
    server: ServerConfig,
    now: float,
    figures: Figures,
    *,
    state: str | None,
    reason: str,
    at: float | None,
    evidence: Evidence | None,
    since: float | None = None,
    draining: bool = False,
    restarting: bool = False,
    blind: bool = False,
    age: float | None = None,
    clearing: Waiting | None = None,
) -> ServerStatus:
    budget = allowance(server.restart, figures.restarts, now)
    window = server.restart.window
    oldest = min((t for t in figures.restarts if now - window < t <= now), default=None)
    e = evidence or Evidence()
    held = bool(e.abandoned_connections) and not e.tokens and e.waited_s is not None
    held = held and (e.waited_s or 0.0) >= server.probe.slow_after
    # A balancer that drains it has another server: it moves traffic away at the first sign.
    moved = held and server.restart.drain
    serving = state in SERVING_STATES and not draining and not restarting and not moved
    return ServerStatus(
        name=server.name,
        url=server.url,
        manager=server.manager,
        state=state or UNKNOWN,
        reason=reason,
        serving=serving,
        exit_code=EXIT_CODES.get(state or "", UNKNOWN_EXIT),
        judged_at=at,
        state_since=since,
        draining=draining,
        restarting=restarting,
        blind=blind,
        verdict_age_s=None if age is None else round(age, 1),
        needs_person=figures.needs_person,
        last_token_at=figures.last_token_at,
        ttft_p50_s=figures.ttft_p50_s,
        ttft_p95_s=figures.ttft_p95_s,
        ttft_samples=figures.ttft_samples,
        restarts_24h=sum(1 for r in figures.restarts if r >= now - DAY),
        incidents_24h=figures.incidents_24h,
        gave_up_24h=figures.gave_up_24h,
        budget_left=budget.left,
        pid=e.pid,
        rss_bytes=e.rss_bytes,
        cpu_percent=e.cpu_percent,
        abandoned_connections=e.abandoned_connections,
        live_connections=e.live_connections,
        kind=server.kind,
        models_finding=e.models_finding,
        cause=e.cause,
        cause_because=e.cause_because,
        server_report=e.server_report,
        server_prefill=e.server_prefill,
        progress_problem=e.progress_problem,
        server_running=e.server_running,
        server_waiting=e.server_waiting,
        incident=figures.incident,
        last_restart=figures.last_restart,
        clearing=clearing,
        restart_cost_s=figures.restart_cost_s,
        restart_cost_measured=figures.restart_cost_measured,
        budget_refill_s=None if oldest is None else round(oldest + window - now, 1),
        restart_backoff_s=None
        if budget.not_before is None or budget.not_before <= now
        else round(budget.not_before - now, 1),
        cannot_run=_cannot_run(server) if state in BAD_STATES else None,
        held_behind=held,
    )


def _cannot_run(server: ServerConfig) -> str | None:
    """Why the program a restart of `server` runs cannot run (read only while it fails)."""
    found = server_unrunnable(server, {**os.environ, **server.env}, restart_only=True)
    return found[0] if found else None


def of_shown(shown: Shown, now: float, mono: float, interval: float) -> ServerStatus:
    """The document of a server the daemon watches, from its cycle's published view: its
    last verdict only while fresh at `mono`."""
    v, blind, seen = shown.verdict, shown.blindness(mono, interval), shown.verdict_mono
    return describe(
        shown.server,
        now,
        shown.figures,
        state=v.state if v and not blind else None,
        reason=blind or (v.reason if v else "no verdict yet"),
        at=shown.judged_at,
        evidence=v.evidence if v else None,
        since=shown.state_since,
        draining=shown.draining,
        restarting=shown.restarting,
        blind=blind is not None,
        age=None if seen is None else mono - seen,
        clearing=_clearing(shown.clearing, mono),
    )


def _clearing(wait: Clearing | None, mono: float) -> Waiting | None:
    if wait is None:
        return None
    return Waiting(
        waited_s=round(mono - wait.began, 1),
        restart_in_s=round(max(0.0, wait.until - mono), 1),
        prefill_total=wait.total,
        cure="cancel" if wait.cancel else "wait",
        restart_cost_s=wait.cost.total,
        destroyed_s=wait.cost.destroyed,
    )


def from_history(server: ServerConfig, store: Store, now: float) -> ServerStatus:
    """The document as the last recorded probe left it (the daemon is not running)."""
    i = store.open_incident_for(server.name)
    shown = None if i is None else _incident(i.id, i.state, i.began_at)
    tally = Tally.load(store, server, now)
    figures = tally.figures(
        server, now, now, incident=shown, needs_person=store.hold_reason(server.name)
    )
    row = store.last_probe(server.name)
    if row is None:
        return describe(
            server, now, figures, state=None, reason="no probe recorded yet", at=None, evidence=None
        )
    return describe(
        server,
        now,
        figures,
        state=row.state,
        reason=row.reason,
        at=row.at,
        evidence=Evidence.from_json(row.evidence),
    )


def _incident(ref: Ref, state: str, began_at: float) -> ShownIncident:
    return ShownIncident(row_id(ref), state, began_at)
