"""The verdict alone: no I/O, `now` passed in."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from mlx_watchdog.judge.states import EXIT_CODES, STATES, State
from mlx_watchdog.judge.verdict import judge
from mlx_watchdog.sense.findings import LoadReport, ProcessSample
from mlx_watchdog.sense.observation import Observation, leaked_requests
from mlx_watchdog.sense.probe import ModelsCheck, ProbeSnapshot
from tests.judging import MODELS_EMPTY, MODELS_OK, T0, S, finished, proc, token, waiting

UNKNOWN = ProcessSample(pid=None, error="no process of this user listens on port 8080")
REMOTE = ProcessSample(pid=None, local=False, error="the server is on another machine")

ROWS = [
    # id, probe, process, models, seconds since the probe started, state, words in the reason
    ("token fast", token(0.05), proc(), MODELS_OK, 0.1, "healthy", "first token in 50 ms"),
    ("token slow", token(12), proc(), MODELS_OK, 12, "slow", "first token after 12.0 s"),
    ("token, models empty", token(0.05), proc(), MODELS_EMPTY, 0.1, "healthy", "in 50 ms"),
    ("refused", finished("refused"), UNKNOWN, None, 0.1, "down", "nothing is listening"),
    ("refused, young pid", finished("refused"), proc(age=5), None, 0.1, "starting", "PID 42"),
    ("html", finished("html_error", "HTTP 502"), proc(), MODELS_OK, 0.1, "dead", "HTML page"),
    ("auth", finished("auth_failed"), proc(), MODELS_OK, 0.1, "dead", "API key"),
    ("too early", waiting(), proc(), MODELS_OK, 5, None, ""),
    ("young, loading", waiting(), proc(age=30, cpu=100), MODELS_OK, 61, "starting", "started"),
    (
        "young but abandoned",
        waiting(),
        proc(age=30, abandoned=1),
        MODELS_OK,
        61,
        "wedged",
        "abandoned",
    ),
    ("waiting, alone", waiting(), proc(), MODELS_OK, 20, "slow", "no token yet"),
    ("waiting, live", waiting(), proc(live=1), MODELS_OK, 20, "busy", "1 live client"),
    ("waiting, abandoned", waiting(), proc(abandoned=2), MODELS_OK, 20, "slow", "2 abandoned"),
    (
        "wedge, abandoned",
        waiting(),
        proc(abandoned=3),
        MODELS_OK,
        61,
        "wedged",
        "3 abandoned requests",
    ),
    (
        "wedge, abandoned and live",
        waiting(),
        proc(live=2, abandoned=1),
        MODELS_OK,
        61,
        "wedged",
        "abandoned request",
    ),
    ("wedge, nobody", waiting(), proc(), MODELS_OK, 61, "wedged", "no other client"),
    ("busy, live and working", waiting(), proc(live=1, cpu=98), MODELS_OK, 120, "busy", "CPU 98%"),
    ("live but idle", waiting(), proc(live=1, cpu=0.2), MODELS_OK, 61, "wedged", "idle"),
    ("busy too long", waiting(), proc(live=1), MODELS_OK, 901, "wedged", "max_busy"),
    (
        "models fail too",
        waiting(),
        proc(),
        ModelsCheck(None, False, "timeout", "", (), 5.0),
        61,
        "wedged",
        "/v1/models fails too",
    ),
    ("trickled keepalives", waiting(200), proc(), MODELS_OK, 61, "wedged", "200 bytes"),
    ("cannot inspect", waiting(), UNKNOWN, MODELS_OK, 61, "busy", "waiting up to max_busy"),
    ("remote, too long", waiting(), REMOTE, MODELS_OK, 901, "wedged", "another machine"),
    ("aborted by us", finished("aborted"), proc(), MODELS_OK, 1, None, ""),
]


@pytest.mark.parametrize(
    ("probe", "process", "models", "at", "state", "words"),
    [r[1:] for r in ROWS],
    ids=[r[0] for r in ROWS],
)
def test_rules(
    probe: ProbeSnapshot,
    process: ProcessSample,
    models: ModelsCheck | None,
    at: float,
    state: str | None,
    words: str,
) -> None:
    verdict = judge(Observation(probe, process, models), S, T0 + at)
    if state is None:
        assert verdict is None
        return
    assert verdict is not None
    assert verdict.state == state, verdict.reason
    assert verdict.reason.startswith(f"{state}: ")
    assert words in verdict.reason


def test_hard_timeout_with_zero_bytes_is_wedged_when_nothing_is_served() -> None:
    probe = replace(finished("no_response"), done_at=T0 + S.hard_timeout)
    verdict = judge(Observation(probe, proc(), MODELS_OK), S, T0 + S.hard_timeout)
    assert verdict is not None and verdict.state == "wedged"


def test_process_carries_the_numbers() -> None:
    verdict = judge(
        Observation(waiting(), proc(live=1, abandoned=2, cpu=99.5), MODELS_OK), S, T0 + 61
    )
    assert verdict is not None
    ev = verdict.evidence
    assert ev.waited_s == 61 and ev.bytes == 0 and ev.tokens == 0
    assert (ev.live_connections, ev.abandoned_connections) == (1, 2)
    assert ev.cpu_percent == 99.5 and ev.models_status == 200 and ev.pid == 42
    assert ev.ttft_s is None and ev.probe_finding == "waiting"


def test_exit_codes_cover_every_state() -> None:
    assert set(EXIT_CODES) == set(STATES)
    assert [
        EXIT_CODES[s] for s in ("healthy", "slow", "busy", "starting", "wedged", "dead", "down")
    ] == [0, 1, 1, 1, 2, 2, 2]


# -- properties ----------------------------------------------------------------------------

processes = st.builds(
    proc,
    live=st.integers(0, 4),
    abandoned=st.integers(0, 4),
    cpu=st.one_of(st.none(), st.floats(0, 400)),
    age=st.floats(0, 10_000),
)
findings = st.sampled_from([None, "ok", "refused", "http_error", "reset", "no_response", "trickle"])


@given(ttft=st.floats(0, 3600), process=processes, later=st.floats(0, 3600))
def test_a_probe_that_got_a_token_is_never_wedged(
    ttft: float, process: ProcessSample, later: float
) -> None:
    verdict = judge(Observation(token(ttft), process, MODELS_OK), S, T0 + ttft + later)
    assert verdict is not None and verdict.state in ("healthy", "slow")


@given(process=processes, waited=st.floats(0, 7200))
def test_busy_never_lasts_past_max_busy(process: ProcessSample, waited: float) -> None:
    verdict = judge(Observation(waiting(), process, MODELS_OK), S, T0 + waited)
    if verdict is not None and verdict.state == "busy":
        assert waited < S.max_busy
    if waited >= S.max_busy and (process.age(T0 + waited) or 0) >= S.startup_grace:
        assert verdict is not None and verdict.state == "wedged"


@given(process=processes, waited=st.floats(0, 7200))
def test_abandoned_work_past_wedge_after_is_wedged(process: ProcessSample, waited: float) -> None:
    verdict = judge(Observation(waiting(), process, MODELS_OK), S, T0 + waited)
    if process.abandoned and waited >= S.wedge_after:
        assert verdict is not None and verdict.state == "wedged"
        assert "abandoned" in verdict.reason


@given(finding=findings, process=processes, waited=st.floats(0, 7200))
def test_every_judged_state_is_known_and_explained(
    finding: str | None, process: ProcessSample, waited: float
) -> None:
    probe = (
        waiting()
        if finding is None
        else replace(
            finished(finding),
            done_at=T0 + waited,
            tokens=1 if finding == "ok" else 0,
            first_token_at=T0 if finding == "ok" else None,
        )
    )
    verdict = judge(Observation(probe, process, MODELS_OK), S, T0 + waited)
    if verdict is not None:
        assert verdict.state in STATES
        assert verdict.reason.startswith(verdict.state + ": ") and len(verdict.reason) > 12


def _load(health: int, body: str) -> LoadReport:
    return LoadReport("/health", "ok", "", health_status=health, health_body=body)


def test_loading_is_starting_only_within_startup_grace_whatever_the_server_says() -> None:
    settings = replace(S, slow_after=1.0, wedge_after=5.0, startup_grace=3.0)
    loading = _load(503, '{"error": {"message": "Loading model"}}')
    young = Observation(waiting(), proc(age=0.5), MODELS_OK, loading)
    assert judge(young, settings, T0 + 2).state == "starting"
    old = Observation(waiting(), proc(age=45.0), MODELS_OK, loading)
    v = judge(old, settings, T0 + 45)
    assert v is not None and v.state == "wedged" and "health route answers 503" in v.reason
    # The process unseen (another machine): the probe's wait bounds it instead.
    remote = Observation(waiting(), REMOTE, MODELS_OK, loading)
    v = judge(remote, settings, T0 + 2.5)
    assert v is not None and v.state == "starting" and "loading" in v.reason
    assert judge(remote, settings, T0 + 45).state == "wedged"


def test_a_probe_told_loading_forever_by_a_server_out_of_sight_is_down() -> None:
    settings = replace(S, startup_grace=3.0)
    told = finished("loading", "HTTP 503: Loading model")
    first = Observation(told, REMOTE, MODELS_OK, loading_since=T0)
    assert judge(first, settings, T0 + 1).state == "starting"
    v = judge(first, settings, T0 + 45)
    assert v is not None and v.state == "down" and "loading its model, for 45" in v.reason


def test_a_server_that_counts_each_choice_is_not_leaking_while_a_client_is_live() -> None:
    report = LoadReport("/metrics", "ok", "", running=4, waiting=0)
    one = proc(live=1)
    assert leaked_requests(report, one) == 2
    assert leaked_requests(report, one, fans_out=True) == 0
    assert leaked_requests(report, proc(live=0), fans_out=True) == 3
    obs = Observation(waiting(), one, MODELS_OK, report, leak_since=T0, fans_out=True)
    v = judge(obs, S, T0 + 61)
    assert v is not None and v.state == "busy", v.reason
    leaking = replace(obs, fans_out=False)
    v = judge(leaking, S, T0 + 61)
    assert v is not None and v.state == "wedged" and "no client" in v.reason


def test_an_empty_models_body_is_evidence_not_a_note_on_every_healthy_line() -> None:
    v = judge(Observation(token(0.05), proc(), MODELS_EMPTY), S, T0 + 0.1)
    assert v is not None and v.state == "healthy" and "/v1/models" not in v.reason
    assert v.evidence.models_finding == "empty_body"
    other = ModelsCheck(200, False, "invalid_json", "no data list", (), 0.01)
    said = judge(Observation(token(0.05), proc(), other), S, T0 + 0.1)
    assert said is not None and "but /v1/models: invalid_json" in said.reason


def test_a_process_that_served_is_no_longer_starting_within_its_grace() -> None:
    """A deadlock right after a restart is a wedge at wedge_after, not startup_grace later:
    once this process gave a token, its youth no longer excuses a silence."""
    young = proc(age=30)
    never = Observation(waiting(), young, MODELS_OK)
    assert judge(never, S, T0 + 61).state == "starting"
    served = Observation(waiting(), young, MODELS_OK, served=True)
    v = judge(served, S, T0 + 61)
    assert v is not None and v.state == "wedged", v
    gone = Observation(finished("refused"), proc(age=5), None, served=True)
    assert judge(gone, S, T0 + 0.1).state == "down"


def test_a_probe_queued_behind_served_clients_waits_from_when_the_last_left() -> None:
    """A patient client held the server for a minute with the probe queued behind it: the
    moment it leaves, the probe is next, not proof of a wedge."""
    now = T0 + 61
    just_left = Observation(waiting(), proc(live=0), MODELS_OK, live_seen=now - 1.0)
    v = judge(just_left, S, now)
    assert v is not None and v.state == "slow" and "its last client left 1.0 s ago" in v.reason
    long_gone = Observation(waiting(), proc(live=0), MODELS_OK, live_seen=now - 60.5)
    v = judge(long_gone, S, now)
    assert v is not None and v.state == "wedged", v.reason


def test_a_cause_named_anew_keeps_its_grounds_whole_whatever_they_say() -> None:
    """The reason quotes what a client can write (a log line, a model's name): a renamed
    verdict keeps its grounds as judged, never cut at a "; cause: " someone wrote there."""
    from mlx_watchdog.judge.cause import Cause, Diagnosis
    from mlx_watchdog.judge.evidence import Evidence
    from mlx_watchdog.judge.verdict import Verdict, renamed

    grounds = "wedged: no token; the server's log: prompt 'x; cause: forged'"
    v = Verdict(State.WEDGED, f"{grounds}; cause: a deadlock", Evidence(), grounds)
    again = renamed(v, Diagnosis(Cause.THROTTLED, "its rate is a quarter of its calibration"))
    assert again.reason.startswith(grounds + "; cause: ") and again.grounds == grounds
    assert "a deadlock" not in again.reason and again.evidence.cause == "throttled"
