"""The real llama.cpp llama-server (built from the registry's sdist, see tests/llamacpp.py) on
a tiny random GGUF, watched with kind = "llama.cpp": its /metrics load report, its 503 while
loading, a patient client, what an abandoned long prompt does to it, and the daemon running
and healing it."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from mlx_watchdog.act.check import check_once
from mlx_watchdog.config import ProbeSettings, ServerConfig, parse_config
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.demo.run import long_prompt, send
from mlx_watchdog.sense.findings import Prefill
from tests import builders
from tests.conftest import DaemonThread, Running, StartLlama, free_port, llama_argv, until

pytestmark = pytest.mark.real_server

PROBE = ProbeSettings(
    slow_after=1.0,
    wedge_after=2.0,
    max_busy=120.0,
    startup_grace=60.0,
    hard_timeout=300.0,
    models_timeout=5.0,
)


def watched(url: str, **probe: float) -> ServerConfig:
    return builders.watched(
        url, name="llama", kind="llama.cpp", match="llama-server", probe=PROBE, **probe
    )


def test_healthy_with_its_own_load_report(llama_server: Running) -> None:
    result = check_once(watched(llama_server.url), pid=llama_server.proc.pid)
    v = result.verdict
    assert v.state == "healthy", v.reason
    assert v.evidence.server_report == "/metrics reports 0 running, 0 waiting"
    assert v.evidence.health_status == 200 and v.evidence.cmdline_matches


def test_loading_is_starting(start_llama: StartLlama) -> None:
    # A 128k context makes the load (KV cache allocation) last about a second, long enough to
    # probe while every route answers 503 "Loading model".
    server = start_llama("-c", "131072", wait=False)
    deadline = time.monotonic() + 30
    status: int | str = "refused"
    while time.monotonic() < deadline and status != 503:
        try:
            status = urllib.request.urlopen(server.url + "/health", timeout=5).status
        except urllib.error.HTTPError as exc:
            status = exc.code
        except OSError:
            status = "refused"
        assert status != 200, "loaded before it could be probed"
        time.sleep(0.002)
    result = check_once(watched(server.url), pid=server.proc.pid)
    assert result.verdict.state == "starting", result.verdict.reason
    assert result.verdict.evidence.probe_finding == "loading"
    assert "loading its model" in result.verdict.reason
    server.stop()


def test_a_patient_client_is_busy_and_served(llama_server: Running) -> None:
    from mlx_watchdog.sense.progress import LogProgress

    reader = LogProgress(llama_server.log)
    reader.read()  # from here on, only what the server logs next
    outcome: list[str] = []
    # About 14,500 tokens, near the 16k context: a line a batch comes once the prompt took
    # 3 s, so even where the first line comes late (8,192 tokens here) two more follow.
    client = threading.Thread(
        target=lambda: outcome.append(send(llama_server.url, long_prompt(7, 1900), 300))
    )
    client.start()
    time.sleep(0.5)
    result = check_once(watched(llama_server.url), pid=llama_server.proc.pid)
    # Its slot's progress, from its own log: a rate needs two of its lines (the flake was
    # asserting on the first one alone, when that came past 6,144 tokens).
    said = until(lambda: (p := reader.read()) and p.rate_tps and p, 120, "two progress lines")
    assert isinstance(said, Prefill) and said.done < said.total
    assert 12000 < said.total < 16384 and said.rate_tps and said.rate_tps > 0
    client.join(300)
    v = result.verdict
    assert v.state == "busy", v.reason
    assert v.evidence.server_running == 1 and v.evidence.live_connections == 1
    assert (v.evidence.server_progress_still_s or 0) < PROBE.wedge_after
    assert outcome == ["served"]


def abandon(url: str, prompt: str, after: float) -> None:
    import json

    body = json.dumps({"messages": [{"role": "user", "content": prompt}], "max_tokens": 8}).encode()
    host, port = url.removeprefix("http://").split(":")
    s = socket.create_connection((host, int(port)))
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
        b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    time.sleep(after)
    s.close()


def test_an_abandoned_long_prompt_is_cancelled_at_the_next_batch(llama_server: Running) -> None:
    """Measured: llama-server notices the closed socket between prompt batches, finishes the
    batch in flight and frees the slot; the abandoned prompt does not wedge it."""
    abandon(llama_server.url, long_prompt(8, 1500), after=2.0)
    result = check_once(
        watched(llama_server.url, wedge_after=30.0, slow_after=15.0), pid=llama_server.proc.pid
    )
    v = result.verdict
    assert v.state == "healthy", v.reason
    assert v.evidence.abandoned_connections == 0
    assert "cancel task" in llama_server.log.read_text()


def test_the_daemon_runs_and_heals_a_real_llama_server(
    tmp_path: Path,
    llama_binary: Path,
    tiny_gguf: Path,
    run_daemon: Callable[[object], DaemonThread],
) -> None:
    port = free_port()
    config = parse_config(
        {
            "watchdog": {
                "interval": "1s",
                "listen": "127.0.0.1:0",
                "state_dir": str(tmp_path / "state"),
            },
            "server": [
                {
                    "name": "llama",
                    "kind": "llama.cpp",
                    "url": f"http://127.0.0.1:{port}",
                    "manager": "process",
                    "command": llama_argv(llama_binary, tiny_gguf, port),
                    "log_file": str(tmp_path / "llama.log"),
                    "probe": {"slow_after": "2s", "wedge_after": "4s", "startup_grace": "10m"},
                    "restart": {"backoff": "1s"},
                }
            ],
        }
    )
    assert config.servers[0].match == "llama-server"
    t = run_daemon(Daemon(config).open())
    w = t.daemon.cycles["llama"]
    until(lambda: w.verdict is not None and w.verdict.state == "healthy", 60, "healthy")
    assert w.verdict is not None and w.verdict.evidence.server_report is not None
    # A patient client whose prompt takes longer than wedge_after: busy, never restarted.
    url = config.servers[0].url
    outcome: list[str] = []
    client = threading.Thread(target=lambda: outcome.append(send(url, long_prompt(9, 1500), 300)))
    client.start()
    until(lambda: w.verdict is not None and w.verdict.state == "busy", 30, "busy")
    client.join(300)
    assert outcome == ["served"]
    until(lambda: w.verdict is not None and w.verdict.state == "healthy", 30, "healthy again")
    states = {row.state for row in t.daemon.store.probes("llama", 0.0)}
    assert "busy" in states and not states & {"wedged", "dead", "down"}, states
    assert t.daemon.store.restarts("llama", 0.0) == []

    first = w.manager.pid()
    assert first is not None
    os.kill(first, signal.SIGKILL)
    until(
        lambda: (
            w.manager.pid() not in (None, first)
            and w.verdict is not None
            and w.verdict.state == "healthy"
        ),
        60,
        "respawned and serving",
    )
    restarts = t.daemon.store.restarts("llama", 0.0)
    assert [(r.trigger, r.outcome) for r in restarts] == [("crashed", "recovered")]


def test_doctor_names_the_failure_modes_and_the_metrics_switch(
    tmp_path: Path, start_llama: StartLlama
) -> None:
    from tests.conftest import mlx_watchdog

    server = start_llama(metrics=False)
    config = tmp_path / "config.toml"
    config.write_text(
        f'[watchdog]\nstate_dir = "{tmp_path / "state"}"\nlisten = "off"\n\n'
        f'[[server]]\nname = "llama"\nkind = "llama.cpp"\nurl = "{server.url}"\n'
    )
    proc = mlx_watchdog("doctor", "--config", str(config), "--json")
    import json

    findings = json.loads(proc.stdout)
    mine = [f for f in findings if f["what"] == "llama"]
    unread = [f for f in mine if "load report cannot be read" in f["detail"]]
    assert unread and unread[0]["level"] == "warning"
    assert unread[0]["fix"] == "start llama-server with --metrics"
    notes = [f for f in mine if f["level"] == "note"]
    assert any("Loading model" in f["detail"] for f in notes), notes
    assert all(f["fix"] for f in notes)
    assert proc.returncode == 1
    server.stop()
