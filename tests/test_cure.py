"""The cure a wedge gets: a wait for the abandoned prefill when that is cheaper, else a restart.

The server here is our own (tests/badserver.py, mode "prefill"), logging its prefill as
mlx_lm.server does, run by the daemon (manager = "process") so the daemon reads its log.
"""

from __future__ import annotations

import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from rich.console import Console

from mlx_watchdog.cli.ops import _status_view
from mlx_watchdog.config import effective, parse_config, to_toml
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.demo.run import send
from mlx_watchdog.record.document import Status
from mlx_watchdog.serve.status import of_shown
from tests.builders import badserver_argv, calibrated_at, restarts_took, watchdog_config
from tests.conftest import DaemonThread, free_port, mlx_watchdog, until

LONG = "word " * 8000  # 40 kB of body: about 10,000 tokens to the server, 5 s at 2000 tok/s


def prefill_config(tmp_path: Path, port: int, *extra: str) -> dict[str, object]:
    server = {
        "name": "owned",
        "url": f"http://127.0.0.1:{port}",
        "manager": "process",
        "match": "badserver",
        "command": badserver_argv(port, "prefill", *extra),
        "log_file": str(tmp_path / "server.log"),
        "probe": {"slow_after": "500ms", "wedge_after": "1s", "startup_grace": "10m"},
        "restart": {"max_restarts": 3, "backoff": "1s"},
    }
    # Its restarts took 30 s (a large model): without that history, its own start (a fraction
    # of a second) would be the cost, and a restart always the cheaper cure.
    restarts_took(tmp_path / "state", "owned", 30.0)
    return watchdog_config(tmp_path / "state", [server], interval="300ms")


def healthy(t: DaemonThread) -> bool:
    w = t.daemon.cycles["owned"]
    return w.verdict is not None and w.verdict.state == "healthy" and w.incident is None


def kinds(t: DaemonThread) -> list[str]:
    return [e.kind for e in t.daemon.store.events() if e.kind != "gave_up"]


def test_an_abandoned_prefill_ending_sooner_than_a_restart_is_waited_for(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    port = free_port()
    t = run_daemon(Daemon(parse_config(prefill_config(tmp_path, port))).open())
    until(lambda: healthy(t), 30, "the server to serve")
    w = t.daemon.cycles["owned"]
    pid = w.manager.pid()
    assert send(f"http://127.0.0.1:{port}", LONG, timeout=0.3) == "gave up"
    doc = until(lambda: (d := t.daemon.status()).servers[0].clearing and d, 30, "a wait shown")
    assert isinstance(doc, Status)
    waiting = doc.servers[0].clearing
    assert waiting is not None and (waiting.prefill_total or 0) > 9000
    assert 0 <= waiting.waited_s < waiting.waited_s + waiting.restart_in_s <= 30
    assert doc.servers[0].restart_cost_s == 30.0
    shown_now = Console(record=True, width=120)
    shown_now.print(_status_view(doc))
    assert "Waiting: " in shown_now.export_text()
    until(lambda: "recovered" in kinds(t), 30, "the server to serve after the prefill")
    assert kinds(t) == ["detected", "clearing", "recovered"]
    assert t.daemon.store.restarts("owned", time.time() - 3600) == [] and w.manager.pid() == pid
    clearing = next(e for e in t.daemon.store.events() if e.kind == "clearing")
    assert clearing.message.startswith("waiting for the abandoned prefill to finish (")
    assert "a restart takes about 30 s here" in clearing.message
    (incident,) = t.daemon.store.incidents(0.0)
    assert incident.state == "wedged" and incident.outcome is not None
    assert incident.outcome.startswith("cleared without a restart: waited ")
    assert [(a["action"], a["outcome"]) for a in incident.actions] == [("wait", "cleared")]
    assert "a restart takes about 30 s here" in incident.actions[0]["detail"]
    assert of_shown(w.shown, time.time(), time.monotonic(), 0.3).clearing is None
    t.stop()
    config_file = tmp_path / "config.toml"
    config_file.write_text(to_toml(effective(t.daemon.config)))
    shown = mlx_watchdog("history", "--config", str(config_file))
    assert shown.returncode == 0, shown.stderr
    assert (
        "wait: cleared" in shown.stdout
        and "    wait: cleared without a restart: waited" in shown.stdout
    )


def test_a_prefill_that_stops_stepping_is_restarted_and_the_restart_measured(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    port = free_port()
    # 40,000 tokens at 4,000 tok/s: about 9 s left when judged, so a wait of about 16 s; the
    # prefill stops at 30% (3 s), its process idle from then: three idle looks (or 10 s
    # without a step) end the wait first.
    extra = ("--rate", "4000", "--stall-at", "0.3")
    t = run_daemon(Daemon(parse_config(prefill_config(tmp_path, port, *extra))).open())
    until(lambda: healthy(t), 30, "the server to serve")
    w = t.daemon.cycles["owned"]
    first = w.manager.pid()
    assert send(f"http://127.0.0.1:{port}", "word " * 32_000, timeout=0.3) == "gave up"
    until(lambda: "recovered" in kinds(t), 60, "the stalled server restarted")
    assert kinds(t) == ["detected", "clearing", "restarting", "recovered"]
    assert w.manager.pid() not in (None, first)
    restarting = next(e for e in t.daemon.store.events() if e.kind == "restarting")
    assert "waited " in restarting.message
    stopped = ("logged no step for ", "then the process is idle (3 looks in a row")
    assert any(said in restarting.message for said in stopped), restarting.message
    (incident,) = t.daemon.store.incidents(0.0)
    assert [(a["action"], a["outcome"]) for a in incident.actions] == [
        ("wait", "gave up"),
        ("restart (process)", "recovered"),
    ]
    # The server's last words, kept before the restart: where it was stuck, what it logged,
    # the client that left.
    (dump,) = t.daemon.store.dumps(incident.id)
    assert dump["pid"] == first and "gen_prefill" in (dump["stack"] or ""), dump["stack_problem"]
    assert "Prompt processing progress: 12288/40014" in (dump["log_tail"] or "")
    assert any("CLOSE_WAIT" in s for s in dump["sockets"])
    (restart,) = t.daemon.store.restarts("owned", time.time() - 3600)
    costs = t.daemon.store.restart_costs("owned", 5)
    assert len(costs) == 2 and costs[0] == 30.0 and 0 < costs[1] < 30  # the earlier one, this one
    assert w.tally.restart_cost().measured == 2
    t.stop()
    config_file = tmp_path / "config.toml"
    config_file.write_text(to_toml(effective(t.daemon.config)))
    shown = mlx_watchdog("history", "--config", str(config_file), "--show", str(incident.id))
    assert shown.returncode == 0, shown.stderr
    shown_as = ("wait: gave up", "before the restart", "gen_prefill", "CLOSE_WAIT")
    for said in (*shown_as, "abandoned_connections=1", "prefill_total=40014"):
        assert said in shown.stdout, said
    missing = mlx_watchdog("history", "--config", str(config_file), "--show", "99")
    assert missing.returncode == 3 and "no incident #99" in missing.stderr
    assert restart.outcome == "recovered"


def test_a_client_resending_the_same_prompt_is_named_a_retry_loop_in_numbers(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    port = free_port()
    t = run_daemon(Daemon(parse_config(prefill_config(tmp_path, port))).open())
    until(lambda: healthy(t), 30, "the server to serve")
    for n in (1, 2, 3):
        assert send(f"http://127.0.0.1:{port}", LONG, timeout=1.0) == "gave up"
        until(lambda n=n: kinds(t).count("recovered") == n, 30, f"incident {n} to clear")
        until(lambda: healthy(t), 30, "the server to serve again")
    incidents = t.daemon.store.incidents(0.0)
    assert len(incidents) == 3
    assert "resends" not in (incidents[1].advice or "")
    advice = incidents[2].advice or ""
    said = re.match(
        r"a client resends a ~10k-token prompt and gives up after ~1 s each time \(3 times\); "
        r"at (\d,\d{3}) tok/s it needs ~5 s",
        advice,
    )
    assert said and 1500 <= int(said.group(1).replace(",", "")) <= 2500, advice
    assert "it will never succeed until its timeout is above 10 s" in advice
    detected = [e for e in t.daemon.store.events() if e.kind == "detected"][-1]
    assert "a client resends a ~10k-token prompt" in detected.message
    # Each cured, and back: its cause is the clients' timeout, not the prefill.
    causes = [i.evidence.get("cause") for i in incidents]
    assert causes == ["abandoned_prefill", "abandoned_prefill", "client_timeouts"], causes
    assert "cause: clients time out before their prefill ends (2 earlier wedges" in detected.message
    assert "a restart treats the symptom" in detected.message


# -- cancelling through the server's own route ------------------------------------------------


def cancel_config(tmp_path: Path, port: int, kind: str, mode: str = "cancellable") -> dict:
    doc = prefill_config(tmp_path, port, "--kind", kind)
    server = doc["server"][0]  # type: ignore[index]
    server["kind"] = kind
    server["command"] = badserver_argv(port, mode, "--kind", kind)
    return doc


@pytest.mark.parametrize("kind", ["vllm-mlx", "rapid-mlx", "sglang"])
def test_the_abandoned_request_is_cancelled_through_the_servers_route_not_restarted(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread], kind: str
) -> None:
    port = free_port()
    t = run_daemon(Daemon(parse_config(cancel_config(tmp_path, port, kind))).open())
    until(lambda: healthy(t), 30, "the server to serve")
    w = t.daemon.cycles["owned"]
    pid = w.manager.pid()
    assert send(f"http://127.0.0.1:{port}", LONG, timeout=0.3) == "gave up"
    until(lambda: "recovered" in kinds(t), 30, "the server to serve after the cancel")
    assert kinds(t) == ["detected", "clearing", "recovered"]
    assert t.daemon.store.restarts("owned", time.time() - 3600) == [] and w.manager.pid() == pid
    clearing = next(e for e in t.daemon.store.events() if e.kind == "clearing")
    assert clearing.message.startswith("cancelling the abandoned requests through the server")
    sent = "abort_all" if kind == "sglang" else "cancelled 1 of 1 request(s) of clients that left"
    assert sent in clearing.message
    (incident,) = t.daemon.store.incidents(0.0)
    assert [(a["action"], a["outcome"]) for a in incident.actions] == [
        ("cancel", "sent"),
        ("cancel", "cleared"),
    ]
    assert (incident.outcome or "").startswith("served again ")
    assert "cancelled chatcmpl-" in (tmp_path / "server.log").read_text()


def test_a_cancel_the_server_refuses_ends_in_a_restart_that_says_so(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    """vllm-mlx by kind, but its status route answers garbage: no id to cancel, a restart."""
    port = free_port()
    doc = cancel_config(tmp_path, port, "vllm-mlx")
    t = run_daemon(Daemon(parse_config(doc)).open())
    until(lambda: healthy(t), 30, "the server to serve")
    w = t.daemon.cycles["owned"]
    first = w.manager.pid()
    garbage = {"/v1/status": {"status": 200, "body": '{"requests": "none of your business"}'}}
    httpx.post(f"http://127.0.0.1:{port}/_hostile", json=garbage, timeout=5)
    assert send(f"http://127.0.0.1:{port}", LONG, timeout=0.3) == "gave up"
    until(lambda: "recovered" in kinds(t), 60, "the server restarted")
    assert kinds(t) == ["detected", "restarting", "recovered"]
    restarting = next(e for e in t.daemon.store.events() if e.kind == "restarting")
    assert 'cancelling failed (GET /v1/status: no "requests" list)' in restarting.message
    assert w.manager.pid() not in (None, first)
    (incident,) = t.daemon.store.incidents(0.0)
    assert [a["action"] for a in incident.actions] == ["cancel", "restart (process)"]


def test_least_cost_off_restarts_a_wedge_that_waiting_would_clear(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    port = free_port()
    doc = prefill_config(tmp_path, port)
    doc["server"][0]["restart"]["least_cost"] = False  # type: ignore[index]
    t = run_daemon(Daemon(parse_config(doc)).open())
    until(lambda: healthy(t), 30, "the server to serve")
    assert send(f"http://127.0.0.1:{port}", LONG, timeout=0.3) == "gave up"
    until(lambda: "recovered" in kinds(t), 30, "the server restarted")
    assert kinds(t) == ["detected", "restarting", "recovered"]
    restarting = next(e for e in t.daemon.store.events() if e.kind == "restarting")
    assert "rather than waiting" not in restarting.message


def test_a_live_client_queued_behind_is_served_after_a_cancel_not_a_restart(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    """The field case: an abandoned long prompt, an impatient client giving up behind it, and
    a live client queued: only the requests older than the live client are cancelled, and the
    live client is served by the same process (a restart would have ended its request)."""
    import threading

    port = free_port()
    doc = cancel_config(tmp_path, port, "vllm-mlx")
    doc["server"][0]["probe"]["wedge_after"] = "3s"  # type: ignore[index]
    t = run_daemon(Daemon(parse_config(doc)).open())
    until(lambda: healthy(t), 30, "the server to serve")
    w = t.daemon.cycles["owned"]
    pid = w.manager.pid()
    url = f"http://127.0.0.1:{port}"
    assert send(url, LONG, timeout=0.3) == "gave up"
    assert send(url, "ping", timeout=1.0) == "gave up"  # a health check with a short timeout
    time.sleep(0.8)  # the live client comes well after the abandoned request
    live: list[str] = []
    client = threading.Thread(target=lambda: live.append(send(url, "hello", timeout=60)))
    client.start()
    until(lambda: "recovered" in kinds(t), 30, "the server to serve after the cancel")
    client.join(30)
    assert live == ["served"]
    assert kinds(t) == ["detected", "clearing", "recovered"]
    assert t.daemon.store.restarts("owned", time.time() - 3600) == [] and w.manager.pid() == pid
    clearing = next(e for e in t.daemon.store.events() if e.kind == "clearing")
    # The abandoned prompt and the impatient client's request; never the live one (served).
    assert re.search(r"cancelled [12] of 2 request\(s\) of clients that left", clearing.message)


def test_the_servers_own_start_is_its_restart_cost_until_a_restart_is_measured(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    """No history: the daemon started the server itself, and that start (well under a second
    here) is what a restart costs, not the 30 s default, so the abandoned prefill's 3 s or so
    (and its margin) are not waited for: the restart is the cheaper cure. The log's prefill
    ends the wait early because the calibration, the request's bytes and the process agree
    with it (judge/credence.py)."""
    port = free_port()
    doc = prefill_config(tmp_path, port)
    for leftover in (tmp_path / "state").glob("history.db*"):
        leftover.unlink()  # no earlier restarts
    calibrated_at(tmp_path / "state", "owned", 2000.0, 4.0)  # the stand-in's rate and size
    t = run_daemon(Daemon(parse_config(doc)).open())
    until(lambda: healthy(t), 30, "the server to serve")
    w = t.daemon.cycles["owned"]
    cost = w.tally.restart_cost()
    assert cost.measured == 1 and cost.seconds < 10
    assert send(f"http://127.0.0.1:{port}", LONG, timeout=0.3) == "gave up"
    until(lambda: "recovered" in kinds(t), 30, "the server restarted")
    assert kinds(t) == ["detected", "restarting", "recovered"]
    restarting = next(e for e in t.daemon.store.events() if e.kind == "restarting")
    assert "restarting rather than waiting: the abandoned prefill needs about" in restarting.message
    assert "a restart takes about" in restarting.message


def test_a_metal_error_during_the_wait_ends_it_in_a_restart_at_once(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    """Waiting for a prefill is the cure only while the prefill can finish: a Metal error in
    its log, with the process gone idle (a command buffer that never completes: no client can
    write that), says it cannot, and the wait becomes a restart that names the line. The line
    alone, the prefill still working, is what any client can have logged: the wait goes on."""
    port = free_port()
    t = run_daemon(Daemon(parse_config(prefill_config(tmp_path, port))).open())
    until(lambda: healthy(t), 30, "the server to serve")
    assert send(f"http://127.0.0.1:{port}", LONG, timeout=0.5) == "gave up"
    until(lambda: "clearing" in kinds(t), 30, "a wait for the abandoned prefill")
    with (tmp_path / "server.log").open("a") as fh:
        fh.write("libc++abi: terminating: [metal::malloc] Resource limit (499000) exceeded\n")
    looked = len(t.daemon.store.probes("owned", 0.0))
    until(lambda: len(t.daemon.store.probes("owned", 0.0)) >= looked + 2, 30, "two more looks")
    assert kinds(t) == ["detected", "clearing"]
    pid = t.daemon.cycles["owned"].manager.pid()
    assert pid is not None
    os.kill(pid, signal.SIGUSR1)  # its GPU hangs: idle from now on, its prefill stepping no more
    until(lambda: "recovered" in kinds(t), 30, "the restart to serve")
    assert kinds(t) == ["detected", "clearing", "restarting", "recovered"]
    restarting = next(e for e in t.daemon.store.events() if e.kind == "restarting")
    assert "cause: a Metal (GPU) error (its log: " in restarting.message
    assert "restarting at once: waiting cannot cure a Metal (GPU) error" in restarting.message
    (incident,) = t.daemon.store.incidents(0.0)
    assert incident.outcome == "restarted"
