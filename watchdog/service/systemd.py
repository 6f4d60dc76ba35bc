"""systemd units: a user unit (`systemctl --user`), or with --system a system unit with `User=`.

A user unit runs while its user has a session; `loginctl enable-linger` keeps it running from
boot with nobody logged in. A system unit starts at boot as the user who ran sudo.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mlx_watchdog.act.managers import System
from mlx_watchdog.service.base import (
    SERVER_ENV,
    STOP_BOUND,
    WATCHDOG_ENV,
    WATCHDOG_UNIT,
    InstallPlan,
    ServiceError,
    ServiceKind,
    Step,
    WatchdogJob,
    job_user,
    no_placeholders,
    server_unit,
    service_env,
    template,
)

SYSTEM_UNITS = Path("/etc/systemd/system")
# The system unit's sandbox (`systemd-analyze security`: 2.7, "OK"). The watchdog and the
# servers it runs keep what they need: the user's home (config, state, logs, model caches) and
# `ReadWritePaths`, the network, /proc (a server's sockets and command line), their own
# devices (a GPU server under the `process` manager); the rest of the system is read-only.
HARDENING = """\
ProtectSystem=strict
ReadWritePaths=@WRITABLE@
PrivateTmp=yes
ProtectKernelTunables=yes
ProtectKernelModules=yes
ProtectKernelLogs=yes
ProtectControlGroups=yes
ProtectClock=yes
ProtectHostname=yes
RestrictNamespaces=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
LockPersonality=yes
CapabilityBoundingSet=
RestrictAddressFamilies=AF_UNIX AF_INET AF_INET6 AF_NETLINK
SystemCallArchitectures=native
SystemCallFilter=@system-service
"""


def user_unit_dir(env: Mapping[str, str], home: Path) -> Path:
    base = env.get("XDG_CONFIG_HOME") or str(home / ".config")
    return Path(base) / "systemd" / "user"


def quote(arg: str) -> str:
    """One argument of a systemd command line: % and $ are specifiers there."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and not re.search(r"[\s\"'\\;]", arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


class Systemd:
    """Installs into systemd: a user unit, or a system unit with `User=`."""

    kind: ServiceKind = "systemd"
    watchdog_label = WATCHDOG_UNIT

    def __init__(self, system: System, *, system_wide: bool = False, preview: bool = False) -> None:
        self.system = system
        self.system_wide = system_wide
        self.preview = preview
        if system_wide and system.uid() != 0 and not preview:
            raise ServiceError("--system writes a system unit: run it with sudo")
        self.domain = "system" if system_wide else "user"
        self.ctl = ("systemctl",) if system_wide else ("systemctl", "--user")

    def server_label(self, name: str) -> str:
        return server_unit(name)

    def _user(self, env: Mapping[str, str], home: Path) -> tuple[str | None, Path]:
        if not self.system_wide:
            return None, home
        user = job_user(env, "unit", preview=self.preview)
        return user.name, user.home

    def _path(self, label: str, env: Mapping[str, str], home: Path) -> Path:
        return (SYSTEM_UNITS if self.system_wide else user_unit_dir(env, home)) / label

    def _render(
        self,
        name: str,
        *,
        python: str,
        env: Mapping[str, str],
        user: str | None,
        values: Mapping[str, str] = {},
        args: Sequence[str] = (),
        writable: Sequence[Path] = (),
    ) -> bytes:
        lines = template("units", f"{name}.service").splitlines(keepends=True)
        while lines and lines[0].startswith("#"):
            lines.pop(0)  # the template's own comment
        text = "# Written by mlx-watchdog; running the install again replaces it.\n"
        text += "".join(lines)
        environment = "\n".join(f"Environment={quote(f'{k}={v}')}" for k, v in env.items())
        if user is not None:
            environment = f"User={user}\n{environment}"
            text = text.replace("WantedBy=default.target", "WantedBy=multi-user.target")
        text = text.replace("Environment=@ENV@", environment)
        if user is None:
            text = text.replace("@HARDENING@\n", "")
        else:
            # "-": a folder that does not exist yet is no reason to fail the start.
            paths = " ".join(quote(f"-{p}") for p in dict.fromkeys(map(str, writable)))
            text = text.replace("@HARDENING@\n", HARDENING.replace("@WRITABLE@", paths))
        text = text.replace("@PYTHON@", quote(python))
        text = text.replace("@SERVER_ARGS@", " ".join(quote(a) for a in args))
        text = text.replace("@STOP@", str(STOP_BOUND))
        for key, value in values.items():
            text = text.replace(key, quote(value) if key == "@CONFIG@" else value)
        no_placeholders(text)
        return text.encode()

    def _install(
        self, label: str, content: bytes, env: Mapping[str, str], home: Path
    ) -> InstallPlan:
        """Write the unit, then (re)start it: `enable --now` would keep an old process running."""
        hints: tuple[str, ...] = ()
        if not self.system_wide:
            hints = (
                "to keep it running while you are logged out, and start it at boot: "
                "loginctl enable-linger " + (env.get("USER") or "$USER"),
            )
        return InstallPlan(
            self.kind,
            self._path(label, env, home),
            content,
            (
                Step((*self.ctl, "daemon-reload")),
                Step((*self.ctl, "enable", label)),
                Step((*self.ctl, "restart", label)),
            ),
            hints=hints,
            label=label,
            domain=self.domain,
        )

    def watchdog_plan(self, job: WatchdogJob) -> InstallPlan:
        user, home = self._user(job.env, job.home)
        content = self._render(
            "mlx-watchdog",
            python=job.python,
            env=service_env(job.env, home, () if self.system_wide else WATCHDOG_ENV),
            user=user,
            values={"@CONFIG@": str(job.config)},
            writable=(home, *job.writable),
        )
        return self._install(WATCHDOG_UNIT, content, job.env, home)

    def server_plan(
        self, *, name: str, args: Sequence[str], home: Path, env: Mapping[str, str], python: str
    ) -> tuple[InstallPlan, dict[str, Any]]:
        user, home = self._user(env, home)
        label = server_unit(name)
        content = self._render(
            "mlx-server",
            python=python,
            env=service_env(env, home, SERVER_ENV),
            user=user,
            values={"@NAME@": name},
            args=args,
        )
        return self._install(label, content, env, home), {"unit": label}

    def uninstall_plan(self, label: str, *, home: Path, env: Mapping[str, str]) -> InstallPlan:
        return InstallPlan(
            self.kind,
            self._path(label, env, home),
            None,
            (
                # Not loaded, or no such unit: already gone.
                Step((*self.ctl, "disable", "--now", label), ok=frozenset({0, 1, 5})),
                Step((*self.ctl, "daemon-reload")),
            ),
            label=label,
            domain=self.domain,
        )
