"""The server's Python threads, sampled while a wedge is suspected: is the generation thread
there, and where does it sit? At most one sample per EVERY seconds per server, each under
STACK_TIMEOUT; when the tool is missing or not permitted the sample says why (never a guess).

py-spy's `dump` (0.4) prints, per thread:

    Thread 19710 (idle): "Thread-1 (_run_generate)"
        Condition.wait (threading.py:331)
        ResponseGenerator._generate (mlx_lm/server.py:811)

macOS `sample` (used for a user, where py-spy needs root) shows native frames only: kept in the
dump before a restart, but it cannot say which Python thread is which.
"""

from __future__ import annotations

import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

from mlx_watchdog.sense import selfdump
from mlx_watchdog.sense.dump import RunCommand, own_first, stack_command, stack_text
from mlx_watchdog.sense.signs import StackSample, ThreadStack
from mlx_watchdog.sense.text import printable

STACK_TIMEOUT = 2.0  # s a sample may take
EVERY = 30.0  # s between two samples of one server
THREADS_MAX = 256
FRAMES_MAX = 64
THREAD = re.compile(r'^Thread (?:0x)?[0-9A-Fa-f]+ \((\w+)\): "(.*)"\s*$')
FRAME = re.compile(r"^\s+(\S.*?) \((.*)\)\s*$")
# faulthandler's dump (the server's own, sense/selfdump.py), innermost first:
#     Thread 0x00007f2b3c9ff6c0 (most recent call first):
#       File ".../mlx_lm/server.py", line 811 in _generate
FAULT_THREAD = re.compile(
    r"^(?:Current thread|Thread) (0x[0-9a-fA-F]+) \(most recent call first\):"
)
FAULT_FRAME = re.compile(r'^\s+File "(.*)", line (\d+) in (\S+)\s*$')


Head = Callable[[str], "tuple[str, bool | None] | None"]  # a line -> a thread's name, idle
Frame = Callable[[str], "str | None"]  # a line -> a frame's function


def _threads(text: str, head: Head, frame: Frame) -> tuple[ThreadStack, ...] | None:
    """A dump's threads, each with its frames innermost first; None when it has none."""
    threads: list[ThreadStack] = []
    name: str | None = None
    idle: bool | None = None
    frames: list[str] = []

    def close() -> None:
        if name is not None and len(threads) < THREADS_MAX:
            threads.append(ThreadStack(name, tuple(frames[:FRAMES_MAX]), idle))

    for line in text.splitlines():
        began = head(line)
        if began is not None:
            close()
            (name, idle), frames = began, []
            continue
        function = frame(line) if name is not None else None
        if function is not None:
            frames.append(printable(function)[:200])
    close()
    return tuple(threads) if threads else None


def parse_py_spy(text: str) -> tuple[ThreadStack, ...] | None:
    """The threads of a `py-spy dump`; None when the text has none (not py-spy's)."""

    def head(line: str) -> tuple[str, bool | None] | None:
        m = THREAD.match(line)
        return (printable(m.group(2))[:120], m.group(1) == "idle") if m else None

    def frame(line: str) -> str | None:
        m = FRAME.match(line)
        return m.group(1) if m else None

    return _threads(text, head, frame)


def parse_faulthandler(text: str) -> tuple[ThreadStack, ...] | None:
    """The threads of a faulthandler dump (no names, no idle marks); None when it has none."""

    def head(line: str) -> tuple[str, bool | None] | None:
        m = FAULT_THREAD.match(line)
        return (f"Thread {m.group(1)}", None) if m else None

    def frame(line: str) -> str | None:
        m = FAULT_FRAME.match(line)
        return m.group(3) if m else None

    return _threads(text, head, frame)


OWN = "faulthandler"  # the server's own dump, through the watchdog's launcher


class Stacker:
    """Samples one server's stacks, rate-limited; `run` and `mono` are injectable."""

    def __init__(
        self,
        *,
        run: RunCommand = subprocess.run,
        mono: Callable[[], float] = time.monotonic,
        every: float = EVERY,
        command: Callable[[int], list[str] | None] = stack_command,
    ) -> None:
        self.run, self.mono, self.every, self.command = run, mono, every, command
        self.last: StackSample | None = None
        self._at: float | None = None

    def sample(
        self, pid: int | None, cmdline: tuple[str, ...] = (), log: Path | None = None
    ) -> StackSample | None:
        """A fresh sample when the last is older than `every`, else the last (None: never).
        `cmdline` and `log`: the process's, for a server that dumps its own stacks."""
        now = self.mono()
        if self._at is not None and now - self._at < self.every:
            return self.last
        self._at = now
        own = pid is not None and log is not None and selfdump.launched(cmdline)
        got = (
            self._own(pid, log)
            if own and pid is not None and own_first(pid, self.command)
            else None
        )
        self.last = got if got is not None and got.threads is not None else self._take(pid)
        return self.last

    @staticmethod
    def _own(pid: int | None, log: Path | None) -> StackSample:
        if pid is None or log is None:
            return StackSample(None, "no server process", OWN)
        text, problem = selfdump.dump(pid, log)
        if text is None:
            return StackSample(None, problem, OWN)
        threads = parse_faulthandler(text)
        if threads is None:
            return StackSample(None, "its dump held no threads", OWN)
        return StackSample(threads, None, OWN)

    def forget(self) -> None:
        self.last, self._at = None, None

    def _take(self, pid: int | None) -> StackSample:
        argv = self.command(pid) if pid is not None else None
        tool = Path(argv[0]).name if argv else "py-spy"
        text, problem = stack_text(pid, STACK_TIMEOUT, self.run, command=lambda _: argv)
        if text is None:
            return StackSample(None, problem, tool)
        if tool == "sample":
            return StackSample(None, "macOS sample shows native frames only", tool)
        threads = parse_py_spy(text)
        if threads is None:
            return StackSample(None, f"{tool} printed no threads", tool)
        return StackSample(threads, None, tool)
