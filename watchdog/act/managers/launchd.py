"""launchd: `launchctl kickstart -k`, escalating to bootout + bootstrap of the job's plist.

launchd as it is: `bootout` returns before the job is torn down (launchd logs "scheduling
cleanup in 5 sec"), so a `bootstrap` right after it fails with 5 or 37 for a few seconds, and a
second `bootout` meanwhile exits 36 ("Operation now in progress"). The helpers here wait for
the job to be gone and retry the bootstrap, for the restart escalation and the installer alike.
`launchctl print` output "is not API": it is parsed defensively, and what is not understood
is said.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlx_watchdog.act.managers.base import REPLACE_TIMEOUT, External, Outcome, System, wait_for
from mlx_watchdog.config import ServerConfig

NOT_LOADED = frozenset({3, 113})  # "No such process", "Could not find service"
IN_PROGRESS = 36  # bootout: "Operation now in progress"
BOOTSTRAP_BUSY = frozenset(
    {5, 37}
)  # bootstrap while the old job is torn down: I/O error, in progress
EXIT_TIMEOUT = 20.0  # launchd's default ExitTimeOut
BOOTSTRAP_RETRY = 30.0
# The job's own lines are one tab deep; nested blocks (jetsam, endpoints) are deeper.
_PID = re.compile(r"^\tpid = (\d+)\s*$", re.MULTILINE)
_STATE = re.compile(r"^\tstate = (.+?)\s*$", re.MULTILINE)
# How launchd runs it: "daemon (3)" (no ProcessType, or Standard: light limits), "interactive
# (4)", "background (5)" (CPU, I/O and the GPU's priority held back), "adaptive (6)".
_SPAWN = re.compile(r"^\tspawn type = (\w+) \((\d+)\)\s*$", re.MULTILINE)


@dataclass(frozen=True)
class JobInfo:
    """What `launchctl print domain/label` says of a loaded job."""

    pid: int | None
    running: bool
    problem: str | None = None  # what was not understood
    spawn_type: str | None = None  # "background (5)"; None: not said


def parse_print(out: str) -> JobInfo:
    pid = _PID.search(out)
    state = _STATE.search(out)
    spawn = _SPAWN.search(out)
    spawn_type = f"{spawn.group(1)} ({spawn.group(2)})" if spawn else None
    if state is None:
        return JobInfo(None, False, "no `state =` line in launchctl print's output")
    running = state.group(1) == "running"
    if running and pid is None:
        return JobInfo(None, False, "state = running but no `pid =` line", spawn_type)
    return JobInfo(int(pid.group(1)) if pid and running else None, running, None, spawn_type)


def job_info(system: System, target: str) -> JobInfo | None:
    """The job, or None when it is not loaded (print exits 113)."""
    code, out = system.run(["launchctl", "print", target], timeout=10)
    if code != 0:
        return None
    return parse_print(out)


def domain_exists(system: System, domain: str) -> bool:
    code, _ = system.run(["launchctl", "print", domain], timeout=10)
    return code == 0


def bootout(system: System, target: str, exit_timeout: float = EXIT_TIMEOUT) -> tuple[bool, str]:
    """Unload `target` and wait until launchd has torn it down; (gone, what happened)."""
    code, out = system.run(["launchctl", "bootout", target], timeout=30)
    said = f"launchctl bootout {target}: exit {code}"
    if code not in (0, IN_PROGRESS, *NOT_LOADED):
        return False, f"{said}: {_last(out)}"
    gone = wait_for(lambda: job_info(system, target) is None, exit_timeout + 10, system, 0.25)
    if not gone:
        return False, f"{said}; still loaded after {exit_timeout + 10:g} s"
    return True, said


def bootstrap(system: System, domain: str, plist: Path) -> tuple[int, str]:
    """Load `plist` into `domain`, retrying while an old job of that label is torn down."""
    deadline = system.mono() + BOOTSTRAP_RETRY
    pause = 0.5
    while True:
        code, out = system.run(["launchctl", "bootstrap", domain, str(plist)], timeout=30)
        if code not in BOOTSTRAP_BUSY or system.mono() + pause > deadline or system.interrupted:
            said = f"launchctl bootstrap {domain} {plist}: exit {code}"
            return code, said if code == 0 else f"{said}: {_last(out)}"
        system.sleep(pause)
        pause = min(pause * 2, 5.0)


def _last(out: str) -> str:
    lines = [line for line in out.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


class LaunchdManager(External):
    """A launchd job: `kickstart -k`, escalating to bootout and bootstrap of its plist."""

    kind = "launchd"

    def __init__(self, server: ServerConfig, system: System) -> None:
        assert server.label is not None
        self.server = server
        self.system = system
        self.label = server.label
        self._domain: str | None = None
        self.plist = (
            server.plist or Path.home() / "Library" / "LaunchAgents" / f"{self.label}.plist"
        )

    @property
    def domain(self) -> str:
        """As recorded at install; for an older config, the domain that exists (a GUI login's,
        else the user's), as `install` would choose."""
        if self._domain is None:
            gui = f"gui/{self.system.uid()}"
            recorded = self.server.domain
            found = gui if domain_exists(self.system, gui) else f"user/{self.system.uid()}"
            self._domain = recorded or found
        return self._domain

    @property
    def target(self) -> str:
        return f"{self.domain}/{self.label}"

    def pid(self) -> int | None:
        info = job_info(self.system, self.target)
        return info.pid if info is not None else None

    def restart(self) -> Outcome:
        steps: list[str] = []
        before = self.pid()

        def replaced() -> bool:
            now = self.pid()
            return now is not None and now != before

        code, out = self.system.run(["launchctl", "kickstart", "-k", self.target], timeout=30)
        steps.append(f"launchctl kickstart -k {self.target}: exit {code}")
        if code == 0 and wait_for(replaced, REPLACE_TIMEOUT, self.system):
            return Outcome(True, f"kickstart replaced PID {before} with {self.pid()}", tuple(steps))

        # Throttled, unloaded or stuck: unload, wait for the teardown, load again, start it.
        why = _last(out) if code != 0 else "the process was not replaced"
        if not self.plist.exists():
            return Outcome(
                False, f"kickstart failed ({why}) and {self.plist} does not exist", tuple(steps)
            )
        gone, said = bootout(self.system, self.target)
        steps.append(said)
        if not gone:
            return Outcome(False, f"{why}; the old job would not go: {said}", tuple(steps))
        code, said = bootstrap(self.system, self.domain, self.plist)
        steps.append(said)
        if code != 0:
            return Outcome(False, f"{why}; {said}", tuple(steps))
        code, out = self.system.run(["launchctl", "kickstart", self.target], timeout=30)
        steps.append(f"launchctl kickstart {self.target}: exit {code}")
        if wait_for(replaced, REPLACE_TIMEOUT, self.system):
            return Outcome(
                True,
                f"{why}; bootout + bootstrap replaced PID {before} with {self.pid()}",
                tuple(steps),
            )
        return Outcome(
            False, f"{why}; bootout + bootstrap did not start the job either", tuple(steps)
        )

    def stop_then_start(self, between: Callable[[], str]) -> Outcome | None:
        """bootout (launchd's own stop: SIGTERM, ExitTimeOut, then SIGKILL), `between`, then
        bootstrap and kickstart; None without the plist to load again."""
        if not self.plist.exists():
            return None
        before = self.pid()
        gone, said = bootout(self.system, self.target)
        steps = [said]
        if not gone:
            return Outcome(False, f"the old job would not go: {said}", tuple(steps))
        steps.append(between())
        # Booted out by us, it is loaded again by us: a watchdog that stops meanwhile
        # finishes this rather than leave the job unloaded.
        with self.system.finishing():
            code, said = bootstrap(self.system, self.domain, self.plist)
            steps.append(said)
            if code != 0:
                return Outcome(False, said, tuple(steps))
            code, _ = self.system.run(["launchctl", "kickstart", self.target], timeout=30)
            steps.append(f"launchctl kickstart {self.target}: exit {code}")
            if wait_for(lambda: self.pid() not in (None, before), REPLACE_TIMEOUT, self.system):
                return Outcome(
                    True,
                    f"bootout + bootstrap replaced PID {before} with {self.pid()}",
                    tuple(steps),
                )
        return Outcome(False, "bootout + bootstrap did not start the job", tuple(steps))
