"""One status document per server: what `/status`, `/healthz`, `/metrics` and `status` show.

The daemon builds it from what it holds; `mlx-watchdog status` without a running daemon builds
the same document from the history database, so both print alike.
"""

from __future__ import annotations

import json
import math
import statistics
from typing import Any

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.judge.budget import decide
from mlx_watchdog.judge.states import EXIT_CODES, SERVING_STATES, UNKNOWN_EXIT
from mlx_watchdog.record.store import Store

TTFT_WINDOW = 3600.0
RESTART_WINDOW = 86400.0


def describe(
    server: ServerConfig,
    store: Store,
    now: float,
    *,
    state: str | None,
    reason: str,
    at: float | None,
    evidence: dict[str, Any],
    since: float | None = None,
    last_token_at: float | None = None,
    draining: bool = False,
    restarting: bool = False,
) -> dict[str, Any]:
    ttfts = sorted(store.ttfts(server.name, now - TTFT_WINDOW))
    restarts = store.restarts(server.name, now - max(RESTART_WINDOW, server.restart.window))
    budget = decide(server.restart, [r.at for r in restarts], now)
    incident = store.open_incident_for(server.name)
    serving = state in SERVING_STATES and not draining and not restarting
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
        "needs_person": store.held(server.name),
        "last_token_at": last_token_at or store.last_token_at(server.name),
        "ttft_p50_s": statistics.median(ttfts) if ttfts else None,
        "ttft_p95_s": ttfts[max(0, math.ceil(0.95 * len(ttfts)) - 1)] if ttfts else None,
        "ttft_samples": len(ttfts),
        "restarts_24h": sum(1 for r in restarts if r.at >= now - RESTART_WINDOW),
        "budget_left": budget.left,
        "pid": evidence.get("pid"),
        "rss_bytes": evidence.get("rss_bytes"),
        "cpu_percent": evidence.get("cpu_percent"),
        "abandoned_connections": evidence.get("abandoned_connections"),
        "live_connections": evidence.get("live_connections"),
        "incident": None
        if incident is None
        else {"id": incident.id, "state": incident.state, "began_at": incident.began_at},
    }


def from_history(server: ServerConfig, store: Store, now: float) -> dict[str, Any]:
    """The document as the last recorded probe left it (the daemon is not running)."""
    row = store.last_probe(server.name)
    if row is None:
        return describe(
            server, store, now, state=None, reason="no probe recorded yet", at=None, evidence={}
        )
    return describe(
        server,
        store,
        now,
        state=row["state"],
        reason=row["reason"],
        at=row["at"],
        evidence=json.loads(row["evidence"]),
    )
