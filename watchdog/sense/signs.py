"""Evidence beyond the probe's, gathered while a wedge is suspected: the server's stacks, the
known failures its log names, its CPU over the wait, the machine's memory. The judge names a
cause from them (judge/cause.py); here they are only data and the lines that are known.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from mlx_watchdog.sense.text import printable

LINE_MAX = 300
# Where a line is the server's or its runtime's own words: at its start, after at most the
# logger's prefix (mlx_lm.server's "%(asctime)s - %(levelname)s - "), a Python exception's
# type, or libc++abi's "terminating ..." Inside a logged request (a request line, a raw body)
# a failure's words are a client's; a client that writes a newline into a logged body can still
# start a line, so a line only corroborates (judge/cause.py): it never names a cause alone.
_START = (
    r"^(?:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} - (?:ERROR|CRITICAL|WARNING) - )?"
    r"(?:libc\+\+abi: [^\[]*|\w*(?:Error|Exception): )?"
)
# Lines servers write when they fail, each from its report or source:
LOG_ERRORS: tuple[tuple[str, re.Pattern[str]], ...] = (
    # mlx-lm 0.32.2 server.py, ResponseGenerator._run_generate: logging.exception(
    # f"mlx_lm.server generation thread died: {e}")
    ("thread_gone", re.compile(_START + r"(?:mlx_lm\.server )?generation thread died")),
    # mlx-lm #1505, #1644, #831: "[metal::malloc] Resource limit (499000) exceeded"
    ("metal", re.compile(_START + r"(?:\[metal::\w+\]|\[METAL\]|Resource limit \(\d+\) exceeded)")),
    # oMLX #2029, Ollama #17902, exo #1429: command buffer timeouts
    (
        "metal",
        re.compile(
            _START + r"(?:command buffer exited with error status\. )?"
            r"(?:kIOGPUCommandBufferCallbackError\w*|GPU Timeout Error)"
        ),
    ),
    # mlx-lm #883, #1666, mlx #3186: IOGPUMemory assertions and panics; llama.cpp's Metal backend
    ("metal", re.compile(r"^(?:panic\(cpu \d+ caller [^)]*\): |\S*)IOGPUMemory\.cpp:\d+")),
    ("metal", re.compile(_START + r"ggml_metal\w*: command buffer \d+ failed")),
)

_FORMS = (
    r"generation thread died|\[metal::|\[METAL\]|Resource limit|kIOGPUCommandBuffer|"
    r"GPU Timeout Error|IOGPUMemory|ggml_metal"
)
_ANY = re.compile(_FORMS.encode())


def any_log_error(chunk: bytes) -> bool:
    """Whether some line of `chunk` may name a known failure (one search over all of it)."""
    return _ANY.search(chunk) is not None


# What mlx-lm's generation thread runs (`ResponseGenerator._run_generate` -> `_generate` in
# 0.32.2; `_generate` as the thread's target before): a stack without it has lost the thread.
GENERATION_FRAMES = frozenset({"_generate", "_run_generate"})
LOW_MEMORY = 0.10  # of the machine's memory available
SWAP_GREW = 512 << 20  # bytes of swap taken during the wait
SWAP_FULL = 0.5  # of the swap in use


@dataclass(frozen=True)
class ThreadStack:
    """One thread of a stack sample: its name, its frames, whether it was idle."""

    name: str
    frames: tuple[str, ...]  # qualified function names, innermost first
    idle: bool | None = None  # py-spy's "(idle)" mark

    @property
    def generates(self) -> bool:
        named = "(_generate)" in self.name or "(_run_generate)" in self.name
        return named or any(f.rsplit(".", 1)[-1] in GENERATION_FRAMES for f in self.frames)


@dataclass(frozen=True)
class StackSample:
    """The server's Python threads at one moment, or why they could not be had."""

    threads: tuple[ThreadStack, ...] | None
    problem: str | None = None
    tool: str = "py-spy"

    @property
    def generation(self) -> ThreadStack | None:
        return next((t for t in self.threads or () if t.generates), None)


@dataclass(frozen=True)
class LogError:
    """A line of the server's log that names a known failure, seen since its last token."""

    kind: str  # thread_gone | metal
    line: str  # printable, cut to LINE_MAX characters


def log_error(line: str) -> LogError | None:
    """The known failure a log line names, or None."""
    for kind, pattern in LOG_ERRORS:
        if pattern.search(line):
            return LogError(kind, printable(line.strip())[:LINE_MAX])
    return None


@dataclass(frozen=True)
class Machine:
    """The machine's memory at a look, and how its swap moved since the wait began."""

    total: int
    available: int
    swap_total: int
    swap_used: int
    swap_grew: int = 0

    @property
    def low(self) -> bool:
        return self.total > 0 and self.available / self.total < LOW_MEMORY

    @property
    def swapping(self) -> bool:
        full = self.swap_total > 0 and self.swap_used / self.swap_total > SWAP_FULL
        return full or self.swap_grew >= SWAP_GREW

    def describe(self) -> str:
        text = f"{gib(self.available)} of {gib(self.total)} memory available"
        text += f", swap {gib(self.swap_used)} of {gib(self.swap_total)} used"
        if self.swap_grew > 0:
            text += f" (+{gib(self.swap_grew)} during the wait)"
        return text


@dataclass(frozen=True)
class OtherModel:
    """Another model the server holds, probed while the probe's own model gives nothing."""

    name: str
    served: bool  # it gave a token
    ttft: float | None = None


@dataclass(frozen=True)
class Signs:
    """Evidence beyond the probe's: gathered while a wedge is suspected, each part bounded."""

    stack: StackSample | None = None
    errors: tuple[LogError, ...] = ()
    # GPU failures the system's log wrote for the process (macOS's unified log): the process's
    # own words, never a client's (sense/unified_log.py)
    system_errors: tuple[LogError, ...] = ()
    work: tuple[float, ...] = ()  # the work sign (sense/work.py) at each look of the wait
    work_on: str = "cpu"  # where it was read: the CPU or the GPU
    machine: Machine | None = None
    gpu_events: tuple[str, ...] = ()  # macOS's GPU event reports since the process started
    clamp: str | None = None  # how the operating system holds the process back (sense/sched.py)
    others_cpu: float | None = None  # the rest of the machine's CPU, % of one core
    other_model: OtherModel | None = None  # another model it holds, probed meanwhile


def gib(n: int) -> str:
    """Bytes as GiB; under 1 GiB, as MiB (a small server is not "0.0 GiB")."""
    if 0 < abs(n) < 1 << 30:
        return f"{n / (1 << 20):.0f} MiB"
    return f"{n / (1 << 30):.1f} GiB"
