"""One status document per server: what `/status`, `/healthz`, `/metrics` and `status` show.

The daemon builds it from what it holds in memory (one query per server, for the restarts);
`mlx-watchdog status` without a running daemon builds the same document from the history
database, so both print alike.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.judge.budget import decide
from mlx_watchdog.judge.states import EXIT_CODES, SERVING_STATES, UNKNOWN_EXIT, EventKind
from mlx_watchdog.judge.verdict import Evidence
from mlx_watchdog.record.store import Store

TTFT_WINDOW = 3600.0
RESTART_WINDOW = 86400.0
DAY = 86400.0
GAVE_UP = EventKind.GAVE_UP  # a history event, not an alert: clients that left mid-request


@dataclass(frozen=True)
class Held:
    """What a status document needs besides the verdict: the daemon holds it in memory, the
    history database holds it when no daemon runs."""

    ttfts: Sequence[float] = ()  # of the last TTFT_WINDOW
    restarts: Sequence[float] = ()  # when, over the longer of a day and the budget's window
    incident: dict[str, Any] | None = None  # id, state, began_at
    needs_person: str | None = None
    last_token_at: float | None = None
    # How often the server was provoked, over the last day: incidents opened, clients that left.
    incidents_24h: int = 0
    gave_up_24h: int = 0
    last_restart: dict[str, Any] | None = None  # at, trigger, outcome, finished_at


def describe(
    server: ServerConfig,
    now: float,
    held: Held,
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
) -> dict[str, Any]:
    ttfts = sorted(held.ttfts)
    budget = decide(server.restart, held.restarts, now)
    serving = state in SERVING_STATES and not draining and not restarting
    e = evidence or Evidence()
    return {
        "name": server.name,
        "url": server.url,
        "manager": server.manager,
        "state": state or "unknown",
        "reason": reason,
        "serving": serving,
        "exit_code": EXIT_CODES.get(state or "", UNKNOWN_EXIT),
        "judged_at": at,
        "state_since": since,
        "draining": draining,
        "restarting": restarting,
        "blind": blind,  # the verdict is too old to say anything about the server now
        "verdict_age_s": None if age is None else round(age, 1),
        "needs_person": held.needs_person,
        "last_token_at": held.last_token_at,
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p95_s": ttfts[max(0, math.ceil(0.95 * len(ttfts)) - 1)] if ttfts else None,
        "ttft_samples": len(ttfts),
        "restarts_24h": sum(1 for r in held.restarts if r >= now - RESTART_WINDOW),
        "incidents_24h": held.incidents_24h,
        "gave_up_24h": held.gave_up_24h,
        "budget_left": budget.left,
        "pid": e.pid,
        "rss_bytes": e.rss_bytes,
        "cpu_percent": e.cpu_percent,
        "abandoned_connections": e.abandoned_connections,
        "live_connections": e.live_connections,
        "kind": server.kind,
        "server_report": e.server_report,
        "server_running": e.server_running,
        "server_waiting": e.server_waiting,
        "incident": held.incident,
        "last_restart": held.last_restart,
    }


def gave_up_counts(store: Store, server: str, since: float) -> list[int]:
    """Clients that gave up, as recorded (one event per look that saw some leave)."""
    return [int(e.data.get("count", 0)) for e in store.events(server, since=since, kind=GAVE_UP)]


def restart_span(server: ServerConfig) -> float:
    """How far back the restarts a status document counts go."""
    return max(RESTART_WINDOW, server.restart.window)


def from_history(server: ServerConfig, store: Store, now: float) -> dict[str, Any]:
    """The document as the last recorded probe left it (the daemon is not running)."""
    incident = store.open_incident_for(server.name)
    restarts = store.restarts(server.name, now - restart_span(server))
    last = restarts[-1] if restarts else None
    held = Held(
        ttfts=[t for _, t in store.ttfts(server.name, now - TTFT_WINDOW)],
        restarts=[r.at for r in restarts],
        last_restart=None
        if last is None
        else {
            "at": last.at,
            "trigger": last.trigger,
            "outcome": last.outcome,
            "finished_at": last.finished_at,
        },
        incident=None
        if incident is None
        else {"id": incident.id, "state": incident.state, "began_at": incident.began_at},
        needs_person=store.held(server.name),
        last_token_at=store.last_token_at(server.name),
        incidents_24h=len(
            [i for i in store.incidents(now - DAY, server.name) if i.opened_at >= now - DAY]
        ),
        gave_up_24h=sum(gave_up_counts(store, server.name, now - DAY)),
    )
    row = store.last_probe(server.name)
    if row is None:
        return describe(
            server, now, held, state=None, reason="no probe recorded yet", at=None, evidence=None
        )
    return describe(
        server,
        now,
        held,
        state=row.state,
        reason=row.reason,
        at=row.at,
        evidence=Evidence.from_json(row.evidence),
    )
