"""`compare` on real servers: mlx_lm.server serial against batched, and against llama.cpp's
llama-server; it refuses while either is busy."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from tests.conftest import Running, mlx_watchdog

pytestmark = pytest.mark.real_server


def compare(*args: str) -> dict[str, object]:
    proc = mlx_watchdog("compare", *args, "--prompt-tokens", "1k", "--json", timeout=600)
    assert proc.returncode == 0, proc.stderr
    doc: dict[str, object] = json.loads(proc.stdout)
    return doc


def test_serial_against_batched_shows_the_batching_benefit(
    serial_server: Running, batched_server: Running
) -> None:
    doc = compare(serial_server.url, batched_server.url)
    a, b = doc["a"], doc["b"]
    assert isinstance(a, dict) and isinstance(b, dict)
    for side in (a, b):
        assert side["ttft_s"] > 0 and side["prefill_tps"] > 0 and side["prompt_tokens"] >= 900
        assert set(side["streams_tps"]) == {"1", "2", "4"}
        assert all(v > 0 for v in side["streams_tps"].values())
        assert side["again_s"] > 0
    # Side by side or one after another: a structural count, not a speed, so it holds on a
    # loaded machine (the rates themselves vary run to run by 2x here).
    assert a["together"] == {"1": 1, "2": 1, "4": 1} and a["batches"] is False, a["together"]
    assert max(b["together"].values()) >= 2 and b["batches"] is True, b["together"]
    findings = doc["findings"]
    assert isinstance(findings, list)
    assert any(
        f.startswith(f"{serial_server.url[7:]} serves one stream at a time") for f in findings
    ), findings
    assert any(f.startswith(f"{batched_server.url[7:]} batches") for f in findings), findings


def test_against_llama_server(serial_server: Running, llama_server: Running) -> None:
    proc = mlx_watchdog(
        "compare", serial_server.url, llama_server.url, "--prompt-tokens", "1k", timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    for row in (
        "first token, tiny prompt",
        "prefill",
        "decode",
        "same prompt again",
        "4 streams at once",
    ):
        assert row in text
    assert llama_server.url[7:] in text and serial_server.url[7:] in text
    # llama-server reports the cached prompt tokens of the repeated prompt (-np 1 keeps it).
    assert "cached" in text


def test_refuses_while_either_is_busy(
    serial_server: Running, batched_server: Running, uploading_client: Callable[[Running], object]
) -> None:
    # A client in the middle of sending its request: served, and costing the server nothing
    # (a 24k-token prompt did the same, and each test then waited ~50 s for its prefill).
    uploading_client(serial_server)
    proc = mlx_watchdog("compare", batched_server.url, serial_server.url, timeout=120)
    assert proc.returncode == 1, proc.stdout
    assert "not comparing" in proc.stderr and serial_server.url in proc.stderr
    assert "being served right now" in proc.stderr


def test_a_server_that_stops_answering_ends_the_comparison_at_its_limit(
    bad_server: Callable[..., Running],
) -> None:
    """It serves the refusal check and a tiny prompt, then holds every request: without an
    overall limit each request would wait its own 30 minutes."""
    stalls = bad_server("hang_later", ok_requests=2)
    fine = bad_server("ok")
    proc = mlx_watchdog("compare", stalls.url, fine.url, "--timeout", "3s", timeout=60)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "was not answered: no_response" in proc.stderr
