"""One sensing round of one server: a probe, the /v1/models check, and the process watched
meanwhile, gathered into an `Observation` (no judging: act/check.py and the cycle judge it).
`probe`, the daemon, `drill` and `calibrate`'s refusal all look through `Checker`, so what one
honours (the watchdog's own leftover probes) all do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.sense.findings import (
    Address,
    LoadReport,
    OwnFault,
    ProbeSnapshot,
    ProcessSample,
    WorkSign,
)
from mlx_watchdog.sense.gpu_events import GpuEvents, gpu_events
from mlx_watchdog.sense.load import LoadReader
from mlx_watchdog.sense.memory import MemoryWatch
from mlx_watchdog.sense.models import check_models, models_in_memory
from mlx_watchdog.sense.observation import Observation, leaked_requests
from mlx_watchdog.sense.own_connections import ANSWERED_GRACE, OwnConnections
from mlx_watchdog.sense.probe import ModelsCheck, Probe, ProbeFinding
from mlx_watchdog.sense.process import Inspector, ProcessTable
from mlx_watchdog.sense.progress import LogProgress, progress_reader, progress_unread
from mlx_watchdog.sense.sched import Clamp, MachineLoad, clamp
from mlx_watchdog.sense.signs import OtherModel, Signs
from mlx_watchdog.sense.stack import Stacker
from mlx_watchdog.sense.unified_log import UnifiedLog
from mlx_watchdog.sense.work import WorkMeter

UNANSWERED = (None, ProbeFinding.NO_RESPONSE, ProbeFinding.TRICKLE, ProbeFinding.ABORTED)
# While the probe is answered at once, the rest of a look (the process and its sockets, the
# models list, the health route) is taken at most this often: it was most of a probe's CPU
# (bench/run.py's footprint, 100 ms: 10.3 -> 4 ms; 100 servers at 1 s: 6.9 -> 3.9 ms, under
# half a core), and a server that serves has nothing in them to judge. Status shows them as
# old as this; a probe not answered at once looks at everything again.
FULL_LOOK_EVERY = 5.0
WORK_KEPT = 30  # readings of the work sign over one wait kept


class Leftovers(Protocol):
    """Where the watchdog's own connections that may outlive their process are kept
    (record/left_probes.py): excluded from the clients a look counts."""

    def load(self) -> list[Address]: ...
    def add(self, address: Address, keep_for: float) -> None: ...
    def shorten(self, address: Address, keep_for: float) -> None: ...


class Unkept:
    """No record: a round whose probes end with it."""

    def load(self) -> list[Address]:
        return []

    def add(self, address: Address, keep_for: float) -> None:
        pass

    def shorten(self, address: Address, keep_for: float) -> None:
        pass


class Checker:
    """Checks one server, round after round; one probe in flight at most.

    `mono` measures spans (a monotonic clock); the left-probe file keeps wall time.
    """

    def __init__(
        self,
        server: ServerConfig,
        *,
        left: Leftovers | None = None,
        table: ProcessTable | None = None,
        inspector: Inspector | None = None,
        mono: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        short_lived: bool = False,
        announce_probe: bool = False,
        stacker: Stacker | None = None,
        memory: MemoryWatch | None = None,
        gpu_reports: GpuEvents = gpu_events,
        clamp_of: Clamp = clamp,
        work: WorkMeter | None = None,
        unified: UnifiedLog | None = None,
    ) -> None:
        self.server = server
        self.left = left or Unkept()
        self.mono = mono
        self.short_lived = short_lived  # announce each connection: the process may exit first
        # The daemon announces its probe's connection only: if it dies (kill -9), the next one
        # must not take the probe it left on the server for a client that gave up.
        self.announce_probe = announce_probe
        self.inspector = inspector or Inspector(server, table=table, mono=mono, wall=wall)
        self.own = OwnConnections(server.probe.hard_timeout, mono)
        self.load = LoadReader(server, mono=mono, own=self.own)
        self.progress: LogProgress = progress_reader(server, wall=wall)
        self.unread = progress_unread(server)  # once: finding a launchd job's log reads a file
        self.probe: Probe | None = None
        self.served_process: tuple[int, float | None] | None = None  # the last to give a token
        self.seen_process: tuple[int, float | None] | None = None  # the last look's server
        self.live_seen: float | None = None  # live clients last seen during this probe's wait
        self.models: ModelsCheck | None = None
        self.leak_since: float | None = None  # a single look may race a client's coming
        # Signs of a cause, gathered while a wedge is suspected and forgotten when it serves.
        self.stacker = stacker or Stacker()
        self.memory = memory or MemoryWatch()
        self.gpu_reports = gpu_reports
        self.clamp_of = clamp_of
        self.clamped: tuple[int, str | None] | None = None  # the last PID read, and its clamp
        self.machine_load = MachineLoad()
        # Another model the server holds, probed once a wait: its own probe, never closed early
        # (closing it would leave one more abandoned request), forgotten once the server serves.
        self.side: Probe | None = None
        self.side_tried = False
        self.work = work or WorkMeter(server, mono=mono)
        self.unified = unified or UnifiedLog(mono=mono)
        self.work_over_wait: list[float] = []
        self.loading_since: float | None = None  # the first of an unbroken run of "loading"
        self.looked: tuple[float, ProcessSample, LoadReport | None] | None = None  # full look
        self.models_at: float | None = None
        self.announced: tuple[str, int] | None = None  # the probe's address, not yet on record
        self.answered_last = False  # the last look's probe was answered (a token)

    def look_at_load(self) -> LoadReport | None:
        """The server's own report, read before deciding to probe. The observation reads it
        again once the probe is sent: what it counts then includes the probe."""
        return self.load.read()

    def start(self) -> Probe:
        """Send the probe and check /v1/models; a round in flight is kept, never doubled."""
        if self.probe is None:
            self.live_seen = None
            self.probe = Probe(
                self.server, mono=self.mono, on_connect=self._probe_connected
            ).start()
            used: list[tuple[str, int]] = []

            def note(address: tuple[str, int]) -> None:
                used.append(address)
                self.connected(address)

            if self._due(self.models_at):
                self.models_at = self.mono()
                self.models = check_models(self.server, mono=self.mono, on_connect=note)
                if self.models.status is not None:  # answered: the server closes its end
                    for address in used:
                        self.own.answered(address)
        return self.probe

    def reconfigure(self, server: ServerConfig) -> None:
        """New settings for the same server, from a reload: the probe in flight is kept (closing
        it would be one more abandoned request), unless the server is now somewhere else."""
        moved = (server.url, server.match) != (self.server.url, self.server.match)
        if moved:
            self.abort()
            old = self.inspector
            self.inspector = Inspector(server, table=old.table, mono=self.mono, wall=old.wall)
            self.leak_since = self.loading_since = None
        if moved or server.compute != self.server.compute:
            self.work = WorkMeter(server, mono=self.mono)
        self.server = server
        self.inspector.server = server
        self.load.server = server
        self.own.keep = server.probe.hard_timeout
        fresh = progress_reader(server, wall=self.progress.wall)
        if fresh.where != self.progress.where:
            self.progress = fresh
        self.unread = progress_unread(server)
        if moved:
            self.load.forget()

    def _due(self, last: float | None) -> bool:
        """A full look is due: none yet, FULL_LOOK_EVERY since the last, or the last verdict's
        probe was not answered at once."""
        return last is None or self.mono() - last >= FULL_LOOK_EVERY or not self.answered_last

    def _probe_connected(self, address: tuple[str, int]) -> None:
        self.connected(address)
        if not self.announce_probe or self.short_lived:
            return
        if self.answered_last:
            # The last was answered at once: on record only if this one waits (at the next
            # look): a server that answers leaves no request behind a killed daemon.
            self.announced = address
        else:  # a server that may hold it: on record before anything else can happen
            self.left.add(address, keep_for=self.server.probe.hard_timeout)

    def connected(self, address: tuple[str, int]) -> None:
        """One of this watchdog's connections to the server: never a client."""
        self.own.connected(address)
        if self.short_lived:
            self.left.add(address, keep_for=self.server.probe.hard_timeout)

    def observe(self, pid: int | None, *, fresh_since: float | None = None) -> Observation:
        """What the probe, /v1/models and the process show now. A finished probe ends the round.

        `fresh_since`: judge the probe as if sent then (after a sleep or a clock jump).
        """
        probe = self.start()
        snap = probe.snapshot()
        if snap.finding == ProbeFinding.KEY_UNREADABLE:
            self.probe = None
            raise OwnFault(f"{self.server.name}: {snap.detail} ({self.server.api_key_file})")
        if snap.finding == ProbeFinding.PROBE_FAILED:
            self.probe = None  # a fresh probe next tick
            raise OwnFault(f"{self.server.name}: {snap.detail}")
        self._account(probe, snap)
        process, load = self._look(pid, snap)
        if process.live:
            self.live_seen = self.mono()
        fans_out = self.server.profile.fans_out
        if leaked_requests(load, process, fans_out=fans_out) > 0:
            self.leak_since = self.mono() if self.leak_since is None else self.leak_since
        else:
            self.leak_since = None
        if snap.finding == ProbeFinding.LOADING:
            self.loading_since = (
                snap.started_at if self.loading_since is None else self.loading_since
            )
        elif snap.done:
            self.loading_since = None
        if snap.done:
            self.probe = None
        if fresh_since is not None and snap.started_at < fresh_since:
            snap = replace(snap, started_at=fresh_since)
            self.leak_since = None
        # A reader that costs a process a look (a unit's journal) is read only while it matters.
        wanted = not snap.done or not self.progress.on_demand
        self._notice_restart(process)
        sizes = [c.received for c in process.clients]
        largest = None if not sizes or None in sizes else max(s or 0 for s in sizes)
        prefill = self.progress.read(largest) if wanted else None
        if not wanted:
            self.progress.fresh = []
        work = self.work.read(process.pid, process.cpu_percent, waiting=not snap.done)
        signs = self._signs(snap, process, work)
        if snap.finding == ProbeFinding.OK and process.pid is not None:
            self.served_process = (process.pid, process.create_time)
        return Observation(
            snap,
            process,
            self.models,
            load,
            self.leak_since,
            self.loading_since,
            fans_out,
            prefill,
            self.progress.problem or self.unread,
            signs,
            self.server.kind,
            served=self._served(process),
            live_seen=self.live_seen,
            work=work,
        )

    def _account(self, probe: Probe, snap: ProbeSnapshot) -> None:
        """The probe's connection as the watchdog's own: answered, or on record while it waits
        (a daemon killed now leaves it on the server)."""
        if snap.done and probe.local_address and snap.finding not in UNANSWERED:
            self.own.answered(probe.local_address)
            if self.announce_probe and self.probe is probe and self.announced is None:
                self.left.shorten(probe.local_address, keep_for=ANSWERED_GRACE)
        if self.announced is not None:
            if not snap.done:
                self.left.add(self.announced, keep_for=self.server.probe.hard_timeout)
            self.announced = None

    def _look(
        self, pid: int | None, snap: ProbeSnapshot
    ) -> tuple[ProcessSample, LoadReport | None]:
        """The process and the server's own report: read anew, or, while the probe is answered
        at once, the last full look's within FULL_LOOK_EVERY."""
        answered, kept = snap.done and snap.finding == ProbeFinding.OK, self.looked
        # Kept only between answered probes: the first answer after a failure looks anew.
        young = kept is not None and self.mono() - kept[0] < FULL_LOOK_EVERY
        reuse, self.answered_last = answered and self.answered_last and young, answered
        if reuse and kept is not None:
            return kept[1], kept[2]
        process = self.inspector.sample(pid, exclude=self.left.load() + self.own.addresses())
        load = self.load.read()
        self.looked = (self.mono(), process, load)
        return process, load

    def _notice_restart(self, process: ProcessSample) -> None:
        """Another server process than the last look's: its log so far is the old one's."""
        if process.pid is None:
            return
        seen, self.seen_process = self.seen_process, (process.pid, process.create_time)
        if seen is not None and not _same_process(seen, process):
            self.progress.restarted()

    def _served(self, process: ProcessSample) -> bool:
        """This very process (PID and start time) gave the watchdog a token."""
        return self.served_process is not None and _same_process(self.served_process, process)

    def _signs(self, snap: ProbeSnapshot, process: ProcessSample, work: WorkSign) -> Signs | None:
        """What may name a cause: the stack (only once a wedge is suspected: it costs a
        process), the log's known failures, the work sign over the wait, the machine's memory,
        the GPU resets macOS recorded (only for an answer with no token)."""
        cpu = process.cpu_percent
        if snap.finding == ProbeFinding.OK or snap.tokens > 0:
            # Served: what the log said before is answered, but a line read in this very look
            # may be the server failing right after it (kept for the next verdict).
            self.progress.errors = list(self.progress.fresh)
            self.work_over_wait.clear()
            self.memory.reset()
            self.stacker.forget()
            self.unified.forget()
            self.side, self.side_tried = None, False
            return None
        if work.percent is not None and not snap.done:
            self.work_over_wait = [*self.work_over_wait[-(WORK_KEPT - 1) :], work.percent]
        # A failure the log states makes the wait a suspect at once: its stack may hold it up.
        waited = snap.waited(self.mono())
        long = waited >= self.server.probe.wedge_after or bool(self.progress.errors)
        suspected = not snap.done and long
        # Another model is asked from slow_after on: by wedge_after its answer is in.
        asks = snap.done or waited >= self.server.probe.slow_after
        other = self._other_model(snap) if asks else None
        if not suspected and not snap.done:
            return Signs(other_model=other) if other is not None else None
        local = self.inspector.local
        # The process that holds the port, whichever manager runs it: the manager's PID when
        # it listens, else the listener (manager "none" and "command" know no PID).
        pid = process.pid
        return Signs(
            stack=self.stacker.sample(pid, process.cmdline, self.server.log_file)
            if suspected and local
            else None,
            errors=tuple(self.progress.errors),
            system_errors=self.unified.read(process.pid, waited) if suspected and local else (),
            work=tuple(self.work_over_wait),
            work_on=work.on,
            machine=self.memory.look() if suspected and local else None,
            gpu_events=self._gpu_events(snap, process) if local else (),
            clamp=self._clamp(pid) if suspected and local else None,
            others_cpu=self.machine_load.others(cpu) if suspected and local else None,
            other_model=other,
        )

    def _other_model(self, snap: ProbeSnapshot) -> OtherModel | None:
        """For a server that holds several models: another of them, probed once a wait. A token
        from it while the probe's model gives none tells a wedged model from a wedged server."""
        if self.server.profile.in_memory is None or snap.model is None:
            return None
        if not self.side_tried:
            self.side_tried = True
            held = models_in_memory(self.server, on_connect=self.connected) or ()
            other = next((m for m in held if m != snap.model), None)
            if other is not None:
                server = replace(self.server, model=other)
                self.side = Probe(server, mono=self.mono, on_connect=self.connected).start()
        if self.side is None:
            return None
        seen = self.side.snapshot()
        return OtherModel(str(seen.model), seen.finding == ProbeFinding.OK, seen.ttft)

    def _clamp(self, pid: int | None) -> str | None:
        """Read once per process: a service's limits do not change while it runs."""
        if pid is None:
            return None
        if self.clamped is None or self.clamped[0] != pid:
            self.clamped = (pid, self.clamp_of(pid))
        return self.clamped[1]

    def _gpu_events(self, snap: ProbeSnapshot, process: ProcessSample) -> tuple[str, ...]:
        empty = snap.done and snap.status == 200 and snap.tokens == 0
        if not empty or process.create_time is None:
            return ()
        return self.gpu_reports(process.create_time)

    def abort(self) -> None:
        self.side, self.side_tried = None, False
        if self.probe is not None:
            self.probe.abort()
            self.probe = None

    def leave(self) -> None:
        """The caller exits with the probe still waiting: remember it, do not close it. So
        too the report requests a stuck server has not answered (they stay in CLOSE_WAIT)."""
        for address in self.own.unanswered():
            self.left.add(address, keep_for=self.server.probe.hard_timeout)


def _same_process(known: tuple[int, float | None], process: ProcessSample) -> bool:
    """The same PID, started at the same time (to a second: the start is read against the
    wall clock each look)."""
    then, now = known[1], process.create_time
    return known[0] == process.pid and (then is None or now is None or abs(then - now) < 1.0)
