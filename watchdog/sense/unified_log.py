"""The GPU's failures macOS writes to its unified log for the server's process: a Metal death
can leave no line in the server's own log, no report, and `/health` 200 until the process
exits (mlx-serve #321: `IOGPUMetalError`, "Execution of the command buffer was aborted due to
an error during execution. Insufficient Memory (00000008:kIOGPUCommandBufferCallbackError
OutOfMemory)"). Read with `log show --style ndjson`, for the server's PID only, over the wait
at most, only while a wedge is suspected and at most once every READ_EVERY seconds. Its entries are
the process's own (the Metal framework in it), never a client's request text: unlike a line of
the server's log, one names a cause (judge/cause.py).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable

from mlx_watchdog.sense import platform
from mlx_watchdog.sense.signs import LINE_MAX, LogError
from mlx_watchdog.sense.text import printable
from mlx_watchdog.sense.tool import ToolRun, Unreadable, answer, bounded

LOG_TIMEOUT = 3.0  # s: `log show` walks the log store; a slow one is given up, said, read later
READ_EVERY = 30.0  # s between two reads for one server
SPAN_MAX = 300  # s of log read back at most
LOG_CAP = 1 << 20  # bytes of its answer
ENTRIES_KEPT = 3  # entries kept, newest last
SYMBOLS = (
    "kIOGPUCommandBufferCallbackError",
    "kIOAccelCommandBufferCallbackError",
    "IOGPUMetalError",
    "GPU Timeout Error",
    "Command buffer execution failed",
    "Execution of the command buffer was aborted",
)


def command(pid: int, span_s: float) -> list[str]:
    said = " OR ".join(f'eventMessage CONTAINS "{s}"' for s in SYMBOLS)
    span = max(1, min(SPAN_MAX, math.ceil(span_s)))
    return [
        "log",
        "show",
        "--last",
        f"{span}s",
        "--style",
        "ndjson",
        "--predicate",
        f"processID == {pid} AND ({said})",
    ]


def parse(text: str, pid: int) -> tuple[LogError, ...]:
    """The GPU failures among ndjson entries, the server's PID's only; a line that is not an
    entry (the closing count, garbage, a line cut short) is skipped."""
    found: list[LogError] = []
    for line in text.splitlines()[:10_000]:
        try:
            entry = json.loads(line[:65536])
        except ValueError:
            continue
        if not isinstance(entry, dict) or entry.get("processID") != pid:
            continue
        message = entry.get("eventMessage")
        if not isinstance(message, str) or not any(s in message for s in SYMBOLS):
            continue
        found.append(LogError("metal", printable(" ".join(message.split()))[:LINE_MAX]))
    return tuple(found[-ENTRIES_KEPT:])


class UnifiedLog:
    """One server's reads of the unified log; nothing off a Mac."""

    def __init__(
        self,
        *,
        run: ToolRun | None = None,
        mono: Callable[[], float] = time.monotonic,
        mac: bool | None = None,
    ) -> None:
        self.run = run or bounded(LOG_CAP, LOG_TIMEOUT)
        self.mono = mono
        self.mac = platform.is_mac() if mac is None else mac
        self.problem = ""  # why the last read failed ("": it did not)
        self._last: tuple[int, float] | None = None  # PID, when
        self._found: tuple[LogError, ...] = ()

    def read(self, pid: int | None, span_s: float) -> tuple[LogError, ...]:
        """Its GPU failures over the last `span_s` seconds (what an earlier read of this
        process found is kept between reads)."""
        if not self.mac or pid is None:
            return ()
        now = self.mono()
        if self._last is not None and self._last[0] == pid and now - self._last[1] < READ_EVERY:
            return self._found
        if self._last is None or self._last[0] != pid:
            self._found = ()
        self._last = (pid, now)
        try:
            out = answer(command(pid, span_s), self.run, LOG_CAP)
        except Unreadable as exc:
            self.problem = str(exc)
            return self._found
        self.problem = ""
        self._found = (self._found + parse(out.decode("utf-8", "replace"), pid))[-ENTRIES_KEPT:]
        return self._found

    def forget(self) -> None:
        """Served again: what was found is answered."""
        self._found, self._last = (), None
