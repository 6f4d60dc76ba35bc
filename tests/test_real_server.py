"""Against the real mlx_lm.server on a tiny model: the states it can really show."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mlx_watchdog.act.check import check_once
from mlx_watchdog.config import ProbeSettings, ServerConfig
from mlx_watchdog.demo.run import long_prompt, send
from mlx_watchdog.judge.evidence import Evidence
from mlx_watchdog.sense.findings import Prefill
from tests.builders import REAL, watched
from tests.conftest import Running, StartServer, free_port, mlx_watchdog, until, wait_until_idle

pytestmark = pytest.mark.real_server

GIVE_UP_AFTER = 2.0
WEDGE_AFTER = "4s"


def server_config(url: str) -> ServerConfig:
    return watched(url, name="real", match="mlx_lm", probe=REAL)


def cli(*args: str) -> tuple[int, dict[str, object]]:
    proc = mlx_watchdog(*args)
    return proc.returncode, json.loads(proc.stdout)


def test_healthy(batched_server: Running) -> None:
    result = check_once(server_config(batched_server.url))
    ev = result.verdict.evidence
    assert result.verdict.state == "healthy", result.verdict.reason
    assert ev.tokens >= 1 and ev.models_ok is True and ev.models_status == 200
    assert ev.pid == batched_server.proc.pid and ev.cmdline_matches is True
    assert ev.abandoned_connections == 0 and ev.live_connections == 0


def test_repeated_probe_is_served_from_the_prompt_cache(batched_server: Running) -> None:
    check_once(server_config(batched_server.url))
    ev = check_once(server_config(batched_server.url)).verdict.evidence
    assert ev.prompt_tokens - ev.cached_tokens <= 2


def test_abandoned_requests_wedge_the_serial_server(serial_server: Running) -> None:
    assert send(serial_server.url, long_prompt(1), timeout=GIVE_UP_AFTER) == "gave up"
    code, doc = cli("probe", "--url", serial_server.url, "--wedge-after", WEDGE_AFTER, "--json")
    ev = Evidence.from_json(doc["evidence"])
    assert (code, doc["state"]) == (2, "wedged"), doc["reason"]
    assert ev.abandoned_connections >= 1 and ev.models_status == 200
    assert ev.bytes == 0 and ev.tokens == 0
    assert "abandoned" in str(doc["reason"])


def test_patient_long_request_is_busy(
    serial_server: Running, patient_client: Callable[..., None]
) -> None:
    patient_client()
    time.sleep(1.0)
    code, doc = cli("probe", "--url", serial_server.url, "--wedge-after", WEDGE_AFTER, "--json")
    ev = Evidence.from_json(doc["evidence"])
    assert (code, doc["state"]) == (1, "busy"), doc["reason"]
    assert ev.live_connections == 1 and ev.abandoned_connections == 0
    # Working for its client, as the judge reads it: far above idle_cpu_percent (its share of
    # a core depends on what else the machine runs: 45 % with two other suites beside it).
    assert ev.cpu_percent is not None and ev.cpu_percent > 10 * ProbeSettings().idle_cpu_percent


def test_a_second_probe_during_a_long_request_stays_busy(
    serial_server: Running, patient_client: Callable[..., None]
) -> None:
    """The first probe command exits with its probe still queued; that is not abandoned work."""
    patient_client()
    time.sleep(1.0)
    states = [
        cli("probe", "--url", serial_server.url, "--wedge-after", "2s", "--json")[1]["state"]
        for _ in range(2)
    ]
    assert states == ["busy", "busy"]


def test_empty_models_body_is_its_own_finding(
    start_real_server: StartServer, tmp_path: Path
) -> None:
    from mlx_watchdog.advice.doctor import _generation

    server = start_real_server(hub_cache=tmp_path / "missing")
    try:
        result = check_once(server_config(server.url))
        said = list(_generation("real", server_config(server.url), None))
    finally:
        server.stop()
    ev = result.verdict.evidence
    assert ev.models_status == 200 and ev.models_finding == "empty_body"
    assert result.verdict.state == "healthy"  # generation works; the finding says what is off
    assert "/v1/models" not in result.verdict.reason  # not on every healthy line: once, below
    (note,) = [f for f in said if "empty body" in f.detail]
    assert note.level == "note" and "HF_HUB_CACHE" in note.fix


def test_connection_refused_is_down() -> None:
    code, doc = cli("probe", "--url", f"http://127.0.0.1:{free_port()}", "--json")
    assert (code, doc["state"]) == (2, "down")


def test_the_servers_log_tells_the_prefill_a_departed_client_left(batched_server: Running) -> None:
    """mlx_lm.server logs each prefill step, for a client that left too: read from its log."""
    from mlx_watchdog.sense.progress import LogProgress

    reader = LogProgress(batched_server.log)
    before = reader.read()  # from here on, only what the server writes next
    assert send(batched_server.url, long_prompt(4242), timeout=1.0) == "gave up"

    def new_prefill() -> object:
        said = reader.read()
        fresh = said is not None and said != before and said.age_s < 60
        return said if fresh and said.done >= 2048 else None

    said = until(new_prefill, 120, "a prefill step in the server's log")
    assert isinstance(said, Prefill) and reader.problem is None
    assert said.total > 6000 and 0 < said.done <= said.total  # 3000 words, ~3 tokens a word
    assert 0 <= said.age_s < 120
    assert said.describe().startswith("prefill")
    wait_until_idle(batched_server)  # the abandoned prefill ends before the next test


class Streamed:
    """A streamed chat request on its own connection, read as it comes until closed."""

    def __init__(self, url: str, body: dict[str, object]) -> None:
        import socket
        import threading

        host, port = url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)))
        data = json.dumps({"messages": [{"role": "user", "content": "hello"}], **body}).encode()
        self.sock.sendall(
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        self.got = 0
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        try:
            while part := self.sock.recv(1 << 16):
                self.got += len(part)
        except OSError:
            return

    def close(self) -> None:
        import socket

        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        self.reader.join(10)


def test_a_batch_drained_for_a_request_it_cannot_batch_is_named(batched_server: Running) -> None:
    """mlx-lm 0.32.2 drains its batch before a request with a seed and reads no new request
    meanwhile: the probe waits while a client is streamed tokens. Busy, said so, and at
    max_busy named batch_drain, from the kernel's count of what it sends each connection."""
    from dataclasses import replace

    from mlx_watchdog.act.check import judged
    from mlx_watchdog.sense.round import Checker

    long = Streamed(batched_server.url, {"max_tokens": 100_000, "stream": True})
    until(lambda: long.got > 10_000, 30, "the long answer to stream")
    seeded = Streamed(batched_server.url, {"max_tokens": 50, "stream": True, "seed": 1})
    spans = replace(REAL, slow_after=0.5, wedge_after=1.0, max_busy=3.0, hard_timeout=60.0)
    checker = Checker(watched(batched_server.url, name="real", match="mlx_lm", probe=spans))
    seen: list[str] = []
    try:

        def named() -> bool:
            v = judged(checker, batched_server.proc.pid)
            if v is not None:
                seen.append(v.reason)
            return v is not None and v.evidence.cause == "batch_drain"

        until(named, 30, "the drain named", step=0.25)
        assert any(r.startswith("busy:") and "it takes no new request" in r for r in seen), seen
        assert "longer than max_busy" in seen[-1] and "cause: it drains its batch" in seen[-1]
        assert seeded.got == 0  # the seeded request waits too
    finally:
        checker.abort()
        long.close()
        seeded.close()
    wait_until_idle(batched_server)
