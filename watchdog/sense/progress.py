"""The server's own account of the prefill it is doing, read from its log.

mlx_lm.server (0.32.2, `server.py`'s keepalive callback) logs a line each prefill step of a
request, for a client that left too:

    2026-12-03 19:34:43,194 - INFO - Prompt processing progress: 2048/12036

llama-server logs its slots' progress too, once a prompt has taken 3 s (see LLAMA below).

The log is read incrementally from where the last look stopped, at most READ_MAX bytes a look
(a log that grew more is skipped ahead to its last READ_MAX); a rotated or truncated log is read
from its start. The first look, and the first after the server (re)started, begins at its end:
nothing written before the watchdog's start or the server's is current. A batched server interleaves the lines of its requests: each prompt size is
followed on its own, and the latest long one is what is told. With `--draft-model` mlx-lm logs
no such lines (speculative decoding drops the progress callback), and then there is no progress
to read, which is said, never guessed.
"""

from __future__ import annotations

import errno
import itertools
import os
import plistlib
import re
import select
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.sense.files import open_regular
from mlx_watchdog.sense.findings import Prefill
from mlx_watchdog.sense.signs import LogError, any_log_error, log_error

READ_MAX = 1 << 20  # bytes a look reads at most
JOURNAL_TAIL = 500  # lines of a unit's journal a first look (or one after a pause) reads
JOURNAL_LINES = 5000  # lines from the cursor a look reads at most
JOURNAL_PAUSE = 30.0  # s without a look, after which the journal is read from its tail
JOURNAL_TIMEOUT = 2.0  # s for journalctl in all
PLIST_MAX = 1 << 20  # bytes of a launchd job's plist read to find its log
PREFILLS_KEPT = 16  # prompt sizes followed at once
SHORT_PROMPT = 512  # tokens: prefilled in one step, so its lines tell nothing of a wedge
RATE_STEPS = 4  # the latest steps a prefill's rate is taken over
ERRORS_KEPT = 8  # known failure lines kept
GONE_AFTER = 60.0  # s: a prefill with no step while the log went on this long was dropped
# A prompt is at most a token a byte of its request (a byte-level tokenizer's worst), plus what
# a chat template adds: a total larger than any connection's request is no request's.
TEMPLATE_TOKENS = 1024
LINE = re.compile(
    rb"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) - INFO - "
    rb"Prompt processing progress: (\d{1,9})/(\d{1,9})\s*$"
)
# llama-server (b11434, `print_timings_pp`), once a prompt has taken over 3 s, each batch:
#   0.10.118.413 I slot print_timing: id  0 | task 0 | prompt processing, n_tokens =   4096,
#   progress = 0.35, t =   5.25 s / 780.08 tokens per second
# The prefix is minutes.seconds.milliseconds.microseconds since the server started.
LLAMA = re.compile(
    rb"^(\d{1,6})\.(\d\d)\.(\d{3})\.(\d{3}) I slot print_timing: id +(\d{1,4}) \| "
    rb"task (\d{1,12}) \| prompt processing, n_tokens = +(\d{1,9}), progress = (\d\.\d{1,4}),"
)


def server_log(server: ServerConfig) -> Path | None:
    """The log the server writes: its `log_file` (manager = "process"), else the
    StandardErrorPath (or StandardOutPath) its launchd job's plist names, where mlx-lm's
    logging goes. A plist that cannot be read names none."""
    if server.log_file is not None:
        return server.log_file
    if server.manager != "launchd" or server.plist is None:
        return None
    try:
        doc = plistlib.loads(_read_regular(server.plist, PLIST_MAX))
    except (OSError, ValueError, plistlib.InvalidFileException):
        return None
    for key in ("StandardErrorPath", "StandardOutPath"):
        named = doc.get(key) if isinstance(doc, dict) else None
        if isinstance(named, str) and named.strip() and "\0" not in named:
            return Path(named).expanduser()
    return None


def _read_regular(path: Path, limit: int) -> bytes:
    """At most `limit` bytes of a regular file."""
    with open_regular(path) as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"larger than {limit} bytes")
    return data


@dataclass(frozen=True)
class _Step:
    at: float  # wall time the server logged it (llama-server: seconds since it started)
    done: int
    total: int
    key: object = None  # which request: mlx-lm's prompt size, llama-server's slot and task
    relative: bool = False  # `at` counts from the server's start, not the wall clock


class LogProgress:
    """Reads one server's log for its prefill progress. `wall` is the wall clock: the log's
    time stamps are the server's local time."""

    def __init__(self, path: Path | None, *, wall: Callable[[], float] = time.time) -> None:
        self.path = path
        self.wall = wall
        self.problem: str | None = None  # why the log could not be read (a finding)
        self._offset: int | None = None  # None: not read yet
        self._inode: int | None = None
        # Nothing written before the watchdog's start, or before the server's (re)start, is
        # current: the first look (and the first after `restarted`) starts at the log's end.
        self._skip = True
        # The prefills in the log's last lines, by prompt size, the one stepped last at the end.
        self._prefills: dict[object, list[_Step]] = {}
        # Known failures the log named since the server last served (the caller clears them),
        # and those the last look read: kept when that look also saw a token.
        self.errors: list[LogError] = []
        self.fresh: list[LogError] = []
        # The server stamps its lines in its own zone (a launchd job's or a unit's may not be
        # the watchdog's): seconds to add to its stamps, learned from lines read as written.
        self._zone = 0.0
        self._largest: int | None = None

    on_demand = False  # True: read only while the probe waits (each look costs a process)

    @property
    def where(self) -> str:
        return f"the server's log {self.path}"

    def restarted(self) -> None:
        """The server (re)started: what its log said before is not about this process."""
        self._skip = True
        self._prefills = {}
        self.errors, self.fresh = [], []

    def read(self, largest: int | None = None) -> Prefill | None:
        """The latest prefill the log tells of, or None (no log, or no progress line yet).
        `largest`: the largest request on the server's connections, in bytes, where the
        kernel counted them: a prefill longer than any of them could be is passed over (a
        client can write such lines into the log: mlx_lm.server logs a malformed body raw)."""
        self.fresh = []
        self._largest = largest
        try:
            chunk = self._fetch()
        except OSError as exc:
            self.problem = f"cannot read {self.where}: {exc.strerror or exc}"
            return None
        self.problem = None
        return None if chunk is None else self._take(chunk)

    def _fetch(self) -> bytes | None:
        """What the log gained since the last look; None: there is no log."""
        return None if self.path is None else self._new_bytes(self.path)

    def _take(self, chunk: bytes) -> Prefill | None:
        if any_log_error(chunk):
            for line in chunk.split(b"\n"):
                found = log_error(line.decode("utf-8", errors="replace"))
                if found is not None:
                    self.errors = [*self.errors[-(ERRORS_KEPT - 1) :], found]
                    self.fresh = [*self.fresh[-(ERRORS_KEPT - 1) :], found]
        steps = [step for line in chunk.split(b"\n") if (step := _step(line)) is not None]
        # llama-server's times count from its start: its newest line is taken as written at
        # this look (read each tick, so at most an interval late), the others before it.
        latest = max((st.at for st in steps if st.relative), default=0.0)
        now = self.wall()
        self._zone = _zone(now, [st.at for st in steps if not st.relative], self._zone)
        for step in steps:
            if step.relative:
                step = _Step(now - (latest - step.at), step.done, step.total, step.key)
            elif self._zone:
                step = _Step(step.at + self._zone, step.done, step.total, step.key)
            self._add(step)
        return self._prefill()

    def _new_bytes(self, path: Path) -> bytes:
        # A link to a log is followed: only numbers are taken from it (the dump's log tail,
        # text kept in the history, follows none).
        with open_regular(path) as fh:
            st = os.fstat(fh.fileno())
            if self._skip:
                # The first look, or the first since the server (re)started: from the end.
                self._skip, self._inode, self._offset = False, st.st_ino, st.st_size
                return b""
            if st.st_ino != self._inode or self._offset is None or st.st_size < self._offset:
                # A rotated log or a truncated one: from its start.
                start = 0
                self._inode, self._prefills = st.st_ino, {}
            else:
                start = max(self._offset, st.st_size - READ_MAX)
            fh.seek(start)
            data = fh.read(min(READ_MAX, st.st_size - start))
        whole = data.rfind(b"\n") + 1  # a line still being written waits for the next look
        self._offset = start + whole
        return data[:whole]

    def _add(self, step: _Step) -> None:
        steps = self._prefills.pop(step.key, [])
        if steps and step.done < steps[-1].done:
            steps = []  # the same size of prompt again: another request
        self._prefills[step.key] = [*steps[-63:], step]  # the newest last
        while len(self._prefills) > PREFILLS_KEPT:
            del self._prefills[next(iter(self._prefills))]

    def _prefill(self) -> Prefill | None:
        if not self._prefills:
            return None
        # A batched server interleaves its requests' lines: a long prompt still prefilling is
        # what tells something (a short one, the probe's own, prefills in one step); one whose
        # steps stopped while others went on was cancelled. Else the latest prefill of all.
        entries = [steps for steps in self._prefills.values() if self._held(steps[-1])]
        if not entries:
            return None
        newest = max(steps[-1].at for steps in entries)
        going = [steps for steps in entries if _going(steps, newest)]
        steps = (going or entries)[-1]
        slowing = _slowing(steps)
        # The rate of its last few steps: a prefill slows as its context grows (measured on
        # mlx-lm: 2,533 tok/s at 10k tokens, 1,284 at 22k), so its early steps would flatter it.
        steps = steps[-RATE_STEPS:]
        first, last = steps[0], steps[-1]
        span = last.at - first.at
        rate = (last.done - first.done) / span if span > 0 and last.done > first.done else None
        return Prefill(
            done=last.done,
            total=last.total,
            rate_tps=None if rate is None else round(rate, 1),
            age_s=round(max(0.0, self.wall() - last.at), 1),
            step_s=round(span / (len(steps) - 1), 2) if len(steps) > 1 else None,
            slowing=slowing,
        )

    def _held(self, step: _Step) -> bool:
        """Whether some request on the server's connections can be this prompt."""
        return self._largest is None or step.total <= self._largest + TEMPLATE_TOKENS


class JournalProgress(LogProgress):
    """A systemd user unit's prefill progress, from its journal: `journalctl --user -u UNIT
    -o cat` from a cursor, so each look reads only what came since. Only while the probe waits
    (a look spawns journalctl); after a pause, from the journal's last JOURNAL_TAIL lines."""

    on_demand = True

    def __init__(
        self,
        unit: str,
        *,
        wall: Callable[[], float] = time.time,
        mono: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(None, wall=wall)
        self.unit = unit
        self.mono = mono
        self._cursor: str | None = None
        self._looked: float | None = None
        self._tail = JOURNAL_TAIL  # fewer after a look that READ_MAX cut before its cursor
        self._since = wall()  # what the journal holds from before is not current
        self._skip = False  # the journal is read by time instead

    def restarted(self) -> None:
        super().restarted()
        self._skip, self._since, self._cursor = False, self.wall(), None

    @property
    def where(self) -> str:
        return f"the journal of {self.unit}"

    def _fetch(self) -> bytes:
        now = self.mono()
        fresh = self._looked is None or now - self._looked > JOURNAL_PAUSE or not self._cursor
        self._looked = now
        argv = ["journalctl", "--user", "-u", self.unit, "-o", "cat", "-q", "--no-pager"]
        argv += ["--show-cursor", "-n", str(self._tail if fresh else JOURNAL_LINES)]
        if fresh:
            # Nothing from before the watchdog's start or the server's (re)start is current.
            self._prefills = {}
            argv += ["--since", f"@{int(self._since)}"]
        else:
            argv += ["--after-cursor", str(self._cursor)]
        code, out, err = bounded_run(argv, cap=READ_MAX, timeout=JOURNAL_TIMEOUT)
        if code != 0:
            said = err.decode(errors="replace").strip().splitlines()
            self._cursor = None  # a cursor it refuses (the journal was rotated): from the tail
            raise OSError(errno.EIO, f"journalctl exited {code}: {said[-1][:200] if said else ''}")
        head, sep, tail = out.rpartition(b"-- cursor: ")
        if sep and (not head or head.endswith(b"\n")):
            cursor = tail.strip()
            if cursor and len(cursor) < 512:
                self._cursor = cursor.decode(errors="replace")
                self._tail = JOURNAL_TAIL
            return head
        if len(out) >= READ_MAX:
            # Cut before its cursor line (lines of kilobytes): the cursor would never move.
            # The next look reads the tail again, a quarter as many lines, until one fits.
            self._cursor, self._tail = None, max(1, (self._tail if fresh else JOURNAL_TAIL) // 4)
        return out


def bounded_run(argv: list[str], *, cap: int, timeout: float) -> tuple[int, bytes, bytes]:
    """A command's exit code, stdout (at most `cap` bytes) and stderr (at most 4 kB), ended
    (SIGKILL) at `timeout` seconds in all. OSError when it cannot run or overran."""
    proc = subprocess.Popen(
        argv,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    deadline = time.monotonic() + timeout
    out, err = bytearray(), bytearray()
    assert proc.stdout is not None and proc.stderr is not None
    streams = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    try:
        while streams:
            left = deadline - time.monotonic()
            if left <= 0:
                raise OSError(errno.ETIMEDOUT, f"{argv[0]} took longer than {timeout:g} s")
            ready, _, _ = select.select(list(streams), [], [], left)
            for fd in ready:
                chunk = os.read(fd, 65536)
                got = streams[fd]
                if not chunk:
                    del streams[fd]
                elif len(got) < (cap if got is out else 4096):
                    got += chunk
        code = proc.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise OSError(errno.ETIMEDOUT, f"{argv[0]} took longer than {timeout:g} s") from None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    return code, bytes(out[:cap]), bytes(err[:4096])


def progress_reader(server: ServerConfig, *, wall: Callable[[], float] = time.time) -> LogProgress:
    """Where this server's progress is read: its log (`server_log`), else a systemd unit's
    journal, else nowhere (a reader that reads nothing)."""
    path = server_log(server)
    if path is None and server.manager == "systemd" and server.unit:
        return JournalProgress(server.unit, wall=wall)
    return LogProgress(path, wall=wall)


def progress_source(server: ServerConfig) -> str | None:
    """Where the server's prefill progress is read, said for a person; None: nowhere."""
    reader = progress_reader(server)
    if isinstance(reader, JournalProgress) or reader.path is not None:
        return reader.where
    return None


PARSED_KINDS = ("mlx_lm", "llama.cpp")  # the kinds whose log lines tell a prefill's progress


def progress_unread(server: ServerConfig) -> str | None:
    """What it costs that this server's progress is read nowhere, and the fix; None when it
    is read (or its kind logs nothing the watchdog parses)."""
    said = unread_cost(server)
    return None if said is None else f"{said[0]}: {said[1]}"


def unread_cost(server: ServerConfig) -> tuple[str, str] | None:
    """`progress_unread` as (what it costs, the fix)."""
    if server.kind not in PARSED_KINDS or progress_source(server) is not None:
        return None
    if server.manager == "launchd":
        fix = "add StandardErrorPath to its launchd plist"
    else:
        fix = 'set log_file to the file its output goes to, or run it with manager = "process"'
    return (
        "no log of this server is read, so an abandoned prefill's progress is unknown: each "
        "wedge is waited for up to what a restart costs, then restarted, even one that would "
        "have cleared a few seconds later",
        fix,
    )


ZONE_STEP = 900.0  # zones differ by whole quarter hours


def _zone(now: float, stamps: list[float], known: float) -> float:
    """The offset between the server's zone and the watchdog's. Lines are read as they are
    written (each look reads what came since the last, nothing from before the start), so the
    newest of a look stands within a few minutes of now: a quarter hour or more apart is the
    zone, to the nearest quarter hour."""
    if not stamps:
        return known
    gap = now - (max(stamps) + known)
    if abs(gap) < ZONE_STEP / 2:
        return known
    return known + round(gap / ZONE_STEP) * ZONE_STEP


def _slowing(steps: list[_Step]) -> float | None:
    """How much each token's time grows with its position (seconds per token, per token), by
    least squares over the steps' times per token; None with fewer than three steps, 0 when
    they do not slow. Attention makes a token's cost grow with the context before it."""
    points = []
    for a, b in itertools.pairwise(steps):
        if b.done > a.done and b.at > a.at:
            points.append(((a.done + b.done) / 2, (b.at - a.at) / (b.done - a.done)))
    if len(points) < 2:
        return None
    mean_p = sum(p for p, _ in points) / len(points)
    mean_t = sum(t for _, t in points) / len(points)
    spread = sum((p - mean_p) ** 2 for p, _ in points)
    if spread <= 0:
        return None
    slope = sum((p - mean_p) * (t - mean_t) for p, t in points) / spread
    return max(0.0, slope)


def _going(steps: list[_Step], newest: float) -> bool:
    """A long prompt's prefill not finished, whose last step is not far behind the log's."""
    last = steps[-1]
    if last.total < SHORT_PROMPT or last.done >= last.total:
        return False
    step = (last.at - steps[0].at) / (len(steps) - 1) if len(steps) > 1 else 0.0
    return newest - last.at <= max(GONE_AFTER, 3 * step)


def _step(line: bytes) -> _Step | None:
    line = line.rstrip(b"\r")
    m = LINE.match(line)
    if m is None:
        return _llama_step(line)
    try:
        at = time.mktime(time.strptime(m.group(1).decode(), "%Y-%m-%d %H:%M:%S"))
    except (ValueError, OverflowError):
        return None
    done, total = int(m.group(3)), int(m.group(4))
    if total <= 0 or done > total:
        return None
    return _Step(at + int(m.group(2)) / 1000, done, total, key=total)


def _llama_step(line: bytes) -> _Step | None:
    m = LLAMA.match(line)
    if m is None:
        return None
    minutes, seconds, millis, micros = (int(m.group(i)) for i in range(1, 5))
    done, share = int(m.group(7)), float(m.group(8))
    if seconds > 59 or not 0 < share <= 1:
        return None
    # The share is printed to two places: the total is about done / share, never below done.
    total = max(done, round(done / share))
    at = minutes * 60 + seconds + millis / 1e3 + micros / 1e6
    return _Step(at, done, total, key=("llama", m.group(5), m.group(6)), relative=True)
