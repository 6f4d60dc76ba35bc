"""A user command that restarts the server: an argv list, no shell, with a timeout."""

from __future__ import annotations

from mlx_watchdog.act.managers.base import External, Outcome, System
from mlx_watchdog.config import ServerConfig


class CommandManager(External):
    """A server restarted by the user's own command (an argv, no shell); its PID is the
    port's listener."""

    kind = "command"

    def __init__(self, server: ServerConfig, system: System) -> None:
        self.server = server
        self.system = system

    def pid(self) -> int | None:
        return None  # the port's listener is the server

    def restart(self) -> Outcome:
        argv = self.server.restart_command
        code, out = self.system.run(argv, timeout=self.server.restart.command_timeout)
        step = f"{argv[0]}: exit {code}"
        if code != 0:
            return Outcome(False, f"restart_command exited {code}: {out[-300:]}", (step,))
        return Outcome(True, "restart_command succeeded", (step,))
