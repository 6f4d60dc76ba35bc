"""The watchdog's own endpoint over real HTTP, and the commands that use it."""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlx_watchdog.config import Config, parse_config
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.record.document import Status, WatchdogLine
from tests.builders import QUICK_TOML, badserver_argv, command_config, toml, watchdog_config
from tests.conftest import (
    BadByPidfile,
    DaemonThread,
    Running,
    daemon_process,
    free_port,
    mlx_watchdog,
    restarts_in,
    until,
)


def two_servers(tmp_path: Path, good: Running, bad: Running) -> Config:
    servers = [
        {"name": "good", "url": good.url, "probe": QUICK_TOML},
        {"name": "hung", "url": bad.url, "probe": QUICK_TOML},
    ]
    return parse_config(watchdog_config(tmp_path / "state", servers))


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


@pytest.fixture(scope="module")
def endpoint(
    tmp_path_factory: pytest.TempPathFactory, module_bad_server: Callable[..., Running]
) -> Iterator[Endpoint]:
    """One daemon with a good and a hung server, shared by the tests that only look (a test
    that drains undrains before it ends)."""
    config = two_servers(
        tmp_path_factory.mktemp("endpoint"), module_bad_server("ok"), module_bad_server("hang")
    )
    t = DaemonThread(Daemon(config).open())
    e = Endpoint(t)

    def state(name: str) -> str | None:
        v = t.daemon.cycles[name].verdict
        return v.state if v else None

    try:
        until(lambda: state("good") == "healthy" and state("hung") == "wedged", 30, "verdicts")
        yield e
    finally:
        t.stop()


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
    again = endpoint.post("/servers/good/drain", token=endpoint.token)
    assert again.status_code == 409 and "drained already" in again.text  # nothing changed
    assert endpoint.post("/servers/good/undrain", token=endpoint.token).status_code == 202
    until(lambda: endpoint.get("/healthz/good").status_code == 200, 10, "the undrain")
    again = endpoint.post("/servers/good/undrain", token=endpoint.token)
    assert again.status_code == 409 and "not drained; nothing to undrain" in again.text
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
    t = run_daemon(Daemon(config).open())
    e = Endpoint(t)
    assert e.daemon.endpoint is not None and e.daemon.endpoint.server_address[0] == "127.0.0.1"


def test_manual_restart_goes_through_the_restart_path(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    ok = BadByPidfile(tmp_path, "ok")
    try:
        raw = command_config(tmp_path, ok)
        raw["watchdog"]["listen"] = "127.0.0.1:0"  # type: ignore[index]
        t = run_daemon(Daemon(parse_config(raw)).open())
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
    # One source for the numbers: the history alone says what the running daemon said.
    counted = ("restarts_24h", "incidents_24h", "gave_up_24h", "budget_left", "incident")
    assert {k: doc["servers"][0][k] for k in counted} == {k: server[k] for k in counted}
    assert doc["servers"][0]["last_restart"] == server["last_restart"]
    assert server["last_restart"]["outcome"] == "recovered"
    human = cli(cfg, "status")
    assert human.returncode == 3 and "not running" in human.stdout
    assert "(recorded " in human.stdout  # the last probe's state, said as past

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


def _raw(url: str, request: bytes, wait: float = 5.0) -> bytes:
    """One request on a bare socket, and what comes back before the server closes or `wait`."""
    import socket
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=wait) as sock:
        sock.sendall(request)
        got = b""
        try:
            while chunk := sock.recv(65536):
                got += chunk
                if b"\r\n\r\n" in got and b"Connection: close" in got:
                    break
        except TimeoutError:
            pass
    return got


def test_a_body_is_read_only_for_the_token_holder_and_its_length_is_checked(
    endpoint: Endpoint,
) -> None:
    action = b"POST /servers/good/drain HTTP/1.1\r\nHost: w\r\n"
    # No token, a body announced of a terabyte that never comes: refused at once, unread.
    refused = _raw(endpoint.url, action + b"Content-Length: 1000000000000\r\n\r\n")
    assert refused.startswith(b"HTTP/1.1 401 ")
    auth = f"Authorization: Bearer {endpoint.token}\r\n".encode()
    for length, code in (
        (b"abc", 400),
        (b"1e3", 400),
        (b"-1", 400),
        (b"10^12", 400),
        (b"4000000000", 413),
        (b"2048", 413),
    ):
        answer = _raw(endpoint.url, action + auth + b"Content-Length: " + length + b"\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 %d " % code), (length, answer[:80])
    missing = _raw(endpoint.url, action + auth + b"\r\n")
    assert missing.startswith(b"HTTP/1.1 411 ")
    chunked = _raw(endpoint.url, action + auth + b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
    assert chunked.startswith(b"HTTP/1.1 411 ")
    ok = _raw(endpoint.url, action + auth + b"Content-Length: 2\r\nConnection: close\r\n\r\n{}")
    assert ok.startswith(b"HTTP/1.1 202 ")
    for method in (b"HEAD", b"OPTIONS", b"TRACE", b"CONNECT"):
        answer = _raw(endpoint.url, method + b" /status HTTP/1.1\r\nHost: w\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 405 ") and b"Allow: GET, POST" in answer


def test_hundreds_of_idle_connections_and_a_slow_sender_leave_the_watchdog_seeing(
    tmp_path: Path, bad_server: Callable[..., Running]
) -> None:
    """launchd gives a job 256 open files. 300 connections that send nothing and one that sends
    its headers a byte at a time must leave the probing and /healthz working: a wedge that
    begins meanwhile is found, and a new client gets the real answer."""
    import resource
    import socket
    import sys
    import time

    hang_file = tmp_path / "hang-now"
    port = free_port()
    server = subprocess.Popen(
        badserver_argv(port, "hang_later", "--hang-file", str(hang_file)),
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
    )
    assert server.stdout is not None and server.stdout.readline().strip() == b"ready"
    listen = free_port()
    cfg = tmp_path / "w.toml"
    cfg.write_text(
        toml(
            {
                "watchdog": {
                    "interval": "500ms",
                    "listen": f"127.0.0.1:{listen}",
                    "state_dir": str(tmp_path / "state"),
                },
                "server": [
                    {
                        "name": "bad",
                        "url": f"http://127.0.0.1:{port}",
                        "match": "badserver",
                        "probe": {"slow_after": "1s", "wedge_after": "2s", "startup_grace": "1s"},
                    }
                ],
            }
        )
    )
    log = tmp_path / "daemon.log"

    def launchd_limits() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))

    with log.open("wb") as err:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "mlx_watchdog", "run", "--config", str(cfg)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            preexec_fn=launchd_limits,
        )
    idle: list[socket.socket] = []
    try:
        until(lambda: "bad healthy" in log.read_text(), 30, "the daemon to see it serve")
        for _ in range(300):
            idle.append(socket.create_connection(("127.0.0.1", listen), timeout=5))
        slow = socket.create_connection(("127.0.0.1", listen), timeout=5)
        idle.append(slow)
        slow.sendall(b"GET /healthz HTTP/1.1\r\n")
        for byte in b"Host: w\r\n":
            slow.sendall(bytes([byte]))
            time.sleep(0.05)
        hang_file.touch()
        began = time.monotonic()
        until(lambda: "bad detected: wedged" in log.read_text(), 30, "the wedge to be found")
        found = time.monotonic() - began
        health = httpx.get(f"http://127.0.0.1:{listen}/healthz", timeout=10)
        assert health.status_code == 503 and "bad unavailable: wedged" in health.text
        assert found < 2.0 + 2 * 0.5 + 3.0, found  # wedge_after + 2 intervals, and slack
        assert daemon.poll() is None
        assert "Too many open files" not in log.read_text()
    finally:
        for sock in idle:
            sock.close()
        daemon.terminate()
        daemon.wait(30)
        server.kill()
        server.wait()
        assert server.stdout is not None
        server.stdout.close()


def test_a_state_folder_others_can_write_is_refused_and_planted_links_are_not_believed(
    tmp_path: Path, bad_server: Callable[..., Running], run_daemon: Callable[[object], DaemonThread]
) -> None:
    """As ssh treats ~/.ssh: a folder anyone may write would let them plant the token the
    endpoint accepts, or a daemon record that points status at their server."""

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    cfg = tmp_path / "w.toml"
    srv = bad_server("ok")
    cfg.write_text(
        toml(
            {
                "watchdog": {"interval": "200ms", "listen": "127.0.0.1:0", "state_dir": str(state)},
                "server": [{"name": "s", "url": srv.url, "match": "badserver"}],
            }
        )
    )
    state.chmod(0o777)
    refused = mlx_watchdog("run", "--config", str(cfg), timeout=30)
    assert refused.returncode == 3
    assert f"state_dir {state} can be written by other users (mode 0777); run: chmod 700" in (
        refused.stderr
    )
    state.chmod(0o700)

    # A token planted as a symlink to a file the attacker controls is never believed.
    theirs = tmp_path / "their-token"
    theirs.write_text("attacker-chosen-token-0123456789\n")
    (state / "api-token").symlink_to(theirs)
    config = parse_config(
        watchdog_config(state, [{"name": "s", "url": srv.url, "match": "badserver"}])
    )
    t = run_daemon(Daemon(config).open())
    until(lambda: t.daemon.cycles["s"].verdict is not None, 20, "a verdict")
    assert t.daemon.endpoint is None, "no endpoint serves with a token it cannot trust"
    t.stop()
    (state / "api-token").unlink()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (state / "daemon.json").unlink(missing_ok=True)
    (state / "daemon.json").symlink_to(victim)

    t = run_daemon(Daemon(config).open())
    e = Endpoint(t)
    assert victim.read_text() == "precious\n", "the record was written through a planted link"
    assert not (state / "daemon.json").is_symlink()
    assert e.post("/servers/s/drain", "attacker-chosen-token-0123456789").status_code == 401
    assert e.post("/servers/s/drain", e.token).status_code == 202
    for name in ("api-token", "daemon.json", "history.db"):
        mode = stat.S_IMODE((state / name).stat().st_mode)
        assert mode == 0o600, (name, oct(mode))
    t.stop()


def _lan_address() -> str:
    import socket

    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return str(a.address)
    pytest.skip("this machine has no address beyond loopback")


@pytest.mark.parametrize("opened", [[], ["/metrics"]])
def test_beyond_loopback_status_and_metrics_need_the_token(
    tmp_path: Path,
    bad_server: Callable[..., Running],
    run_daemon: Callable[[object], DaemonThread],
    opened: list[str],
) -> None:
    host = _lan_address()
    config = parse_config(
        {
            "watchdog": {
                "interval": "200ms",
                "listen": f"{host}:0",
                "state_dir": str(tmp_path / "state"),
                "open_routes": opened,
            },
            "server": [{"name": "s", "url": bad_server("ok").url, "match": "badserver"}],
        }
    )
    wanted = "/status, /metrics, the status page and the actions need the token"
    assert any(wanted in w for w in config.warnings)
    t = run_daemon(Daemon(config).open())
    e = Endpoint(t)
    until(lambda: t.daemon.cycles["s"].verdict is not None, 20, "a verdict")
    bearer = {"Authorization": f"Bearer {e.token}"}
    assert e.get("/healthz").status_code == 200  # balancers need no token
    assert e.get("/status").status_code == 401
    assert e.get("/status", headers=bearer).status_code == 200
    assert e.get("/metrics").status_code == (200 if opened else 401)
    assert e.get("/metrics", headers=bearer).status_code == 200
    assert e.get("/status", headers={"Authorization": "Bearer nope"}).status_code == 401
    # this user's `status` sends its daemon's token itself
    cfg = tmp_path / "w.toml"
    cfg.write_text(
        toml(
            {
                "watchdog": {"state_dir": str(tmp_path / "state")},
                "server": [{"name": "s", "url": "http://127.0.0.1:1"}],
            }
        )
    )
    live = mlx_watchdog("status", "--config", str(cfg), "--json")
    assert json.loads(live.stdout)["watchdog"]["running"] is True, live.stderr


def test_open_routes_names_only_guarded_routes() -> None:
    from mlx_watchdog.config import ConfigError

    wanted = 'watchdog.open_routes = ["/healthz"]: "/healthz" is not a route'
    with pytest.raises(ConfigError, match=re.escape(wanted)):
        parse_config({"watchdog": {"open_routes": ["/healthz"]}})


def test_a_persons_restart_never_repeats_the_watchdogs_and_reports_how_it_ended(
    tmp_path: Path, hanging: BadByPidfile
) -> None:
    """While the daemon restarts a wedged server, and just after it serves again, `restart`
    is refused, saying what happened; later it runs, and waits for and prints the outcome."""

    raw = command_config(tmp_path, hanging)
    raw["server"][0]["restart_command"][-1] = "3"  # type: ignore[index]  # a 3 s restart
    cfg = tmp_path / "w.toml"
    cfg.write_text(toml(raw))
    log = tmp_path / "daemon.log"
    db = tmp_path / "state" / "history.db"
    proc = daemon_process(cfg, log)
    try:
        until(lambda: "restarting through" in log.read_text(), 30, "the daemon's restart")
        during = cli(cfg, "restart", "bad")
        assert during.returncode == 1 and "is being restarted already" in during.stderr
        until(lambda: "recovered" in log.read_text(), 30, "the daemon's restart to end")
        after = cli(cfg, "restart", "bad")
        assert after.returncode == 1 and "and serves again" in after.stderr, after.stderr
        assert restarts_in(db) == [("wedged", "recovered")]  # no second restart asked
        time.sleep(10)
        later = cli(cfg, "restart", "bad")
        assert later.returncode == 0, later.stdout + later.stderr
        assert "restarted bad: serving again after" in later.stdout
        assert restarts_in(db) == [("wedged", "recovered"), ("manual", "recovered")]
        quick = cli(cfg, "restart", "bad", "--no-wait")
        assert quick.returncode == 1 and "serves again" in quick.stderr
        said = cli(cfg, "restart", "bad", "--no-wait", "--json")
        assert said.returncode == 1 and json.loads(said.stdout)["done"] is False
        assert "serves again" in json.loads(said.stdout)["refused"]
        drained = cli(cfg, "drain", "bad", "--json")
        assert drained.returncode == 0 and json.loads(drained.stdout)["done"] is True
        row = next(line for line in cli(cfg, "status").stdout.splitlines() if "bad" in line)
        assert row.split()[2] == "drained", row  # the traffic column: out of the balancer
        again = cli(cfg, "drain", "bad", "--json")
        assert again.returncode == 1 and "drained already" in json.loads(again.stdout)["refused"]
    finally:
        proc.terminate()
        assert proc.wait(30) == 0


class BigMetrics:
    """A backend whose /metrics takes a while to send (2 MB): a client can leave mid-answer."""

    def status(self) -> Status:
        return Status(WatchdogLine())

    def prometheus(self) -> tuple[bytes, str]:
        return b"# a long exposition\n" * 100_000, "text/plain"

    def act(self, name: str, action: str) -> str:
        raise KeyError(name)


def test_clients_that_go_away_mid_answer_leave_no_traceback(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A load balancer's timeout or Ctrl-C on curl is routine: no traceback per disconnect
    (there were 12 for 12), and the endpoint answers the next client."""
    import socket
    import struct

    from mlx_watchdog.serve.endpoint import start

    server, _ = start(BigMetrics(), "127.0.0.1", 0, "t", ())
    port = server.server_address[1]
    try:
        for _ in range(12):
            s = socket.create_connection(("127.0.0.1", port))
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            s.recv(10)  # the answer has begun
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()  # a reset, not a polite close
        time.sleep(0.5)
        assert httpx.get(f"http://127.0.0.1:{port}/status", timeout=10).status_code == 200
    finally:
        server.shutdown()
        server.server_close()
    assert "Traceback" not in capfd.readouterr().err


def test_restarts_asked_for_at_the_same_moment_are_one_restart(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    """Eight people press restart at once: one is queued, the others are told why not."""
    import threading

    ok = BadByPidfile(tmp_path, "ok")
    try:
        raw = command_config(tmp_path, ok)
        raw["watchdog"]["listen"] = "127.0.0.1:0"  # type: ignore[index]
        t = run_daemon(Daemon(parse_config(raw)).open())
        e = Endpoint(t)
        until(lambda: e.get("/healthz/bad").status_code == 200, 20, "healthy")
        go = threading.Barrier(8)
        codes: list[int] = []

        def press() -> None:
            go.wait()
            codes.append(e.post("/servers/bad/restart", token=e.token).status_code)

        pressing = [threading.Thread(target=press) for _ in range(8)]
        for p in pressing:
            p.start()
        for p in pressing:
            p.join(30)
        assert sorted(codes) == [202] + [409] * 7, codes
        until(lambda: t.daemon.store.restarts("bad", 0.0), 20, "the restart")
        until(lambda: t.daemon.store.restarts("bad", 0.0)[0].outcome, 20, "its outcome")
        assert len(t.daemon.store.restarts("bad", 0.0)) == 1
        assert not t.daemon.cycles["bad"].asks.queued
    finally:
        ok.kill()


def test_a_keep_alive_client_is_told_to_reconnect_never_cut_mid_request(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A connection's whole life is bounded (a byte-a-second sender must not keep it), but a
    page reloaded over one keep-alive connection is told `Connection: close` between two
    answers once the connection is older than KEEP_ALIVE, and reconnects: no request fails."""
    from mlx_watchdog.record.store import Store
    from mlx_watchdog.serve import endpoint
    from tests.pageday import NOW, PageBackend, a_day, status_doc

    monkeypatch.setattr(endpoint, "CONNECTION_LIFETIME", 1.5)
    monkeypatch.setattr(endpoint, "KEEP_ALIVE", 0.5)
    store = Store(None)
    a_day(store, "srv-healthy", NOW)
    server, _ = endpoint.start(PageBackend(store, status_doc(NOW)), "127.0.0.1", 0, "t" * 20)
    url = f"http://127.0.0.1:{server.server_address[1]}/healthz"
    closes, answered, ends = 0, 0, time.monotonic() + 3.0
    try:
        with httpx.Client(timeout=5) as client:
            while time.monotonic() < ends:
                r = client.get(url)  # a RemoteProtocolError here: cut mid-request
                answered += 1
                closes += r.headers.get("connection") == "close"
    finally:
        server.shutdown()
        server.server_close()
    assert answered > 10 and closes >= 2  # past two connections' lifetimes, none cut


def test_a_typo_in_the_config_on_disk_blinds_no_command_while_the_daemon_runs(
    tmp_path: Path, bad_server: Callable[..., Running]
) -> None:
    """The daemon runs on the config it loaded; a typo written since made status, history and
    restart exit 3 with the config error (a monitoring check said UNKNOWN). They read the
    running watchdog's record now, and say the config on disk has an error; with no watchdog
    running the error is all there is (exit 3)."""
    srv = bad_server("ok")
    state = tmp_path / "state"
    cfg = tmp_path / "w.toml"
    cfg.write_text(
        f'[watchdog]\nstate_dir = "{state}"\nlisten = "127.0.0.1:0"\ninterval = "300ms"\n\n'
        f'[[server]]\nname = "bad"\nurl = "{srv.url}"\nmatch = "badserver"\n'
    )
    log = tmp_path / "daemon.log"
    proc = daemon_process(cfg, log)
    try:
        until(lambda: "bad healthy" in log.read_text(), 30, "healthy")
        cfg.write_text(cfg.read_text().replace("interval =", "intervall ="))  # the typo
        shown = cli(cfg, "status", "--json")
        assert shown.returncode == 0, shown.stderr
        doc = json.loads(shown.stdout)
        assert doc["watchdog"]["pid"] == proc.pid and doc["servers"][0]["state"] == "healthy"
        assert "config error:" in shown.stderr and '"intervall"' in shown.stderr
        assert "showing what the watchdog recorded" in shown.stderr
        assert cli(cfg, "history").returncode == 0
        # The ask reaches the daemon, which answers it (manager = "none": refused at once).
        asked = cli(cfg, "restart", "bad", "--json")
        assert asked.returncode == 1, asked.stderr
        assert "the watchdog only watches bad" in json.loads(asked.stdout)["refused"]
    finally:
        proc.terminate()
        assert proc.wait(30) == 0
    alone = cli(cfg, "status")
    assert alone.returncode == 3 and '"intervall"' in alone.stderr
    assert "showing what the watchdog recorded" not in alone.stderr
