"""The sign that the server works, read where its work runs: its CPU where it computes on the
CPU (Linux's `mlx[cpu]`, psutil), its GPU time where it computes on the GPU (macOS, ioreg:
sense/gpu.py). On a Mac the process's CPU is no sign either way: a GPU prefill and a wedge
both show about 1 %. Where the sign cannot be read it is unknown, said with its reason, and
the judge waits within its bounds (judge/clearing.py), never reads it as idle.

The GPU is read only while the probe waits (the caller says so): a healthy look costs nothing.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.sense import gpu, platform
from mlx_watchdog.sense.findings import WorkSign
from mlx_watchdog.sense.tool import Unreadable

log = logging.getLogger(__name__)

GpuClock = Callable[[int], int]  # a PID -> its GPU time so far, ns (Unreadable: why not)


def computes_on(server: ServerConfig, on_mac: bool | None = None) -> str:
    """Where this server's work runs: its `compute` key, or by the platform (`auto`): every
    local server of the supported kinds computes on the GPU through Metal on a Mac."""
    if server.compute != "auto":
        return server.compute
    return "gpu" if (platform.is_mac() if on_mac is None else on_mac) else "cpu"


class WorkMeter:
    """The work sign of one server, reading after reading."""

    def __init__(
        self,
        server: ServerConfig,
        *,
        gpu_time: GpuClock | None = None,
        mono: Callable[[], float] = time.monotonic,
        on_mac: bool | None = None,
    ) -> None:
        self.on = computes_on(server, on_mac)
        self.mac = platform.is_mac() if on_mac is None else on_mac
        self.gpu_time = gpu_time or gpu.gpu_time_ns
        self.mono = mono
        self._last: tuple[int, int, float] | None = None  # PID, GPU ns, when
        self._said: set[str] = set()

    def read(self, pid: int | None, cpu_percent: float | None, *, waiting: bool) -> WorkSign:
        """The sign now. `waiting`: the probe waits, so the GPU is worth its reading."""
        if self.on == "cpu":
            return WorkSign("cpu", cpu_percent)
        if not self.mac:
            return WorkSign("gpu", None, "no reader of a process's GPU time on this platform", "")
        if not waiting:
            self._last = None  # a wait's first look starts its own baseline
            return WorkSign("gpu", None, source="ioreg")
        if pid is None:
            return WorkSign("gpu", None, "no server process", "ioreg")
        try:
            ns = self.gpu_time(pid)
        except Unreadable as exc:
            self._last = None
            self._say(str(exc))
            return WorkSign("gpu", None, str(exc), "ioreg")
        now = self.mono()
        last, self._last = self._last, (pid, ns, now)
        if last is None or last[0] != pid or now <= last[2] or ns < last[1]:
            return WorkSign("gpu", None, source="ioreg")  # a first reading: no span yet
        share = (ns - last[1]) / 1e9 / (now - last[2]) * 100.0
        return WorkSign("gpu", round(min(share, 100.0), 2), source="ioreg")

    def _say(self, why: str) -> None:
        """A reader that fails says so once, not at every look."""
        if why not in self._said:
            self._said.add(why)
            log.warning("the server's GPU time cannot be read: %s", why)
