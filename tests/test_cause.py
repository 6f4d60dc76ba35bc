"""A cause on every failing verdict, from the evidence that decides it; never one weak sign."""

from __future__ import annotations

import hashlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_watchdog.act.check import judged
from mlx_watchdog.config import parse_config
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.judge.cause import Cause, Facts, budget_spent, diagnose, recurring
from mlx_watchdog.judge.verdict import Verdict
from mlx_watchdog.record.document import Status, WatchdogLine
from mlx_watchdog.sense.memory import MemoryWatch
from mlx_watchdog.sense.round import Checker
from mlx_watchdog.sense.signs import LogError, Machine, Signs, StackSample, ThreadStack, log_error
from mlx_watchdog.sense.stack import Stacker, parse_py_spy
from tests.builders import badserver_argv, watchdog_config, watched
from tests.conftest import DaemonThread, Running, free_port, until

GIB = 1 << 30
SPY_ALIVE = """Process 19707: python -m mlx_lm.server --model m --port 8080
Python v3.11.7 (/usr/bin/python3.11)

Thread 19707 (idle): "MainThread"
    _PollLikeSelector.select (selectors.py:415)
    BaseServer.serve_forever (socketserver.py:233)
Thread 19710 (active): "Thread-1 (_run_generate)"
    eval (mlx_lm/generate.py:401)
    ResponseGenerator._generate (mlx_lm/server.py:811)
    ResponseGenerator._run_generate (mlx_lm/server.py:544)
    Thread.run (threading.py:982)
"""
SPY_GONE = SPY_ALIVE[: SPY_ALIVE.index("Thread 19710")]
GEN = ThreadStack("Thread-1 (_run_generate)", ("eval", "ResponseGenerator._generate"), False)
MAIN = ThreadStack("MainThread", ("select",), True)
WEDGED = Facts(state="wedged", kind="mlx_lm", answered=True)


def test_py_spy_threads_are_parsed_and_the_generation_thread_found() -> None:
    threads = parse_py_spy(SPY_ALIVE)
    assert threads is not None and [t.name for t in threads] == [
        "MainThread",
        "Thread-1 (_run_generate)",
    ]
    assert threads[1].frames[0] == "eval" and threads[1].idle is False
    assert StackSample(threads).generation == threads[1]
    gone = parse_py_spy(SPY_GONE)
    assert gone is not None and StackSample(gone).generation is None
    assert parse_py_spy("py-spy: Permission denied (os error 13)") is None
    # Outside text: escapes are shown, never acted on.
    hostile = parse_py_spy('Thread 1 (idle): "bad\x1b[2Jname"\n    f\x07 (x.py:1)\n')
    assert (
        hostile is not None and "\x1b" not in hostile[0].name and "\x07" not in hostile[0].frames[0]
    )


@pytest.mark.parametrize(
    ("line", "kind"),
    [
        (
            "2026-12-05 13:59:52,614 - ERROR - mlx_lm.server generation thread died: boom",
            "thread_gone",
        ),
        ("libc++abi: terminating: [metal::malloc] Resource limit (499000) exceeded.", "metal"),
        (
            "Error: command buffer exited with error status. kIOGPUCommandBufferCallbackErrorTimeout",
            "metal",
        ),
        ("[METAL] Command buffer execution failed: GPU Timeout Error", "metal"),
        (
            "panic(cpu 2 caller 0xfffffe): IOGPUMemory.cpp:492 completeMemory() prepare count underflow",
            "metal",
        ),
        ("ggml_metal_graph_compute: command buffer 0 failed with status 5", "metal"),
    ],
)
def test_known_failure_lines_are_recognised(line: str, kind: str) -> None:
    found = log_error(line)
    assert found is not None and found.kind == kind


def test_ordinary_lines_are_not_failures() -> None:
    for line in (
        "2026-12-05 13:59:23,275 - INFO - Prompt processing progress: 6/7",
        '127.0.0.1 - - [05/Dec/2026 13:59:23] "POST /v1/chat/completions HTTP/1.1" 200 -',
        "metal device: Apple M2 Max",
    ):
        assert log_error(line) is None


def test_each_cause_from_what_decides_it() -> None:
    died = LogError("thread_gone", "mlx_lm.server generation thread died: boom")
    still = (0.5, 0.0, 1.2)  # the process idle over the wait: what no client writes
    said_died = diagnose(WEDGED, Signs(errors=(died,), work=still))
    assert said_died.cause is Cause.THREAD_GONE
    assert said_died.because.endswith("; the process idle and nothing moving")
    answer = replace(WEDGED, state="dead", answer='{"error": "generation thread died"}')
    assert diagnose(answer, Signs()).cause is Cause.THREAD_GONE
    no_thread = Signs(stack=StackSample((MAIN,)), work=still)
    assert diagnose(WEDGED, no_thread).cause is Cause.THREAD_GONE
    metal = LogError("metal", "[metal::malloc] Resource limit (499000) exceeded")
    said = diagnose(WEDGED, Signs(errors=(metal,), work=still))
    assert said.cause is Cause.METAL_ERROR and "Resource limit" in said.because
    for held, facts in (
        ("it answers the probe wrongly", replace(WEDGED, state="dead")),
        ('/health answers 503 "unavailable"', replace(WEDGED, health_unavailable=True)),
        ("its process is gone", replace(WEDGED, state="down", gone=True)),
    ):
        named = diagnose(facts, Signs(errors=(metal,)))
        assert named.cause is Cause.METAL_ERROR and named.because.endswith(held)
    idle = Signs(stack=StackSample((MAIN, GEN)), work=(0.5, 0.0, 1.2))
    deadlock = diagnose(WEDGED, idle)
    assert deadlock.cause is Cause.DEADLOCK and "eval" in deadlock.because
    assert diagnose(replace(WEDGED, abandoned=2), Signs()).cause is Cause.ABANDONED_PREFILL
    assert diagnose(replace(WEDGED, leaked=1), Signs()).cause is Cause.LEAKED_REQUEST
    full = Machine(64 * GIB, 2 * GIB, 8 * GIB, 3 * GIB, swap_grew=GIB)
    assert diagnose(WEDGED, Signs(machine=full)).cause is Cause.MEMORY_PRESSURE
    gone = Facts(state="down", kind="mlx_lm", answered=False, gone=True)
    assert diagnose(gone, Signs()).cause is Cause.EXITED
    assert diagnose(WEDGED, Signs()).cause is Cause.UNKNOWN


def test_the_servers_own_words_outrank_the_sockets() -> None:
    """A thread that died with a client still connected is not an abandoned prefill: waiting
    for that client's work would wait for nothing."""
    died = LogError("thread_gone", "generation thread died: x")
    facts = replace(WEDGED, abandoned=1, health_unavailable=True)
    assert diagnose(facts, Signs(errors=(died,))).cause is Cause.THREAD_GONE
    # The line alone, as any client can have it logged: the sockets decide.
    alone = diagnose(replace(WEDGED, abandoned=1), Signs(errors=(died,)))
    assert alone.cause is Cause.ABANDONED_PREFILL


# Each alone is weak: another server version names its thread otherwise, an idle process may
# be between requests, a machine may be full and serve well, a 503 may mean anything elsewhere.
WEAK_SIGNS: dict[str, tuple[Facts, Signs]] = {
    "a stack without the thread while a prefill moves": (
        replace(WEDGED, progressing=True),
        Signs(stack=StackSample((MAIN,))),
    ),
    "a stack without the thread, the server not answering": (
        replace(WEDGED, answered=False),
        Signs(stack=StackSample((MAIN,))),
    ),
    "an idle CPU": (WEDGED, Signs(work=(0.0, 0.0, 0.0, 0.0))),
    # A log line, even in the server's own shape, may be a client's (a raw body, a newline).
    "a log line of the thread's death alone": (
        WEDGED,
        Signs(errors=(LogError("thread_gone", "mlx_lm.server generation thread died: x"),)),
    ),
    "a Metal line alone, the process working": (
        WEDGED,
        Signs(errors=(LogError("metal", "[metal::malloc] Resource limit (1) exceeded"),)),
    ),
    "the generation thread, idle, too few looks": (
        WEDGED,
        Signs(stack=StackSample((MAIN, GEN)), work=(0.0, 0.0)),
    ),
    "low memory": (WEDGED, Signs(machine=Machine(64 * GIB, 2 * GIB, 8 * GIB, 0))),
    "swap in use": (WEDGED, Signs(machine=Machine(64 * GIB, 30 * GIB, 8 * GIB, 6 * GIB))),
    "another kind's 503": (
        replace(WEDGED, kind="llama.cpp", health_unavailable=True, answered=False),
        Signs(),
    ),
    "a stack without the thread while HTTP answers, the process working": (
        WEDGED,
        Signs(stack=StackSample((MAIN,)), work=(90.0, 100.0, 100.0)),
    ),
    "a stack of another kind without the thread": (
        replace(WEDGED, kind="llama.cpp"),
        Signs(stack=StackSample((MAIN,))),
    ),
}


@pytest.mark.parametrize("name", sorted(WEAK_SIGNS))
def test_one_weak_sign_names_no_cause(name: str) -> None:
    facts, signs = WEAK_SIGNS[name]
    assert diagnose(facts, signs).cause is Cause.UNKNOWN


@given(
    cpu=st.lists(st.floats(0, 100), max_size=6),
    available=st.integers(0, 64),
    swap_used=st.integers(0, 8),
    progressing=st.booleans(),
)
def test_no_cause_is_named_from_absent_or_machine_signs_alone(
    cpu: list[float], available: int, swap_used: int, progressing: bool
) -> None:
    """Without the server's own words, a stack, sockets or a machine both full and swapping,
    nothing is named, whatever CPU and memory say one at a time."""
    machine = Machine(64 * GIB, available * GIB, 8 * GIB, swap_used * GIB)
    facts = replace(WEDGED, progressing=progressing)
    found = diagnose(facts, Signs(work=tuple(cpu), machine=machine)).cause
    assert found in (Cause.UNKNOWN, Cause.MEMORY_PRESSURE)
    if found is Cause.MEMORY_PRESSURE:
        assert machine.low and machine.swapping


def test_a_wedge_back_after_cures_is_the_clients_timeouts() -> None:
    assert recurring(Cause.ABANDONED_PREFILL, 1) is Cause.ABANDONED_PREFILL
    assert recurring(Cause.ABANDONED_PREFILL, 2) is Cause.CLIENT_TIMEOUTS
    assert recurring(Cause.DEADLOCK, 5) is Cause.DEADLOCK


def test_a_spent_budget_says_whether_each_restart_cured_it() -> None:
    cured = budget_spent(3, 3600, 3, Cause.CLIENT_TIMEOUTS)
    assert cured.startswith("3 wedges in the last 3600 s, each cured by a restart")
    assert "clients time out" in cured and "calibrate" in cured and "did not help" not in cured
    failed = budget_spent(3, 3600, 1, Cause.UNKNOWN, refill_in=1500)
    assert failed.startswith("3 restarts in the last 3600 s: 1 brought it back for a while, 2")
    assert "next is allowed in 25 min at the latest" in failed
    assert "a person is needed" not in failed  # said by the note that shows it: once
    none = budget_spent(2, 3600, 0, Cause.DEADLOCK)
    assert none.startswith("2 restarts in the last 3600 s did not bring it back (")
    # A person's restart counts against the budget, named as what it was.
    asked = budget_spent(3, 3600, 1, Cause.UNKNOWN, asked=1)
    assert asked.startswith(
        "3 restarts in the last 3600 s (1 asked for by a person or a reload): 1 brought it back"
    )


# -- the checker against a server that hangs, each sign from a stand-in ------------------------


def spy(tmp_path: Path, text: str) -> Callable[[int], list[str]]:
    """A stand-in stack tool: prints `text` as py-spy would."""
    out = tmp_path / "stack.txt"
    out.write_text(text)
    return lambda pid: [sys.executable, "-c", f"print(open({str(out)!r}).read())"]


def judge_until_wedged(checker: Checker, pid: int, looks: int = 4) -> Verdict:
    """Judge every 0.25 s until wedged `looks` times (each look is one CPU reading)."""
    wedged: list[Verdict] = []
    deadline = time.monotonic() + 30
    while len(wedged) < looks and time.monotonic() < deadline:
        v = judged(checker, pid)
        if v is not None and v.state == "wedged":
            wedged.append(v)
        time.sleep(0.25)
    assert wedged, "never judged wedged"
    return wedged[-1]


def no_memory() -> Machine | None:
    return None


def test_a_metal_error_in_the_log_names_the_cause(
    tmp_path: Path, bad_server: Callable[..., Running]
) -> None:
    srv = bad_server("hang")
    log = tmp_path / "server.log"
    log.write_text("2026-12-05 10:00:00,000 - INFO - Starting httpd\n")
    # wedge_after a minute away: a failure the log states is judged at the look that holds it up
    server = replace(
        watched(srv.url, hard_timeout=120.0, wedge_after=60.0, max_busy=90.0), log_file=log
    )
    stacker = Stacker(command=lambda pid: None)
    checker = Checker(server, stacker=stacker, memory=MemoryWatch(no_memory))
    judged(checker, srv.proc.pid)  # the first look reads the log to its end
    with log.open("a") as fh:
        fh.write("libc++abi: terminating: [metal::malloc] Resource limit (499000) exceeded\n")
    # Held up by the process idle its last looks (no client can write that): named once the
    # looks show it, each a CPU reading (answering the watchdog's own requests costs a little).
    named: list[Verdict] = []

    def metal() -> bool:
        v = judged(checker, srv.proc.pid)
        named[:] = [v] if v is not None else []
        return v is not None and v.evidence.cause == "metal_error"

    until(metal, 30, "the Metal error named", step=0.25)
    (v,) = named
    assert "cause: a Metal (GPU) error (its log: " in v.reason and "499000" in v.reason
    assert v.state == "wedged" and "no wait for wedge_after" in v.reason
    checker.abort()


def test_a_stack_without_the_generation_thread_names_it_gone(
    tmp_path: Path, bad_server: Callable[..., Running]
) -> None:
    srv = bad_server("hang")
    stacker = Stacker(every=0.0, command=spy(tmp_path, SPY_GONE))
    checker = Checker(
        watched(srv.url, hard_timeout=60.0), stacker=stacker, memory=MemoryWatch(no_memory)
    )
    named: list[Verdict] = []

    def gone() -> bool:  # once the looks show the process idle (a sign no client writes)
        v = judged(checker, srv.proc.pid)
        named[:] = [v] if v is not None else []
        return v is not None and v.evidence.cause == "generation_thread_gone"

    until(gone, 30, "the lost thread named", step=0.25)
    (v,) = named
    assert "no generation thread, while HTTP still answers" in (v.evidence.cause_because or "")
    checker.abort()


THREAD_DIED_LINE = (
    "2026-12-05 10:00:01,000 - ERROR - mlx_lm.server generation thread died: unhashable type\n"
)


def stated_checker(tmp_path: Path, srv: Running, stack: str) -> tuple[Checker, Path]:
    """A checker whose wedge_after is a minute away, reading a log the test writes to."""
    log = tmp_path / "server.log"
    log.write_text("2026-12-05 10:00:00,000 - INFO - Starting httpd\n")
    spans = {"hard_timeout": 120.0, "wedge_after": 60.0, "max_busy": 90.0}
    server = replace(watched(srv.url, **spans), log_file=log)
    stacker = Stacker(every=0.0, command=spy(tmp_path, stack))
    checker = Checker(server, stacker=stacker, memory=MemoryWatch(no_memory))
    judged(checker, srv.proc.pid)  # the first look reads the log to its end
    return checker, log


def test_a_death_the_log_states_is_judged_at_once_not_after_wedge_after(
    tmp_path: Path, bad_server: Callable[..., Running]
) -> None:
    """Older mlx-lm: the thread dies, /health stays 200, the probe hangs. The log's line and a
    stack without the thread decide at the look that reads them, a minute before wedge_after."""
    srv = bad_server("hang")
    checker, log = stated_checker(tmp_path, srv, SPY_GONE)
    with log.open("a") as fh:
        fh.write(THREAD_DIED_LINE)
    started = time.monotonic()
    named: list[Verdict] = []

    def gone() -> bool:
        v = judged(checker, srv.proc.pid)
        named[:] = [v] if v is not None else []
        return v is not None and v.state == "wedged"

    until(gone, 30, "the stated death judged", step=0.25)
    assert time.monotonic() - started < 10  # wedge_after is 60 s
    (v,) = named
    assert v.evidence.cause == "generation_thread_gone", v.reason
    assert "no wait for wedge_after" in v.reason and "unhashable type" in v.reason
    checker.abort()


def test_a_stated_death_a_working_server_contradicts_waits_for_wedge_after(
    tmp_path: Path, bad_server: Callable[..., Running]
) -> None:
    """The same line (a client can write it) while the stack has the generation thread and the
    process works: nothing is judged before wedge_after, no cause named."""
    srv = bad_server("hang", extra=("--busy-generation",))
    checker, log = stated_checker(tmp_path, srv, SPY_ALIVE)
    with log.open("a") as fh:
        fh.write(THREAD_DIED_LINE)
    verdicts: list[Verdict | None] = []

    def twelve() -> bool:
        verdicts.append(judged(checker, srv.proc.pid))
        return len(verdicts) >= 12

    until(twelve, 30, "twelve looks", step=0.25)
    assert checker.work_over_wait and sum(checker.work_over_wait) / len(checker.work_over_wait) > 5
    states = {v.state for v in verdicts if v is not None}
    assert states <= {"slow"}, [v.reason for v in verdicts if v is not None]
    assert not any(v is not None and v.evidence.cause for v in verdicts)
    checker.abort()


def test_an_idle_generation_thread_over_the_wait_is_a_deadlock(
    bad_server: Callable[..., Running],
) -> None:
    """The real py-spy on our server, laid out as mlx_lm.server's threads: its generation
    thread waits forever on an event, the process idle, nothing logged."""
    srv = bad_server("hang")
    checker = Checker(
        watched(srv.url, hard_timeout=60.0),
        stacker=Stacker(every=0.0),
        memory=MemoryWatch(no_memory),
    )
    v = judge_until_wedged(checker, srv.proc.pid, looks=6)
    assert v.evidence.cause == "deadlock", (v.reason, checker.work_over_wait)
    assert re.search(
        r"its generation thread sits in \S*wait while the process stays idle", v.reason
    )
    checker.abort()


def test_memory_pressure_from_a_stand_in_reading(bad_server: Callable[..., Running]) -> None:
    srv = bad_server("hang")
    readings = iter([3 * GIB, 4 * GIB] + [5 * GIB] * 100)

    def full() -> Machine:
        return Machine(64 * GIB, GIB, 8 * GIB, next(readings))

    checker = Checker(
        watched(srv.url, hard_timeout=60.0),
        stacker=Stacker(command=lambda pid: None),
        memory=MemoryWatch(full),
    )
    v = judge_until_wedged(checker, srv.proc.pid, looks=3)
    assert v.evidence.cause == "memory_pressure", v.reason
    assert "1.0 GiB of 64.0 GiB memory available" in v.reason
    assert "+2.0 GiB during the wait" in v.reason
    checker.abort()


def test_incidents_are_counted_by_cause() -> None:
    """A fleet counts causes: the detected event's cause is the metric's label."""
    from mlx_watchdog.record.metrics import Metrics

    metrics = Metrics(lambda: Status(WatchdogLine()))
    metrics.event("s", "detected", {"cause": "deadlock"})
    metrics.event("s", "detected", {"cause": "deadlock"})
    metrics.event("s", "detected", {})
    metrics.event("s", "restarting", {"cause": "deadlock", "trigger": "wedged"})
    text = metrics.exposition()[0].decode()
    assert 'mlx_watchdog_incidents_total{cause="deadlock",server="s"} 2.0' in text
    assert 'mlx_watchdog_incidents_total{cause="unknown",server="s"} 1.0' in text


# -- a GPU reset: 200 with no token, at once, from a process that served ------------------------


def test_an_empty_answer_names_a_gpu_reset_only_from_a_process_that_served() -> None:
    dead = Facts(state="dead", kind="ollama", answered=True, empty_in=0.18, served=True)
    found = diagnose(dead, Signs(gpu_events=("gpuEvent-2026-12-05-101500.ips",)))
    assert found.cause is Cause.GPU_RESET
    assert "200 with no token in 180 ms" in found.because
    assert "gpuEvent-2026-12-05-101500.ips" in found.because
    # Never served: a model that answers nothing from its start, not a reset.
    assert diagnose(replace(dead, served=False), Signs()).cause is Cause.UNKNOWN
    # Any other failing answer is not an empty one.
    assert diagnose(replace(dead, empty_in=None), Signs()).cause is Cause.UNKNOWN
    # A log line of a Metal failure with it is the more specific cause.
    metal = Signs(errors=(LogError("metal", "[METAL] Command buffer execution failed"),))
    assert diagnose(dead, metal).cause is Cause.METAL_ERROR


def test_gpu_event_reports_are_read_by_name_and_time_and_bounded(tmp_path: Path) -> None:
    from mlx_watchdog.sense import gpu_events as ge

    system, retired, absent = tmp_path / "sys", tmp_path / "sys" / "Retired", tmp_path / "none"
    retired.mkdir(parents=True)
    for folder, name, at in [
        (system, "gpuEvent-2026-12-05-100000.ips", 1000.0),  # before the process started
        (retired, "gpuEvent-2026-12-05-110000.ips", 2000.0),
        (system, "gpuEvent-2026-12-05-120000.ips", 3000.0),
        (system, "python3.11-2026-12-05-120000.ips", 3000.0),  # a crash report: not a GPU event
        (system, "gpuEvent-notes.txt", 3000.0),
    ]:
        path = folder / name
        path.write_text("{}")
        os.utime(path, (at, at))
    found = ge.gpu_events(1500.0, [system, retired, absent])
    assert found == ("gpuEvent-2026-12-05-120000.ips", "gpuEvent-2026-12-05-110000.ips")
    for n in range(10):
        (retired / f"gpuEvent-{n}.ips").write_text("{}")
    assert len(ge.gpu_events(0.0, [retired])) == ge.KEPT
    # Elsewhere than macOS there are no such folders to read.
    assert ge.report_folders() == () or sys.platform == "darwin"


def test_a_gpu_reset_is_named_and_cured_by_a_restart(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    """The stand-in's GPU is reset (SIGUSR2): every answer then 200 with no token in 180 ms,
    as Ollama's runner after one (ollama #18213). Named, restarted, serving again."""
    port = free_port()
    server = {
        "name": "g",
        "url": f"http://127.0.0.1:{port}",
        "manager": "process",
        "match": "badserver",
        "command": badserver_argv(port, "ok"),
        "probe": {"slow_after": "500ms", "wedge_after": "1s", "startup_grace": "10s"},
    }
    t = run_daemon(Daemon(parse_config(watchdog_config(tmp_path / "state", [server]))).open())
    w = t.daemon.cycles["g"]
    until(lambda: w.verdict is not None and w.verdict.state == "healthy", 30, "it serves")
    pid = w.manager.pid()
    assert pid is not None
    os.kill(pid, signal.SIGUSR2)
    store = t.daemon.store
    until(lambda: [r.outcome for r in store.restarts("g", 0.0)] == ["recovered"], 30, "cured")
    (incident,) = store.incidents(0.0)
    assert incident.state == "dead" and incident.evidence["cause"] == "gpu_reset", incident.reason
    assert "where this same process gave tokens before" in incident.evidence["cause_because"]
    assert w.manager.pid() != pid


# -- throttled: a prefill far slower than its calibration, the system holding it back -----------


def test_a_prefill_far_below_its_calibration_is_throttled_only_when_nothing_else_explains_it() -> (
    None
):
    from mlx_watchdog.judge.cause import throttled

    working = {"cpu": 95.0, "idle_below": 5.0}
    found = throttled(250.0, 2000.0, others=10.0, clamp="nice 15", **working)
    assert found is not None and found.cause is Cause.THROTTLED
    assert "250 tokens/s, 1/8 of the 2,000" in found.because
    assert "quiet (10% of a core)" in found.because and "holds it back: nice 15" in found.because
    # The system seen holding it back names it even on a busy machine ...
    assert throttled(250.0, 2000.0, others=180.0, clamp="nice 15", **working) is not None
    # ... but a busy machine with no clamp is contention, not a throttle.
    assert throttled(250.0, 2000.0, others=180.0, clamp=None, **working) is None
    # Slower by less than 4x, an idle process, no calibration: not it.
    assert throttled(600.0, 2000.0, others=10.0, clamp="nice 15", **working) is None
    assert throttled(250.0, 2000.0, cpu=1.0, idle_below=5.0, others=10.0, clamp="x") is None
    assert throttled(250.0, None, others=10.0, clamp="nice 15", **working) is None


def test_the_calibrated_rate_is_its_curves_slope_where_the_prefill_is() -> None:
    from mlx_watchdog.judge.estimate import calibrated_rate

    linear = {"fit": {"a": 0.2, "b": 1 / 2000, "c": 0.0}}
    assert calibrated_rate(linear, 8000) == pytest.approx(2000.0)
    slowing = {"fit": {"a": 0.0, "b": 1 / 2000, "c": 1e-8}}  # attention grows with the context
    assert calibrated_rate(slowing, 50_000) == pytest.approx(1 / (1 / 2000 + 1e-3))
    for bad in (None, {}, {"fit": {"b": "x", "c": 0}}, {"fit": {"b": 0, "c": 0}}, {"fit": 3}):
        assert calibrated_rate(bad, 1000) is None


def test_a_niced_process_is_seen_held_back_and_a_cgroup_quota_read() -> None:
    from mlx_watchdog.sense import sched

    if sys.platform == "darwin":
        pytest.skip("macOS reads ps -o pri=, not nice")
    ours = os.nice(0)
    child = subprocess.Popen(["nice", "-n", "15", "sleep", "30"])
    try:
        until(lambda: psutil.Process(child.pid).name() == "sleep", 10, "nice to exec sleep")
        said = sched.clamp(child.pid)
        assert said is not None and f"nice {min(19, ours + 15)}" in said
    finally:
        child.kill()
        child.wait()
    if ours < sched.NICE_CLAMPS:
        held = sched.clamp(os.getpid())
        assert held is None or "nice" not in held


@pytest.mark.parametrize("manager", ["none", "command"])
def test_the_listeners_limits_are_read_whichever_manager_runs_it(
    tmp_path: Path,
    manager: str,
    bad_server: Callable[..., Running],
    run_daemon: Callable[[object], DaemonThread],
) -> None:
    """Issue 54: under manager "none" or "command" the manager knows no PID, and no stack or
    limit was ever read, so a wedge that "process" names was unknown there. They are read from
    the process that holds the port."""
    if sys.platform == "darwin":
        pytest.skip("macOS reads ps -o pri=, not nice")
    srv = bad_server("hang", under=("nice", "-n", "15"))
    server: dict[str, object] = {
        "name": "h",
        "url": srv.url,
        "manager": manager,
        "probe": {"slow_after": "300ms", "wedge_after": "1s", "startup_grace": "1s"},
    }
    if manager == "command":
        server["restart_command"] = ["false"]
    state = tmp_path / "state"
    t = run_daemon(Daemon(parse_config(watchdog_config(state, [server], interval="300ms"))).open())
    w = t.daemon.cycles["h"]

    def clamped() -> bool:
        v = w.verdict
        return v is not None and v.state == "wedged" and "nice" in (v.evidence.clamp or "")

    until(clamped, 30, "the wedge judged with the listener's limits")
    assert w.verdict is not None and w.verdict.evidence.pid == srv.proc.pid


def test_a_cpu_quota_under_a_core_is_read_from_the_process_cgroup(tmp_path: Path) -> None:
    from mlx_watchdog.sense.sched import _cpu_quota

    (tmp_path / "proc/42").mkdir(parents=True)
    (tmp_path / "proc/42/cgroup").write_text("0::/user.slice/mlx.service\n")
    group = tmp_path / "sys/fs/cgroup/user.slice/mlx.service"
    group.mkdir(parents=True)
    (group / "cpu.max").write_text("50000 100000\n")
    assert _cpu_quota(42, tmp_path) == "a CPU quota of 0.5 of a core (cgroup cpu.max)"
    (group / "cpu.max").write_text("max 100000\n")
    assert _cpu_quota(42, tmp_path) is None
    (group / "cpu.max").write_text("200000 100000\n")  # two cores: no clamp for one process
    assert _cpu_quota(42, tmp_path) is None
    assert _cpu_quota(43, tmp_path) is None


def test_a_throttled_prefill_is_named_with_the_key_to_set(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    """The stand-in prefills at 250 tokens/s under `nice -n 15`, where its calibration
    measured 2,000: an abandoned prompt's wedge is named throttled, with what holds it back."""
    from tests.builders import restarts_took

    port = free_port()
    state = tmp_path / "state"
    server = {
        "name": "t",
        "url": f"http://127.0.0.1:{port}",
        "manager": "process",
        "match": "badserver",
        "command": ["nice", "-n", "15", *badserver_argv(port, "prefill", "--rate", "250")],
        "log_file": str(tmp_path / "server.log"),
        "probe": {"slow_after": "500ms", "wedge_after": "1s", "startup_grace": "10m"},
    }
    restarts_took(state, "t", 60.0)  # a restart costs more: the wedge is waited for
    from mlx_watchdog.record.store import Store

    store = Store(state / "history.db")
    store.save_calibration("t", time.time(), {"fit": {"a": 0.1, "b": 1 / 2000, "c": 0.0}})
    store.close()
    t = run_daemon(Daemon(parse_config(watchdog_config(state, [server], interval="300ms"))).open())
    w = t.daemon.cycles["t"]
    until(lambda: w.verdict is not None and w.verdict.state == "healthy", 30, "it serves")
    from mlx_watchdog.demo.run import send

    assert send(f"http://127.0.0.1:{port}", "word " * 3000, timeout=0.3) == "gave up"
    until(lambda: t.daemon.store.incidents(0.0), 30, "the wedge")

    def named() -> bool:
        v = w.verdict
        return v is not None and v.evidence.cause == "throttled"

    until(named, 30, "the throttle named")
    assert w.verdict is not None
    because = w.verdict.evidence.cause_because or ""
    assert "1/8 of the 2,000 its calibration measured" in because, because
    assert "nice 15" in because
    from mlx_watchdog.serve.page import _notes

    page = " ".join(_notes(t.daemon.status().servers[0]))
    assert "Cause: the system throttles the server" in page and "ProcessType" in page, page


# -- one model of several wedged: unloaded, the server and its other models kept ----------------


def ollama_like(tmp_path: Path, port: int) -> dict[str, object]:
    """A server entry for the Ollama stand-in (tests/ollamalike.py), run by the daemon."""
    (tmp_path / "blobs").mkdir(exist_ok=True)
    argv = [
        sys.executable,
        str(Path(__file__).parent / "ollamalike.py"),
        "--port",
        str(port),
        "--models",
        "stuck-model,other-model",
        "--blobs",
        str(tmp_path / "blobs"),
        "--wedge-file",
        str(tmp_path / "wedge"),
    ]
    return {
        "name": "o",
        "url": f"http://127.0.0.1:{port}",
        "kind": "ollama",
        "model": "stuck-model",
        "manager": "process",
        "match": "ollamalike",
        "command": argv,
        "probe": {"slow_after": "500ms", "wedge_after": "2s", "startup_grace": "10s"},
    }


def runners(pid: int) -> dict[str, int]:
    """The stand-in's runners by the blob each loads."""
    found = {}
    for child in psutil.Process(pid).children():
        argv = child.cmdline()
        if "runner" in argv:
            found[argv[argv.index("--model") + 1]] = child.pid
    return found


def test_one_wedged_model_is_unloaded_and_the_server_kept(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    """Its runner takes the probe and never answers, while the other model serves: named
    model_wedged from a second probe of the other model, cured by ending that model's runner
    (keep_alive 0 cannot unload a model with a request in flight), not the server."""
    port = free_port()
    server = ollama_like(tmp_path, port)
    t = run_daemon(Daemon(parse_config(watchdog_config(tmp_path / "state", [server]))).open())
    w = t.daemon.cycles["o"]
    until(lambda: w.verdict is not None and w.verdict.state == "healthy", 30, "it serves")
    pid = w.manager.pid()
    assert pid is not None
    before = runners(pid)
    assert len(before) == 2
    (tmp_path / "wedge").touch()
    store = t.daemon.store
    until(lambda: [r.outcome for r in store.restarts("o", 0.0)] == ["recovered"], 60, "cured")
    (incident,) = store.incidents(0.0)
    assert incident.evidence["cause"] == "model_wedged", incident.reason
    assert "other-model, on the same server, answered" in incident.evidence["cause_because"]
    assert w.manager.pid() == pid  # the server was not restarted
    after = runners(pid)
    stuck = f"sha256-{hashlib.sha256(b'stuck-model').hexdigest()}"
    replaced = [b for b in after if before.get(b) != after[b]]
    assert [b.rsplit("/", 1)[-1] for b in replaced] == [stuck], (before, after)
    (action,) = [a for a in incident.actions if str(a.get("action", "")).startswith("restart")]
    assert "ended the runner of stuck-model" in str(action["detail"]), action
    assert any("keep_alive 0" in s for s in action["steps"]), action


def test_a_model_is_wedged_alone_only_when_another_answered() -> None:
    from mlx_watchdog.sense.signs import OtherModel

    wedged = Facts(state="wedged", kind="ollama", answered=True, model="a")
    served = Signs(other_model=OtherModel("b", True, 0.05))
    found = diagnose(wedged, served)
    assert found.cause is Cause.MODEL_WEDGED and "b, on the same server, answered" in found.because
    assert "in 50 ms" in found.because
    # The other model waits too: the whole server is wedged, no model named.
    assert diagnose(wedged, Signs(other_model=OtherModel("b", False))).cause is Cause.UNKNOWN
    assert diagnose(replace(wedged, state="busy"), served).cause is not Cause.MODEL_WEDGED


def test_a_model_that_cannot_be_unloaded_restarts_the_server_saying_why() -> None:
    from mlx_watchdog.act.ladder import Ladder
    from mlx_watchdog.act.managers import Outcome

    class Restarts:
        kind = "process"

        def restart(self) -> Outcome:
            return Outcome(True, "restarted", ("stopped PID 1", "started PID 2"))

    failed = Outcome(False, "no runner", ("asked Ollama to unload a (keep_alive 0): HTTP 200",))
    outcome = Ladder._replace(Restarts(), None, lambda: failed)  # type: ignore[arg-type]
    assert outcome.ok and outcome.detail == "restarted"
    assert outcome.steps == (
        "asked Ollama to unload a (keep_alive 0): HTTP 200",
        "could not unload the model (no runner): restarted the server",
        "stopped PID 1",
        "started PID 2",
    )
    unloaded = Outcome(True, "unloaded a")
    assert Ladder._replace(Restarts(), None, lambda: unloaded) is unloaded  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "show",
    [
        {"body": "not json"},
        {"body": '{"modelfile": 5}'},
        {"body": '{"modelfile": "FROM ../../etc/passwd\\nFROM /blobs/none"}'},
        {"status": 500, "body": "<html>oops</html>", "ctype": "text/html"},
        {"body": "x" * 2_000_000},
    ],
)
def test_hostile_answers_to_an_unload_fail_it_in_words_and_signal_nothing(
    bad_server: Callable[..., Running], show: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The server's /api/generate, /api/ps and /api/show answered badly: the unload fails with
    why (the ladder then restarts the server), within its bounds, and no process is signalled
    (the server has no runner child whose command line loads a blob it named)."""
    import httpx

    from mlx_watchdog.act import unload
    from mlx_watchdog.act.managers import System

    monkeypatch.setattr(unload, "GONE_WAIT", 0.5)
    srv = bad_server("ok", kind="ollama")
    held = {"body": '{"models": [{"name": "bad-model", "model": "bad-model"}]}'}
    answers = {"/api/show": show, "/api/generate": {"body": "\x00\xff"}, "/api/ps": held}
    httpx.post(f"{srv.url}/_hostile", json=answers, timeout=5)
    server = watched(srv.url, kind="ollama")
    outcome = unload.Unloader(server, "bad-model", srv.proc.pid, System())()
    assert not outcome.ok and outcome.detail.startswith("bad-model stays loaded and ")
    assert srv.proc.poll() is None
