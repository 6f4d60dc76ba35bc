"""What a named cause asks of its cure, beside the one restart path (cycle.py): a throttle
named from the calibration, the memory cure's wait between its stop and start, a wedged model
unloaded instead of its server restarted."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from mlx_watchdog.act.managers import System
from mlx_watchdog.act.unload import Unloader
from mlx_watchdog.config import ServerConfig
from mlx_watchdog.judge.cause import Cause, throttled
from mlx_watchdog.judge.estimate import calibrated_rate
from mlx_watchdog.judge.states import BAD_STATES
from mlx_watchdog.judge.verdict import Verdict, renamed
from mlx_watchdog.sense.memory import Settle
from mlx_watchdog.sense.signs import Machine

RENAMABLE = (Cause.ABANDONED_PREFILL, Cause.CLIENT_TIMEOUTS, Cause.UNKNOWN)


def named_throttled(
    v: Verdict, calibration: Callable[[], dict[str, Any] | None], idle_below: float
) -> Verdict:
    """A failing server whose prefill runs far below its calibration, the system holding it
    back or nothing else running: named for that (a restart starts it under the same
    limits). The calibration is read only when a prefill rate is there to compare."""
    e = v.evidence
    if v.state not in BAD_STATES or e.cause not in RENAMABLE or e.prefill_rate_tps is None:
        return v
    found = throttled(
        e.prefill_rate_tps,
        calibrated_rate(calibration(), e.prefill_done or 0),
        cpu=e.cpu_percent,
        others=e.others_cpu_percent,
        clamp=e.clamp,
        idle_below=idle_below,
    )
    return v if found is None else renamed(v, found)


def settle_for(
    v: Verdict | None,
    freed: Callable[[], int],
    machine: Callable[[], Machine | None],
    system: System,
    mono: Callable[[], float],
) -> Settle | None:
    """Under memory pressure, a restart waits between the stop and the start for the memory
    the server held (`freed`) to come back; a watchdog that stops ends the wait."""
    if v is None or v.evidence.cause != Cause.MEMORY_PRESSURE:
        return None
    return Settle(
        freed(),
        read=machine,
        sleep=system.sleep,
        mono=mono,
        stopping=lambda: system.interrupted,
    )


def unloader_for(
    v: Verdict | None,
    server: ServerConfig,
    pid: int | None,
    system: System,
    mono: Callable[[], float],
) -> Unloader | None:
    """One wedged model of a server that holds several is unloaded, not the server
    restarted."""
    if v is None or v.evidence.cause != Cause.MODEL_WEDGED or v.evidence.model is None:
        return None
    return Unloader(server, v.evidence.model, pid, system, mono)
