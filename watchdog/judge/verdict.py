"""An observation -> a state and a reason a person understands (its evidence: judge/evidence.py).
Pure: no I/O, `now` comes in."""

from __future__ import annotations

from dataclasses import dataclass, replace

from mlx_watchdog.config import ProbeSettings
from mlx_watchdog.judge.cause import (
    MIN_IDLE_READINGS,
    STATED,
    Cause,
    Diagnosis,
    Facts,
    diagnose,
)
from mlx_watchdog.judge.evidence import Evidence, evidence
from mlx_watchdog.judge.states import BAD_STATES, EXIT_CODES, State
from mlx_watchdog.sense.findings import (
    DEAD_FINDINGS,
    DOWN_FINDINGS,
    OK,
    Client,
    LoadReport,
    ModelsCheck,
    ProbeFinding,
    ProbeSnapshot,
)
from mlx_watchdog.sense.observation import Observation, leaked_requests
from mlx_watchdog.sense.signs import Signs


@dataclass(frozen=True)
class Verdict:
    """The judged state of a server, the reason in words, and the evidence."""

    state: State
    reason: str
    evidence: Evidence
    grounds: str = ""  # the reason before its cause was named ("": the reason names none)

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.state]


def judge(obs: Observation, settings: ProbeSettings, now: float) -> Verdict | None:
    """The state the observation shows, or None while it is too early to tell.

    "Too early" is a probe still waiting for less than `slow_after`: the caller keeps its last
    verdict. The probe is never what gives up; `wedge_after` is a threshold, not a timeout.
    """
    state, reason = _rule(obs, settings, now)
    if state is None:
        return None
    said = obs.prefill
    if said is not None and state in PREFILL_SHOWN and not said.finished:
        reason += f"; the server's log: {said.describe()}"
    found = cause_of(obs, state, settings, now) if state in BAD_STATES else None
    grounds = f"{state}: {reason}"
    named = found is not None and found.cause is not Cause.UNKNOWN
    return Verdict(
        state,
        f"{grounds}; cause: {found.describe()}" if named and found is not None else grounds,
        evidence(obs, now, found, idle_below=settings.idle_cpu_percent),
        grounds,
    )


def cause_of(obs: Observation, state: State, s: ProbeSettings, now: float) -> Diagnosis:
    """Why a failing server fails, from everything the observation holds."""
    probe, proc, load, models = obs.probe, obs.process, obs.load, obs.models
    health = load.health_body if load is not None else ""
    said = obs.prefill
    facts = Facts(
        state=str(state),
        kind=obs.kind,
        answered=any(
            x is not None
            for x in (
                models.status if models else None,
                load.health_status if load else None,
                probe.status,
            )
        ),
        answer=" ".join(p for p in (probe.detail, health) if p),
        health_unavailable=load is not None
        and load.health_status == 503
        and "unavailable" in health.lower(),
        abandoned=proc.abandoned or 0,
        leaked=leaked_requests(load, proc, fans_out=obs.fans_out),
        progressing=said is not None and not said.finished and said.age_s < s.slow_after,
        gone=state == State.DOWN and proc.pid is None and proc.local,
        empty_in=_empty_in(probe),
        served=obs.served,
        drained=drained(obs, s, now),
        model=probe.model,
        idle_below=s.idle_cpu_percent,
    )
    return diagnose(facts, obs.signs or Signs())


EMPTY = (ProbeFinding.ZERO_TOKENS, ProbeFinding.DONE_WITHOUT_TOKEN, ProbeFinding.NO_DATA_EVENTS)


def _empty_in(probe: ProbeSnapshot) -> float | None:
    """How long a 200 answer with no token took; None for any other answer."""
    if probe.finding not in EMPTY or probe.status != 200 or probe.done_at is None:
        return None
    return probe.done_at - probe.started_at


PREFILL_SHOWN = (State.BUSY, State.WEDGED, State.SLOW)  # states where a prefill explains


Judged = tuple[State | None, str]  # None: nothing to say yet (or about the server)


def _rule(obs: Observation, s: ProbeSettings, now: float) -> Judged:
    finding = obs.probe.finding
    if finding == ProbeFinding.LOADING:
        return _says_loading(obs, s, now)
    if finding == OK:
        ttft = obs.probe.ttft if obs.probe.ttft is not None else obs.probe.waited(now)
        note = _models_note(obs.models)
        if ttft > s.slow_after:
            return (
                State.SLOW,
                f"first token after {_s(ttft)} (slow_after is {_s(s.slow_after)}){note}",
            )
        return State.HEALTHY, f"first token in {_s(ttft)}{note}"
    if finding in DOWN_FINDINGS:
        proc, age = obs.process, obs.process.age(now)
        if age is not None and age < s.startup_grace and proc.pid is not None and not obs.served:
            return State.STARTING, f"PID {proc.pid} started {_s(age)} ago and is not answering yet"
        where = f"; {proc.error}" if proc.error and proc.pid is None else ""
        return State.DOWN, f"{DOWN_FINDINGS[finding]}{where}"
    if finding in DEAD_FINDINGS:
        detail = f" ({obs.probe.detail})" if obs.probe.detail else ""
        return State.DEAD, f"{DEAD_FINDINGS[finding]}{detail}"
    if finding not in (None, ProbeFinding.NO_RESPONSE):
        return None, ""  # aborted by the watchdog itself: says nothing about the server
    return _waiting(obs, s, now)


def _says_loading(obs: Observation, s: ProbeSettings, now: float) -> Judged:
    """The server said it is loading its model: starting, until startup_grace says down."""
    probe, proc = obs.probe, obs.process
    age = proc.age(now)
    loading_for = now - obs.loading_since if obs.loading_since is not None else None
    if age is None and loading_for is not None and loading_for >= s.startup_grace:
        return State.DOWN, (
            f"says it is loading its model, for {_s(loading_for)} now "
            f"(startup_grace is {_s(s.startup_grace)}): {probe.detail}"
        )
    if age is not None and age >= s.startup_grace:
        return State.DOWN, (
            f"still loading its model {_s(age)} after it started "
            f"(startup_grace is {_s(s.startup_grace)}): {probe.detail}"
        )
    since = f" (PID {proc.pid} started {_s(age)} ago)" if age is not None else ""
    return State.STARTING, f"the server says it is loading its model{since}"


def _waiting(obs: Observation, s: ProbeSettings, now: float) -> Judged:
    """The probe is waiting (or waited to the hard timeout) with no token."""
    probe, proc, load = obs.probe, obs.process, obs.load
    waited, age = probe.waited(now), proc.age(now)
    young = age is not None and age < s.startup_grace and not obs.served
    # A young process may still be loading its model, unless it served already, or clients
    # came and went or wait on it.
    if young and waited < s.startup_grace and not proc.abandoned and not proc.live:
        return (
            State.STARTING,
            f"PID {proc.pid} started {_s(age or 0)} ago; no token yet after {_s(waited)}",
        )
    if load is not None and load.ok and load.loaded == 0 and waited < s.startup_grace:
        return State.STARTING, f"{load.describe()}: it loads one for the probe"
    got = _bytes_note(probe)
    if _stated(obs, s, now):
        return State.WEDGED, (
            f"no token for {_s(waited)}{got}; a failure its log states is held up by a sign "
            "no client writes, so no wait for wedge_after"
        )
    if waited < s.slow_after:
        return None, ""
    if load is not None and _loading(load) and not _past_grace(age, waited, s):
        return State.STARTING, f"its health route answers {load.health_status}: loading"
    if load is not None and (load.health_status or 0) >= 500:
        return State.WEDGED, (
            f"no token for {_s(waited)}{got} and the server's own health route answers "
            f"{load.health_status} ({load.health_body.strip()[:80] or 'no body'})"
        )
    if proc.abandoned is None or proc.live is None:
        return _unseen_clients(obs, s, waited, got)
    abandoned, live = proc.abandoned, proc.live
    if waited < s.wedge_after:
        if live and not abandoned:
            return State.BUSY, (
                f"{_clients(live)} being served; the probe has waited {_s(waited)}"
                f"{_drain_note(obs, s, now)}"
            )
        held = f"; {_abandoned(abandoned)}" if abandoned else ""
        return State.SLOW, f"no token yet after {_s(waited)}{got}{held}"
    return _past_wedge_after(obs, s, now, got)


def _stated(obs: Observation, s: ProbeSettings, now: float) -> bool:
    """The server's log states a failure no wait cures (a thread's death, a Metal error) and a
    sign no client writes holds it up: judged at the look that shows both."""
    if obs.signs is None or not (obs.signs.errors or obs.signs.system_errors):
        return False
    return cause_of(obs, State.WEDGED, s, now).cause in STATED


def _unseen_clients(obs: Observation, s: ProbeSettings, waited: float, got: str) -> Judged:
    """No token, and the server's connections cannot be seen: busy up to max_busy."""
    proc, load = obs.process, obs.load
    why = proc.error or "its connections cannot be inspected"
    stalled = load.stalled() if load is not None and load.ok else None
    if load is not None and load.ok and load.queued and stalled is not None:
        why = f"{load.describe()}, last progress {_s(stalled)} ago"
    if waited >= s.max_busy:
        return (
            State.WEDGED,
            f"no token for {_s(waited)}{got}, longer than max_busy ({_s(s.max_busy)}); {why}",
        )
    return (
        State.BUSY,
        f"no token yet after {_s(waited)}{got}; {why}, so waiting up to max_busy ({_s(s.max_busy)})",
    )


def _past_wedge_after(obs: Observation, s: ProbeSettings, now: float, got: str) -> Judged:
    """No token for wedge_after: wedged, unless live clients keep a working server busy."""
    proc, load = obs.process, obs.load
    waited, abandoned, live = obs.probe.waited(now), proc.abandoned or 0, proc.live or 0
    lead = f"no token for {_s(waited)}{got} while {_models_state(obs.models)}"
    leaked = leaked_requests(load, proc, fans_out=obs.fans_out)
    leak_for = now - obs.leak_since if obs.leak_since is not None else 0.0
    if leaked > 0 and not abandoned and leak_for >= s.slow_after:
        return State.WEDGED, (
            f"{lead}; {load.describe() if load else ''} but only {_clients(live)} and the "
            f"probe are connected: {leaked} request{'s' if leaked != 1 else ''} "
            f"{'have' if leaked != 1 else 'has'} no client (for {_s(leak_for)})"
        )
    behind = queued_behind(obs, now)
    if abandoned and not behind:
        oldest = proc.oldest_abandoned(now)
        since = f" (the oldest seen for {_s(oldest)})" if oldest else ""
        verb = "hold" if abandoned != 1 else "holds"
        return State.WEDGED, f"{lead}; {_abandoned(abandoned)}{since} {verb} the server"
    if not live and obs.live_seen is not None and now - obs.live_seen < s.wedge_after:
        # Queued behind clients that were served: the wait counts from when the last left.
        return State.SLOW, (
            f"no token yet after {_s(waited)}{got}; its last client left "
            f"{_s(now - obs.live_seen)} ago, so the probe is next"
        )
    if not live:
        return State.WEDGED, f"{lead}; no other client is connected, so it serves nobody"
    idle = _idle_work(obs, s)
    if idle is not None:
        return State.WEDGED, f"{lead}; {_clients(live)} connected but {idle}"
    if waited >= s.max_busy:
        return (
            State.WEDGED,
            f"{lead}; busy with {_clients(live)} for longer than max_busy ({_s(s.max_busy)})",
        )
    stalled = load.stalled() if load is not None and load.ok else None
    cpu = _work_note(obs)
    said = f"; {load.describe()}" if load is not None and load.ok and load.queued else ""
    if behind:
        said += (
            f"; {_abandoned(behind)} sent after it wait{'s' if behind == 1 else ''} behind "
            "it, holding nobody up until it is served"
        )
    still = f", its progress counter still for {_s(stalled)}" if said and stalled else ""
    return State.BUSY, (
        f"{_clients(live)} being served{cpu}; the probe has waited {_s(waited)}{said}{still}"
        f"{_drain_note(obs, s, now)}"
    )


def _idle_work(obs: Observation, s: ProbeSettings) -> str | None:
    """Why the server works on nothing now, read where its work runs; None: it may work. The
    CPU: one look (Linux, `mlx[cpu]`). The GPU (a Mac): its time flat over MIN_IDLE_READINGS
    looks, as one long command may not move it for a while; unread, never idle."""
    work, cpu = obs.work, obs.process.cpu_percent
    if work is None or work.on == "cpu":
        if cpu is not None and cpu < s.idle_cpu_percent:
            return f"the process is idle (CPU {cpu:.1f}%)"
        return None
    last = obs.signs.work[-MIN_IDLE_READINGS:] if obs.signs is not None else ()
    if len(last) < MIN_IDLE_READINGS or any(r >= s.idle_cpu_percent for r in last):
        return None
    return f"its GPU time has not moved over {len(last)} looks (GPU {last[-1]:.1f}%)"


def _work_note(obs: Observation) -> str:
    work, cpu = obs.work, obs.process.cpu_percent
    if work is None or work.on == "cpu":
        return f" (CPU {cpu:.0f}%)" if cpu is not None else ""
    if work.percent is None and work.unknown:
        return f" (its GPU time cannot be read: {work.unknown}; its CPU says nothing here)"
    return f" (GPU {work.percent:.0f}%)" if work.percent is not None else ""


QUEUE_GAP = 0.05  # s: a request whose last byte came this much later was sent after the other


def queued_behind(obs: Observation, now: float) -> int:
    """Abandoned requests that were all sent after a live client the server still owes an
    answer: queued behind the work of someone who waits, they hold nobody up until it is done
    (a tiny request that left behind a patient client's long prompt is no wedge). Told by the
    kernel's byte counts (a request received, its answer not yet sent) and their order; 0
    where either cannot be read, and the abandoned work is judged as before."""
    clients = obs.process.clients
    left = [c for c in clients if c.status == "abandoned"]
    ahead = [c.sent for c in clients if c.status == "live" and _owed(c, now)]
    if not left or not ahead or any(c.received is None for c in left):
        return 0
    return len(left) if min(c.sent for c in left) > min(ahead) + QUEUE_GAP else 0


def _owed(c: Client, now: float) -> bool:
    """A live client that asked (it sent bytes) and is owed its answer: nothing sent back
    since its request came, or being sent to now (an idle keep-alive connection is neither)."""
    if not c.received or c.sent_at is None:
        return False
    if c.answered_at is None:
        return True
    return c.answered_at < c.sent_at or now - c.answered_at < FED_WITHIN


FED_WITHIN = 1.0  # s: a connection the server sent data this recently is being answered now


def drained(obs: Observation, s: ProbeSettings, now: float) -> int:
    """Connections a batched mlx_lm server is answering now (the kernel's count of what it sent
    them, a sign no client writes) while the probe, past slow_after, has had no byte: it takes
    no new request. mlx-lm 0.32.2 drains its batch before a request it cannot batch (a seed, an
    image, another model: server.py `drain_batch`) and reads none until the batch ends. 0 where
    not seen, or where the server serves one request at a time anyway (--draft-model)."""
    probe, proc = obs.probe, obs.process
    if obs.kind != "mlx_lm" or "--draft-model" in proc.cmdline or probe.bytes or probe.done:
        return 0
    if probe.waited(now) < s.slow_after:
        return 0
    return sum(
        1
        for c in proc.clients
        if c.status == "live" and c.answered_at is not None and now - c.answered_at < FED_WITHIN
    )


def _drain_note(obs: Observation, s: ProbeSettings, now: float) -> str:
    n = drained(obs, s, now)
    if not n:
        return ""
    return (
        f"; it takes no new request: {n} connection{'s are' if n != 1 else ' is'} sent tokens "
        "while the probe has had nothing (mlx-lm drains its batch before a request it cannot "
        "batch: one with a seed, an image, another model)"
    )


def _past_grace(age: float | None, waited: float, s: ProbeSettings) -> bool:
    """Whatever the server says, "starting" ends with startup_grace: by the process's age, or
    by the probe's wait when the process cannot be seen."""
    return (age if age is not None else waited) >= s.startup_grace


def _loading(load: LoadReport) -> bool:
    return load.health_status == 503 and "loading" in load.health_body.lower()


def _models_note(models: ModelsCheck | None) -> str:
    # An empty body is mlx_lm.server's missing cache folder: harmless to serving, said once by
    # `status` and `doctor` with its fix, not on every healthy line.
    if models is None or models.ok or models.finding == "empty_body":
        return ""
    return f"; but /v1/models: {models.finding} ({models.detail})"


def _models_state(models: ModelsCheck | None) -> str:
    if models is None:
        return "/v1/models was not checked"
    if models.ok or models.finding == "not_listed":
        return f"/v1/models answers {models.status}"
    if models.status is not None:
        return f"/v1/models answers {models.status} with {models.finding.replace('_', ' ')}"
    return f"/v1/models fails too ({models.finding})"


def _bytes_note(probe: ProbeSnapshot) -> str:
    if probe.keepalives:
        return f" ({probe.keepalives} keepalives, {probe.bytes} bytes)"
    if probe.bytes:
        return f" ({probe.bytes} bytes)"
    return ""


def _clients(n: int) -> str:
    return f"{n} live client{'s' if n != 1 else ''}"


def _abandoned(n: int) -> str:
    return f"{n} abandoned request{'s' if n != 1 else ''}"


def _s(seconds: float) -> str:
    if seconds < 1:
        return f"{seconds * 1000:.0f} ms"
    if seconds < 100:
        return f"{seconds:.1f} s"
    return f"{seconds:.0f} s"


def renamed(v: Verdict, found: Diagnosis) -> Verdict:
    """The verdict with its cause named anew, after its grounds (never parsed from its words)."""
    grounds = v.grounds or v.reason
    evidence = replace(v.evidence, cause=str(found.cause), cause_because=found.because)
    return replace(
        v, reason=f"{grounds}; cause: {found.describe()}", evidence=evidence, grounds=grounds
    )
