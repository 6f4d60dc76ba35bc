"""launchd: `launchctl kickstart -k`, escalating to bootout + bootstrap of the job's plist."""

from __future__ import annotations

import re
from pathlib import Path

from mlx_watchdog.act.managers import Outcome, System, wait_for
from mlx_watchdog.config import ServerConfig

REPLACE_TIMEOUT = 15.0
_PID = re.compile(r"^\s*pid = (\d+)\s*$", re.MULTILINE)


class LaunchdManager:
    kind = "launchd"

    def __init__(self, server: ServerConfig, system: System) -> None:
        assert server.label is not None
        self.server = server
        self.system = system
        self.label = server.label
        self.plist = (
            server.plist or Path.home() / "Library" / "LaunchAgents" / f"{self.label}.plist"
        )

    @property
    def domain(self) -> str:
        return f"gui/{self.system.uid()}"

    @property
    def target(self) -> str:
        return f"{self.domain}/{self.label}"

    def pid(self) -> int | None:
        code, out = self.system.run(["launchctl", "print", self.target], timeout=10)
        if code != 0:
            return None
        match = _PID.search(out)
        return int(match.group(1)) if match else None

    def exited(self) -> str | None:
        return None  # the service manager restarts its own job (KeepAlive, Restart=)

    def start(self) -> None:
        pass  # launchd owns the job's life

    def stop(self) -> None:
        pass

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

        # Throttled, unloaded or stuck: unload and load the job again, then start it.
        why = out.splitlines()[-1] if code != 0 and out else "the process was not replaced"
        if not self.plist.exists():
            return Outcome(
                False, f"kickstart failed ({why}) and {self.plist} does not exist", tuple(steps)
            )
        code, out = self.system.run(["launchctl", "bootout", self.target], timeout=30)
        steps.append(f"launchctl bootout {self.target}: exit {code}")  # not loaded is fine
        code, out = self.system.run(
            ["launchctl", "bootstrap", self.domain, str(self.plist)], timeout=30
        )
        steps.append(f"launchctl bootstrap {self.domain} {self.plist}: exit {code}")
        if code != 0:
            return Outcome(False, f"bootstrap failed: {out}", tuple(steps))
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
