"""Time bounds: how old a verdict may be, when the clocks jumped, how long a stop may take.

The service managers that run the watchdog must wait longer than its stop (launchd's
ExitTimeOut, systemd's TimeoutStopSec), so `service` reads these too."""

from __future__ import annotations

from mlx_watchdog.sense.findings import REPORT_TIMEOUT

STOP_TIMEOUT = 20.0  # for a restart in progress to finish by itself
INTERRUPT_TIMEOUT = 5.0  # then for its interrupted command to end


def fresh_for(interval: float, slow_after: float, models_timeout: float) -> float:
    """How old a verdict may be and still be served as current: a few intervals, plus what one
    tick may take by its own deadlines (the wait for a quick token, /v1/models, the health
    route and load report, the process). Older, the watchdog is blind and says so."""
    tick = min(slow_after, interval / 2) + models_timeout + 2 * min(models_timeout, REPORT_TIMEOUT)
    return 3 * interval + slow_after + tick + 2.0


JUMP = 10.0  # seconds the clocks may part between two ticks before it counts as a jump


def jumped(d_wall: float, d_mono: float, interval: float) -> bool:
    """A Mac that slept, a clock step or a suspended watchdog, between two ticks.

    The wall clock and the span clock advance alike, by about one interval. When they part, or
    the span is far longer than the interval, what was measured across the gap says nothing
    about the server."""
    return abs(d_wall - d_mono) > JUMP or d_mono - 3 * interval > JUMP


def blindness(age: float, limit: float, problem: str | None, running: float | None) -> str | None:
    """Why a verdict `age` seconds old is not served as current (None while within `limit`):
    the last tick's fault, or how long the running tick has run."""
    if age <= limit:
        return None
    if problem:
        why = problem
    elif running is not None:
        why = f"a tick has run for {running:.0f} s"
    else:
        why = "no tick has given a verdict"
    return f"no fresh verdict (watchdog blind for {age:.0f} s: {why})"
