"""Restart managers: how a server is restarted, behind one small interface (base.py), one
module per service manager, and the one that only observes."""

from __future__ import annotations

from pathlib import Path

from mlx_watchdog.act.managers.base import (
    INTERRUPTED,
    REPLACE_TIMEOUT,
    External,
    Manager,
    ManagerError,
    NoManager,
    Outcome,
    System,
    identity_problem,
    wait_for,
)
from mlx_watchdog.act.managers.command import CommandManager
from mlx_watchdog.act.managers.launchd import LaunchdManager
from mlx_watchdog.act.managers.process import ProcessManager
from mlx_watchdog.act.managers.systemd import SystemdManager
from mlx_watchdog.config import ServerConfig

__all__ = [
    "INTERRUPTED",
    "REPLACE_TIMEOUT",
    "External",
    "Manager",
    "ManagerError",
    "NoManager",
    "Outcome",
    "System",
    "identity_problem",
    "make_manager",
    "wait_for",
]


def make_manager(server: ServerConfig, system: System, state_dir: Path) -> Manager:
    if server.manager == "launchd":
        return LaunchdManager(server, system)
    if server.manager == "systemd":
        return SystemdManager(server, system)
    if server.manager == "process":
        return ProcessManager(server, system, state_dir / f"process-{server.name}.json")
    if server.manager == "command":
        return CommandManager(server, system)
    return NoManager(server)
