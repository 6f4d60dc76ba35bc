"""A password or token written in a server's URL never reaches an output: every command's text
and JSON, the endpoint, the log, the history and the alerts. It is moved out of the URL when the
config is read, so nothing that shows the URL can carry it."""

from __future__ import annotations

import base64
import json
import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from mlx_watchdog.config import ServerConfig, parse_config
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.sense.request import auth_headers
from tests.builders import toml, watchdog_config
from tests.conftest import DaemonThread, Running, mlx_watchdog, until

FORMS = [
    ("user:Hunter2Secret@", "user", "Hunter2Secret"),
    ("TokOnlySecret99@", "TokOnlySecret99", ""),
    (":EmptyUserSecret@", "", "EmptyUserSecret"),
    ("me:p%40ssSecret%3A@", "me", "p@ssSecret:"),
]
SECRETS = ("Hunter2Secret", "TokOnlySecret99", "EmptyUserSecret", "p%40ssSecret", "p@ssSecret")


@pytest.mark.parametrize(("userinfo", "user", "password"), FORMS)
def test_credentials_leave_the_url_and_become_basic_auth(
    userinfo: str, user: str, password: str
) -> None:
    server = ServerConfig(name="s", url=f"http://{userinfo}127.0.0.1:8080")
    assert server.url == "http://127.0.0.1:8080"
    header = auth_headers(server)["Authorization"]
    assert base64.b64decode(header.removeprefix("Basic ")).decode() == f"{user}:{password}"
    assert not any(s in repr(server) for s in SECRETS)


def test_no_output_carries_a_secret_from_a_url(
    tmp_path: Path,
    bad_server: Callable[..., Running],
    run_daemon: Callable[[object], DaemonThread],
    caplog: pytest.LogCaptureFixture,
) -> None:
    ok, broken = bad_server("ok"), bad_server("error_500")
    servers = [
        {"name": f"s{i}", "url": ok.url.replace("://", f"://{info}"), "match": "badserver"}
        for i, (info, _, _) in enumerate(FORMS)
    ]
    servers.append(
        {
            "name": "broken",
            "url": broken.url.replace("://", "://user:Hunter2Secret@"),
            "match": "badserver",
        }
    )
    raw = watchdog_config(tmp_path / "state", servers, alerts=["json://127.0.0.1:9/x"])
    cfg = tmp_path / "w.toml"
    cfg.write_text(toml(raw))
    outputs: list[str] = []
    for args in (
        ["probe", "--config", str(cfg)],
        ["probe", "--config", str(cfg), "--json"],
        ["probe", "--url", servers[0]["url"], "--json"],
        ["probe", "--url", servers[1]["url"]],
        ["config", "check", "--config", str(cfg)],
    ):
        run = mlx_watchdog(*args)
        assert run.returncode in (0, 2), run.stderr
        outputs += [run.stdout, run.stderr]

    sent: list[str] = []

    def notify(url: str, title: str, body: str) -> bool:
        sent.append(f"{title}\n{body}")
        return True

    caplog.set_level(logging.DEBUG, logger="mlx_watchdog")
    t = run_daemon(Daemon(parse_config(raw), notify=notify).open())
    until(lambda: t.daemon.cycles["broken"].incident is not None, 20, "the broken one detected")
    endpoint = t.daemon.endpoint
    assert endpoint is not None
    url = f"http://127.0.0.1:{endpoint.server_address[1]}"
    outputs += [httpx.get(url + "/status").text, httpx.get(url + "/healthz").text]
    outputs += [httpx.get(url + "/metrics").text]
    status = mlx_watchdog("status", "--config", str(cfg), "--json")
    outputs += [status.stdout, status.stderr]
    t.daemon.alerter.flush()
    t.stop()
    stopped = mlx_watchdog("status", "--config", str(cfg), "--json")
    history = mlx_watchdog("history", "--config", str(cfg), "--json")
    outputs += [stopped.stdout, history.stdout, caplog.text, *sent]
    with sqlite3.connect(tmp_path / "state" / "history.db") as db:
        for table in ("probes", "incidents", "events"):
            outputs.append(json.dumps(db.execute(f"SELECT * FROM {table}").fetchall()))
    assert sent and "broken" in "".join(sent)
    assert json.loads(status.stdout)["servers"][0]["url"] == ok.url
    leaks = [(s, i) for i, text in enumerate(outputs) for s in SECRETS if s in text]
    assert leaks == [], leaks
