"""`fleet` against peers that lie: each crafted /status is that machine's row ("unknown" or
unreachable, exit 3 at least), never a crash that hides the healthy machines, never an escape
sequence on the terminal, never a wait longer than the per-machine deadline."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from tests.conftest import Running, mlx_watchdog

GOOD = {
    "watchdog": {"running": True},
    "servers": [
        {"name": "fine", "state": "healthy", "exit_code": 0, "reason": "healthy: first token"}
    ],
}
HOSTILE = {
    "exit code 256": {
        "watchdog": {"running": True},
        "servers": [{"name": "x", "state": "healthy", "exit_code": 256}],
    },
    "exit code -1": {
        "watchdog": {"running": True},
        "servers": [{"name": "x", "state": "healthy", "exit_code": -1}],
    },
    "exit code as text": {
        "watchdog": {"running": True},
        "servers": [{"name": "x", "exit_code": "0"}],
    },
    "markup": {
        "watchdog": {"running": True},
        "servers": [{"name": "[/]", "state": "[/]", "exit_code": 0, "reason": "[bold]x[/]"}],
    },
    "no servers key": {"watchdog": {"running": True}},
    "servers a string": {"watchdog": {"running": True}, "servers": "all fine"},
    "server not an object": {"watchdog": {"running": True}, "servers": [1]},
    "watchdog a list": {"watchdog": [], "servers": []},
    "no name or state": {"watchdog": {"running": True}, "servers": [{}]},
    "numbers that are not": {
        "watchdog": {"running": True},
        "servers": [
            {
                "name": "x",
                "state": "healthy",
                "exit_code": 0,
                "restarts_24h": "many",
                "gave_up_24h": 1e308,
                "budget_left": -5,
            }
        ],
    },
    "escapes": {
        "watchdog": {"running": True},
        "servers": [
            {
                "name": "\x1b[2Jwiped",
                "state": "healthy",
                "exit_code": 0,
                "reason": "\x1b]8;;http://evil\x1b\\click\x1b]8;;\x1b\\",
            }
        ],
    },
}
SERVING = ("numbers that are not", "escapes")
RAW = {
    "nested": "[" * 100_000,
    "not json": "<html>",
    "trickle": {"body": json.dumps(GOOD) * 3, "trickle": 0.5},
    "endless": {"body": "x" * 65536, "endless": True},
}


@pytest.fixture
def peers(bad_server: Callable[..., Running]) -> tuple[Running, Running]:
    good, bad = bad_server("ok"), bad_server("ok")
    httpx.put(good.url + "/_hostile", json={"/status": {"body": json.dumps(GOOD)}}, timeout=5)
    return good, bad


def _answer(bad: Running, answer: object) -> None:
    if isinstance(answer, dict) and ("body" in answer):
        route = answer
    else:
        route = {"body": answer if isinstance(answer, str) else json.dumps(answer)}
    r = httpx.put(bad.url + "/_hostile", json={"/status": route}, timeout=5)
    assert r.status_code == 204


@pytest.mark.parametrize("name", [*HOSTILE, *RAW])
def test_a_lying_peer_is_its_own_row_and_never_hides_the_others(
    name: str, peers: tuple[Running, Running]
) -> None:
    good, bad = peers
    _answer(bad, HOSTILE.get(name, RAW.get(name)))
    for args in (["--json"], []):
        run = mlx_watchdog("fleet", good.url, bad.url, *args, timeout=60)
        assert "Traceback" not in run.stderr, run.stderr
        wanted = 0 if name in SERVING else 3  # a serving peer with odd fields is still serving
        assert run.returncode == wanted, (name, run.stdout[-400:], run.stderr[-400:])
        assert not any(c in run.stdout for c in ("\x1b", "\x9b", "u001b", "u009b"))
        if args:
            rows = json.loads(run.stdout)["rows"]
            assert rows[0]["machine"] == good.url and rows[0]["state"] == "healthy"
            theirs = [r for r in rows if r["machine"] == bad.url]
            assert theirs and all(
                r["state"] in ("unknown", "unreachable", "healthy") for r in theirs
            )
        else:
            assert "fine" in run.stdout and "healthy" in run.stdout


@pytest.mark.parametrize(
    "url", ["https://mac-1.lan:9464", "http://mac-1.lan:9464/status", "http://u:p@mac-1:9464"]
)
def test_a_peer_url_it_cannot_read_as_given_is_refused(url: str) -> None:
    run = mlx_watchdog("fleet", url)
    assert run.returncode == 3 and "give a watchdog's endpoint as http://host:port" in run.stderr
