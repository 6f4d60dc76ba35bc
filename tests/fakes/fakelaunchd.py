"""A stand-in for `launchctl` with launchd's own semantics, as harsh as the real one.

- Domains: `gui/<uid>` exists only while that user has a GUI login (the machine's "gui" list);
  `user/<uid>` always; `system` for root alone. Acting on a domain that does not exist fails as
  launchd does: 125 "Domain does not support specified action" (113 for `print`).
- `bootout` returns at once; the job is torn down in the background: SIGTERM, ExitTimeOut
  (default 20 s), SIGKILL, then a few seconds of cleanup. Until it is gone, `print` still shows
  it, another `bootout` exits 36 ("Operation now in progress") and `bootstrap` of that label
  exits 5 ("Input/output error"). A loaded label bootstrapped again exits 5 too.
- Every loaded job runs under a small supervisor process: it starts the program at load when
  RunAtLoad is set, and respawns it ThrottleInterval (default 10 s) after it exits when
  KeepAlive is set. `kickstart -k` SIGKILLs and respawns at once; `kickstart` and `print` of a
  job that is not loaded exit 113.
- A job gets only its plist's EnvironmentVariables, runs in WorkingDirectory or `/`, appends to
  StandardOutPath/StandardErrorPath, and runs as UserName when root loaded it into `system`.
- An agent plist not owned by the caller, or writable by group or others, is refused (122);
  a system plist must be owned by root.
- `reboot` (not a launchctl verb: the tests' power switch) ends every job, forgets every
  domain's jobs, and loads the plists in the machine's LaunchDaemons folder into `system`.

State is one JSON file ($FAKE_SVC_STATE) under a lock; every call is appended to $FAKE_SVC_LOG.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import plistlib
import pwd
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STATE = Path(os.environ["FAKE_SVC_STATE"])
CLEANUP = 3.0  # launchd: "scheduling cleanup in 5 sec"; bootstrap fails with 5 meanwhile
UID = os.getuid()


@contextlib.contextmanager
def locked() -> Iterator[dict[str, Any]]:
    with open(STATE.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = json.loads(STATE.read_text()) if STATE.exists() else {}
        yield state
        tmp = STATE.with_suffix(f".{os.getpid()}")
        tmp.write_text(json.dumps(state))
        tmp.replace(STATE)  # readers without the lock (the tests) see one whole state


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] not in "ZX"
    except OSError:
        return False


def domains(state: dict[str, Any]) -> set[str]:
    found = {f"user/{UID}"}
    if UID in state.get("machine", {}).get("gui", []):
        found.add(f"gui/{UID}")
    if UID == 0:
        found.add("system")
    return found


def jobs(state: dict[str, Any], domain: str) -> dict[str, Any]:
    return state.setdefault("launchd", {}).setdefault(domain, {})


def err(message: str, code: int) -> int:
    print(message, file=sys.stderr)
    return code


# -- launchctl ------------------------------------------------------------------------------


def launchctl(args: list[str]) -> int:
    if not args:
        return err("Usage: launchctl <subcommand> ... | help [subcommand]", 64)
    cmd, rest = args[0], args[1:]
    flags = [a for a in rest if a.startswith("-")]
    rest = [a for a in rest if not a.startswith("-")]
    with locked() as state:
        if cmd == "reboot":
            return reboot(state)
        if cmd == "print":
            return print_(state, rest[0])
        if cmd == "bootstrap":
            return bootstrap(state, rest)
        if cmd == "bootout":
            return bootout(state, rest[0])
        if cmd == "kickstart":
            return kickstart(state, rest[0], "-k" in flags)
        if cmd in ("enable", "disable"):
            domain, _, label = rest[0].rpartition("/")
            if domain not in domains(state):
                return err(
                    f"Could not {cmd} service: 125: Domain does not support specified action", 125
                )
            disabled = set(state.get("disabled", {}).get(domain, []))
            (disabled.discard if cmd == "enable" else disabled.add)(label)
            state.setdefault("disabled", {})[domain] = sorted(disabled)
            return 0
    return err(f"Unrecognized subcommand: {cmd}", 64)


def is_domain(target: str) -> bool:
    kind, _, uid = target.partition("/")
    return target == "system" or (kind in ("gui", "user") and uid.isdigit())


SPAWN_TYPES = {
    "Interactive": "interactive (4)",
    "Background": "background (5)",
    "Adaptive": "adaptive (6)",
}


def print_(state: dict[str, Any], target: str) -> int:
    if is_domain(target):
        if target not in domains(state):
            return err(f"Could not print domain: 113: Could not find domain for {target}", 113)
        print(f"{target} = {{\n\ttype = {target.split('/')[0]}\n\tservices = {{\n", end="")
        for label, job in jobs(state, target).items():
            print(f"\t\t{job.get('pid') or 0}\t-\t{label}")
        print("\t}\n}")
        return 0
    domain, _, label = target.rpartition("/")
    job = jobs(state, domain).get(label) if domain in domains(state) else None
    if job is None:
        return err(f'Could not find service "{label}" in domain for {domain}', 113)
    running = alive(job.get("pid"))
    print(f"{target} = {{")
    print(f"\tactive count = {int(running)}")
    print(f"\tpath = {job['path']}")
    print(f"\ttype = {'LaunchDaemon' if domain == 'system' else 'LaunchAgent'}")
    print(
        f"\tstate = {'running' if running else ('exiting' if job.get('booting_out') else 'not running')}"
    )
    print("")
    print(f"\tprogram = {job['argv'][0]}")
    print("\targuments = {")
    for arg in job["argv"]:
        print(f"\t\t{arg}")
    print("\t}")
    print("")
    # A nested block with a pid line of its own: only the job's own `pid =` (one tab) counts.
    # launchd's word for the job's ProcessType: none (or Standard) is a daemon's (hermes-agent
    # #99563: a LaunchAgent without ProcessType printed "daemon (3)").
    spawn = SPAWN_TYPES.get(str(job.get("process_type")), "daemon (3)")
    print(f"\tspawn type = {spawn}\n\tjetsam properties = {{\n\t\tpid = 1\n\t\tpriority = 3\n\t}}")
    if running:
        print(f"\tpid = {job['pid']}")
    print(f"\truns = {job.get('runs', 0)}")
    if job.get("last_exit") is not None:
        print(f"\tlast exit code = {job['last_exit']}")
    print("\tenvironment = {")
    for k, v in job.get("env", {}).items():
        print(f"\t\t{k} => {v}")
    print("\t}\n}")
    return 0


def bootstrap(state: dict[str, Any], rest: list[str]) -> int:
    if len(rest) < 2:
        return err("Usage: launchctl bootstrap <domain-target> <service-path>", 64)
    domain, path = rest[0], Path(rest[1])
    if domain not in domains(state):
        return err("Bootstrap failed: 125: Domain does not support specified action", 125)
    try:
        info = path.stat()
        plist = plistlib.loads(path.read_bytes())
    except (OSError, plistlib.InvalidFileException, ValueError):
        return err("Bootstrap failed: 5: Input/output error", 5)
    owner = 0 if domain == "system" else UID
    if info.st_uid != owner or info.st_mode & 0o022:
        return err("Bootstrap failed: 122: Path had bad ownership/permissions", 122)
    label = str(plist.get("Label", ""))
    if label in state.get("disabled", {}).get(domain, []):
        return err("Bootstrap failed: 119: Service is disabled", 119)
    if label in jobs(state, domain):
        # Loaded, or still being torn down after a bootout: launchd answers the same.
        return err("Bootstrap failed: 5: Input/output error", 5)
    load(state, domain, path, plist)
    return 0


def load(state: dict[str, Any], domain: str, path: Path, plist: dict[str, Any]) -> None:
    label = str(plist["Label"])
    job = {
        "path": str(path),
        "argv": [str(a) for a in plist["ProgramArguments"]],
        "env": {str(k): str(v) for k, v in plist.get("EnvironmentVariables", {}).items()},
        "cwd": str(plist.get("WorkingDirectory", "/")),
        "out": plist.get("StandardOutPath"),
        "err": plist.get("StandardErrorPath"),
        "keep_alive": bool(plist.get("KeepAlive", False)),
        "process_type": plist.get("ProcessType"),
        "throttle": float(plist.get("ThrottleInterval", 10)),
        "exit_timeout": float(plist.get("ExitTimeOut", 20)),
        "user": plist.get("UserName") if domain == "system" else None,
        "run_at_load": bool(plist.get("RunAtLoad", False)),
        "pid": None,
        "runs": 0,
        "start_now": bool(plist.get("RunAtLoad", False)),
    }
    jobs(state, domain)[label] = job
    supervisor = subprocess.Popen(
        [sys.executable, __file__, "supervise", domain, label],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env=dict(os.environ),
    )
    job["supervisor"] = supervisor.pid


def bootout(state: dict[str, Any], target: str) -> int:
    domain, _, label = target.rpartition("/")
    if domain not in domains(state):
        return err("Boot-out failed: 125: Domain does not support specified action", 125)
    job = jobs(state, domain).get(label)
    if job is None:
        return err("Boot-out failed: 113: Could not find specified service", 113)
    if job.get("booting_out"):
        return err("Boot-out failed: 36: Operation now in progress", 36)
    job["booting_out"] = True  # the supervisor tears it down; this returns at once
    return 0


def kickstart(state: dict[str, Any], target: str, kill: bool) -> int:
    domain, _, label = target.rpartition("/")
    job = jobs(state, domain).get(label) if domain in domains(state) else None
    if job is None or job.get("booting_out"):
        return err(f'Could not find service "{label}" in domain for {domain}', 113)
    if kill and alive(job.get("pid")):
        os.kill(job["pid"], signal.SIGKILL)
    job["start_now"] = True
    return 0


def reboot(state: dict[str, Any]) -> int:
    for domain_jobs in state.get("launchd", {}).values():
        for job in domain_jobs.values():
            for pid in (job.get("supervisor"), job.get("pid")):
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
    state["launchd"] = {}
    state.setdefault("machine", {})["gui"] = []  # nobody is logged in after a reboot
    folder = state.get("machine", {}).get("daemons")
    if folder and UID == 0:
        for path in sorted(Path(folder).glob("*.plist")):
            plist = plistlib.loads(path.read_bytes())
            if path.stat().st_uid == 0 and not path.stat().st_mode & 0o022:
                load(state, "system", path, plist)
    return 0


# -- the supervisor of one job ----------------------------------------------------------------


def supervise(domain: str, label: str) -> None:
    proc: subprocess.Popen[bytes] | None = None
    exited_at = 0.0
    while True:
        with locked() as state:
            job = jobs(state, domain).get(label)
            if job is None or job.get("supervisor") != os.getpid():
                return
            if proc is not None and proc.poll() is not None:
                job["last_exit"] = proc.returncode
                job["pid"] = None
                proc, exited_at = None, time.monotonic()
            if job.get("booting_out"):
                break
            throttled = time.monotonic() - exited_at < job["throttle"]
            respawn = job["keep_alive"] and job["runs"] > 0 and not throttled
            if proc is None and (job.pop("start_now", False) or respawn):
                job["runs"] += 1
                try:
                    proc = spawn(job)
                    job["pid"] = proc.pid
                except OSError:  # launchd logs "Service could not be spawned" and throttles
                    job["last_exit"], exited_at = 78, time.monotonic()
        time.sleep(0.1)
    # bootout: SIGTERM, ExitTimeOut, SIGKILL, then cleanup before the label is free again.
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(job["exit_timeout"])
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    with locked() as state:
        job = jobs(state, domain).get(label)
        if job is not None:
            job["pid"] = None
    time.sleep(CLEANUP)
    with locked() as state:
        current = jobs(state, domain).get(label)
        if current is not None and current.get("supervisor") == os.getpid():
            del jobs(state, domain)[label]


def spawn(job: dict[str, Any]) -> subprocess.Popen[bytes]:
    out = open(job["out"] or os.devnull, "ab")  # noqa: SIM115 - handed to the child
    errs = open(job["err"] or job["out"] or os.devnull, "ab")  # noqa: SIM115
    argv = job["argv"]
    user = job.get("user")
    if user and UID == 0:
        entry = pwd.getpwnam(user)
        # As UserName. The tests' interpreter may live under root's home: the job keeps the one
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
    try:
        return subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=errs,
            cwd=job["cwd"],
            env=dict(job["env"]),  # the plist's variables and nothing else
        )
    finally:
        out.close()
        errs.close()


if __name__ == "__main__":
    if sys.argv[1:2] == ["supervise"]:
        supervise(sys.argv[2], sys.argv[3])
        sys.exit(0)
    with Path(os.environ["FAKE_SVC_LOG"]).open("a") as log:
        log.write(json.dumps(["launchctl", *sys.argv[1:]]) + "\n")
    sys.exit(launchctl(sys.argv[1:]))
