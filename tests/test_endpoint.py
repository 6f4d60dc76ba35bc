"""The watchdog's own endpoint over real HTTP, and the commands that use it."""

from __future__ import annotations

import json
import os
import stat
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlx_watchdog.config import Config, parse_config
from mlx_watchdog.serve.daemon import Daemon
from tests.conftest import BadByPidfile, DaemonThread, Running, mlx_watchdog, until
from tests.test_daemon import FAST_PROBE, command_config


def two_servers(tmp_path: Path, good: Running, bad: Running) -> Config:
    return parse_config(
        {
            "watchdog": {
                "interval": "200ms",
                "listen": "127.0.0.1:0",
                "state_dir": str(tmp_path / "state"),
            },
            "server": [
                {"name": "good", "url": good.url, "probe": FAST_PROBE},
                {"name": "hung", "url": bad.url, "probe": FAST_PROBE},
            ],
        }
    )


class Endpoint:
    def __init__(self, t: DaemonThread) -> None:
        self.daemon = t.daemon
        until(lambda: self.daemon.endpoint is not None, 10, "the endpoint")
        assert self.daemon.endpoint is not None
        host, port = self.daemon.endpoint.server_address[:2]
        self.url = f"http://{host!s}:{port}"
        self.token = (self.daemon.state_dir / "api-token").read_text().strip()

    def get(self, path: str, **kw: object) -> httpx.Response:
        return httpx.get(self.url + path, timeout=10, **kw)  # type: ignore[arg-type]

    def post(self, path: str, token: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.post(self.url + path, headers=headers, timeout=10)


@pytest.fixture
def endpoint(
    tmp_path: Path,
    bad_server: Callable[..., Running],
    run_daemon: Callable[[object], DaemonThread],
) -> Iterator[Endpoint]:
    config = two_servers(tmp_path, bad_server("ok"), bad_server("hang"))
    t = run_daemon(Daemon(config))
    e = Endpoint(t)

    def state(name: str) -> str | None:
        v = t.daemon.watches[name].verdict
        return v.state if v else None

    until(lambda: state("good") == "healthy" and state("hung") == "wedged", 30, "both verdicts")
    yield e


def test_healthz_follows_the_state(endpoint: Endpoint) -> None:
    good = endpoint.get("/healthz/good")
    assert good.status_code == 200 and good.text.startswith("good ok: healthy")
    hung = endpoint.get("/healthz/hung")
    assert hung.status_code == 503 and hung.text.startswith("hung unavailable: wedged")
    overall = endpoint.get("/healthz")
    assert overall.status_code == 503  # one server cannot take traffic
    doc = endpoint.get("/healthz/hung", headers={"Accept": "application/json"}).json()
    assert doc["ok"] is False and doc["servers"][0]["state"] == "wedged"
    assert endpoint.get("/healthz/nope").status_code == 404


def test_status_is_json_of_all_servers(endpoint: Endpoint) -> None:
    doc = endpoint.get("/status").json()
    by_name = {s["name"]: s for s in doc["servers"]}
    assert doc["watchdog"]["running"] is True and doc["watchdog"]["pid"] == os.getpid()
    assert by_name["good"]["serving"] is True and by_name["good"]["ttft_p50_s"] > 0
    assert by_name["hung"]["state"] == "wedged" and by_name["hung"]["exit_code"] == 2
    assert by_name["hung"]["incident"]["state"] == "wedged"
    assert by_name["hung"]["budget_left"] == 3  # manager "none": nothing was restarted


def test_metrics_parse_as_prometheus_text(endpoint: Endpoint) -> None:
    r = endpoint.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    families = {f.name: f for f in text_string_to_metric_families(r.text)}
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in families.values()
        for s in f.samples
    }
    assert samples[("mlx_watchdog_state", (("server", "good"), ("state", "healthy")))] == 1
    assert samples[("mlx_watchdog_state", (("server", "hung"), ("state", "wedged")))] == 1
    assert samples[("mlx_watchdog_state", (("server", "hung"), ("state", "healthy")))] == 0
    assert samples[("mlx_watchdog_serving", (("server", "hung"),))] == 0
    assert families["mlx_watchdog_time_to_first_token_seconds"].type == "histogram"
    count = samples[("mlx_watchdog_time_to_first_token_seconds_count", (("server", "good"),))]
    assert count >= 1
    assert families["mlx_watchdog_probes"].type == "counter"
    assert samples[("mlx_watchdog_probes_total", (("server", "hung"), ("state", "wedged")))] >= 1
    assert samples[("mlx_watchdog_events_total", (("kind", "detected"), ("server", "hung")))] == 1


def test_actions_need_the_token_and_drain_turns_healthz_503(endpoint: Endpoint) -> None:
    assert endpoint.post("/servers/good/drain").status_code == 401
    assert endpoint.post("/servers/good/drain", token="wrong").status_code == 401
    r = endpoint.post("/servers/good/drain", token=endpoint.token)
    assert r.status_code == 202 and "drain of good queued" in r.json()["message"]
    until(lambda: endpoint.get("/healthz/good").status_code == 503, 10, "the drain")
    assert endpoint.get("/status").json()["servers"][0]["draining"] is True
    assert endpoint.post("/servers/good/undrain", token=endpoint.token).status_code == 202
    until(lambda: endpoint.get("/healthz/good").status_code == 200, 10, "the undrain")
    assert endpoint.post("/servers/nope/restart", token=endpoint.token).status_code == 404


def test_wrong_methods_and_paths(endpoint: Endpoint) -> None:
    assert endpoint.get("/servers/good/restart").status_code == 405
    assert endpoint.post("/status", token=endpoint.token).status_code == 405
    assert httpx.put(endpoint.url + "/healthz").status_code == 405
    assert endpoint.get("/nope").status_code == 404
    assert endpoint.post("/servers/good/explode", token=endpoint.token).status_code == 404


def test_token_file_is_private(endpoint: Endpoint) -> None:
    mode = stat.S_IMODE((endpoint.daemon.state_dir / "api-token").stat().st_mode)
    assert mode == 0o600 and len(endpoint.token) >= 32


def test_binds_loopback_by_default(
    tmp_path: Path, bad_server: Callable[..., Running], run_daemon: Callable[[object], DaemonThread]
) -> None:
    config = parse_config(
        {"watchdog": {"state_dir": str(tmp_path / "s")}, "server": [{"url": bad_server("ok").url}]}
    )
    assert (config.watchdog.listen_host, config.watchdog.listen_port) == ("127.0.0.1", 9464)
    # The default host, on a free port so a watchdog already running here is not disturbed.
    config = replace(config, watchdog=replace(config.watchdog, listen_port=0))
    t = run_daemon(Daemon(config))
    e = Endpoint(t)
    assert e.daemon.endpoint is not None and e.daemon.endpoint.server_address[0] == "127.0.0.1"


def test_manual_restart_goes_through_the_restart_path(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    ok = BadByPidfile(tmp_path, "ok")
    try:
        raw = command_config(tmp_path, ok)
        raw["watchdog"]["listen"] = "127.0.0.1:0"  # type: ignore[index]
        t = run_daemon(Daemon(parse_config(raw)))
        e = Endpoint(t)
        until(lambda: e.get("/healthz/bad").status_code == 200, 20, "healthy")
        before = ok.pid()
        assert e.post("/servers/bad/restart", token=e.token).status_code == 202
        until(lambda: t.daemon.store.restarts("bad", 0.0), 20, "the restart")
        until(lambda: t.daemon.store.restarts("bad", 0.0)[0].outcome, 20, "its outcome")
        (restart,) = t.daemon.store.restarts("bad", 0.0)
        assert (restart.trigger, restart.outcome) == ("manual", "recovered")
        assert ok.pid() != before
    finally:
        ok.kill()


# -- status and history, as a person runs them ---------------------------------------------


def cli(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return mlx_watchdog(*args, "--config", str(config), timeout=60)


def test_status_and_history_with_the_daemon_running_and_stopped(
    tmp_path: Path, hanging: BadByPidfile
) -> None:
    from tests.test_daemon import daemon_process, toml

    raw = command_config(tmp_path, hanging)
    raw["watchdog"]["listen"] = "127.0.0.1:0"  # type: ignore[index]
    cfg = tmp_path / "w.toml"
    cfg.write_text(toml(raw))
    log = tmp_path / "daemon.log"
    proc = daemon_process(cfg, log)
    try:
        until(lambda: "recovered" in log.read_text(), 30, "the wedge to be healed")
        until(lambda: "bad healthy" in log.read_text(), 30, "healthy again")
        live = cli(cfg, "status", "--json")
        assert live.returncode == 0, live.stderr
        doc = json.loads(live.stdout)
        assert doc["watchdog"]["running"] is True and doc["watchdog"]["pid"] == proc.pid
        (server,) = doc["servers"]
        assert server["state"] == "healthy" and server["restarts_24h"] == 1
        assert server["budget_left"] == 2
        human = cli(cfg, "status")
        assert human.returncode == 0 and "watchdog running" in human.stdout
        assert "bad" in human.stdout and "healthy" in human.stdout
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    stopped = cli(cfg, "status", "--json")
    assert stopped.returncode == 3
    doc = json.loads(stopped.stdout)
    assert doc["watchdog"]["running"] is False and "not running" in doc["watchdog"]["why"]
    assert doc["servers"][0]["state"] == "healthy"  # the last recorded probe
    human = cli(cfg, "status")
    assert human.returncode == 3 and "not running" in human.stdout

    history = cli(cfg, "history", "--json")
    assert history.returncode == 0
    (incident,) = json.loads(history.stdout)
    assert incident["state"] == "wedged" and incident["outcome"] == "restarted"
    assert incident["actions"][0]["trigger"] == "wedged"
    table = cli(cfg, "history", "--since", "1h", "--server", "bad")
    assert "wedged" in table.stdout and "restarted" in table.stdout
    other = cli(cfg, "history", "--server", "other")
    assert other.returncode == 3 and 'no server named "other"' in other.stderr
    refused = cli(cfg, "restart", "bad")
    assert refused.returncode == 3 and "not running" in refused.stderr
