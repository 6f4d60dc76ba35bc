"""launchd jobs: an agent in the user's domain, or with --system a LaunchDaemon.

The domain is the one that exists: `gui/<uid>` with a GUI login, `user/<uid>` over SSH with
nobody at the screen (it runs while that user has a session, and does not start at boot), and
`system` for a LaunchDaemon with `UserName`: the layout for a Mac that must serve after a
reboot with nobody logged in.
"""

from __future__ import annotations

import plistlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mlx_watchdog.act.managers import System
from mlx_watchdog.act.managers.launchd import IN_PROGRESS, NOT_LOADED, domain_exists
from mlx_watchdog.sense import selfdump
from mlx_watchdog.service.base import (
    SERVER_ENV,
    STOP_BOUND,
    WATCHDOG_ENV,
    WATCHDOG_LABEL,
    InstallPlan,
    ServiceError,
    ServiceKind,
    Step,
    WatchdogJob,
    job_user,
    no_placeholders,
    server_label,
    service_env,
    template,
)

DAEMONS = Path("/Library/LaunchDaemons")
SYSTEM_LOGS = Path("/Library/Logs/mlx-watchdog")
SERVER_EXIT_TIMEOUT = 30


class Launchd:
    """Installs into launchd: a LaunchAgent in the right domain, or a LaunchDaemon."""

    kind: ServiceKind = "launchd"
    watchdog_label = WATCHDOG_LABEL

    def __init__(self, system: System, *, system_wide: bool = False, preview: bool = False) -> None:
        self.system = system
        self.system_wide = system_wide
        self.preview = preview
        self.uid = system.uid()
        if system_wide and self.uid != 0 and not preview:
            raise ServiceError("--system writes a LaunchDaemon: run it with sudo")
        if not system_wide and self.uid == 0:
            raise ServiceError(
                "run as root, this would load an agent into root's own domain; for a job that "
                "starts at boot with nobody logged in, use --system (sudo mlx-watchdog install "
                "--system), or run install as the user who runs the server"
            )
        self.hints: list[str] = []
        self.domain = self._domain()

    def server_label(self, name: str) -> str:
        return server_label(name)

    def _domain(self) -> str:
        if self.system_wide:
            return "system"
        gui = f"gui/{self.uid}"
        if domain_exists(self.system, gui):
            return gui
        self.hints.append(
            f"nobody is logged in at this Mac's screen, so the job goes into user/{self.uid}: it "
            "runs while you have a session (SSH included) and does not start at boot; for a Mac "
            "that must serve after a reboot with nobody logged in: sudo mlx-watchdog install "
            "--system"
        )
        return f"user/{self.uid}"

    def _user(self, env: Mapping[str, str]) -> tuple[str | None, Path, int | None]:
        """The job's user, home and (root writing for them) uid."""
        if not self.system_wide:
            return None, Path.home(), None
        user = job_user(env, preview=self.preview)
        return user.name, user.home, user.uid

    def _path(self, label: str, home: Path) -> Path:
        folder = DAEMONS if self.system_wide else home / "Library" / "LaunchAgents"
        return folder / f"{label}.plist"

    def _logs(self, home: Path) -> Path:
        return SYSTEM_LOGS if self.system_wide else home / "Library" / "Logs" / "mlx-watchdog"

    def _render(
        self,
        name: str,
        *,
        label: str,
        python: str,
        log: Path,
        env: Mapping[str, str],
        home: Path,
        user: str | None,
        exit_timeout: int,
        values: Mapping[str, str] = {},
        args: Sequence[str] = (),
    ) -> bytes:
        """Fill the plist template: @NAMES@ from `values`, @SERVER_ARGS@ becomes `args`."""
        plist = plistlib.loads(template("launchd", f"{name}.plist").encode())
        fill = {
            "@LABEL@": label,
            "@PYTHON@": python,
            "@STACKS@": str(selfdump.LAUNCHER),
            "@LOG@": str(log),
            **values,
        }
        argv: list[str] = []
        for item in plist["ProgramArguments"]:
            argv.extend(args if item == "@SERVER_ARGS@" else [fill.get(item, item)])
        plist["ProgramArguments"] = argv
        for key, value in list(plist.items()):
            if isinstance(value, str):
                plist[key] = fill.get(value, value)
        plist["EnvironmentVariables"] = dict(env)
        plist["WorkingDirectory"] = str(home)
        plist["ExitTimeOut"] = exit_timeout
        if user is not None:
            plist["UserName"] = user
        no_placeholders(plist)
        return plistlib.dumps(plist, sort_keys=False)

    def _install(self, label: str, content: bytes, home: Path, owner: int | None) -> InstallPlan:
        """Write the file, then load it; running it again replaces the job with the new file."""
        path = self._path(label, home)
        target = f"{self.domain}/{label}"
        return InstallPlan(
            self.kind,
            path,
            content,
            (
                Step(
                    ("launchctl", "bootout", target),
                    ok=frozenset({0, IN_PROGRESS, *NOT_LOADED}),
                    wait_gone=target,
                ),
                Step(("launchctl", "enable", target)),
                Step(("launchctl", "bootstrap", self.domain, str(path)), retry_busy=True),
            ),
            hints=tuple(self.hints),
            label=label,
            domain=self.domain,
            dirs=(self._logs(home),),
            dirs_owner=owner,
        )

    def watchdog_plan(self, job: WatchdogJob) -> InstallPlan:
        user, job_home, uid = self._user(job.env)
        home = job_home if self.system_wide else job.home
        content = self._render(
            "mlx-watchdog",
            label=WATCHDOG_LABEL,
            python=job.python,
            log=self._logs(home) / "watchdog.log",
            env=service_env(job.env, home, () if self.system_wide else WATCHDOG_ENV),
            home=home,
            user=user,
            exit_timeout=STOP_BOUND,
            values={"@CONFIG@": str(job.config)},
        )
        return self._install(WATCHDOG_LABEL, content, home, uid)

    def server_plan(
        self, *, name: str, args: Sequence[str], home: Path, env: Mapping[str, str], python: str
    ) -> tuple[InstallPlan, dict[str, Any]]:
        user, job_home, uid = self._user(env)
        home = job_home if self.system_wide else home
        label = server_label(name)
        log = self._logs(home) / f"server-{name}.log"
        content = self._render(
            "mlx-server",
            label=label,
            python=python,
            log=log,
            env=service_env(env, home, SERVER_ENV),
            home=home,
            user=user,
            exit_timeout=SERVER_EXIT_TIMEOUT,
            args=args,
        )
        plan = self._install(label, content, home, uid)
        entry = {
            "label": label,
            "plist": str(plan.path),
            "domain": self.domain,
            "log_file": str(log),
        }
        return plan, entry

    def uninstall_plan(self, label: str, *, home: Path, env: Mapping[str, str]) -> InstallPlan:
        target = f"{self.domain}/{label}"
        return InstallPlan(
            self.kind,
            self._path(label, home),
            None,
            (
                Step(
                    ("launchctl", "bootout", target),
                    ok=frozenset({0, IN_PROGRESS, *NOT_LOADED}),
                    wait_gone=target,
                ),
            ),
            label=label,
            domain=self.domain,
        )
