"""How the operating system holds a process back, and how busy the rest of the machine is.

A server run as a service can be throttled where the same command in a shell is not: launchd
applies "light resource limits ... throttling its CPU usage and I/O bandwidth" to a job with no
`ProcessType` (launchd.plist(5)) and more to `Background` ones (decode about 8x slower:
dryvist/nix-ai PR #916; a 30k-token prefill 4-9 s from a shell, over 60 s under a LaunchAgent:
raullenchai/Rapid-MLX #1363). Its nice value stays 0 there; `ps -o pri=` shows it (20 against a
normal process's 31: MemPalace PR #2507). On Linux a unit's `Nice=`, `CPUSchedulingPolicy=` or
`CPUQuota=` (cgroup `cpu.max`) does the same. Each reading is bounded and may be missing.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import psutil

from mlx_watchdog.sense import platform
from mlx_watchdog.sense.progress import bounded_run

NICE_CLAMPS = 5  # a nice value from which the process gets visibly less CPU than its peers
MAC_NORMAL_PRI = 31  # a normal process's scheduling priority on macOS
PS_TIMEOUT = 2.0

Clamp = Callable[[int], "str | None"]  # a PID -> how the OS holds it back, in words


def clamp(pid: int, *, root: Path = Path("/")) -> str | None:
    """How the operating system holds this process back, in words; None when it does not (or
    cannot be read)."""
    if platform.is_mac():
        return _mac_priority(pid)
    said: list[str] = []
    try:
        nice = psutil.Process(pid).nice()
    except (psutil.Error, OSError):
        nice = 0
    if nice >= NICE_CLAMPS:
        said.append(f"nice {nice}")
    policy = _policy(pid)
    if policy is not None:
        said.append(policy)
    quota = _cpu_quota(pid, root)
    if quota is not None:
        said.append(quota)
    return ", ".join(said) or None


def _policy(pid: int) -> str | None:
    getter = getattr(os, "sched_getscheduler", None)
    if getter is None:
        return None
    try:
        policy = getter(pid)
    except OSError:
        return None
    names = {
        getattr(os, "SCHED_IDLE", -1): "SCHED_IDLE",
        getattr(os, "SCHED_BATCH", -1): "SCHED_BATCH",
    }
    return f"scheduling policy {names[policy]}" if policy in names else None


def _cpu_quota(pid: int, root: Path) -> str | None:
    """A cgroup v2 CPU quota under one core (systemd's CPUQuota=), from the process's cgroup."""
    try:
        lines = (root / f"proc/{pid}/cgroup").read_text(errors="replace")[:4096].splitlines()
        group = next(x.split("::", 1)[1] for x in lines if x.startswith("0::"))
        limit = (root / "sys/fs/cgroup" / group.lstrip("/") / "cpu.max").read_text()[:100]
        quota_s, period_s = limit.split()
        quota, period = int(quota_s), int(period_s)
    except (OSError, StopIteration, ValueError):
        return None  # no cgroup v2, no limit ("max"), or nothing readable
    if period <= 0 or quota >= period:
        return None
    return f"a CPU quota of {quota / period:.2g} of a core (cgroup cpu.max)"


def _mac_priority(pid: int) -> str | None:
    try:
        code, out, _ = bounded_run(["ps", "-o", "pri=", "-p", str(pid)], cap=64, timeout=PS_TIMEOUT)
        pri = int(out.strip() or b"x") if code == 0 else None
    except (OSError, ValueError):
        return None
    if pri is None or pri >= MAC_NORMAL_PRI:
        return None
    return f"scheduling priority {pri} (a normal process has {MAC_NORMAL_PRI})"


class MachineLoad:
    """The CPU the rest of the machine uses besides one process, in percent of one core, over
    the span since this reader's last reading (its own, not psutil's shared interval)."""

    def __init__(self, times: Callable[[], tuple[float, float]] | None = None) -> None:
        self.times = times or _cpu_times
        self.last = self.times()

    def others(self, process_cpu: float | None) -> float | None:
        busy, total = self.times()
        (busy0, total0), self.last = self.last, (busy, total)
        if process_cpu is None or total <= total0:
            return None
        cores = psutil.cpu_count() or 1
        return max(0.0, (busy - busy0) / (total - total0) * 100.0 * cores - process_cpu)


def _cpu_times() -> tuple[float, float]:
    """The machine's busy and total CPU seconds so far."""
    t = psutil.cpu_times()
    idle = t.idle + getattr(t, "iowait", 0.0)
    # guest time is counted in user and nice already (as psutil's own cpu_percent reads it)
    total = sum(t) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)
    return total - idle, total
