"""What every restart manager is built on: the `Manager` interface, `System` (every side effect:
running launchctl, spawning, signalling, so tests can put fake service managers on PATH or
replace the whole object), the outcome of a restart and the identity check before one."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Protocol

import psutil

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.sense.process import ProcessTable
from mlx_watchdog.sense.text import BadJson, load_json

REPLACE_TIMEOUT = 15.0  # seconds a service manager has to replace the server's process


class ManagerError(Exception):
    """A manager could not do what was asked; the message says what and why."""


@dataclass(frozen=True)
class Outcome:
    """A manager's own account of a restart: done or not, why, and each step it took."""

    ok: bool
    detail: str
    steps: tuple[str, ...] = ()


INTERRUPTED = 130


class System:
    """The operating system, as the managers use it.

    `interrupt()` is for a daemon that must stop within a bound: waits return at once and a
    running command is killed (exit code INTERRUPTED), so a restart in progress ends quickly
    and is recorded as interrupted.
    """

    mono: Callable[[], float] = staticmethod(time.monotonic)

    def __init__(self, record: Path | None = None) -> None:
        self._interrupted = threading.Event()
        # The commands running now, written before each is waited on: a watchdog killed
        # meanwhile leaves them to its successor, which ends them (`settle_left`).
        self.record = record
        self._running: dict[int, dict[str, object]] = {}
        self._running_lock = threading.Lock()
        self._finishing = threading.local()

    def interrupt(self) -> None:
        self._interrupted.set()

    def resume(self) -> None:
        self._interrupted.clear()

    @property
    def interrupted(self) -> bool:
        return self._interrupted.is_set() and not getattr(self._finishing, "depth", 0)

    @contextlib.contextmanager
    def finishing(self) -> Iterator[None]:
        """The second step of a two-step restart (the start after a stop), in this thread: a
        watchdog that stops meanwhile lets it finish (each command within its own timeout)
        rather than leave the server stopped."""
        self._finishing.depth = getattr(self._finishing, "depth", 0) + 1
        try:
            yield
        finally:
            self._finishing.depth -= 1

    def sleep(self, seconds: float) -> None:
        if getattr(self._finishing, "depth", 0):
            time.sleep(seconds)
        else:
            self._interrupted.wait(seconds)

    def run(self, argv: Sequence[str], timeout: float) -> tuple[int, str]:
        """Run a command without a shell: (exit code, its output).

        Output goes to a file, not a pipe: a command that leaves a daemon behind (which keeps
        the pipe open) would otherwise hold the watchdog until the timeout.
        """
        with tempfile.TemporaryFile() as out:
            try:
                # In a session of its own: on a timeout the whole group goes, a wrapper's
                # children too (killing only the direct child left them running).
                proc = subprocess.Popen(
                    list(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            except FileNotFoundError:
                return 127, f"{argv[0]}: command not found"
            except PermissionError:
                return 126, f"{argv[0]}: permission denied"
            self._note(proc.pid, argv)
            try:
                deadline = time.monotonic() + timeout
                while (code := proc.poll()) is None:
                    left = deadline - time.monotonic()
                    if left <= 0 or self.interrupted:
                        self.kill_group(proc.pid, signal.SIGKILL)
                        proc.wait()
                        if self.interrupted:
                            return INTERRUPTED, f"{argv[0]}: killed, the watchdog is stopping"
                        return 124, f"{argv[0]}: no answer within {timeout:g}s"
                    self.sleep(min(left, 0.1))
            finally:
                self._note(proc.pid, None)
            out.seek(0)
            return code, out.read().decode(errors="replace").strip()

    def _note(self, pgid: int, argv: Sequence[str] | None) -> None:
        if self.record is None:
            return
        from mlx_watchdog.record.private import write_private

        with self._running_lock:
            if argv is None:
                self._running.pop(pgid, None)
            else:
                with contextlib.suppress(psutil.Error):
                    created = psutil.Process(pgid).create_time()
                    self._running[pgid] = {"pgid": pgid, "created": created, "argv": list(argv)}
            with contextlib.suppress(OSError):
                write_private(self.record, json.dumps(list(self._running.values())))

    def settle_left(self, grace: float = 5.0) -> list[str]:
        """End the commands a killed watchdog left running (their whole process group), and
        say which. A group is ours when its leader is the process we started (PID and start
        time), or, with the leader gone, while members of it remain: a process group's number
        is not given to a new process while the group has members."""
        if self.record is None:
            return []
        from mlx_watchdog.record.private import UnsafeState, read_private

        try:
            entries = load_json(read_private(self.record))
        except (OSError, UnsafeState, BadJson):
            return []
        said = []
        for entry in entries if isinstance(entries, list) else []:
            left = _entry(entry)
            if left is None:
                continue  # not an entry this watchdog writes: never acted on
            pgid, created, argv = left
            if not self._ours(pgid, created):
                continue
            self.kill_group(pgid, signal.SIGTERM)
            if not wait_for(lambda pgid=pgid: not _members(pgid), grace, self):  # type: ignore[misc]
                self.kill_group(pgid, signal.SIGKILL)
            said.append(f"{argv} (process group {pgid})")
        with contextlib.suppress(OSError):
            self.record.unlink()
        return said

    @staticmethod
    def _ours(pgid: int, created: float) -> bool:
        """The group is provably the one recorded: its leader is the process started then; or,
        with the leader gone, every member is this user's and started after it (a group's
        number is not given again while it has members, and none can predate its leader)."""
        try:
            leader = psutil.Process(pgid)
            return abs(leader.create_time() - created) < 0.01 and os.getpgid(pgid) == pgid
        except psutil.NoSuchProcess:
            pass
        except (psutil.Error, OSError):
            return False
        members = _members(pgid)
        try:
            return bool(members) and all(
                psutil.Process(m).uids().real == os.getuid()
                and psutil.Process(m).create_time() >= created - 0.01
                for m in members
            )
        except psutil.Error:
            return False

    def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], log: IO[bytes] | None
    ) -> subprocess.Popen[bytes]:
        """Start a process in its own process group (so it can be stopped as a whole)."""
        return subprocess.Popen(
            list(argv),
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=log or subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def kill_group(self, pgid: int, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, sig)

    def uid(self) -> int:
        return os.getuid()

    def alive(self, pid: int) -> bool:
        try:
            return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False


def _entry(entry: object) -> tuple[int, float, str] | None:
    """(process group, its leader's start time, its command) of a commands.json entry, only
    when it is one the watchdog could have written: a group of its own making, never 0, 1, a
    negative number (all processes) or the watchdog's own group."""
    if not isinstance(entry, dict):
        return None
    pgid, created, argv = entry.get("pgid"), entry.get("created"), entry.get("argv")
    if not isinstance(pgid, int) or isinstance(pgid, bool) or not 1 < pgid < 1 << 31:
        return None
    if pgid == os.getpgrp() or not isinstance(created, (int, float)) or isinstance(created, bool):
        return None
    if not 0 < created < 1e11 or not isinstance(argv, list):
        return None
    return pgid, float(created), " ".join(str(a) for a in argv)[:200]


def _members(pgid: int) -> list[int]:
    """The live processes of process group `pgid`."""
    members = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error, OSError):
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc.pid)
    return members


class Manager(Protocol):
    """How one server is restarted (and, for a server the watchdog runs, started and
    stopped): the one interface the ladder and the daemon use, whatever runs it."""

    kind: str
    server: ServerConfig  # a reload that leaves the process alone hands over the new settings

    @property
    def spawned(self) -> bool:
        """The server running now is this manager's own child: its start, timed to the first
        token, is what a restart costs here until one is measured."""

    def pid(self) -> int | None:
        """The server's PID as the manager knows it, or None."""

    def restart(self) -> Outcome:
        """Replace the server process; the caller then waits for it to serve."""

    def stop_then_start(self, between: Callable[[], str]) -> Outcome | None:
        """Replace the server in two steps with `between` run after the stop (its words are a
        step of the outcome); None when this manager can only restart in one step."""

    def exited(self) -> str | None:
        """How the server exited ("exited with code 1", "was killed by SIGKILL") when the
        manager owns its process and saw it end by itself; None otherwise."""

    def start(self) -> None:
        """The daemon starts: a manager that owns the process starts (or adopts) it."""

    def stop(self) -> None:
        """The daemon stops: a manager that owns the process stops it."""


def wait_for(check: Callable[[], bool], timeout: float, system: System, step: float = 0.2) -> bool:
    deadline = system.mono() + timeout
    while True:
        if check():
            return True
        if system.mono() >= deadline or system.interrupted:
            return False
        system.sleep(step)


def identity_problem(server: ServerConfig, pid: int | None, table: ProcessTable) -> str | None:
    """Why `pid` must not be signalled as this server, or None when it is safe.

    The PID must hold the listening socket on the server's port (when anything does; behind a
    proxy's path the port is the proxy's) and its command line must contain `match`.
    """
    if pid is None:
        return None
    try:
        proxied = server.behind_proxy
        listener = None if proxied else table.listener(server.port, server.host, server.match)
        proc = table.process(pid)
        cmdline = " ".join(proc.cmdline())
    except psutil.NoSuchProcess:
        return None  # gone already: nothing will be signalled
    except (psutil.AccessDenied, psutil.ZombieProcess, OSError) as exc:
        return f"cannot inspect PID {pid} ({type(exc).__name__}), so it is not signalled"
    if listener is not None and listener != pid:
        return (
            f"PID {pid} does not hold port {server.port} (PID {listener} does); "
            "check the manager's label or unit"
        )
    if server.match not in cmdline:
        return f'PID {pid} runs "{cmdline[:120]}", which does not contain match = "{server.match}"'
    return None


class External:
    """A server whose life belongs to someone else (launchd, systemd, the user's command):
    nothing to start or stop with the watchdog, and an exit is theirs to act on."""

    spawned = False

    def exited(self) -> str | None:
        return None

    def stop_then_start(self, between: Callable[[], str]) -> Outcome | None:
        return None

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass


class NoManager(External):
    """Observe and alert only."""

    kind = "none"

    def __init__(self, server: ServerConfig) -> None:
        self.server = server

    def pid(self) -> int | None:
        return None

    def restart(self) -> Outcome:
        return Outcome(False, 'manager = "none": the watchdog observes and alerts only')
