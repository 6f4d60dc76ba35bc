"""The restart ladder: identity check, drain, the manager's restart, a token to verify it.

It keeps no state and writes no history: the server's cycle (cycle/) decides when to climb,
is told just before the manager acts (so that a watchdog killed mid-restart still counts the
restart), and records how it ended.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import psutil

from mlx_watchdog.act.managers import Manager, ManagerError, Outcome, System, identity_problem
from mlx_watchdog.config import ServerConfig
from mlx_watchdog.sense.probe import DOWN_FINDINGS, OK, Probe, ProbeFinding
from mlx_watchdog.sense.process import ProcessTable
from mlx_watchdog.sense.round import Checker

log = logging.getLogger("mlx_watchdog")

RETRY_PAUSE = 0.5


@dataclass(frozen=True)
class Climb:
    """How one restart ended."""

    outcome: Outcome  # the manager's own account
    result: str  # recovered, failed, interrupted; served: it served before it was restarted
    served_at: float | None  # wall time of the first token afterwards

    def action(self, started: float, trigger: str, kind: str) -> dict[str, object]:
        """The restart as its incident's history keeps it."""
        return {
            "at": started,
            "action": f"restart ({kind})",
            "trigger": trigger,
            "outcome": self.result,
            "detail": self.outcome.detail,
            "steps": list(self.outcome.steps),
        }


@dataclass(frozen=True)
class Drain:
    """What the ladder calls to drain the server and to end the drain (the cycle's flag).
    `wait`: wait for the clients on it to finish; not for those behind work nobody waits for
    (an abandoned request on a serial server): they cannot finish before it."""

    begin: Callable[[], None]
    end: Callable[[], None]
    wait: bool = True
    # Until the balancer has taken the server out (act/rotation.py); False: it was not told.
    out: Callable[[], bool] = lambda: True


class Ladder:
    """Climbs a restart step by step (identity check, drain, the manager, a token to verify);
    owns no state and writes no history: the cycle asks and records."""

    def __init__(
        self,
        *,
        system: System | None = None,
        table: ProcessTable | None = None,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.system = system or System()
        self.table = table or ProcessTable()
        self.wall = wall
        self.mono = mono
        self.stopping = stopping

    def identity(self, server: ServerConfig, manager: Manager) -> tuple[int | None, str | None]:
        """The PID a restart would signal, and why it must not be signalled (None: it may)."""
        pid = manager.pid()
        if pid is None and manager.kind == "command" and not server.behind_proxy:
            pid = self.table.listener(server.port, server.host, server.match)
        return pid, identity_problem(server, pid, self.table)

    def climb(
        self,
        server: ServerConfig,
        manager: Manager,
        checker: Checker,
        *,
        drain: Drain | None,
        begin: Callable[[], None],
        settle: Callable[[], str] | None = None,
        unload: Callable[[], Outcome] | None = None,
    ) -> Climb:
        """Drain (when asked), `begin`, restart through the manager, wait for a token, undrain.

        With `settle`, the server is stopped, `settle` waits between the stop and the start (for
        its memory to come back), then it is started; a manager that restarts only in one step
        restarts, and the outcome says so. With `unload`, one wedged model is unloaded instead
        (the server and its other models stay); where that fails, the server is restarted."""
        if drain is not None:
            drain.begin()
            if not drain.out():
                log.warning("%s: the balancer's agent check has not taken it out", server.name)
            if self._wait_drained(server, manager, checker, wait=drain.wait):
                drain.end()  # it served again meanwhile: a restart would only cost
                return Climb(Outcome(True, "it served again during the drain"), "served", None)
        checker.abort()  # its server is about to be replaced
        begin()
        try:
            try:
                outcome = self._replace(manager, settle, unload)
            except (ManagerError, OSError) as exc:
                outcome = Outcome(False, str(exc))
            served_at = None
            if outcome.ok:
                served_at, foreign = self._await_token(server, manager, checker)
                if foreign is not None:
                    outcome = replace(outcome, steps=(*outcome.steps, foreign))
        finally:
            if drain is not None:
                drain.end()
        result = "recovered" if served_at else ("interrupted" if self.stopping() else "failed")
        return Climb(outcome, result, served_at)

    @staticmethod
    def _replace(
        manager: Manager,
        settle: Callable[[], str] | None,
        unload: Callable[[], Outcome] | None = None,
    ) -> Outcome:
        if unload is not None:
            unloaded = unload()
            if unloaded.ok:
                return unloaded
            restarted = manager.restart()
            said = f"could not unload the model ({unloaded.detail}): restarted the server"
            return replace(restarted, steps=(*unloaded.steps, said, *restarted.steps))
        if settle is None:
            return manager.restart()
        outcome = manager.stop_then_start(settle)
        if outcome is not None:
            return outcome
        outcome = manager.restart()
        said = f"{manager.kind} restarts in one step: no wait for memory between stop and start"
        return replace(outcome, steps=(*outcome.steps, said))

    def _await_token(
        self, server: ServerConfig, manager: Manager, checker: Checker
    ) -> tuple[float | None, str | None]:
        """Probe until a token comes (also warming the prompt cache) or startup_grace ends;
        the wall time of the token. A server the manager saw exit again has not started: a
        process counts as started only once it serves, and a token from another process that
        took the port meanwhile is not the restarted server's (what it was is said)."""
        deadline = self.mono() + server.probe.startup_grace
        while not self.stopping():
            left = deadline - self.mono()
            if left <= 0 or manager.exited() is not None:
                return None, None
            probing = replace(server, probe=replace(server.probe, hard_timeout=left))
            # Its connections are the watchdog's own: a probe that times out on a server
            # still starting must not count as a client that gave up.
            probe = Probe(probing, mono=self.mono, on_connect=checker.connected).start()
            while not probe.wait(0.2):
                if self.stopping():
                    probe.abort()
                    return None, None
            snap = probe.snapshot()
            if snap.finding == OK:
                foreign = self._foreign(server, manager)
                if foreign is not None:
                    return None, foreign
                token = snap.first_token_at or self.mono()
                return self.wall() - (self.mono() - token), None
            if snap.finding in DOWN_FINDINGS or snap.finding == ProbeFinding.RESET:
                self.system.sleep(RETRY_PAUSE)  # not listening yet
            else:
                self.system.sleep(RETRY_PAUSE * 2)
        return None, None

    def _foreign(self, server: ServerConfig, manager: Manager) -> str | None:
        """Why the token came from another process than the one the manager started (None
        when it is that one, or the manager names none)."""
        ours = manager.pid()
        if ours is None:
            return None
        held = self.stranger(server, ours)
        if held is None:
            return None
        return (
            f"the token came from PID {held[0]} ({held[1]}), which took the port while the "
            f"server restarted; the server the manager started is PID {ours}"
        )

    def stranger(self, server: ServerConfig, ours: int | None) -> tuple[int, str] | None:
        """The process (PID, command line) that listens on the server's address where the
        manager's server (`ours`, None: it runs none) does not: a child the server left in
        its own session, which the manager's stop does not reach, or anything else. None when
        nothing does, or it is ours or one of its descendants (a wrapper's server)."""
        if server.behind_proxy:  # the port is the proxy's
            return None
        holder = self.table.listener(server.port, server.host, server.match)
        if holder is None or holder == ours:
            return None
        try:
            proc = self.table.process(holder)
            if ours is not None and any(p.pid == ours for p in proc.parents()):
                return None
            what = " ".join(proc.cmdline())[:160]
        except psutil.NoSuchProcess:
            return None
        except psutil.Error:
            what = "?"
        return holder, what

    def _wait_drained(
        self, server: ServerConfig, manager: Manager, checker: Checker, *, wait: bool
    ) -> bool:
        """Wait (bounded) for live clients to finish before a restart; True when the server
        served the probe meanwhile (the restart is not needed)."""
        deadline = self.mono() + server.restart.drain_timeout
        while self.mono() < deadline and not self.stopping():
            probe = checker.probe
            if probe is not None and probe.snapshot().tokens > 0:
                return True
            if not wait:
                return False
            live = checker.inspector.sample(manager.pid(), exclude=checker.own.addresses()).live
            if not live:
                return False
            self.system.sleep(1.0)
        log.warning("%s drain_timeout reached with clients still connected", server.name)
        return False

    def run_hook(self, server: ServerConfig, which: str, argv: tuple[str, ...]) -> None:
        """Run drain_command or undrain_command; a failure is logged, the restart goes on."""
        if not argv:
            return
        code, out = self.system.run(argv, server.restart.command_timeout)
        if code != 0:
            log.error("%s %s exited %d: %s", server.name, which, code, out[-200:])
