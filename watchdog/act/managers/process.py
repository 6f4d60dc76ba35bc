"""The watchdog runs the server itself: own process group, SIGTERM, then SIGKILL, respawn.

The child's PID and start time are written to a small file, so a watchdog that was killed and
started again adopts its own earlier child (verified by PID *and* start time) instead of
spawning a second server onto a busy port, and never signals a stranger with a reused PID.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import psutil

from mlx_watchdog.act.managers.base import Outcome, System, wait_for
from mlx_watchdog.config import ServerConfig
from mlx_watchdog.sense import selfdump
from mlx_watchdog.sense.files import create_new, open_append, open_regular


class ProcessManager:
    """A server the watchdog runs itself, in its own process group, recorded so that a
    restarted watchdog adopts it rather than starting a second one."""

    kind = "process"

    def __init__(self, server: ServerConfig, system: System, record: Path) -> None:
        self.server = server
        self.system = system
        self.record = record
        self._child: subprocess.Popen[bytes] | None = None
        self._adopted: int | None = None

    def pid(self) -> int | None:
        if self._child is not None:
            return self._child.pid if self._child.poll() is None else None
        if self._adopted is not None and self.system.alive(self._adopted):
            return self._adopted
        return None

    @property
    def spawned(self) -> bool:
        """The running server is this manager's own child (spawned, not adopted)."""
        return self._child is not None and self._child.poll() is None

    def exited(self) -> str | None:
        if self._child is not None and (code := self._child.poll()) is not None:
            if code < 0:
                return f"was killed by {signal.Signals(-code).name}"
            return f"exited with code {code}"
        if self._adopted is not None and not self.system.alive(self._adopted):
            return "exited"
        return None

    def start(self) -> None:
        if self.pid() is not None:
            return
        adopted = self._adoptable()
        if adopted is not None:
            self._adopted = adopted
            return
        log = None
        if self.server.log_file is not None:
            self.server.log_file.parent.mkdir(parents=True, exist_ok=True)
            log = open_append(self.server.log_file)
        try:
            self._child = self.system.spawn(self.command(), self.server.env, log)
        finally:
            if log is not None:
                log.close()
        self._adopted = None
        self._write_record(self._child.pid)

    def command(self) -> tuple[str, ...]:
        """The server's command, run through the stack launcher where it is a Python server
        whose log the watchdog keeps (its stacks then need no root: sense/selfdump.py)."""
        argv = self.server.command
        if self.server.log_file is None:
            return tuple(argv)
        return selfdump.wrap(argv, {**os.environ, **self.server.env}) or tuple(argv)

    def stop(self) -> None:
        self._stop()

    def _stop(self) -> str:
        """SIGTERM to the group, SIGKILL after stop_grace; the step as the outcome says it."""
        pid = self.pid()
        if pid is None:
            self._reap()
            return "no process to stop"
        grace = self.server.restart.stop_grace
        self.system.kill_group(pid, signal.SIGTERM)
        said = f"stopped PID {pid}"
        if not wait_for(lambda: not self._running(pid), grace, self.system):
            self.system.kill_group(pid, signal.SIGKILL)
            wait_for(lambda: not self._running(pid), 10.0, self.system)
            said = f"killed PID {pid}: it did not stop within stop_grace ({grace:g}s)"
        self._reap()
        self.record.unlink(missing_ok=True)
        return said

    def restart(self) -> Outcome:
        return self._replace(None)

    def stop_then_start(self, between: Callable[[], str]) -> Outcome:
        return self._replace(between)

    def _replace(self, between: Callable[[], str] | None) -> Outcome:
        before = self.pid()
        steps = [self._stop()]
        if between is not None:
            steps.append(between())
        try:
            self.start()
        except OSError as exc:
            return Outcome(
                False,
                f"cannot start {self.server.command[0]}: {exc.strerror or exc}"
                + (f" ({exc.filename})" if exc.filename else ""),
                tuple(steps),
            )
        steps.append(f"started PID {self.pid()}")
        return Outcome(True, f"replaced PID {before} with {self.pid()}", tuple(steps))

    # -- helpers ----------------------------------------------------------------------------

    def _running(self, pid: int) -> bool:
        if self._child is not None and self._child.pid == pid:
            return self._child.poll() is None
        return self.system.alive(pid)

    def _reap(self) -> None:
        if self._child is not None:
            try:
                self._child.wait(5)
            except subprocess.TimeoutExpired:
                return
            self._child = None
        self._adopted = None

    def _write_record(self, pid: int) -> None:
        try:
            created = psutil.Process(pid).create_time()
            self.record.parent.mkdir(parents=True, exist_ok=True)
            with create_new(self.record, 0o600) as fh:  # never through a planted link
                fh.write(json.dumps({"pid": pid, "create_time": created}).encode())
        except (psutil.Error, OSError):
            pass  # without the record a restarted watchdog spawns anew instead of adopting

    def _adoptable(self) -> int | None:
        try:
            with open_regular(self.record, follow=False) as fh:
                data = json.loads(fh.read(4096))
            pid, created = int(data["pid"]), float(data["create_time"])
            proc = psutil.Process(pid)
            same = abs(proc.create_time() - created) < 0.01 and self.system.alive(pid)
        except (OSError, ValueError, KeyError, TypeError, OverflowError, RecursionError):
            return None  # a record cut short or written by hand: spawn anew
        except psutil.Error:
            return None
        return pid if same else None
