"""The daily summary of one server: the last 24 hours as its history has them."""

from __future__ import annotations

import math

from mlx_watchdog.judge.states import EventKind
from mlx_watchdog.record.store import Store
from mlx_watchdog.record.tally import DAY, event_count


def daily_summary(store: Store, server: str, now: float) -> tuple[str, dict[str, object]]:
    """The text of the alert and its numbers: incidents, restarts, total outage, clients that
    gave up, TTFT p95, and the latest advice."""
    since = now - DAY
    incidents = [i for i in store.incidents(since, server) if i.opened_at >= since]
    restarts = store.restarts(server, since)
    outage = sum(i.outage_s or 0.0 for i in incidents)
    gave_up = sum(
        event_count(e.data.get("count"))
        for e in store.events(server, since=since, kind=EventKind.GAVE_UP)
    )
    ttfts = sorted(t for _, t in store.ttfts(server, since))
    p95 = ttfts[max(0, math.ceil(0.95 * len(ttfts)) - 1)] if ttfts else None
    advice = next((i.advice for i in reversed(incidents) if i.advice), None)
    numbers: dict[str, object] = {
        "incidents": len(incidents),
        "restarts": len(restarts),
        "outage_s": round(outage, 1),
        "gave_up": gave_up,
        "ttft_p95_s": None if p95 is None else round(p95, 3),
        "advice": advice,
    }
    text = (
        f"{len(incidents)} incident{'s' if len(incidents) != 1 else ''}, "
        f"{len(restarts)} restart{'s' if len(restarts) != 1 else ''}, outage {outage:.0f} s in all, "
        f"{gave_up} client{'s' if gave_up != 1 else ''} gave up mid-request, TTFT p95 "
        + ("none measured" if p95 is None else f"{p95:.2f} s")
    )
    return (f"{text}. Advice: {advice}" if advice else text), numbers
