"""Each server's own load report, read from answers shaped as each project's source writes
them, and what the verdict makes of it. Pure: answers and `now` passed in."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from mlx_watchdog.config import parse_config
from mlx_watchdog.config.profiles import PROFILES
from mlx_watchdog.judge.states import State
from mlx_watchdog.judge.verdict import judge
from mlx_watchdog.sense.answer import classify_error
from mlx_watchdog.sense.findings import LoadReport, ProbeFinding, ProbeSnapshot
from mlx_watchdog.sense.load import json_value, parse_prometheus, read_report
from mlx_watchdog.sense.observation import Observation
from tests.judging import MODELS_OK, T0, S, proc, waiting

# llama-server's to_metrics(): HELP and TYPE lines, names with a colon, no labels.
LLAMA_METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed.
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 6400
# HELP llamacpp:n_decode_total Total number of llama_decode() calls
# TYPE llamacpp:n_decode_total counter
llamacpp:n_decode_total {decodes}
# HELP llamacpp:requests_processing Number of requests processing.
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing {running}
# HELP llamacpp:requests_deferred Number of requests deferred.
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred {deferred}
"""

# prometheus_client output (Rapid-MLX, vLLM): labels, several samples of one family.
RAPID_METRICS = """\
# HELP rapid_mlx_requests_running Requests in the running batch
# TYPE rapid_mlx_requests_running gauge
rapid_mlx_requests_running{model="a"} 1.0
rapid_mlx_requests_running{model="b"} 1.0
rapid_mlx_requests_waiting{model="a"} 3.0
rapid_mlx_steps_executed_total{model="a"} 1234.0
rapid_mlx_build_info{version="0.16.10",commit="x y"} 1.0
"""

# mlx-openai-server /v1/queue/stats: {"status", "queue_stats": handler.get_queue_stats()}.
OPENAI_SERVER_STATS = {
    "status": "ok",
    "queue_stats": {
        "queue_stats": {
            "running": True,
            "queue_size": 2,
            "max_queue_size": 100,
            "active_requests": 1,
            "completed_requests": 7,
            "failed_requests": 0,
        },
        "batch_stats": {
            "running": False,
            "queue_size": 0,
            "max_queue_size": 100,
            "active_requests": 0,
            "disabled": True,
        },
    },
}
# vllm-mlx /v1/status (waybarrios/vllm-mlx 4b654c0, server.py `status`); Ollama /api/ps.
VLLM_MLX_STATUS = {
    "status": "running",
    "model": "m",
    "residency": None,
    "uptime_s": 12.5,
    "steps_executed": 4321,
    "num_running": 2,
    "num_waiting": 1,
    "total_requests_processed": 9,
    "requests": [{"request_id": "r", "status": "running", "phase": "prefill", "elapsed_s": 3.2}],
}
OLLAMA_PS = {"models": [{"name": "qwen3:4b", "model": "qwen3:4b", "size_vram": 1}]}


def test_prometheus_text_sums_samples_over_labels() -> None:
    sums = parse_prometheus(RAPID_METRICS + "garbage line\nname_only\nx NaN\n")
    assert sums["rapid_mlx_requests_running"] == 2.0
    assert sums["rapid_mlx_steps_executed_total"] == 1234.0
    assert sums["rapid_mlx_build_info"] == 1.0  # a space inside a label value
    assert "garbage" not in sums and "x" not in sums


@pytest.mark.parametrize(
    ("kind", "body", "running", "waiting", "progress", "loaded"),
    [
        ("llama.cpp", LLAMA_METRICS.format(decodes=88, running=1, deferred=3), 1, 3, 88.0, None),
        ("rapid-mlx", RAPID_METRICS, 2, 3, 1234.0, None),
        ("mlx-openai-server", json.dumps(OPENAI_SERVER_STATS), 1, 2, None, None),
        ("vllm-mlx", json.dumps(VLLM_MLX_STATUS), 2, 1, 4321.0, None),
        ("ollama", json.dumps(OLLAMA_PS), None, None, None, 1),
    ],
)
def test_each_profile_reads_its_server_shape(
    kind: str,
    body: str,
    running: int | None,
    waiting: int | None,
    progress: float | None,
    loaded: int | None,
) -> None:
    route = PROFILES[kind].load  # type: ignore[index]
    assert route is not None
    report = read_report(route, 200, body.encode())
    assert report.ok, report
    assert (report.running, report.waiting, report.progress, report.loaded) == (
        running,
        waiting,
        progress,
        loaded,
    )


def test_a_bad_answer_is_a_finding_never_a_crash() -> None:
    route = PROFILES["llama.cpp"].load
    assert route is not None
    off = read_report(route, 501, b'{"error":{"message":"Start it with `--metrics`"}}')
    assert off.finding == "http_error" and "--metrics" in off.detail
    assert read_report(route, 200, b"").finding == "invalid"
    assert read_report(route, 200, b"other_metric 1\n").finding == "invalid"
    stats = PROFILES["mlx-openai-server"].load
    assert stats is not None
    assert read_report(stats, 200, b"<html>").finding == "invalid"
    assert read_report(stats, 200, b'{"status": "ok"}').finding == "invalid"
    assert json_value({"a": {"b": "text"}}, "a.b") == "text"
    assert json_value({"a": [1, 2]}, "a") == 2
    assert json_value({"a": 1}, "a.b") is None
    text = read_report(stats, 200, b'{"queue_stats": {"queue_stats": {"active_requests": "3"}}}')
    assert text.finding == "invalid"
    assert text.detail == "queue_stats.queue_stats.active_requests = str is not a count"


def test_kind_sets_match_and_an_explicit_match_wins() -> None:
    cfg = parse_config(
        {
            "server": [
                {"url": "http://127.0.0.1:8081", "kind": "llama.cpp"},
                {"url": "http://127.0.0.1:8082", "kind": "ollama", "match": "ollama serve"},
                {"url": "http://127.0.0.1:8083"},
            ]
        }
    )
    assert [s.match for s in cfg.servers] == ["llama-server", "ollama serve", "mlx_lm"]
    assert [s.kind for s in cfg.servers] == ["llama.cpp", "ollama", "mlx_lm"]


def test_llama_loading_answer_is_its_own_finding() -> None:
    body = b'{"error":{"message":"Loading model","type":"unavailable_error","code":503}}'
    assert classify_error(503, "application/json", body)[0] == ProbeFinding.LOADING
    other = b'{"error":{"message":"no slot available","type":"unavailable_error"}}'
    assert classify_error(503, "application/json", other)[0] == ProbeFinding.HTTP_ERROR


def report(
    running: int,
    waiting: int,
    still_for: float | None,
    *,
    health: int = 200,
    now: float,
) -> LoadReport:
    """A report answered at `now` whose counter has shown one value for `still_for`."""
    since = None if still_for is None else now - still_for
    return LoadReport(
        "/metrics",
        "ok",
        "",
        status=200,
        running=running,
        waiting=waiting,
        progress=None if still_for is None else 5.0,
        since=since,
        read_at=now,
        health_status=health,
    )


def obs(
    probe: ProbeSnapshot,
    load: LoadReport | None,
    leak_since: float | None = None,
    **kw: object,
) -> Observation:
    return Observation(probe, proc(**kw), MODELS_OK, load, leak_since)  # type: ignore[arg-type]


def test_a_still_progress_counter_alone_never_restarts() -> None:
    """One prefill step can last minutes, and the counter moves once per step (measured on
    the real llama-server: n_decode_total moved every 1-5 s through a 12k-token prompt, and
    the daemon restarted a patient client's server when a still counter was decisive). It is
    shown in the reason, never a reason."""
    now = T0 + 95
    still = report(1, 1, 95, now=now)
    v = judge(obs(waiting(), still, live=1), S, now)
    assert v is not None and v.state == State.BUSY
    assert "1 running, 1 waiting" in v.reason and "still for 95.0 s" in v.reason
    assert v.evidence.server_running == 1 and v.evidence.server_progress_still_s == 95
    # past max_busy it is wedged, as without the report
    late = T0 + S.max_busy + 1
    v = judge(obs(waiting(), report(1, 1, 95, now=late), live=1), S, late)
    assert v is not None and v.state == State.WEDGED


def test_requests_with_no_client_are_a_leak_once_it_persists() -> None:
    now = T0 + 95
    leak = report(3, 1, None, now=now)  # no progress counter (mlx-openai-server, vllm-mlx)
    v = judge(obs(waiting(), leak, leak_since=now - 30, live=1), S, now)
    assert v is not None and v.state == State.WEDGED and "2 requests have no client" in v.reason
    # One look alone may race a client that is just coming or going: not enough.
    v = judge(obs(waiting(), leak, leak_since=now, live=1), S, now)
    assert v is not None and v.state == State.BUSY
    v = judge(obs(waiting(), leak, leak_since=None, live=1), S, now)
    assert v is not None and v.state == State.BUSY
    fits = report(1, 1, None, now=now)  # one client and the probe: nothing leaked
    v = judge(obs(waiting(), fits, live=1), S, now)
    assert v is not None and v.state == State.BUSY


def test_unknown_sockets_with_moving_work_stay_busy_until_max_busy() -> None:
    now = T0 + 300
    moving = report(1, 0, 1, now=now)
    p = replace(proc(live=1), abandoned=None, live=None, error="access denied")
    v = judge(Observation(waiting(), p, MODELS_OK, moving), S, now)
    assert v is not None and v.state == State.BUSY and "1 running" in v.reason


def test_loading_is_starting_until_startup_grace_then_down() -> None:
    loading = replace(
        waiting(),
        finding=ProbeFinding.LOADING,
        detail="HTTP 503: Loading model",
        done_at=T0 + 0.01,
        status=503,
    )
    v = judge(obs(loading, None, age=30), S, T0 + 1)
    assert v is not None and v.state == State.STARTING
    v = judge(obs(loading, None, age=600), S, T0 + 1)
    assert v is not None and v.state == State.DOWN and "still loading" in v.reason


def test_health_route_failing_is_wedged_but_a_missing_route_is_not() -> None:
    now = T0 + 15
    dead = report(0, 0, None, health=503, now=now)
    v = judge(obs(waiting(), dead, live=1), S, now)
    assert v is not None and v.state == State.WEDGED and "answers 503" in v.reason
    missing = report(0, 0, None, health=404, now=now)
    v = judge(obs(waiting(), missing, live=1), S, now)
    assert v is not None and v.state != State.WEDGED


def test_no_model_loaded_means_one_is_loading() -> None:
    now = T0 + 20
    empty = LoadReport("/api/ps", "ok", "", status=200, loaded=0)
    v = judge(obs(waiting(), empty), S, now)
    assert v is not None and v.state == State.STARTING


def test_side_by_side_counts_overlapping_answers_and_bursts() -> None:
    from mlx_watchdog.advice.compare import side_by_side

    serial = [(0.25, 0.56), (0.87, 1.18), (1.49, 1.80), (2.1, 2.4)]  # one after another
    assert side_by_side(serial) == 1
    bursts = [(0.25, 0.56), (1.43, 1.43), (1.427, 1.427), (1.427, 1.427)]  # measured, batched
    assert side_by_side(bursts) == 3
    streaming = [(0.1, 1.0), (0.12, 1.1), (0.5, 0.9)]
    assert side_by_side(streaming) == 3
    assert side_by_side([]) == 1


def test_the_counter_stall_is_measured_between_answers() -> None:
    """A read that times out (llama-server answers /metrics only between decode steps) ends
    nothing and proves nothing; the stall spans answers that showed the same value."""
    import httpx

    from mlx_watchdog.config import ServerConfig
    from mlx_watchdog.sense.load import LoadReader

    now = [0.0]
    script = iter([("ok", 5), ("timeout", 0), ("ok", 5), ("ok", 6)])

    def answer(request: httpx.Request) -> httpx.Response:
        kind, value = next(script)
        if kind == "timeout":
            raise httpx.ReadTimeout("no answer", request=request)
        body = LLAMA_METRICS.format(decodes=value, running=1, deferred=1)
        return httpx.Response(200, stream=httpx.ByteStream(body.encode()))

    server = ServerConfig(name="l", url="http://127.0.0.1:9", kind="llama.cpp")
    reader = LoadReader(server, mono=lambda: now[0], transport=httpx.MockTransport(answer))
    reader._health = lambda path: (200, "")  # type: ignore[method-assign]
    seen = []
    for t in (0.0, 10.0, 20.0, 30.0):
        now[0] = t
        r = reader.read()
        assert r is not None
        seen.append((r.finding, r.stalled()))
    assert seen == [("ok", 0.0), ("timeout", None), ("ok", 20.0), ("ok", 0.0)]
