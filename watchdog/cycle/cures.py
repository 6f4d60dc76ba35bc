"""What a named cause asks of its cure, beside the one restart path (cycle.py): a throttle
named from the calibration, the memory cure's wait between its stop and start, a wedged model
unloaded instead of its server restarted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
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
OWNING = ("process", "launchd", "systemd")  # managers that start the server's process


def port_held(
    v: Verdict,
    server: ServerConfig,
    ours: int | None,
    stranger: Callable[[ServerConfig, int | None], tuple[int, str] | None],
) -> Verdict:
    """A failing server whose address another process holds (a child it left in its own
    session, out of the manager's reach): its restarts cannot bind, and the watchdog signals
    only the server it verified, so the reason names the holder for a person to end."""
    if v.state not in BAD_STATES or server.manager not in OWNING:
        return v
    held = stranger(server, ours)
    if held is None:
        return v
    pid, what = held
    running = f"PID {ours}" if ours is not None else "none runs now"
    note = (
        f"; port {server.port} is held by PID {pid} ({what}), not by the server "
        f"{server.manager} started ({running}): end it yourself (kill {pid}), the watchdog "
        "signals only its server"
    )
    return replace(v, reason=v.reason + note, grounds=(v.grounds or v.reason) + note)


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
        cpu=e.cpu_percent if e.work_on == "cpu" else e.work_percent,
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
