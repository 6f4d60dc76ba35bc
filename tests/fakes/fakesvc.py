"""Fake `systemctl --user` that keeps a small job table and runs real processes (the fake
`launchctl` is fakelaunchd.py).

The job table is a JSON file ($FAKE_SVC_STATE); every call's argv is appended to
$FAKE_SVC_LOG. restart kills the unit's process and starts a new one, show reports the PID,
daemon-reload reads the user's unit files (ExecStart, Environment); enable/disable [--now] need
a loaded unit.
"""

from __future__ import annotations

import fcntl
import json
import os
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
        code = systemctl(sys.argv[1:], state)
        tmp = STATE.with_suffix(f".{os.getpid()}")
        tmp.write_text(json.dumps(state))
        tmp.replace(STATE)
    return code


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[0]).name))
