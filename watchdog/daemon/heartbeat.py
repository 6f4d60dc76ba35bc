"""The watchdog watched: its service manager learns whether the ticks go on.

Under systemd (`Type=notify`, `WatchdogSec=`) the daemon says `READY=1` once it watches and
`WATCHDOG=1` every second while every server's job makes progress; a daemon whose ticks stop,
or whose whole process hangs, is killed after `WatchdogSec` and started again (`Restart=`).
launchd has no such protocol: there the daemon ends itself with `EXIT_STALLED` when its ticks
stop, and `KeepAlive` starts it again. Both need the same rule, `stalled`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

EXIT_STALLED = 70  # EX_SOFTWARE: not a clean stop, so KeepAlive and Restart=on-failure act
STALL_MARGIN = 10.0  # past the verdict's own freshness bound, before the daemon gives up on itself


class Notifier:
    """sd_notify(3) on the socket systemd names in $NOTIFY_SOCKET; nothing without it.

    The variable is taken out of the environment at once, so no server the watchdog starts
    can speak for it (systemd's `NotifyAccess=main` would ignore them anyway)."""

    def __init__(self, env: dict[str, str] | os._Environ[str] | None = None) -> None:
        env = os.environ if env is None else env
        address = env.pop("NOTIFY_SOCKET", "")
        env.pop("WATCHDOG_USEC", None)
        env.pop("WATCHDOG_PID", None)
        self.address = "\0" + address[1:] if address.startswith("@") else address

    def send(self, *lines: str) -> bool:
        if not self.address:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
                sock.settimeout(1.0)
                sock.sendto("\n".join(lines).encode(), self.address)
            return True
        except OSError:
            return False  # the manager went away or refused: nothing the daemon can mend


def stalled(progress: Mapping[str, float], limits: Mapping[str, float], now: float) -> str | None:
    """Why the ticks have stopped, or None: a server whose job has neither begun nor ended a
    tick for longer than its limit (its verdict's freshness bound plus `STALL_MARGIN`)."""
    late = {name: now - at for name, at in progress.items() if now - at > limits.get(name, 0.0)}
    if not late:
        return None
    name, age = max(late.items(), key=lambda item: item[1])
    more = f" (and {len(late) - 1} more)" if len(late) > 1 else ""
    return f"no tick of {name} has begun or ended for {age:.0f} s{more}"
