"""Why a server stopped serving, named from the evidence that decides it. Pure: no I/O.

Each cause has its own cure and its own fix upstream:

- model_wedged: one model of a server that holds several gives nothing while another answers
  (Ollama, LM Studio: dryvist/nix-ai #1879, #1886); cured by unloading that model;
- abandoned_prefill: clients left mid-request and their work holds the server (the seed's case);
- leaked_request: the server counts requests no connection belongs to (a slot never freed);
- generation_thread_gone: HTTP answers, nothing generates (mlx-lm #1505; mlx-lm 0.32.2 logs
  "generation thread died" and answers 503 on /health, older releases hang with /health 200);
- deadlock: the generation thread is there, idle, and nothing moves (mlx-lm #1834, #1493);
- metal_error: the server's log names a Metal failure (mlx-lm #1505, #1644, #831; oMLX #2029;
  Ollama #17902; exo #1429; mlx-lm #883, #1666);
- gpu_reset: a process that served answers 200 with no token, at once (the GPU was reset under
  it and the runner stays broken: ollama #18213, llama.cpp #20141); macOS's gpuEvent reports
  corroborate;
- throttled: its prefill runs far slower than its calibration while the rest of the machine is
  quiet or the system holds it back (a launchd job without ProcessType Interactive, a nice
  value, a CPU quota): a cycle's judgement, with the calibration (see `throttled`);
- batch_drain: a batched mlx_lm.server answers some connections while the probe gets nothing:
  it takes no new request until its batch drains (before a request it cannot batch);
- memory_pressure: the machine is out of memory and swapping (mlx-lm #1252, Ollama #18131);
- client_timeouts: the same wedge back again and again, each restart curing it: clients give up
  before their prefill ends (a cycle's judgement, from its incidents; see `recurring`);
- exited: the process is gone;
- unknown: nothing decides; an honest value.

A cause is named only from a strong sign or from two independent weaker ones; one weak sign alone
(an idle CPU, a full machine, a stack missing a thread) is never enough. Evidence has an author:
the server's answer to the watchdog's own request, /health, its stack, its process (CPU, exit)
are signs no client writes. Its log is written in part by clients (mlx-lm logs a malformed body
raw, newlines and all, and every request line), so a log line, even one shaped as the server's
own (sense/signs.py), only corroborates: it names a cause together with a sign no client writes.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from mlx_watchdog.sense.signs import Signs


class Cause(StrEnum):
    """Why a failing server fails, in one word (docs/causes.md)."""

    ABANDONED_PREFILL = "abandoned_prefill"
    MODEL_WEDGED = "model_wedged"
    LEAKED_REQUEST = "leaked_request"
    THREAD_GONE = "generation_thread_gone"
    DEADLOCK = "deadlock"
    METAL_ERROR = "metal_error"
    GPU_RESET = "gpu_reset"
    MEMORY_PRESSURE = "memory_pressure"
    THROTTLED = "throttled"
    BATCH_DRAIN = "batch_drain"
    CLIENT_TIMEOUTS = "client_timeouts"
    EXITED = "exited"
    UNKNOWN = "unknown"


WORDS: dict[Cause, str] = {
    Cause.ABANDONED_PREFILL: "an abandoned request holds the server",
    Cause.MODEL_WEDGED: "one model is wedged, not the server",
    Cause.LEAKED_REQUEST: "a request with no client holds a slot",
    Cause.THREAD_GONE: "the generation thread is gone",
    Cause.DEADLOCK: "a deadlock",
    Cause.METAL_ERROR: "a Metal (GPU) error",
    Cause.GPU_RESET: "the GPU was reset under it: it answers with no token",
    Cause.MEMORY_PRESSURE: "the machine is out of memory",
    Cause.THROTTLED: "the system throttles the server",
    Cause.BATCH_DRAIN: "it drains its batch and takes no new request",
    Cause.CLIENT_TIMEOUTS: "clients time out before their prefill ends",
    Cause.EXITED: "the server process is gone",
    Cause.UNKNOWN: "unknown",
}

# Causes no waiting can cure: restart at once, whatever a cheaper cure would have been.
NO_PROGRESS = frozenset({Cause.THREAD_GONE, Cause.DEADLOCK, Cause.METAL_ERROR})
# Causes the server's log states: with a sign no client writes, judged at once (verdict.py).
STATED = frozenset({Cause.THREAD_GONE, Cause.METAL_ERROR})
MIN_IDLE_READINGS = 3  # CPU readings over the wait, all idle, before idleness counts


@dataclass(frozen=True)
class Diagnosis:
    """A cause with the evidence that decided it."""

    cause: Cause
    because: str = ""  # the evidence that decided it, in words

    def describe(self) -> str:
        words = WORDS[self.cause]
        return f"{words} ({self.because})" if self.because else words


@dataclass(frozen=True)
class Facts:
    """What the verdict's rule saw, as the diagnosis needs it."""

    state: str  # wedged | dead | down
    kind: str  # the server's kind (mlx_lm, llama.cpp, ...)
    answered: bool  # the server answers HTTP (/v1/models, its health route or the probe)
    answer: str = ""  # the probe's error text, the health route's body
    health_unavailable: bool = False  # mlx-lm's /health said 503 "unavailable"
    abandoned: int = 0
    leaked: int = 0
    progressing: bool = False  # the server's log shows a prefill moving now
    gone: bool = False  # down, and no server process is running
    model: str | None = None  # the model the probe named
    drained: int = 0  # connections it answers now while the probe has had nothing
    empty_in: float | None = None  # the probe's answer: 200 with no token, in this many seconds
    served: bool = False  # this same process gave the watchdog a token before
    idle_below: float = 5.0  # the CPU % under which the process is idle


THREAD_DIED = "generation thread died"  # mlx-lm 0.32.2's words, in its log and its answers


def diagnose(facts: Facts, signs: Signs) -> Diagnosis:
    """The cause the evidence shows; unknown unless a strong sign or two weak ones agree."""
    # A Metal failure first: it is what kills the thread (mlx-lm #1505), the more specific.
    checks = (
        _model_wedged,
        _metal,
        _thread_gone,
        _gpu_reset,
        _memory,  # a machine out of memory idles its processes: no deadlock is read then
        _deadlock,
        _batch_drain,
        _holds_slot,
    )
    for check in checks:
        found = check(facts, signs)
        if found is not None:
            return found
    if facts.gone:
        return Diagnosis(Cause.EXITED, "no server process is running")
    return Diagnosis(Cause.UNKNOWN, _unknown_hint(facts, signs))


def _thread_gone(f: Facts, s: Signs) -> Diagnosis | None:
    if THREAD_DIED in f.answer.lower():  # its answer to the watchdog's own request
        return Diagnosis(Cause.THREAD_GONE, f"it answers: {f.answer[:160]}")
    # Weak alone: a stack without the thread (another version may name it otherwise), a 503
    # from a health route (another server may mean something else by it), a log line (a
    # client may have written it).
    weak = [lost] if (lost := _lost_thread(f, s)) else []
    if f.kind == "mlx_lm" and f.health_unavailable:
        weak.append('/health answers 503 "unavailable"')
    said = next((e.line for e in s.errors if e.kind == "thread_gone"), None)
    if said is not None and (weak or _still(f, s)):
        held = weak[0] if weak else "the process idle and nothing moving"
        return Diagnosis(Cause.THREAD_GONE, f"its log: {said}; {held}")
    if len(weak) == 2:
        return Diagnosis(Cause.THREAD_GONE, "; ".join(weak))
    # One weak sign, held up by another no client writes: the process idle, nothing moving.
    if weak and f.answered and _still(f, s) and not f.abandoned:
        return Diagnosis(
            Cause.THREAD_GONE, f"{weak[0]}, while HTTP still answers and the process is idle"
        )
    return None


def _metal(f: Facts, s: Signs) -> Diagnosis | None:
    """A Metal failure macOS's unified log wrote for the failing process (its own words: no
    client writes there); or one the server's log names, held up by a sign no client writes:
    the server answered the watchdog's own request wrongly (dead), its process is gone, its
    health route or stack lost the generation thread, or it sits idle with nothing moving."""
    system = next((e.line for e in s.system_errors if e.kind == "metal"), None)
    if system is not None and f.state in ("wedged", "dead", "down"):
        return Diagnosis(Cause.METAL_ERROR, f"macOS's log for its process: {system}")
    said = next((e.line for e in s.errors if e.kind == "metal"), None)
    if said is None:
        return None
    if f.state == "dead":
        held = "it answers the probe wrongly"
    elif f.gone:
        held = "its process is gone"
    elif f.health_unavailable:
        held = '/health answers 503 "unavailable"'
    elif lost := _lost_thread(f, s):
        held = lost
    elif _still(f, s):
        held = "the process idle and nothing moving"
    else:
        return None
    return Diagnosis(Cause.METAL_ERROR, f"its log: {said}; {held}")


def _model_wedged(f: Facts, s: Signs) -> Diagnosis | None:
    """Another model the same server holds answered the watchdog's own probe while this one
    gives nothing (or answers wrongly): the host serves, the model does not."""
    other = s.other_model
    if other is None or not other.served or f.state not in ("wedged", "dead"):
        return None
    took = f" in {other.ttft * 1000:.0f} ms" if other.ttft is not None else ""
    return Diagnosis(
        Cause.MODEL_WEDGED,
        f"{f.model or 'its model'} gives no token while {other.name}, on the same server, "
        f"answered the watchdog's probe{took}",
    )


def _gpu_reset(f: Facts, s: Signs) -> Diagnosis | None:
    """Its answer to the watchdog's own request is 200 with no token, where this same process
    gave tokens before: something broke under it (a model that answers nothing from its start
    never served). macOS's GPU event reports since it started say what."""
    if f.state != "dead" or f.empty_in is None or not f.served:
        return None
    because = (
        f"it answers the probe 200 with no token in {f.empty_in * 1000:.0f} ms, "
        "where this same process gave tokens before"
    )
    if s.gpu_events:
        because += f"; macOS recorded a GPU event since it started ({s.gpu_events[0]})"
    return Diagnosis(Cause.GPU_RESET, because)


def _lost_thread(f: Facts, s: Signs) -> str | None:
    """mlx-lm's stack without its generation thread, in words; None if the stack has it (or
    there is none, or it is another kind's, whose threads are named otherwise)."""
    stack = s.stack
    if f.kind == "mlx_lm" and stack is not None and stack.threads and stack.generation is None:
        return f"its stack ({stack.tool}) has no generation thread"
    return None


def _still(f: Facts, s: Signs) -> bool:
    """Nothing works in it now: its last few looks idle and no progress (abandoned requests or
    not: an idle process is not computing them; the clearing reads idleness the same way)."""
    last = s.work[-MIN_IDLE_READINGS:]
    idle_now = len(last) == MIN_IDLE_READINGS and sum(last) / len(last) < f.idle_below
    return f.state == "wedged" and idle_now and not f.progressing


def _deadlock(f: Facts, s: Signs) -> Diagnosis | None:
    """The generation thread is there, the process idle over the whole wait, nothing moving,
    and no abandoned work to explain it: three signs, the stack first."""
    thread = s.stack.generation if s.stack is not None else None
    if thread is None or not _idle(f, s) or f.progressing or f.abandoned or f.state != "wedged":
        return None
    at = thread.frames[0] if thread.frames else "?"
    cpu = sum(s.work) / len(s.work)
    return Diagnosis(
        Cause.DEADLOCK,
        f"its generation thread sits in {at} while the process stays idle "
        f"({s.work_on.upper()} {cpu:.1f}% over the wait, {len(s.work)} looks) and no "
        "progress is logged",
    )


def _idle(f: Facts, s: Signs) -> bool:
    """Idle over the wait: its mean work sign, CPU or GPU (one look's spike, a stack tool's
    attach, is not work); no readings (a GPU that cannot be read) is never idle."""
    n = len(s.work)
    return n >= MIN_IDLE_READINGS and sum(s.work) / n < f.idle_below


def _batch_drain(f: Facts, s: Signs) -> Diagnosis | None:
    """It sends tokens on other connections while the probe has had nothing: serving, but no
    new request is taken (the kernel's byte counts: a sign no client writes)."""
    if not f.drained or f.state != "wedged":
        return None
    n = f.drained
    return Diagnosis(
        Cause.BATCH_DRAIN,
        f"{n} connection{'s are' if n != 1 else ' is'} sent tokens while the probe has had "
        "nothing: no new request is read until its batch ends (mlx-lm drains it before a "
        "request it cannot batch: a seed, an image, another model)",
    )


def _holds_slot(f: Facts, s: Signs) -> Diagnosis | None:
    # The verdict's reason already counts them.
    if f.abandoned:
        return Diagnosis(Cause.ABANDONED_PREFILL)
    if f.leaked:
        return Diagnosis(Cause.LEAKED_REQUEST)
    return None


def _memory(f: Facts, s: Signs) -> Diagnosis | None:
    m = s.machine
    if m is None or not (m.low and m.swapping):
        return None
    return Diagnosis(Cause.MEMORY_PRESSURE, m.describe())


def _unknown_hint(f: Facts, s: Signs) -> str:
    """What is missing to name it: the honest half of "unknown"."""
    if f.state != "wedged":
        return ""
    if _idle(f, s) and s.stack is not None and s.stack.threads is None:
        return (
            "the process is idle and nothing moves: a deadlock or a lost generation thread; "
            f"no stack to tell which ({s.stack.problem})"
        )
    return ""


NEXT_STEP: dict[Cause, str] = {
    Cause.ABANDONED_PREFILL: (
        "raise the clients' timeouts above their longest prompt's prefill "
        "(`mlx-watchdog calibrate` measures it)"
    ),
    Cause.LEAKED_REQUEST: "report it upstream with `mlx-watchdog history --show` of an incident",
    Cause.THREAD_GONE: (
        "report it upstream (`mlx-watchdog history --show` of an incident has what a report "
        "needs) and upgrade the server when a fix is out"
    ),
    Cause.DEADLOCK: "report it upstream with `mlx-watchdog history --show` of an incident",
    Cause.METAL_ERROR: (
        "give it less to hold: a smaller model or context, a smaller prompt cache, fewer servers"
    ),
    Cause.MEMORY_PRESSURE: "run fewer or smaller models at once, or give the machine more memory",
    Cause.MODEL_WEDGED: (
        "the watchdog unloads that model (the server and its other models stay); if it comes "
        "back, read the server's log for that model's runner"
    ),
    Cause.BATCH_DRAIN: (
        "nothing to restart while its clients are served: have clients leave out `seed` (and "
        "send images to a server of their own), or serve one model per server; a client that "
        "left is cured as an abandoned request"
    ),
    Cause.THROTTLED: (
        "let it run at full speed: a launchd job needs `<key>ProcessType</key>"
        "<string>Interactive</string>` in its plist (unset, launchd throttles its CPU and I/O), "
        "a systemd unit no `Nice=`, `CPUSchedulingPolicy=idle|batch` or `CPUQuota=`; "
        "`mlx-watchdog doctor` reads them"
    ),
    Cause.GPU_RESET: (
        "a restart clears it; if it comes back, keep macOS up to date and give the GPU less at "
        "once (a smaller model or batch): a GPU reset is the system's, not the server's"
    ),
    Cause.EXITED: "read the server's log for why it exits (`mlx-watchdog history --show`)",
    Cause.UNKNOWN: "read `mlx-watchdog history --show` of an incident for its stack and log",
}
NEXT_STEP[Cause.CLIENT_TIMEOUTS] = NEXT_STEP[Cause.ABANDONED_PREFILL]


def budget_spent(
    used: int,
    window: float,
    cured: int,
    cause: Cause,
    refill_in: float | None = None,
    asked: int = 0,
) -> str:
    """What a spent budget means, in words, counted honestly: restarts that each cured a
    wedge that came back are not restarts that failed, those a person or a reload asked for
    are named as such, and when one is allowed again."""
    again = (
        "" if refill_in is None else f"; the next is allowed in {_span(refill_in)} at the latest"
    )
    if used and cured >= used:
        return (
            f"{used} wedges in the last {window:g} s, each cured by a restart; the cause is still "
            f"there: {WORDS[cause]}; next: {NEXT_STEP[cause]}. Restarts wait until it serves "
            f"again or a person restarts it{again}"
        )
    whose = f" ({asked} asked for by a person or a reload)" if asked else ""
    if cured:
        counted = (
            f"{used} restarts in the last {window:g} s{whose}: {cured} brought it back for a "
            f"while, {used - cured} did not"
        )
    else:
        counted = f"{used} restarts in the last {window:g} s{whose} did not bring it back"
    return (
        f"{counted} ({WORDS[cause]}); next: {NEXT_STEP[cause]} (still probing; a healthy "
        f"probe ends the hold{again})"
    )


def _span(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def recurring(cause: Cause, earlier: int, threshold: int = 2) -> Cause:
    """An abandoned prefill that keeps coming back after each cure: the clients' timeouts."""
    if cause is Cause.ABANDONED_PREFILL and earlier >= threshold:
        return Cause.CLIENT_TIMEOUTS
    return cause


SLOWER = 4.0  # a prefill this many times slower than its calibration measured is throttled
QUIET = 50.0  # the rest of the machine under this % of one core: nothing else runs


def throttled(
    rate_tps: float | None,
    expected_tps: float | None,
    *,
    cpu: float | None,
    others: float | None,
    clamp: str | None,
    idle_below: float,
) -> Diagnosis | None:
    """A prefill far slower than its calibration, while its process works and nothing else on
    the machine explains it (the rest quiet), or the system is seen holding it back. The rate is
    the log's (which only corroborates); the process's CPU, the machine's and the clamp are
    signs no client writes."""
    if rate_tps is None or expected_tps is None or rate_tps <= 0:
        return None
    if rate_tps * SLOWER > expected_tps or cpu is None or cpu < idle_below:
        return None
    quiet = others is not None and others < QUIET
    if clamp is None and not quiet:
        return None  # other work on the machine may take its share: contention, not a clamp
    because = (
        f"its prefill runs at {rate_tps:,.0f} tokens/s, 1/{expected_tps / rate_tps:.0f} of the "
        f"{expected_tps:,.0f} its calibration measured there"
    )
    if quiet:
        because += f", while the rest of the machine is quiet ({others:.0f}% of a core)"
    if clamp is not None:
        because += f"; the system holds it back: {clamp}"
    return Diagnosis(Cause.THROTTLED, because)
