"""Fake `launchctl` and `systemctl --user` that keep a small job table and run real processes.

Installed under both names in a folder put first on PATH. The job table is a JSON file
($FAKE_SVC_STATE); every call's argv is appended to $FAKE_SVC_LOG. The jobs are real processes:
kickstart -k and restart kill the job's process and start a new one, print/show report the
state and PID, bootout/bootstrap unload and load (with the plist's EnvironmentVariables), enable
and disable are remembered per label (a disabled label cannot be bootstrapped). A launchd job
marked "throttled" accepts a kickstart and does nothing, as launchd does while it throttles a
job that respawned too fast. systemctl --user daemon-reload reads the user's unit files
(ExecStart, Environment); enable/disable [--now] need a loaded unit.
"""

from __future__ import annotations

import fcntl
import json
import os
import plistlib
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

STATE = Path(os.environ["FAKE_SVC_STATE"])
LOG = Path(os.environ["FAKE_SVC_LOG"])


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] not in "ZX"
    except OSError:
        return False


def spawn(job: dict[str, Any]) -> None:
    out = open(job.get("log", os.devnull), "ab")  # noqa: SIM115 - handed to the child
    proc = subprocess.Popen(
        job["argv"],
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=out,
        start_new_session=True,
        env={**os.environ, **job.get("env", {})},
    )
    job["pid"] = proc.pid


def kill(job: dict[str, Any]) -> None:
    pid = job.get("pid")
    if alive(pid):
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    job["pid"] = None


def launchctl(args: list[str], state: dict[str, Any]) -> int:
    jobs = state.setdefault("launchd", {})
    uid = os.getuid()
    if not args:
        print("Usage: launchctl <subcommand> ...", file=sys.stderr)
        return 64
    cmd, rest = args[0], args[1:]
    flags = [a for a in rest if a.startswith("-")]
    rest = [a for a in rest if not a.startswith("-")]

    def job_of(target: str) -> dict[str, Any] | None:
        domain, _, label = target.rpartition("/")
        if domain != f"gui/{uid}":
            return None
        job = jobs.get(label)
        return job if job and job.get("loaded") else None

    def missing(target: str) -> int:
        print(
            f'Could not find service "{target.rpartition("/")[2]}" in domain for user gui: {uid}',
            file=sys.stderr,
        )
        return 113

    if cmd == "print":
        job = job_of(rest[0])
        if job is None:
            return missing(rest[0])
        running = alive(job.get("pid"))
        print(
            f"{rest[0]} = {{\n\tactive count = {int(running)}\n\tpath = {job.get('plist')}\n"
            f"\tstate = {'running' if running else 'not running'}\n"
            f"\tprogram = {job['argv'][0]}"
        )
        if running:
            print(f"\tpid = {job['pid']}")
        print("}")
        return 0
    if cmd == "kickstart":
        job = job_of(rest[0])
        if job is None:
            return missing(rest[0])
        if job.get("throttled"):
            return 0
        if "-k" in flags:
            kill(job)
        if not alive(job.get("pid")):
            spawn(job)
        return 0
    if cmd == "bootout":
        job = job_of(rest[0])
        if job is None:
            print("Boot-out failed: 3: No such process", file=sys.stderr)
            return 3
        kill(job)
        job["loaded"] = False
        return 0
    if cmd == "bootstrap":
        if len(rest) < 2:
            print("Usage: launchctl bootstrap <domain-target> <service-path>", file=sys.stderr)
            return 64
        if rest[0] != f"gui/{uid}":
            print(
                "Bootstrap failed: 125: Domain does not support specified action", file=sys.stderr
            )
            return 125
        try:
            plist = plistlib.loads(Path(rest[1]).read_bytes())
        except (OSError, plistlib.InvalidFileException):
            print(f"Bootstrap failed: 5: Input/output error ({rest[1]})", file=sys.stderr)
            return 5
        label = plist["Label"]
        if label in state.get("launchd_disabled", []):
            print("Bootstrap failed: 119: Service is disabled", file=sys.stderr)
            return 119
        job = jobs.get(label, {})
        if job.get("loaded"):
            print("Bootstrap failed: 5: Input/output error", file=sys.stderr)
            return 5
        job.update(
            argv=plist["ProgramArguments"],
            loaded=True,
            throttled=False,
            plist=rest[1],
            log=plist.get("StandardOutPath", os.devnull),
            env=plist.get("EnvironmentVariables", {}),
        )
        jobs[label] = job
        if plist.get("RunAtLoad"):
            spawn(job)
        return 0
    if cmd in ("enable", "disable"):
        # Remembered per label, loaded or not, as launchd keeps its overrides database.
        domain, _, label = rest[0].rpartition("/")
        if domain != f"gui/{uid}":
            print(f"Could not {cmd} service: domain {domain} is not known", file=sys.stderr)
            return 113
        disabled = set(state.get("launchd_disabled", []))
        (disabled.discard if cmd == "enable" else disabled.add)(label)
        state["launchd_disabled"] = sorted(disabled)
        return 0
    print(f"Unrecognized subcommand: {cmd}", file=sys.stderr)
    return 64


def systemctl(args: list[str], state: dict[str, Any]) -> int:
    units = state.setdefault("systemd", {})
    if "--user" not in args:
        print("this fake only knows systemctl --user", file=sys.stderr)
        return 1
    args = [a for a in args if a != "--user"]
    cmd, rest = args[0], args[1:]
    if cmd == "show":
        unit = rest[-1]
        job = units.get(unit, {})
        print(job["pid"] if alive(job.get("pid")) else 0)
        return 0
    if cmd == "is-active":
        job = units.get(rest[0], {})
        print("active" if alive(job.get("pid")) else "inactive")
        return 0 if alive(job.get("pid")) else 3
    if cmd == "daemon-reload":
        reload_unit_files(units)
        return 0
    now = "--now" in rest
    unit = [a for a in rest if not a.startswith("-")][-1] if rest else ""
    if unit not in units:
        if cmd in ("enable", "disable"):
            print(f"Failed to {cmd} unit: Unit file {unit} does not exist.", file=sys.stderr)
            return 1
        print(f"Failed to {cmd} {unit}: Unit {unit} not found.", file=sys.stderr)
        return 5
    job = units[unit]
    if cmd in ("enable", "disable"):
        job["enabled"] = cmd == "enable"
        if not now:
            return 0
        cmd = "start" if cmd == "enable" else "stop"
    if cmd in ("restart", "stop"):
        kill(job)
    if cmd in ("restart", "start") and not alive(job.get("pid")):
        spawn(job)
    return 0


def reload_unit_files(units: dict[str, Any]) -> None:
    """Load the user's unit files as systemd does on daemon-reload; forget removed ones."""
    home = Path(os.environ.get("HOME", "/"))
    folder = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config") / "systemd" / "user"
    seen = set()
    for path in sorted(folder.glob("*.service")) if folder.is_dir() else []:
        settings: dict[str, list[str]] = {}
        for line in path.read_text().splitlines():
            key, sep, value = line.partition("=")
            if sep and not line.startswith("#"):
                settings.setdefault(key.strip(), []).append(
                    value.replace("%%", "%").replace("$$", "$")
                )
        if "ExecStart" not in settings:
            continue
        seen.add(path.name)
        env = dict(v.split("=", 1) for e in settings.get("Environment", []) for v in shlex.split(e))
        job = units.setdefault(path.name, {})
        job.update(argv=shlex.split(settings["ExecStart"][0]), env=env, file=str(path))
    for name in [n for n, job in units.items() if job.get("file") and n not in seen]:
        if not alive(units[name].get("pid")):
            del units[name]


def main(name: str) -> int:
    with LOG.open("a") as log:
        log.write(json.dumps([name, *sys.argv[1:]]) + "\n")
    with open(STATE.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = json.loads(STATE.read_text()) if STATE.exists() else {}
        code = (launchctl if name == "launchctl" else systemctl)(sys.argv[1:], state)
        STATE.write_text(json.dumps(state))
    return code


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[0]).name))
