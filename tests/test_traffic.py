"""No synthetic probe while real traffic proves the server, and never many in a row."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from mlx_watchdog.config import parse_config
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.judge.evidence import Evidence
from mlx_watchdog.judge.states import State
from mlx_watchdog.judge.traffic import SKIP_MAX, proves, skipped_verdict
from mlx_watchdog.judge.verdict import Verdict
from mlx_watchdog.record.document import Status, WatchdogLine
from mlx_watchdog.sense.findings import LoadReport
from tests.builders import badserver_argv, watchdog_config
from tests.conftest import DaemonThread, free_port, until

SERVED = LoadReport("/metrics", "ok", "", status=200, running=1, delivered_since=40.0)


def last(state: State = State.HEALTHY, live: int | None = 1, abandoned: int | None = 0) -> Verdict:
    e = Evidence(live_connections=live, abandoned_connections=abandoned, ttft_s=0.05, tokens=1)
    return Verdict(state, f"{state}: ...", e)


def test_tokens_delivered_to_live_clients_prove_a_healthy_server() -> None:
    why = proves(last(), SERVED, skipped=0)
    assert why == "40 tokens delivered to 1 live client since the last look"
    v = skipped_verdict(last(), SERVED, why)
    assert v.state == State.HEALTHY and v.reason.endswith("(probe skipped)")
    assert (v.evidence.ttft_s, v.evidence.tokens, v.evidence.probe_finding) == (None, 0, "skipped")


@pytest.mark.parametrize(
    ("verdict", "report", "skipped"),
    [
        (last(), SERVED, SKIP_MAX),  # every few ticks the probe goes anyway
        (last(State.BUSY), SERVED, 0),
        (last(State.WEDGED), SERVED, 0),
        (None, SERVED, 0),
        (last(live=0), SERVED, 0),  # tokens, but nobody live to have got them
        (last(live=None), SERVED, 0),  # connections unseen
        (last(abandoned=1), SERVED, 0),  # a client left: its work may be what counts
        (last(abandoned=None), SERVED, 0),
        (last(), LoadReport("/metrics", "timeout", "no answer"), 0),
        (last(), LoadReport("/metrics", "ok", "", delivered_since=0.0), 0),
        (last(), LoadReport("/metrics", "ok", "", delivered_since=None), 0),
        (last(), None, 0),
    ],
)
def test_anything_less_is_probed(
    verdict: Verdict | None, report: LoadReport | None, skipped: int
) -> None:
    assert proves(verdict, report, skipped) is None


def traffic_config(tmp_path: Path, port: int, *extra: str) -> dict[str, object]:
    server = {
        "name": "busy",
        "url": f"http://127.0.0.1:{port}",
        "kind": "vllm",
        "manager": "process",
        "match": "badserver",
        "command": badserver_argv(port, "traffic", "--kind", "vllm", *extra),
        "probe": {"slow_after": "500ms", "wedge_after": "1s", "startup_grace": "10m"},
        "restart": {"max_restarts": 3, "backoff": "1s"},
    }
    return watchdog_config(tmp_path / "state", [server], interval="300ms")


def test_a_skipped_probe_is_not_counted_as_a_probe() -> None:
    from mlx_watchdog.record.metrics import Metrics

    metrics = Metrics(lambda: Status(WatchdogLine()))
    metrics.observe("s", last())
    metrics.observe("s", skipped_verdict(last(), SERVED, "40 tokens delivered"))
    metrics.skipped("s")
    text = metrics.exposition()[0].decode()
    assert 'mlx_watchdog_probes_total{server="s",state="healthy"} 1.0' in text
    assert 'mlx_watchdog_probes_skipped_total{server="s"} 1.0' in text


def live_client(url: str) -> threading.Thread:
    """A patient client streaming a long answer (tests/badserver.py: --delay seconds)."""
    body = {"messages": [{"role": "user", "content": "word " * 400}], "stream": True}

    def run() -> None:
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            for _ in r.iter_bytes():
                pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_live_traffic_skips_probes_but_never_more_than_two_in_a_row(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    port = free_port()
    config = parse_config(traffic_config(tmp_path, port, "--delay", "6"))
    t = run_daemon(Daemon(config).open())
    w = t.daemon.cycles["busy"]
    until(lambda: w.verdict is not None and w.verdict.state == "healthy", 30, "healthy")
    client = live_client(config.servers[0].url)
    until(
        lambda: any(
            p.reason.endswith("(probe skipped)") for p in t.daemon.store.probes("busy", 0.0)
        ),
        30,
        "a skip",
    )
    client.join(30)
    # The metrics first, then the history: the history has every tick the metrics counted.
    text = t.daemon.metrics.exposition()[0].decode()
    rows = [p.reason.endswith("(probe skipped)") for p in t.daemon.store.probes("busy", 0.0)]
    run = longest = 0
    for skipped in rows:
        run = run + 1 if skipped else 0
        longest = max(longest, run)
    assert 1 <= longest <= SKIP_MAX, rows
    assert sum(rows) >= 2 and not all(rows)
    counted = re.search(r'mlx_watchdog_probes_skipped_total\{server="busy"\} (\d+)\.0', text)
    assert counted and 1 <= int(counted.group(1)) <= sum(rows)
    assert t.daemon.store.incidents(0.0) == []


def test_a_lying_counter_cannot_hide_a_wedge(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    """The counter grows at every read and a client stays connected, yet the server holds
    every request: a probe still goes every few ticks, and the wedge is seen."""
    port = free_port()
    hang = tmp_path / "hang"
    extra = ("--delay", "60", "--lying", "--hang-file", str(hang))
    config = parse_config(traffic_config(tmp_path, port, *extra))
    t = run_daemon(Daemon(config).open())
    w = t.daemon.cycles["busy"]
    until(lambda: w.verdict is not None and w.verdict.state == "healthy", 30, "healthy")
    live_client(config.servers[0].url)  # streams for a minute: a live client throughout
    until(lambda: w.least.skipped > 0, 30, "a skip on the lying counter")
    hang.touch()
    until(lambda: t.daemon.store.incidents(0.0), 30, "the wedge to be seen")
    (incident,) = t.daemon.store.incidents(0.0)
    assert incident.state == "wedged"
    rows = [p for p in t.daemon.store.probes("busy", 0.0)]
    # Between the last real probe answered and the wedge, at most SKIP_MAX skipped ticks.
    answered = max(i for i, p in enumerate(rows) if p.ttft_s is not None)
    skips_after = [p for p in rows[answered + 1 :] if p.reason.endswith("(probe skipped)")]
    assert len(skips_after) <= SKIP_MAX
