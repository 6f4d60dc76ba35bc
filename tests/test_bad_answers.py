"""Every malformed or misbehaving answer is a named finding and a state, never a crash."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from mlx_watchdog.act.check import check_once
from mlx_watchdog.config import ServerConfig
from mlx_watchdog.judge.verdict import judge
from mlx_watchdog.sense.observation import Observation
from mlx_watchdog.sense.probe import Probe
from mlx_watchdog.sense.process import Inspector
from tests.builders import QUICK, watched
from tests.conftest import Running, free_port, send_chat


def server_at(url: str, **probe: float) -> ServerConfig:
    return watched(url, **probe)


ROWS = [
    # mode, expected state, expected probe finding, expected /v1/models finding
    ("ok", "healthy", "ok", "ok"),
    ("nonstream", "healthy", "ok", "ok"),
    ("reasoning_empty", "healthy", "ok", "ok"),
    ("slow", "slow", "ok", "ok"),
    ("models_empty", "healthy", "ok", "empty_body"),
    ("models_garbage", "healthy", "ok", "invalid_json"),
    ("html_500", "dead", "html_error", "ok"),
    ("html_200", "dead", "html_error", "ok"),
    ("invalid_json", "dead", "invalid_json", "ok"),
    ("no_data", "dead", "no_data_events", "ok"),
    ("done_no_token", "dead", "done_without_token", "ok"),
    ("zero_tokens", "dead", "zero_tokens", "ok"),
    ("finish_error", "dead", "finish_error", "ok"),
    ("stream_error", "dead", "stream_error", "ok"),
    ("error_404", "dead", "http_error", "ok"),
    ("error_500", "dead", "http_error", "ok"),
    ("auth_401", "dead", "auth_failed", "ok"),
    ("auth_403", "dead", "auth_failed", "ok"),
    ("too_large", "dead", "body_too_large", "ok"),
    ("reset", "dead", "reset", "ok"),
    ("reset_early", "dead", "reset", "ok"),
]


@pytest.mark.parametrize(("mode", "state", "finding", "models"), ROWS, ids=[r[0] for r in ROWS])
def test_bad_answer(
    bad_server: Callable[..., Running], mode: str, state: str, finding: str, models: str
) -> None:
    srv = bad_server(mode, delay=1.0)
    # The slow answer (1 s) must come after slow_after and before wedge_after.
    result = check_once(server_at(srv.url, wedge_after=1.8, max_busy=1.9))
    ev = result.verdict.evidence
    assert (result.verdict.state, ev.models_finding) == (state, models), result.verdict.reason
    assert ev.probe_finding == finding, result.verdict.reason
    assert ev.pid == srv.proc.pid
    assert result.verdict.reason.startswith(state + ": ")


def test_trickle_is_wedged_while_it_lasts(bad_server: Callable[..., Running]) -> None:
    srv = bad_server("trickle")
    result = check_once(server_at(srv.url))
    ev = result.verdict.evidence
    assert result.verdict.state == "wedged", result.verdict.reason
    assert ev.probe_finding == "waiting" and ev.keepalives >= 3 and ev.tokens == 0
    assert "keepalives" in result.verdict.reason


def test_trickle_is_cut_at_the_hard_timeout_and_dead(bad_server: Callable[..., Running]) -> None:
    srv = bad_server("trickle")
    server = server_at(srv.url)
    probe = Probe(server).start()
    assert probe.wait(10)
    snap = probe.snapshot()
    assert snap.finding == "trickle"
    assert snap.keepalives >= 5 and snap.tokens == 0
    assert snap.waited(time.time()) >= QUICK.hard_timeout
    verdict = judge(Observation(snap, Inspector(server).sample()), server.probe, time.time())
    assert verdict is not None and verdict.state == "dead"


def test_slot_never_released_with_nobody_else_is_wedged(bad_server: Callable[..., Running]) -> None:
    srv = bad_server("hang")
    result = check_once(server_at(srv.url))
    ev = result.verdict.evidence
    assert result.verdict.state == "wedged", result.verdict.reason
    assert ev.bytes == 0 and ev.models_ok is True
    assert ev.live_connections == 0 and ev.abandoned_connections == 0
    assert "no other client" in result.verdict.reason


def test_slot_held_for_a_client_that_left_is_wedged(bad_server: Callable[..., Running]) -> None:
    srv = bad_server("hang")
    gone = [send_chat(srv.port) for _ in range(2)]
    time.sleep(0.2)
    for s in gone:
        s.close()
    result = check_once(server_at(srv.url))
    assert result.verdict.state == "wedged", result.verdict.reason
    assert result.verdict.evidence.abandoned_connections == 2
    assert "2 abandoned requests" in result.verdict.reason


def test_connected_clients_with_an_idle_process_is_wedged(
    bad_server: Callable[..., Running],
) -> None:
    srv = bad_server("hang")
    waiting = send_chat(srv.port)
    try:
        time.sleep(0.2)
        # Answering the probe and /v1/models costs the hanging server about 1% of a second on
        # a loaded machine; a process serving a client shows tens of percent.
        result = check_once(server_at(srv.url, idle_cpu_percent=5.0))
    finally:
        waiting.close()
    ev = result.verdict.evidence
    assert result.verdict.state == "wedged", result.verdict.reason
    assert ev.live_connections == 1 and ev.cpu_percent < 5.0
    assert "idle" in result.verdict.reason


def test_nothing_listening_is_down() -> None:
    result = check_once(server_at(f"http://127.0.0.1:{free_port()}"))
    assert result.verdict.state == "down"
    assert result.verdict.evidence.probe_finding == "refused"
    assert result.verdict.evidence.models_finding == "refused"
