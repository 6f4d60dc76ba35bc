"""A stand-in for `systemctl` with systemd's own semantics, as harsh as the real one.

- `systemctl --user` talks to the user's service manager, which runs only while the user has a
  session or lingering (the machine's "user_managers" list); otherwise it fails as systemd
  does: "Failed to connect to bus: No medium found", exit 1. `systemctl` (the system instance)
  changes nothing for anyone but root: "Access denied", exit 4.
- daemon-reload reads the unit files (the user's folder, or /etc/systemd/system's stand-in in
  the machine's "system_units"); units are loaded from them and forgotten when they are gone.
- A started unit runs under a small supervisor process: `Restart=on-failure` respawns it
  `RestartSec` after a failure, until `StartLimitBurst` starts within `StartLimitIntervalSec`
  (then the unit is "failed"). stop and restart are synchronous, as systemctl waits for its job:
  SIGTERM, `TimeoutStopSec` (default 90 s), SIGKILL.
- `Type=notify`: the unit gets `$NOTIFY_SOCKET` (and `$WATCHDOG_USEC` with `WatchdogSec=`);
  messages are taken only from the main PID (`NotifyAccess=main`, checked by the sender's
  credentials as systemd does). A start waits for `READY=1` (up to `TimeoutStartSec`, then
  the unit fails); a main process that exits before it is a failed start. With `WatchdogSec=`,
  no `WATCHDOG=1` for that long sends SIGABRT, then SIGKILL after `TimeoutAbortSec` (default
  `TimeoutStopSec`), and counts as a failure for `Restart=on-failure`.
- A unit gets only its `Environment=` lines, runs in `WorkingDirectory` (default: the user's
  home for the user manager, `/` for the system one) and as `User=` when the system runs it.
- Its stdout and stderr go to the journal, a line an entry (a line over journald's LineMax,
  48K, is split), read back with `journalctl` (see `journalctl` below: `--user`, `-u`,
  `-o cat`, `-n`, `--after-cursor`, `--show-cursor`, `--since @EPOCH`, `-q`, `--no-pager`;
  an unknown option or a cursor it did not write fails as journalctl does).

State is one JSON file ($FAKE_SVC_STATE) under a lock; every call is appended to $FAKE_SVC_LOG.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

# One state file and its lock for both stand-ins; this runs as a script beside fakelaunchd.
from fakelaunchd import UID, alive, err, locked


def units_of(state: dict[str, Any], scope: str) -> dict[str, Any]:
    return state.setdefault("systemd", {}).setdefault(scope, {})


def systemctl(args: list[str]) -> int:
    scope = "user" if "--user" in args else "system"
    args = [a for a in args if a != "--user"]
    cmd, rest = args[0], args[1:]
    now = "--now" in rest
    names = [a for a in rest if not a.startswith("-")]
    with locked() as state:
        machine = state.get("machine", {})
        if scope == "user" and UID not in machine.get("user_managers", [UID]):
            return err("Failed to connect to bus: No medium found", 1)
        units = units_of(state, scope)
        if cmd == "show":
            job = units.get(names[-1], {})
            print(job["pid"] if alive(job.get("pid")) else 0)
            return 0
        if cmd == "is-active":
            job = units.get(names[0], {})
            active = alive(job.get("pid"))
            print("active" if active else ("failed" if job.get("failed") else "inactive"))
            return 0 if active else 3
        if scope == "system" and UID != 0:
            return err(f"Failed to {cmd} {' '.join(names)}: Access denied", 4)
        if cmd == "daemon-reload":
            reload_unit_files(units, unit_folder(state, scope))
            return 0
        unit = names[-1] if names else ""
        if unit not in units:
            if cmd in ("enable", "disable"):
                return err(f"Failed to {cmd} unit: Unit file {unit} does not exist.", 1)
            return err(f"Failed to {cmd} {unit}: Unit {unit} not found.", 5)
        job = units[unit]
        if cmd in ("enable", "disable"):
            job["enabled"] = cmd == "enable"
            if not now:
                return 0
            cmd = "start" if cmd == "enable" else "stop"
        if cmd in ("restart", "stop"):
            stop(job)
        if cmd in ("restart", "start"):
            job.update(failed=False, starts=[], wanted=True)
            if not alive(job.get("supervisor")):
                job["supervisor"] = subprocess.Popen(
                    [sys.executable, __file__, "supervise", scope, unit],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.DEVNULL,
                    start_new_session=True,
                    env=dict(os.environ),
                ).pid
    if cmd in ("restart", "start"):
        # systemctl waits for the start job: the process exists (Type=notify: it said
        # READY=1) when it returns.
        deadline = time.monotonic() + (job["timeout_start"] + 5 if job["type"] == "notify" else 10)
        while time.monotonic() < deadline:
            with locked() as state:
                job = units_of(state, scope).get(unit, {})
                if job.get("type") != "notify" and job.get("starts"):
                    break  # Type=simple: the job is done once the process was spawned, even
                    # if it exited at once (systemd >= 240 waits for the exec, no longer)
                if job.get("failed"):
                    return err(f"Job for {unit} failed.", 1)
                if alive(job.get("pid")) and (job.get("type") != "notify" or job.get("ready")):
                    break
            time.sleep(0.05)
    return 0


def stop(job: dict[str, Any]) -> None:
    """systemctl waits for the stop: SIGTERM, TimeoutStopSec, SIGKILL."""
    job["wanted"] = False
    for key in ("supervisor", "pid"):
        pid = job.get(key)
        if not alive(pid):
            continue
        os.kill(pid, signal.SIGTERM if key == "pid" else signal.SIGKILL)
        deadline = time.monotonic() + (job.get("timeout_stop", 90.0) if key == "pid" else 5)
        while alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    job["pid"] = job["supervisor"] = None


def unit_folder(state: dict[str, Any], scope: str) -> Path:
    if scope == "system":
        return Path(state.get("machine", {}).get("system_units", "/nonexistent"))
    home = Path(os.environ.get("HOME", "/"))
    return Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config") / "systemd" / "user"


def reload_unit_files(units: dict[str, Any], folder: Path) -> None:
    """Load the unit files as systemd does on daemon-reload; forget removed ones."""
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

        def one(key: str, default: str, settings: dict[str, list[str]] = settings) -> str:
            return settings.get(key, [default])[-1]

        job = units.setdefault(path.name, {})
        job.update(
            argv=shlex.split(settings["ExecStart"][0]),
            env=env,
            file=str(path),
            user=one("User", ""),
            cwd=one("WorkingDirectory", ""),
            restart=one("Restart", "no"),
            restart_sec=float(one("RestartSec", "0.1")),
            burst=int(one("StartLimitBurst", "5")),
            interval=float(one("StartLimitIntervalSec", "10")),
            timeout_stop=float(one("TimeoutStopSec", "90")),
            type=one("Type", "simple"),
            notify_access=one("NotifyAccess", "main" if one("Type", "") == "notify" else "none"),
            watchdog_sec=float(one("WatchdogSec", "0")),
            timeout_start=float(one("TimeoutStartSec", "90")),
            timeout_abort=float(one("TimeoutAbortSec", one("TimeoutStopSec", "90"))),
        )
    for name in [n for n, job in units.items() if job.get("file") and n not in seen]:
        if not alive(units[name].get("pid")):
            del units[name]


def supervise(scope: str, unit: str) -> None:
    folder = tempfile.mkdtemp(prefix="fake-notify-")
    try:
        supervise_in(scope, unit, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def supervise_in(scope: str, unit: str, folder: str) -> None:
    proc: subprocess.Popen[bytes] | None = None
    next_start = 0.0
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(os.path.join(folder, "notify"))
    os.chmod(folder, 0o755)
    os.chmod(notify.getsockname(), 0o777)  # a User= unit writes to it, as to systemd's own
    notify.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    notify.setblocking(False)
    pinged = began = 0.0
    aborted: float | None = None
    while True:
        messages = receive(notify)
        with locked() as state:
            job = units_of(state, scope).get(unit)
            if job is None or job.get("supervisor") != os.getpid() or not job.get("wanted"):
                return
            now = time.monotonic()
            if proc is not None and job["type"] == "notify":
                for pid, lines in messages:
                    if job["notify_access"] == "none" or (
                        job["notify_access"] == "main" and pid != proc.pid
                    ):
                        job["notify_refused"] = job.get("notify_refused", 0) + 1
                        continue
                    job["ready"] = job.get("ready") or "READY=1" in lines
                    if "WATCHDOG=1" in lines:
                        pinged = now
                    job["status"] = next(
                        (line[7:] for line in lines if line.startswith("STATUS=")),
                        job.get("status"),
                    )
                if proc.poll() is None:
                    late = (
                        job["watchdog_sec"] > 0 and now - max(pinged, began) > job["watchdog_sec"]
                    )
                    if not job.get("ready") and now - began > job["timeout_start"]:
                        proc.send_signal(signal.SIGTERM)  # "start operation timed out"
                    elif late and aborted is None:
                        job["watchdog_timeouts"] = job.get("watchdog_timeouts", 0) + 1
                        proc.send_signal(signal.SIGABRT)  # "Watchdog timeout"
                        aborted = now
                    elif aborted is not None and now - aborted > job["timeout_abort"]:
                        proc.kill()
            if proc is not None and proc.poll() is not None:
                failed = proc.returncode != 0 or (job["type"] == "notify" and not job.get("ready"))
                job["pid"], proc, aborted = None, None, None
                job["ready"] = False
                if not (failed and job["restart"] in ("on-failure", "always")):
                    job["failed"] = failed
                    return
                next_start = time.monotonic() + job["restart_sec"]
            if proc is None and time.monotonic() >= next_start:
                now = time.time()
                job["starts"] = [t for t in job.get("starts", []) if t > now - job["interval"]]
                if len(job["starts"]) >= job["burst"]:
                    job["failed"] = True  # "Start request repeated too quickly."
                    return
                job["starts"].append(now)
                extra = {}
                if job["type"] == "notify":
                    extra["NOTIFY_SOCKET"] = notify.getsockname()
                    if job["watchdog_sec"] > 0:
                        extra["WATCHDOG_USEC"] = str(int(job["watchdog_sec"] * 1e6))
                proc = spawn(job, scope, extra)
                if proc is not None:
                    threading.Thread(
                        target=to_journal, args=(proc.stdout, scope, unit), daemon=True
                    ).start()
                job["pid"] = proc.pid if proc else None
                job["ready"] = False
                pinged = began = time.monotonic()
                if proc is None:
                    next_start = time.monotonic() + job["restart_sec"]
        time.sleep(0.05)


def receive(sock: socket.socket) -> list[tuple[int, list[str]]]:
    """What arrived on the notify socket: (the sender's PID, its lines)."""
    got = []
    creds = struct.calcsize("3i")
    while True:
        try:
            data, ancillary, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(creds))
        except BlockingIOError:
            return got
        pid = 0
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = struct.unpack("3i", payload[:creds])[0]
        got.append((pid, data.decode(errors="replace").splitlines()))


def spawn(job: dict[str, Any], scope: str, extra: dict[str, str]) -> subprocess.Popen[bytes] | None:
    argv = job["argv"]
    home = os.environ.get("HOME", "/")
    if scope == "system" and job.get("user") and UID == 0:
        entry = pwd.getpwnam(job["user"])
        home = entry.pw_dir
        # As User=. The tests' interpreter may live under root's home: the unit keeps the one
        # capability to read and search anywhere (see tests/conftest.py User.run).
        argv = [
            "setpriv",
            f"--reuid={entry.pw_uid}",
            f"--regid={entry.pw_gid}",
            "--clear-groups",
            "--inh-caps=+dac_read_search",
            "--ambient-caps=+dac_read_search",
            *argv,
        ]
    cwd = job.get("cwd") or (home if scope == "user" else "/")
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            cwd=cwd,
            env={**job["env"], **extra},  # the unit's Environment= lines and systemd's own
        )
    except OSError:
        return None


LINE_MAX = 48 * 1024  # journald's LineMax: a longer line is split into entries
CURSOR = re.compile(r"^s=fakejournal;i=([0-9a-f]{1,16})$")


def journal_path() -> Path:
    return Path(os.environ["FAKE_SVC_STATE"] + ".journal")


def to_journal(stream: Any, scope: str, unit: str) -> None:
    """Each line the unit writes, an entry of the journal, as journald takes a stream."""
    last = 0
    with journal_path().open("ab") as journal:
        for line in iter(stream.readline, b""):
            line = line.rstrip(b"\n")
            for i in range(0, max(len(line), 1), LINE_MAX):
                last = max(last + 1, time.time_ns())
                entry = {"scope": scope, "unit": unit, "seq": last}
                entry["message"] = line[i : i + LINE_MAX].decode("utf-8", "replace")
                journal.write(json.dumps(entry).encode() + b"\n")
                journal.flush()


def journalctl(args: list[str]) -> int:
    """journalctl's reading of a unit's journal, as systemd 252's does it."""
    scope, unit, lines, after, show = "system", None, None, None, False
    not_before = 0  # --since, in the entries' ns (their seq is the time they were written)
    it = iter(args)
    for a in it:
        if a == "--user":
            scope = "user"
        elif a in ("-u", "--unit"):
            unit = next(it, None)
        elif a in ("-n", "--lines"):
            lines = int(next(it, "10"))
        elif a == "--after-cursor":
            after = next(it, "")
        elif a == "--show-cursor":
            show = True
        elif a in ("-S", "--since"):
            value = next(it, "")
            if not re.fullmatch(r"@\d+(\.\d+)?", value):
                return err(f"Failed to parse timestamp: {value}", 1)  # this stand-in: @EPOCH
            not_before = int(float(value[1:]) * 1e9)
        elif a in ("-o", "--output"):
            if next(it, None) != "cat":
                return err("this stand-in writes -o cat only", 1)
        elif a in ("-q", "--quiet", "--no-pager"):
            pass
        else:
            return err(f"journalctl: unrecognized option '{a}'", 1)
    since = 0
    if after is not None:
        m = CURSOR.match(after)
        if m is None:
            return err("Failed to seek to cursor: Invalid argument", 1)
        since = int(m.group(1), 16)
    entries = []
    with contextlib.suppress(FileNotFoundError), journal_path().open("rb") as journal:
        for raw in journal:
            with contextlib.suppress(ValueError):
                e = json.loads(raw)
                if e["scope"] == scope and e["unit"] == unit and e["seq"] > since:
                    if e["seq"] < not_before:
                        continue
                    entries.append(e)
    if lines is not None:  # after a cursor the first N from it; else the last N
        entries = entries[:lines] if after is not None else entries[-lines:] if lines else []
    out = sys.stdout.buffer
    for e in entries:
        out.write(e["message"].encode() + b"\n")
    if show and entries:
        out.write(f"-- cursor: s=fakejournal;i={entries[-1]['seq']:x}\n".encode())
    out.flush()
    return 0


def main() -> int:
    if sys.argv[1:2] == ["supervise"]:
        supervise(sys.argv[2], sys.argv[3])
        return 0
    tool, args = (
        ("journalctl", sys.argv[2:])
        if sys.argv[1:2] == ["journalctl"]
        else ("systemctl", sys.argv[1:])
    )
    with Path(os.environ["FAKE_SVC_LOG"]).open("a") as log:
        log.write(json.dumps([tool, *args]) + "\n")
    return journalctl(args) if tool == "journalctl" else systemctl(args)


if __name__ == "__main__":
    sys.exit(main())
