"""systemd user units: `systemctl --user restart`."""

from __future__ import annotations

from collections.abc import Callable

from mlx_watchdog.act.managers.base import REPLACE_TIMEOUT, External, Outcome, System, wait_for
from mlx_watchdog.config import ServerConfig


class SystemdManager(External):
    """A systemd user unit: `systemctl --user restart`, its PID from `MainPID`."""

    kind = "systemd"

    def __init__(self, server: ServerConfig, system: System) -> None:
        assert server.unit is not None
        self.server = server
        self.system = system
        self.unit = server.unit

    def pid(self) -> int | None:
        code, out = self.system.run(
            ["systemctl", "--user", "show", "-p", "MainPID", "--value", self.unit], timeout=10
        )
        if code != 0 or not out.strip().isdigit():
            return None
        return int(out.strip()) or None

    def restart(self) -> Outcome:
        before = self.pid()
        argv = ["systemctl", "--user", "restart", self.unit]
        code, out = self.system.run(argv, timeout=120)
        steps = (f"{' '.join(argv)}: exit {code}",)
        if code != 0:
            return Outcome(False, f"systemctl restart failed: {out}", steps)
        if wait_for(lambda: self.pid() not in (None, before), REPLACE_TIMEOUT, self.system):
            return Outcome(True, f"replaced PID {before} with {self.pid()}", steps)
        return Outcome(
            False, f"systemctl restart succeeded but PID {before} was not replaced", steps
        )

    def stop_then_start(self, between: Callable[[], str]) -> Outcome:
        """`systemctl --user stop` (it waits for the stop: SIGTERM, TimeoutStopSec, SIGKILL),
        `between`, then `start`."""
        before = self.pid()
        steps: list[str] = []
        stop = ["systemctl", "--user", "stop", self.unit]
        code, out = self.system.run(stop, timeout=120)
        steps.append(f"{' '.join(stop)}: exit {code}")
        if code != 0:
            return Outcome(False, f"systemctl stop failed: {out}", tuple(steps))
        steps.append(between())
        # Stopped by us, it is started by us: a watchdog that stops meanwhile finishes this.
        with self.system.finishing():
            start = ["systemctl", "--user", "start", self.unit]
            code, out = self.system.run(start, timeout=120)
            steps.append(f"{' '.join(start)}: exit {code}")
            if code != 0:
                return Outcome(False, f"systemctl start failed: {out}", tuple(steps))
            if wait_for(lambda: self.pid() not in (None, before), REPLACE_TIMEOUT, self.system):
                return Outcome(True, f"replaced PID {before} with {self.pid()}", tuple(steps))
        return Outcome(
            False, f"systemctl start succeeded but no new PID replaced {before}", tuple(steps)
        )
