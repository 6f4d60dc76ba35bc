"""Install the watchdog, or an mlx_lm.server, as a launchd job or a systemd unit.

A plan is the file to write and the steps to run; `--dry-run` prints it, `apply` carries it
out. The templates are `launchd/*.plist` and `units/*.service` at the top of the repository,
shipped inside the package. A service gets no shell environment, so every program is named by
the absolute path of the interpreter the tool is installed in, and every path is absolute.
`launchd.Launchd` and `systemd.Systemd` are the two targets; what they share is in base.py.
"""

from __future__ import annotations

from mlx_watchdog.act.managers import System
from mlx_watchdog.service.base import (
    NO_BUS,
    SERVER_ENV,
    STOP_BOUND,
    WATCHDOG_LABEL,
    WATCHDOG_UNIT,
    InstallPlan,
    JobUser,
    ServiceError,
    ServiceKind,
    Step,
    Target,
    WatchdogJob,
    apply,
    default_kind,
    interpreter,
    job_user,
    no_placeholders,
    server_args,
    server_label,
    server_unit,
    service_env,
    template,
    unreadable_by,
    write,
)
from mlx_watchdog.service.launchd import Launchd
from mlx_watchdog.service.systemd import Systemd

__all__ = [
    "NO_BUS",
    "SERVER_ENV",
    "STOP_BOUND",
    "WATCHDOG_LABEL",
    "WATCHDOG_UNIT",
    "InstallPlan",
    "JobUser",
    "ServiceError",
    "ServiceKind",
    "Step",
    "Target",
    "WatchdogJob",
    "apply",
    "default_kind",
    "interpreter",
    "job_user",
    "no_placeholders",
    "server_args",
    "server_label",
    "server_unit",
    "service_env",
    "target",
    "template",
    "unreadable_by",
    "write",
]


def target(
    kind: ServiceKind, system: System, *, system_wide: bool = False, preview: bool = False
) -> Target:
    """The target for `kind`; `system_wide` installs a LaunchDaemon or a system unit. A
    `preview` (--dry-run) is shown whoever asks: only doing it needs root."""
    if kind == "launchd":
        return Launchd(system, system_wide=system_wide, preview=preview)
    return Systemd(system, system_wide=system_wide, preview=preview)
