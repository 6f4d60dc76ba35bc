"""The restart budget: at most `max_restarts` per `window`, with a growing pause between them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from mlx_watchdog.config import RestartSettings


@dataclass(frozen=True)
class Decision:
    allowed: bool
    spent: bool  # the window's restarts are used up: a person is needed
    not_before: float | None  # backing off until then
    used: int
    left: int


def decide(settings: RestartSettings, restarts: Sequence[float], now: float) -> Decision:
    """May the server be restarted at `now`, given when it was restarted before?"""
    recent = sorted(t for t in restarts if t > now - settings.window)
    used = len(recent)
    left = max(0, settings.max_restarts - used)
    if used >= settings.max_restarts:
        return Decision(False, True, None, used, 0)
    # A restart recorded after `now` means the clock was stepped back since: it still counts
    # against the budget, but paces nothing (its pause would last as long as the step).
    recent = [t for t in recent if t <= now]
    if recent:
        # 1x, 2x, 4x ... the backoff after the 1st, 2nd, 3rd restart in the window.
        not_before = recent[-1] + settings.backoff * 2 ** (used - 1)
        if now < not_before:
            return Decision(False, False, not_before, used, left)
    return Decision(True, False, None, used, left)
