"""When a verdict calls for a restart. Pure, beside `budget.decide`: the budget says whether a
restart may happen now, this says whether one is called for at all.

Times are readings of the span clock (monotonic): a Mac that sleeps, or a clock step, does not
make a server look down for hours.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from mlx_watchdog.config import ProbeSettings
from mlx_watchdog.judge.states import State


class Trigger(StrEnum):
    """What may start a restart."""

    WEDGED = "wedged"  # up, serving nobody: at once
    DEAD = "dead"  # answers wrongly twice in a row
    DOWN = "down"  # nothing answers for longer than startup_grace
    CRASHED = "crashed"  # the server the watchdog owns exited: at once, the budget paces it
    MANUAL = "manual"  # a person asked


@dataclass(frozen=True)
class Streak:
    """What the triggers remember between verdicts of one server."""

    dead: int = 0  # verdicts in a row that were `dead`
    down_since: float | None = None  # when the `down` verdicts began


def step(
    streak: Streak,
    state: State,
    now: float,
    settings: ProbeSettings,
    *,
    exited: bool = False,
) -> tuple[Streak, Trigger | None]:
    """The streak after this verdict, and the trigger it sets off (or None).

    `exited`: the manager owns the server's process and saw it exit. Nothing else can tell a
    crash from a slow start that well, so it is the only way past `startup_grace` for `down`.
    """
    if state == State.WEDGED:
        return Streak(), Trigger.WEDGED
    if state == State.DEAD:
        dead = streak.dead + 1
        return Streak(dead=dead), Trigger.DEAD if dead >= 2 else None
    if state == State.DOWN:
        since = now if streak.down_since is None else streak.down_since
        if exited:
            return Streak(down_since=since), Trigger.CRASHED
        return Streak(down_since=since), (
            Trigger.DOWN if now - since >= settings.startup_grace else None
        )
    # starting, busy, slow, healthy: nothing to act on, and every streak ends.
    return Streak(), None
