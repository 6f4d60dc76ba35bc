"""A watchdog that cannot see says so: a tick that fails or blocks leaves no verdict served as
current, `/healthz` turns 503, an alert says the watchdog is blind, and a fresh verdict ends it.
The daemon runs against the misbehaving server with its span clock in the test's hands."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from mlx_watchdog.config import parse_config
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.judge.bounds import fresh_for
from mlx_watchdog.serve.endpoint import start as start_endpoint
from tests.conftest import Running


class Broken:
    """Stands in for one of the tick's parts: until `broken`, it passes the call on; then it
    fails as a bug in the watchdog would (not an error the part itself expects)."""

    def __init__(self, real: Callable[..., object]) -> None:
        self.real = real
        self.broken = False

    def __call__(self, *args: object, **kwargs: object) -> object:
        if self.broken:
            raise RuntimeError("a fault no one foresaw")
        return self.real(*args, **kwargs)


class Mono:
    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def blind_daemon(
    tmp_path: Path, bad_server: Callable[..., Running]
) -> tuple[Daemon, Broken, Mono, list[tuple[str, str]]]:
    srv = bad_server("ok")
    config = parse_config(
        {
            "watchdog": {
                "interval": "1s",
                "listen": "off",
                "state_dir": str(tmp_path / "state"),
                "alerts": ["json://127.0.0.1:9/alerts"],
            },
            "server": [
                {
                    "name": "bad",
                    "url": srv.url,
                    "match": "badserver",
                    "probe": {"slow_after": "1s", "wedge_after": "2s", "models_timeout": "1s"},
                }
            ],
        }
    )
    sent: list[tuple[str, str]] = []
    mono = Mono()

    def notify(url: str, title: str, body: str) -> bool:
        sent.append((title, body))
        return True

    daemon = Daemon(config, mono=mono, notify=notify).open()
    # A part every tick goes through (the process is looked at every few seconds only while
    # the server answers at once, so it would not fail every tick).
    checker = daemon.cycles["bad"].checker
    table = Broken(checker.observe)
    checker.observe = table  # type: ignore[method-assign]
    yield daemon, table, mono, sent
    daemon.cycles["bad"].checker.abort()
    daemon.close()


def test_a_failing_tick_is_blindness_said_once_and_ended_by_a_fresh_verdict(
    blind_daemon: tuple[Daemon, Broken, Mono, list[tuple[str, str]]],
) -> None:
    daemon, table, mono, sent = blind_daemon
    w = daemon.cycles["bad"]
    server = w.server
    limit = fresh_for(daemon.config.watchdog.interval, server.probe.slow_after, 1.0)
    endpoint, _ = start_endpoint(daemon, "127.0.0.1", 0, "t")
    url = f"http://127.0.0.1:{endpoint.server_address[1]}"
    try:
        daemon._job("bad")
        assert w.verdict is not None and w.verdict.state == "healthy"
        assert httpx.get(url + "/healthz").status_code == 200

        table.broken = True
        for _ in range(3):
            mono.now += limit / 2
            daemon._job("bad")  # fails, and must not raise: the job goes on
            daemon.look_at_sight()
        doc = daemon.status().servers[0]
        assert doc.state == "unknown" and doc.blind and not doc.serving
        assert doc.verdict_age_s == pytest.approx(3 * limit / 2, abs=0.2)
        assert doc.exit_code == 3
        assert doc.reason.startswith("no fresh verdict (watchdog blind for ")
        assert "RuntimeError: a fault no one foresaw" in doc.reason
        health = httpx.get(url + "/healthz")
        assert health.status_code == 503 and "no fresh verdict" in health.text
        metrics = httpx.get(url + "/metrics").text
        assert 'mlx_watchdog_state{server="bad",state="unknown"} 1.0' in metrics
        assert 'mlx_watchdog_state{server="bad",state="healthy"} 0.0' in metrics
        failed = daemon.store.events("bad", since=0.0, kind="tick_failed")
        assert len(failed) == 1, "the same fault is recorded once, not at every tick"

        table.broken = False
        mono.now += 1.0
        daemon._job("bad")
        daemon.look_at_sight()
        daemon.alerter.flush()
        doc = daemon.status().servers[0]
        assert (doc.state, doc.blind, doc.serving) == ("healthy", False, True)
        assert httpx.get(url + "/healthz").status_code == 200
        titles = [t for t, _ in sent]
        assert titles == ["the watchdog cannot see bad", "the watchdog sees bad again"]
        kinds = [e.kind for e in daemon.store.events("bad", since=0.0) if e.kind != "gave_up"]
        assert kinds == ["tick_failed", "blind", "seeing"]
    finally:
        endpoint.shutdown()
        endpoint.server_close()


def test_a_tick_that_blocks_is_blindness_too(
    blind_daemon: tuple[Daemon, Broken, Mono, list[tuple[str, str]]],
) -> None:
    daemon, _, mono, _ = blind_daemon
    w = daemon.cycles["bad"]
    daemon._job("bad")
    assert w.shown.blindness(mono.now, daemon.interval) is None
    w.tick_begins()  # a tick that began and never ended, as one stuck in a read
    mono.now += 60.0
    why = w.shown.blindness(mono.now, daemon.interval)
    assert why == "no fresh verdict (watchdog blind for 60 s: a tick has run for 60 s)"
    w.phase = w.phase.RESTARTING  # the watchdog at work is shown as restarting, not blind
    w.publish()
    assert w.shown.blindness(mono.now, daemon.interval) is None


def test_an_unreadable_key_file_blinds_the_watchdog_and_never_blames_the_server(
    blind_daemon: tuple[Daemon, Broken, Mono, list[tuple[str, str]]],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    from dataclasses import replace

    daemon, _, mono, _ = blind_daemon
    w = daemon.cycles["bad"]
    daemon._job("bad")
    assert w.verdict is not None and w.verdict.state == "healthy"
    folder = tmp_path / "key-now-a-folder"
    folder.mkdir()  # the key file replaced by a directory while the daemon runs
    w.server = replace(w.server, api_key_file=folder)
    w.checker.server = w.server
    for _ in range(4):
        mono.now += 20.0
        daemon._job("bad")
    doc = daemon.status().servers[0]
    assert doc.state == "unknown" and "cannot read api_key_file" in doc.reason
    assert daemon.store.restarts("bad", 0.0) == []
    # Said once, in words: the watchdog's own setting, no traceback to read.
    said = [r for r in caplog.records if "cannot be probed" in r.getMessage()]
    assert len(said) == 1 and said[0].exc_info is None, [r.getMessage() for r in caplog.records]
    assert w.verdict.state == "healthy", "the last verdict stands, and is not served as current"


def test_a_long_restart_of_its_own_is_no_blindness_after_it_ends() -> None:
    """Issue 54: a restart of a minute left the verdict a minute old when it ended, and the
    watchdog said it was blind, then seeing, at the next tick. The restart is the watchdog at
    work: the verdict's age counts from its end."""
    from mlx_watchdog.cycle.shown import Shown
    from mlx_watchdog.record.tally import Figures

    server = parse_config({"server": [{"name": "s", "url": "http://127.0.0.1:9"}]}).servers[0]
    limit = Shown(server, Figures(), 0.0, 0.0).fresh_for(1.0)
    before = Shown(server, Figures(), 0.0, 70.0, verdict_mono=5.0, restarting=True)
    assert before.blindness(70.0, 1.0) is None  # while it runs: restarting, shown as such
    after = Shown(server, Figures(), 0.0, 70.0, verdict_mono=5.0, acted_mono=70.0)
    assert after.blindness(71.0, 1.0) is None
    assert after.blindness(70.0 + limit + 1, 1.0) is not None  # no fresh verdict after it
    unacted = Shown(server, Figures(), 0.0, 70.0, verdict_mono=5.0)
    assert unacted.blindness(71.0, 1.0) is not None
