"""The restart budget: at most `max_restarts` per `window`, with a growing pause between them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlx_watchdog.config import RestartSettings


@dataclass(frozen=True)
class LastRestart:
    """The last restart as people see it; `outcome` None while it runs."""

    at: float
    trigger: str
    outcome: str | None = None  # recovered, failed, interrupted
    finished_at: float | None = None


@dataclass(frozen=True)
class Allowance:
    """Whether a restart is allowed now, by the budget and the backoff."""

    allowed: bool
    spent: bool  # the window's restarts are used up: a person is needed
    not_before: float | None  # backing off until then
    used: int
    left: int


def allowance(settings: RestartSettings, restarts: Sequence[float], now: float) -> Allowance:
    """May the server be restarted at `now`, given when it was restarted before?"""
    recent = sorted(t for t in restarts if t > now - settings.window)
    used = len(recent)
    left = max(0, settings.max_restarts - used)
    if used >= settings.max_restarts:
        return Allowance(False, True, None, used, 0)
    # A restart recorded after `now` means the clock was stepped back since: it still counts
    # against the budget, but paces nothing (its pause would last as long as the step).
    recent = [t for t in recent if t <= now]
    if recent:
        # 1x, 2x, 4x ... the backoff after the 1st, 2nd, 3rd restart in the window.
        not_before = recent[-1] + settings.backoff * 2 ** (used - 1)
        if now < not_before:
            return Allowance(False, False, not_before, used, left)
    return Allowance(True, False, None, used, left)


# The restarts a person, the maintenance window or a reload asked for: they count against the
# budget, but they are not the watchdog's cures that failed.
ASKED = ("manual", "maintenance", "reload")

RECENT_RESTART = 10.0  # a person's restart this soon after one that worked is a repeat


def repeat_restart(
    name: str,
    last: LastRestart | None,
    *,
    queued: bool,
    running: bool,
    now: float,
    interval: float,
) -> str | None:
    """Why a person's restart now would be a second restart for one cause (None: it is not)."""
    if queued:
        return f"a restart of {name} is already asked for"
    if last is None:
        return None
    at, trigger, outcome, finished_at = last.at, last.trigger, last.outcome, last.finished_at
    if running:
        return (
            f"{name} is being restarted already ({trigger}, begun "
            f"{now - at:.0f} s ago); `status` shows how it ends"
        )
    recent = max(RECENT_RESTART, 2 * interval)
    if outcome == "recovered" and finished_at and now - finished_at < recent:
        return (
            f"{name} was restarted {now - at:.0f} s ago ({trigger}) and serves "
            f"again; if it needs another, ask again in {recent - (now - finished_at):.0f} s"
        )
    return None
