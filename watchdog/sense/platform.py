"""Which platform's signs are read: macOS's tools (`ioreg`, `netstat -anv`, `launchctl`, `log`,
`sample`) or Linux's (/proc, sock_diag, py-spy). The platform the watchdog runs on, unless
`MLX_WATCHDOG_PLATFORM` names another: the tests' seam, which runs the macOS path on Linux
with stand-ins for those tools on PATH (CONTRIBUTING.md). It decides only which readers run,
never the service manager or the folders."""

from __future__ import annotations

import os
import sys

VARIABLE = "MLX_WATCHDOG_PLATFORM"
KNOWN = ("darwin", "linux")


def name() -> str:
    """ "darwin" or "linux" (any other system is read as Linux is: psutil's view only)."""
    asked = os.environ.get(VARIABLE, "").strip().lower()
    if asked in KNOWN:
        return asked
    return "darwin" if sys.platform == "darwin" else "linux"


def is_mac() -> bool:
    return name() == "darwin"
