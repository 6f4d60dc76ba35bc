"""The programs a config names that this machine cannot run: a server's `command`, its
`restart_command` and its drain hooks, each found by its path or on the PATH. A service gets a
shorter PATH than a login shell (launchd's is /usr/bin:/bin:/usr/sbin:/sbin), so a program found
only on this shell's PATH is named too: a service would not find it."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping

from mlx_watchdog.config.schema import Config, ServerConfig

SERVICE_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"  # launchd's, and a bare unit's


def unrunnable(config: Config, env: Mapping[str, str] | None = None) -> list[str]:
    """What each server names that cannot be run, in words naming the key and its value."""
    return [why for s in config.servers for why in server_unrunnable(s, env)]


def server_unrunnable(
    s: ServerConfig, env: Mapping[str, str] | None = None, *, restart_only: bool = False
) -> list[str]:
    """What one server names that cannot be run (`restart_only`: what a restart runs: its
    command or restart_command, not the drain hooks)."""
    env = os.environ if env is None else env
    named = {
        "command": s.command if s.manager == "process" else (),
        "restart_command": s.restart_command if s.manager == "command" else (),
    }
    if not restart_only:
        named["restart.drain_command"] = s.restart.drain_command
        named["restart.undrain_command"] = s.restart.undrain_command
    return [
        f'[[server]] "{s.name}": {key}[0] = "{argv[0]}" {why}'
        for key, argv in named.items()
        if argv and (why := _why_not(argv[0], env.get("PATH", ""), service=not restart_only))
    ]


def _why_not(program: str, path: str, *, service: bool = True) -> str | None:
    """Why `program` cannot run; `service`: also when only this shell's PATH finds it."""
    if os.sep in program:
        if not os.path.isfile(program):
            return "does not exist"
        return None if os.access(program, os.X_OK) else "is not executable"
    if shutil.which(program, path=path) is None:
        return "is not on the PATH; name it by its absolute path"
    if service and shutil.which(program, path=SERVICE_PATH) is None:
        where = shutil.which(program, path=path)
        return (
            f"is found only on this shell's PATH ({where}), not on a service's "
            f"({SERVICE_PATH}): name it by that absolute path"
        )
    return None
