"""What `doctor` checks of the machine: the service manager that runs the watchdog (launchd on
a Mac, systemd elsewhere), and what a Mac does to a job (sleep, protected folders, models)."""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from pathlib import Path

from mlx_watchdog import service
from mlx_watchdog.act.managers import System
from mlx_watchdog.advice.finding import Finding
from mlx_watchdog.config import Config, ServerConfig
from mlx_watchdog.sense.files import open_regular
from mlx_watchdog.sense.progress import PLIST_MAX


def service_findings(system: System, home: Path, env: Mapping[str, str]) -> Iterator[Finding]:
    if service.default_kind() == "launchd":
        yield from _launchd(system, home)
    else:
        yield from _systemd(system, home, env)


def _launchd(system: System, home: Path) -> Iterator[Finding]:
    from mlx_watchdog.act.managers.launchd import job_info
    from mlx_watchdog.service.launchd import DAEMONS

    label, uid = service.WATCHDOG_LABEL, system.uid()
    agent = home / "Library" / "LaunchAgents" / f"{label}.plist"
    places = [(DAEMONS / f"{label}.plist", "system")]
    places += [(agent, f"gui/{uid}"), (agent, f"user/{uid}")]
    installed = [(path, domain) for path, domain in places if path.exists()]
    if not installed:
        yield Finding(
            "warning",
            "service",
            f"the watchdog is not installed as a launchd job (no {agent}, no "
            f"{DAEMONS / f'{label}.plist'})",
            "mlx-watchdog install (or sudo mlx-watchdog install --system)",
        )
        return
    for path, domain in installed:
        info = job_info(system, f"{domain}/{label}")
        if info is None:
            continue
        if info.problem:
            yield Finding("warning", "service", f"launchctl print {domain}/{label}: {info.problem}")
        if info.running:
            yield Finding("ok", "service", f"running in {domain} (PID {info.pid}) from {path}")
            if domain.startswith("user/"):
                yield Finding(
                    "warning",
                    "service",
                    f"loaded in {domain}: it does not start at boot before someone logs in",
                    "for a Mac that must serve after a reboot: sudo mlx-watchdog install --system",
                )
            return
        yield Finding(
            "problem",
            "service",
            f"loaded in {domain} but not running (launchctl print {domain}/{label})",
            "mlx-watchdog install (it reloads and starts it); its log says why it exits",
        )
        return
    where = ", ".join(str(path) for path, _ in installed)
    yield Finding(
        "problem",
        "service",
        f"{where} is installed but not loaded in any launchd domain",
        "mlx-watchdog install (it loads and starts it)",
    )


NOTIFIER_PATHS = (  # where Apprise's macosx:// looks for terminal-notifier
    "/opt/homebrew/bin/terminal-notifier",
    "/usr/local/bin/terminal-notifier",
    "/usr/bin/terminal-notifier",
    "/bin/terminal-notifier",
    "/opt/local/bin/terminal-notifier",
)
PROTECTED = ("Documents", "Desktop", "Downloads")  # macOS privacy protection (TCC) folders


def mac_findings(config: Config, home: Path, system: System, *, python: str) -> Iterator[Finding]:
    """What launchd jobs on a Mac trip over: notifications need a GUI session and
    terminal-notifier, and privacy protection can keep a job out of some folders."""
    if any(url.startswith("macosx://") for url in config.watchdog.alerts):
        if not any(os.access(p, os.X_OK) for p in NOTIFIER_PATHS):
            yield Finding(
                "problem",
                "alerts",
                "macosx:// alerts need terminal-notifier, which Apprise looks for in "
                + ", ".join(NOTIFIER_PATHS),
                "brew install terminal-notifier",
            )
        from mlx_watchdog.act.managers.launchd import domain_exists

        if not domain_exists(system, f"gui/{system.uid()}"):
            yield Finding(
                "warning",
                "alerts",
                "macosx:// alerts show only in a GUI session; nobody is logged in at the screen",
                "add an alert that leaves the machine (ntfy://, mailto://, a webhook)",
            )
    places = [("the Python the service runs", Path(python))]
    if config.source is not None:
        places.append(("the config", config.source))
    places += [(f"{s.name}'s model", Path(m)) for s in config.servers for m in _models(s)]
    for what, path in places:
        where = _protected(path, home)
        if where:
            yield Finding(
                "warning",
                "privacy",
                f"{what} is under {where} ({path}): macOS privacy protection can keep a "
                "launchd job from reading it",
                "move it out (e.g. ~/mlx or /opt), or grant the interpreter Full Disk Access",
            )


def _models(server: ServerConfig) -> list[str]:
    args = list(server.command)
    if server.plist is not None and server.plist.exists():
        doc, _ = read_job(server.plist)
        found = doc.get("ProgramArguments") if doc is not None else None
        args = [str(a) for a in found] if isinstance(found, list) else []
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a in ("--model", "--draft-model")]


def read_job(path: Path) -> tuple[dict[str, object] | None, str | None]:
    """A launchd plist read within its size cap, or why it could not be."""
    import plistlib
    from xml.parsers.expat import ExpatError

    try:
        with open_regular(path) as fh:
            data = fh.read(PLIST_MAX + 1)
        if len(data) > PLIST_MAX:
            return None, f"{path} is larger than {PLIST_MAX >> 20} MiB"
        doc = plistlib.loads(data)
    except (OSError, plistlib.InvalidFileException, ValueError, ExpatError) as exc:
        return None, f"{path}: {exc}"
    if not isinstance(doc, dict):
        return None, f"{path} is not a launchd job (not a dictionary)"
    return doc, None


def _protected(path: Path, home: Path) -> str | None:
    path = path.expanduser()
    for name in PROTECTED:
        if path.is_relative_to(home / name):
            return f"~/{name}"
    if path.is_relative_to("/Volumes"):
        return "an external volume"
    return None


def _systemd(system: System, home: Path, env: Mapping[str, str]) -> Iterator[Finding]:
    from mlx_watchdog.service.systemd import SYSTEM_UNITS, user_unit_dir

    label = service.WATCHDOG_UNIT
    for path, ctl in (
        (SYSTEM_UNITS / label, ["systemctl"]),
        (user_unit_dir(env, home) / label, ["systemctl", "--user"]),
    ):
        if not path.exists():
            continue
        code, out = system.run([*ctl, "is-active", label], timeout=10)
        if code != 0:
            yield Finding(
                "problem",
                "service",
                f"{path} is installed but not running ({' '.join(ctl)} is-active: "
                f"{out.strip()[-120:]})",
                "mlx-watchdog install (it loads and starts it)",
            )
            return
        yield Finding("ok", "service", f"installed and running (systemd: {label})")
        if len(ctl) == 2:
            user = env.get("USER") or ""
            code, out = system.run(["loginctl", "show-user", user, "-p", "Linger"], timeout=10)
            if code == 0 and out.strip() == "Linger=no":
                yield Finding(
                    "warning",
                    "service",
                    "a user unit without lingering stops when you log out and does not start "
                    "at boot",
                    f"loginctl enable-linger {user} (or sudo mlx-watchdog install --system)",
                )
        return
    yield Finding(
        "warning",
        "service",
        f"the watchdog is not installed as a systemd unit ({user_unit_dir(env, home) / label} "
        "is missing)",
        "mlx-watchdog install",
    )
