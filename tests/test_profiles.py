"""Each profile's load report read from a running server (the tests' misbehaving server
emulating each project's routes, shaped from their source): what the report adds to the
sockets, and that it never turns a busy server wedged."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest

from mlx_watchdog.act.check import check_once
from mlx_watchdog.config import ServerConfig
from mlx_watchdog.record.left_probes import LeftProbes
from mlx_watchdog.sense.round import Checker
from tests.builders import QUICK
from tests.conftest import Running, send_chat

# The connected client is served (as far as the sockets tell) and the process may look idle:
# idle_cpu_percent = 0 is what a Mac whose GPU does the work needs, so only the report can tell.
PATIENT = replace(QUICK, wedge_after=2.0, max_busy=30.0, hard_timeout=60.0, idle_cpu_percent=0.0)
REPORTING = ["llama.cpp", "rapid-mlx", "vllm"]  # running, waiting and a progress counter
COUNTING = ["vllm-mlx", "mlx-openai-server"]  # requests only: a leak shows, a stall does not


def config(url: str, kind: str) -> ServerConfig:
    return ServerConfig(name=kind, url=url, kind=kind, match="badserver", probe=PATIENT)  # type: ignore[arg-type]


def leak_one(port: int) -> socket.socket:
    """Send the request that takes the slot (its socket is closed by the server), then connect
    a patient client that waits behind it."""
    first = send_chat(port)
    first.settimeout(5)
    assert first.recv(100) == b""  # the server closed it: nothing in CLOSE_WAIT
    first.close()
    patient = send_chat(port)
    time.sleep(0.2)
    return patient


@pytest.mark.parametrize("kind", [k for k in REPORTING + COUNTING if k != "vllm"])
def test_a_leaked_slot_behind_a_closed_socket_is_wedged(
    kind: str, bad_server: Callable[..., Running]
) -> None:
    srv = bad_server("leak", kind=kind)
    patient = leak_one(srv.port)
    try:
        result = check_once(config(srv.url, kind))
    finally:
        patient.close()
    v = result.verdict
    assert v.state == "wedged", v.reason
    assert v.evidence.abandoned_connections == 0 and v.evidence.live_connections == 1
    assert (v.evidence.server_running or 0) >= 1, v.evidence.server_report


@pytest.mark.parametrize("kind", ["openai", "mlx_lm"])
def test_without_a_load_report_the_same_leak_looks_busy(
    kind: str, bad_server: Callable[..., Running]
) -> None:
    """The control: the sockets alone show a served client, so the report is what tells."""
    srv = bad_server("leak", kind="llama.cpp")
    patient = leak_one(srv.port)
    try:
        result = check_once(config(srv.url, kind))
    finally:
        patient.close()
    assert result.verdict.state == "busy", result.verdict.reason


def test_vllm_counts_each_choice_so_a_live_client_may_hold_several(
    bad_server: Callable[..., Running],
) -> None:
    """vLLM reports a request with n = 2 as two running: from its counts a leaked slot beside
    one live client looks the same as that client's second choice. Left busy (up to max_busy),
    never called a leak while a client is connected."""
    srv = bad_server("leak", kind="vllm")
    patient = leak_one(srv.port)
    try:
        result = check_once(config(srv.url, "vllm"))
    finally:
        patient.close()
    v = result.verdict
    assert v.state == "busy", v.reason
    assert (v.evidence.server_running or 0) >= 1 and v.evidence.live_connections == 1


@pytest.mark.parametrize("kind", REPORTING + COUNTING)
def test_work_that_moves_is_busy(kind: str, bad_server: Callable[..., Running]) -> None:
    srv = bad_server("work", delay=6.0, kind=kind)
    patient = send_chat(srv.port)
    try:
        time.sleep(0.3)
        result = check_once(config(srv.url, kind))
    finally:
        patient.close()
    v = result.verdict
    assert v.state == "busy", v.reason
    assert (v.evidence.server_running or 0) >= 1, v.evidence.server_report


@pytest.mark.parametrize("kind", ["ollama", "lmstudio"])
def test_a_model_is_named_when_the_server_needs_one(
    kind: str, bad_server: Callable[..., Running]
) -> None:
    srv = bad_server("ok", kind=kind)
    result = check_once(config(srv.url, kind))
    assert result.verdict.state == "healthy", result.verdict.reason
    if kind == "ollama":
        assert result.verdict.evidence.server_report == "/api/ps reports 1 model loaded"
    # the control: probing the same server as a generic one names no model and is refused
    generic = check_once(config(srv.url, "openai"))
    assert generic.verdict.state == "dead" and "model is required" in generic.verdict.reason


def test_a_server_that_needs_a_model_and_lists_none_is_dead(
    bad_server: Callable[..., Running],
) -> None:
    srv = bad_server("models_empty", kind="ollama")
    result = check_once(config(srv.url, "ollama"))
    assert result.verdict.state == "dead"
    assert result.verdict.evidence.probe_finding == "no_model"


def test_the_watchdogs_own_report_request_is_never_abandoned_work(
    bad_server: Callable[..., Running], tmp_path: Path
) -> None:
    """A report request that times out stays in CLOSE_WAIT on the server: it is the
    watchdog's own, like its probe, and must not count as a client that gave up. A check that
    exits (the `probe` command) leaves those on record for the daemon, and only those."""
    srv = bad_server("report_hang", kind="llama.cpp")
    left = LeftProbes(tmp_path / "left-probes.json")
    checker = Checker(config(srv.url, "llama.cpp"), left=left)
    checker.observe(None)
    obs = checker.observe(None)
    assert obs.load is not None and obs.load.finding == "timeout"
    in_flight = checker.probe.local_address if checker.probe is not None else None
    hanging = [a for a in checker.own.unanswered() if a != in_flight]
    assert len(hanging) >= 2
    assert obs.process.abandoned == 0, obs.process.clients
    probe = checker.probe.local_address if checker.probe is not None else None
    checker.leave()
    recorded = left.load()
    assert set(hanging) <= set(recorded)
    # besides them only the probe, when it is still in flight (a loaded machine)
    assert set(recorded) - set(hanging) <= {probe}, (recorded, hanging, probe)

    answering = Checker(config(bad_server("ok", kind="llama.cpp").url, "llama.cpp"), left=left)
    answering.observe(None)
    assert answering.own.addresses()
    in_flight = answering.probe.local_address if answering.probe is not None else None
    assert set(answering.own.unanswered()) <= {in_flight}
