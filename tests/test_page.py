"""The status page without a browser: what the history gives it, what it escapes, how it is
served and guarded, and `mlx-watchdog open`. tests/test_page_browser.py looks at it in one."""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import re
import stat
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_watchdog.config import parse_config
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.judge.evidence import Evidence
from mlx_watchdog.judge.states import STATES, State
from mlx_watchdog.judge.verdict import Verdict
from mlx_watchdog.record.document import Waiting
from mlx_watchdog.record.store import Store
from mlx_watchdog.record.tally import DAY
from mlx_watchdog.serve.day import (
    MAX_POINTS,
    MAX_RUNS,
    Days,
    Summary,
    clipped,
    coarsen,
    read_day,
    runs_of,
    thin,
)
from mlx_watchdog.serve.endpoint import start
from mlx_watchdog.serve.page import CSP, render
from tests.builders import toml, watchdog_config
from tests.conftest import DaemonThread, Running, mlx_watchdog, until
from tests.pageday import NOW, STEP, PageBackend, a_day, changed, status_doc


def test_a_day_reads_back_as_written() -> None:
    store = Store(None)
    written = a_day(store, "x", NOW)
    day = read_day(store, "x", NOW, STEP)
    assert [r.state for r in day.runs] == written.runs
    assert len(day.ttfts) == day.probes_with_token == written.probes_with_token
    assert {h: n for h, n in enumerate(day.restarts) if n} == written.restarts_by_hour
    assert {h: n for h, n in enumerate(day.gave_up) if n} == written.gave_up_by_hour
    assert len(day.incidents) == written.incidents and day.incidents[0].outage_s == 1800
    assert day.advice is not None and day.advice["client_s"] == 150


def test_runs_leave_unprobed_time_blank_and_merge_a_state() -> None:
    probes = [(0.0, "healthy"), (30.0, "healthy"), (60.0, "wedged"), (500.0, "wedged")]
    runs = runs_of(probes, until=1000.0, step=30.0)
    assert [(r.state, r.start, r.end) for r in runs] == [
        ("healthy", 0.0, 60.0),
        ("wedged", 60.0, 90.0),  # the next probe is 440 s later: the watchdog was away
        ("wedged", 500.0, 530.0),
    ]
    assert runs_of([(0.0, "<b>nonsense</b>")], 10.0, 30.0)[0].state == "unknown"
    assert runs_of([(995.0, "healthy")], 1000.0, 30.0)[0].end == 1000.0  # never past now


def test_many_probes_are_thinned_to_each_spans_slowest() -> None:
    points = [(float(i), 0.1) for i in range(5000)]
    points[4321] = (4321.0, 9.0)
    kept = thin(points, 0.0, 5000.0)
    assert len(kept) == MAX_POINTS
    assert (4321.0, 9.0) in kept  # a spike survives
    assert thin(points[:10], 0.0, 5000.0) == points[:10]


def test_hostile_text_is_escaped_and_the_style_is_the_one_the_policy_allows() -> None:
    store = Store(None)
    hostile = '<script>alert(1)</script><img src="http://example.com/x">'
    a_day(store, "srv-healthy", NOW, hostile=hostile)
    doc = status_doc(NOW, ("healthy", "wedged"))
    doc = changed(doc, 0, reason=hostile, needs_person=hostile)
    html = render(
        doc, Days(store, lambda: STEP, lambda: NOW, time.monotonic).of(["srv-healthy"]), NOW, 10
    )
    assert "<script" not in html and "<img" not in html
    assert html.count("&lt;script&gt;") >= 3  # the reason, the person note, the incident, advice
    style = re.search(r"<style>(.*?)</style>", html, re.S)
    assert style is not None
    digest = base64.b64encode(hashlib.sha256(style.group(1).encode()).digest()).decode()
    assert f"'sha256-{digest}'" in CSP
    assert "default-src 'none'" in CSP and "script-src" not in CSP  # no script at all


def test_a_history_value_of_the_wrong_type_is_said_on_the_page() -> None:
    store = Store(None)
    store.record_probe("x", NOW - 60, "healthy", "ok", {"ttft_s": 0.1})
    store.db.guard(None, lambda db: db.execute("UPDATE probes SET at = 'soon'"))
    days = Days(store, lambda: STEP, lambda: NOW, time.monotonic).of(["x"])
    assert days["x"].problem is not None and "history unreadable" in days["x"].problem
    doc = status_doc(NOW, ("healthy",))
    doc = changed(doc, 0, name="x")
    assert "history unreadable" in render(doc, days, NOW, 10)


def test_probes_come_as_recorded_and_the_history_is_read_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The page's day is kept as the daemon records probes (Days is one of its sinks): the
    history's probes are read once per server, and a page view within fresh_s reads nothing."""
    store = Store(None)
    mono = [0.0]
    days = Days(store, lambda: STEP, lambda: NOW, lambda: mono[0], fresh_s=10.0)
    store.record_probe("x", NOW - 60, "healthy", "ok", {"ttft_s": 0.1})
    assert days.of(["x"])["x"].probes_with_token == 1  # from the history
    reads: list[object] = []
    monkeypatch.setattr(store, "states", lambda *a: reads.append(a) or [])
    days.observe("x", Verdict(State.HEALTHY, "ok", Evidence(ttft_s=0.2)))
    mono[0] = 9.0
    assert days.of(["x"])["x"].probes_with_token == 1  # kept: a page view reads nothing
    mono[0] = 10.5
    day = days.of(["x"])["x"]
    assert day.probes_with_token == 2 and day.ttfts[-1] == (NOW, 0.2)
    assert day.last_probes[-1] == (NOW, "healthy") and reads == []  # never read again


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from([1.0, 30.0, 100.0, 400.0, 5000.0]), st.sampled_from(STATES)),
        max_size=300,
    )
)
def test_the_kept_summary_draws_what_a_read_of_the_history_draws(
    steps: list[tuple[float, str]],
) -> None:
    """Probes added one by one (gaps, a watchdog away, states flapping) draw the same runs and
    points as runs_of and thin over the same probes read at once."""
    kept, probes, at = Summary(), [], NOW - DAY
    for gap, state in steps:
        at += gap
        ttft = None if state == "wedged" else gap / 1000
        kept.add(at, state, ttft, 100.0)
        probes.append((at, state, ttft))
    now = at + 50.0
    runs, ttfts, tokens = kept.drawn(now, 100.0)
    since = now - DAY
    every = clipped(runs_of([(a, s) for a, s, _ in probes], now, 100.0), since, now)
    assert runs == coarsen(every, since, now)
    points = [(a, t) for a, _, t in probes if t is not None and a >= since]
    assert ttfts == thin(points, since, now) and tokens == len(points)


def test_the_page_is_served_with_its_policy_and_read_only() -> None:
    store = Store(None)
    a_day(store, "srv-healthy", NOW)
    server, _ = start(PageBackend(store, status_doc(NOW)), "127.0.0.1", 0, "t" * 20)
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        r = httpx.get(url + "/", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"] == "text/html; charset=utf-8"
        assert r.headers["content-security-policy"] == CSP
        assert r.headers["x-content-type-options"] == "nosniff"
        assert '<meta http-equiv="refresh" content="10">' in r.text
        assert r.text.count('<section class="server') == 8  # one per state
        assert httpx.post(url + "/", timeout=10).status_code == 405
        assert httpx.get(url + "/?x=1", timeout=10).status_code == 200
        # Gzipped to a client that accepts it (browsers do), the same page once unpacked.
        plain = httpx.get(url + "/", headers={"Accept-Encoding": "identity"}, timeout=10)
        assert "content-encoding" not in plain.headers
        assert r.headers["content-encoding"] == "gzip" and r.headers["vary"] == "Accept-Encoding"
        assert int(r.headers["content-length"]) < len(plain.content) / 3
        assert r.text == plain.text
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("open_routes", "page_code"), [((), 401), (("/status",), 200), (("/metrics",), 401)]
)
def test_beyond_loopback_the_page_follows_the_status_rule(
    open_routes: tuple[str, ...], page_code: int
) -> None:
    store = Store(None)
    server, _ = start(
        PageBackend(store, status_doc(NOW, ("healthy",))), "0.0.0.0", 0, "t" * 20, open_routes
    )
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        assert httpx.get(url + "/", timeout=10).status_code == page_code
        assert httpx.get(url + "/status", timeout=10).status_code == page_code
        auth = {"Authorization": "Bearer " + "t" * 20}
        assert httpx.get(url + "/", headers=auth, timeout=10).status_code == 200
    finally:
        server.shutdown()
        server.server_close()


def test_the_page_has_no_script_and_no_address_elsewhere() -> None:
    store = Store(None)
    a_day(store, "srv-wedged", NOW)
    html = render(
        status_doc(NOW),
        Days(store, lambda: STEP, lambda: NOW, time.monotonic).of(["srv-wedged"]),
        NOW,
        10,
    )
    assert "<script" not in html and " on" not in re.sub(r">[^<]*<", "><", html)  # no handlers
    assert not re.findall(r"(?:src|href)=\"(?!data:)", html)  # nothing to fetch


def _browser_script(tmp_path: Path) -> tuple[Path, Path]:
    """A browser for Python's webbrowser ($BROWSER): writes the address it was given."""
    seen = tmp_path / "opened"
    script = tmp_path / "browser"
    script.write_text(
        f"#!{sys.executable}\nimport sys\nopen({str(seen)!r}, 'w').write(sys.argv[1])\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script, seen


def _open_config(tmp_path: Path, state: Path) -> Path:
    cfg = tmp_path / "open.toml"
    server = {"name": "s", "url": "http://127.0.0.1:1"}
    cfg.write_text(toml({"watchdog": {"state_dir": str(state)}, "server": [server]}))
    return cfg


@pytest.mark.parametrize(
    ("listen", "opened", "works"),
    [("127.0.0.1", [], True), ("0.0.0.0", [], False), ("0.0.0.0", ["/status"], True)],
)
def test_open_starts_the_browser_on_the_page(
    tmp_path: Path,
    bad_server: Callable[..., Running],
    run_daemon: Callable[[object], DaemonThread],
    listen: str,
    opened: list[str],
    works: bool,
) -> None:
    state = tmp_path / "state"
    settings = {"interval": "200ms", "listen": f"{listen}:0", "state_dir": str(state)}
    server = {"name": "s", "url": bad_server("ok").url, "match": "badserver"}
    t = run_daemon(
        Daemon(
            parse_config({"watchdog": {**settings, "open_routes": opened}, "server": [server]})
        ).open()
    )
    until(lambda: (state / "daemon.json").exists(), 10, "the endpoint")
    port = t.daemon.endpoint.server_address[1]  # type: ignore[union-attr]
    script, seen = _browser_script(tmp_path)
    cfg = _open_config(tmp_path, state)
    done = mlx_watchdog("open", "--config", str(cfg), env={"BROWSER": str(script)})
    if not works:
        assert done.returncode == 1 and not seen.exists()
        assert "needs the API token" in done.stderr and "open_routes" in done.stderr
        return
    assert done.returncode == 0, done.stderr
    assert seen.read_text() == f"http://127.0.0.1:{port}/"  # a wildcard opens on loopback
    assert f"opened http://127.0.0.1:{port}/" in done.stdout
    as_json = mlx_watchdog("open", "--config", str(cfg), "--print-url", "--json")
    assert as_json.returncode == 0, as_json.stderr
    assert json.loads(as_json.stdout) == {"url": f"http://127.0.0.1:{port}/", "opened": False}
    printed = mlx_watchdog("open", "--config", str(cfg), "--print-url")
    assert printed.returncode == 0 and printed.stdout.strip() == f"http://127.0.0.1:{port}/"
    assert "<title>" in httpx.get(printed.stdout.strip(), timeout=10).text


def test_open_without_a_running_watchdog_says_so(tmp_path: Path) -> None:
    script, seen = _browser_script(tmp_path)
    cfg = _open_config(tmp_path, tmp_path / "state")
    done = mlx_watchdog("open", "--config", str(cfg), env={"BROWSER": str(script)})
    assert done.returncode == 3 and "the watchdog is not running" in done.stderr
    assert not seen.exists()


def test_open_with_no_browser_prints_where_the_page_is(
    tmp_path: Path, bad_server: Callable[..., Running], run_daemon: Callable[[object], DaemonThread]
) -> None:
    state = tmp_path / "state"
    server = {"name": "s", "url": bad_server("ok").url, "match": "badserver"}
    run_daemon(Daemon(parse_config(watchdog_config(state, [server]))).open())
    until(lambda: (state / "daemon.json").exists(), 10, "the endpoint")
    failing = tmp_path / "nobrowser"
    failing.write_text("#!/bin/sh\nexit 1\n")
    failing.chmod(0o755)
    # Only the given browser: none of this machine's own may be found on PATH.
    env = {
        "BROWSER": str(failing),
        "PATH": str(tmp_path / "empty"),
        "DISPLAY": "",
        "WAYLAND_DISPLAY": "",
    }
    done = mlx_watchdog("open", "--config", str(_open_config(tmp_path, state)), env=env)
    assert done.returncode == 1 and "no browser could be started here" in done.stderr
    assert "http://127.0.0.1:" in done.stderr


def test_a_server_that_flaps_every_probe_stays_a_small_page_and_its_wedge_shows() -> None:
    """17,280 probes (every 5 s) flipping healthy/slow, with one wedged probe: at most
    MAX_RUNS shapes, the wedge still drawn, the TTFTs thinned, the page some hundred kB."""
    store = Store(None)
    since = NOW - 86400
    for k in range(17_280):
        state = "wedged" if k == 9_000 else ("healthy", "slow")[k % 2]
        store.record_probe(
            "x",
            since + 5 * k + 1,
            state,
            "r",
            {"ttft_s": None if state == "wedged" else 0.1 + k % 5},
        )
    incident = store.open_incident("x", NOW - 100, "wedged", "w", {})
    for k in range(200):
        store.add_action(incident, {"action": "wait", "outcome": f"step {k}"})
    store.set_advice(incident, "a" * 100_000)
    day = read_day(store, "x", NOW, 5.0)
    assert 2 <= len(day.runs) <= MAX_RUNS + 1 and MAX_POINTS <= len(day.ttfts) <= MAX_POINTS + 1
    assert [r.state for r in day.runs].count("wedged") == 1
    # Kept as it came (coarsened and thinned on the way), it draws what one read draws.
    probes = store.states("x", since)
    every = clipped(runs_of([(a, st) for a, st, _ in probes], NOW, 5.0), since, NOW)
    assert list(day.runs) == coarsen(every, since, NOW)
    assert list(day.ttfts) == thin([(a, t) for a, _, t in probes if t is not None], since, NOW)
    html = render(status_doc(NOW, ("healthy",)), {"srv-healthy": day}, NOW, 10)
    assert len(html) < 300_000
    assert "and 196 more" in html and "a" * 401 not in html


def test_the_page_asked_for_hard_does_not_slow_the_probing(
    tmp_path: Path,
    bad_server: Callable[..., Running],
    run_daemon: Callable[[object], DaemonThread],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eight clients asking for the page as fast as they can for 3 s: the history is read
    once per server per fresh span, and the server is judged on schedule meanwhile."""
    from mlx_watchdog.serve import day

    reads: list[str] = []
    real_read = day.read_day
    monkeypatch.setattr(
        day,
        "read_day",
        lambda store, server, *a: reads.append(server) or real_read(store, server, *a),
    )
    server = {"name": "s", "url": bad_server("ok").url, "match": "badserver"}
    t = run_daemon(Daemon(parse_config(watchdog_config(tmp_path / "state", [server]))).open())
    until(lambda: t.daemon.endpoint is not None and t.daemon.cycles["s"].verdict, 20, "a verdict")
    t.daemon.days.fresh_s = 1.0
    port = t.daemon.endpoint.server_address[1]  # type: ignore[union-attr]
    judged_before = t.daemon.cycles["s"].judged_at
    stop, pages = time.monotonic() + 3.0, []

    def ask() -> None:
        with httpx.Client(timeout=10) as client:
            while time.monotonic() < stop:
                pages.append(client.get(f"http://127.0.0.1:{port}/").status_code)

    askers = [threading.Thread(target=ask) for _ in range(8)]
    for a in askers:
        a.start()
    for a in askers:
        a.join()
    assert len(pages) >= 40 and set(pages) == {200}
    assert len(reads) <= 5  # 3 s at one read a second, and the first
    judged = t.daemon.cycles["s"].judged_at
    assert judged is not None and judged_before is not None and judged - judged_before >= 2.0


def test_open_on_a_running_watchdog_without_the_page_says_what_it_answered(
    tmp_path: Path,
) -> None:
    """An older daemon still running after an upgrade answers / with 404: `open` says so
    instead of opening an error in the browser."""
    import json
    import os

    from mlx_watchdog.record.private import private_dir, write_private

    class Old(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(404)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None:
            pass

    old = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Old)
    threading.Thread(target=old.serve_forever, daemon=True).start()
    state = tmp_path / "state"
    private_dir(state)
    url = f"http://127.0.0.1:{old.server_address[1]}"
    write_private(state / "daemon.json", json.dumps({"pid": os.getpid(), "url": url}))
    script, seen = _browser_script(tmp_path)
    try:
        done = mlx_watchdog(
            "open", "--config", str(_open_config(tmp_path, state)), env={"BROWSER": str(script)}
        )
    finally:
        old.shutdown()
        old.server_close()
    assert done.returncode == 1 and f"the watchdog at {url} answered HTTP 404" in done.stderr
    assert not seen.exists()


def test_the_page_says_where_progress_is_read_and_which_cure_is_under_way() -> None:
    store = Store(None)
    days = Days(store, lambda: STEP, lambda: NOW, time.monotonic).of(["srv-wedged", "srv-busy"])
    doc = status_doc(NOW, ("wedged", "busy"))
    doc = changed(
        doc,
        0,
        progress_problem="no log of this server is read <so> every wedge will be restarted",
        clearing=Waiting(waited_s=2.0, restart_in_s=13.0, prefill_total=0, cure="cancel"),
    )
    doc = changed(
        doc,
        1,
        server_prefill="prefilling 2,048/12,036 prompt tokens",
        clearing=Waiting(waited_s=1.0, restart_in_s=9.0, prefill_total=12036, cure="wait"),
    )
    html = render(doc, days, NOW, 10)
    assert "Prefill progress: no log of this server is read &lt;so&gt; every wedge" in html
    assert "Waiting: 2 s after cancelling the abandoned requests instead of restarting" in html
    assert "Its log: prefilling 2,048/12,036 prompt tokens" in html
    assert "Waiting: 1 s for an abandoned prefill to finish instead of restarting" in html


def test_the_page_names_the_cause_and_the_next_step() -> None:
    store = Store(None)
    days = Days(store, lambda: STEP, lambda: NOW, time.monotonic).of(["srv-wedged", "srv-busy"])
    doc = status_doc(NOW, ("wedged", "busy"))
    because = "its log: generation thread died: <b>list</b>"
    doc = changed(doc, 0, cause="generation_thread_gone", cause_because=because)
    doc = changed(doc, 1, cause="not-a-cause")  # a status document from another version
    html = render(doc, days, NOW, 10)
    assert (
        "Cause: the generation thread is gone (its log: generation thread died: "
        "&lt;b&gt;list&lt;/b&gt;). Next: report it upstream" in html
    )
    assert html.count("Cause: ") == 1


def test_a_fresh_watchdogs_charts_span_the_last_hour_not_a_day() -> None:
    from mlx_watchdog.serve.page import uptime

    store = Store(None)
    for k in range(40):  # 20 minutes of probes every 30 s: healthy, then 5 min wedged
        state = "wedged" if k >= 30 else "healthy"
        ttft = None if state == "wedged" else 0.2
        store.record_probe("srv-healthy", NOW - 1200 + 30 * k, state, "r", {"ttft_s": ttft})
    days = Days(store, lambda: STEP, lambda: NOW, time.monotonic).of(["srv-healthy"])
    html = render(status_doc(NOW, ("healthy",)), days, NOW, 10)
    assert "State, last hour" in html and "Time to first token of each probe, last hour" in html
    assert "last 24 hours (" not in html.split("Per hour")[0]
    up = uptime(days["srv-healthy"])
    assert up is not None and 0.6 < up < 0.8  # 15 of the 20 probed minutes served
    assert f"{100 * up:.2f} % of 20 min" in html  # a share of what was probed, not of a day


def test_the_page_shows_where_the_server_is_and_what_to_do_when_held() -> None:
    store = Store(None)
    a_day(store, "srv-wedged", NOW)
    days = Days(store, lambda: STEP, lambda: NOW, time.monotonic).of(["srv-wedged"])
    doc = status_doc(NOW, ("wedged",))
    doc = changed(
        doc,
        0,
        pid=4242,
        rss_bytes=3 << 30,
        models_finding="empty_body",
        needs_person="3 restarts in the last 3600 s did not help",
    )
    s = doc.servers[0]
    html = render(doc, days, NOW, 10)
    for shown in ("4242", "3072 MiB", "200, empty body", s.manager):
        assert f"<dd>{shown}</dd>" in html, shown
    assert s.url == "http://127.0.0.1:1/wedged"  # wraps between its parts, never in them
    assert (
        '<dd><span class="nb">http://</span><wbr><span class="nb">127.</span><wbr>'
        '<span class="nb">0.</span><wbr><span class="nb">0.</span><wbr>'
        '<span class="nb">1:1</span><wbr><span class="nb">/wedged</span></dd>'
    ) in html
    assert "last 24 hours" in html  # a day of history: a day's span
    assert "Next: once the cause is dealt with" in html
    assert "mlx-watchdog restart srv-wedged" in html


def test_the_page_shows_the_last_probes_and_the_share_served_over_30_days() -> None:
    """A heartbeat strip of the last probes (newest at the right) and the share of the probed
    time spent serving over 30 days, from the serving days kept beside the probes."""
    store = Store(None)
    a_day(store, "srv-healthy", NOW)
    day = read_day(store, "srv-healthy", NOW, STEP)
    assert len(day.last_probes) == 60 and day.last_probes[-1][1] == "healthy"
    probed, serving = day.month
    wedged = 6 * STEP  # 30 min of probes every STEP counted as wedged (the last one: to the next)
    assert probed > 20 * 3600 and serving == probed - wedged
    doc = status_doc(NOW, ("healthy",))
    html = render(doc, {"srv-healthy": day}, NOW, 10)
    strip = re.search(r'<figure class="strip">(.*?)</figure>', html, re.S)
    assert strip is not None
    marks = re.findall(r'<rect class="probe s-(\w+)" x="([\d.]+)"', strip.group(1))
    states = [s for s, _ in marks]
    assert len(marks) == 60 and states.count("busy") == 12  # the busy hour among them
    assert set(states) == {"healthy", "busy"} and states[-1] == "healthy"
    assert float(marks[-1][1]) > float(marks[0][1])  # newest at the right
    share = f"{100 * serving / probed:.2f} %"
    assert f"<dt>serving (30 d)</dt><dd>{share}</dd>" in html
    fresh = read_day(Store(None), "new", NOW, STEP)
    assert fresh.month == (0.0, 0.0) and '<figure class="strip">' not in render(
        changed(doc, 0, name="new"),
        {"new": fresh},
        NOW,
        10,
    )


def test_a_days_summary_stays_bounded_whatever_the_interval() -> None:
    """Two days of probes every second, each with a token: the summary keeps counts per minute
    (a day of them at most), not a time per probe, and counts the last day's probes to within a
    minute's."""
    from mlx_watchdog.serve.day import MAX_POINTS, MAX_RUNS, TOKEN_BUCKET, Summary

    kept = Summary()
    start = 1_800_000_000.0
    seconds = 2 * 86_400
    for n in range(seconds):
        kept.add(start + n, "healthy" if n % 7 else "slow", 0.05, 1.0)
    now = start + seconds - 1
    assert len(kept.tokens) <= 86_400 / TOKEN_BUCKET + 1
    assert len(kept.ttfts) <= 4 * MAX_POINTS and len(kept.runs) <= 4 * MAX_RUNS
    runs, points, tokens = kept.drawn(now, 1.0)
    assert 86_400 <= tokens <= 86_400 + TOKEN_BUCKET
    assert len(points) <= MAX_POINTS + 1 and len(runs) <= MAX_RUNS + 1


def test_each_state_has_its_own_colour_and_the_dashboard_the_same() -> None:
    """Slow and busy shared one orange, wedged, dead and down one red: each state its own
    colour now, the page's and the Grafana dashboard's the same."""
    import json

    from mlx_watchdog.fleet import dashboard
    from mlx_watchdog.judge.states import SHOWN_STATES
    from mlx_watchdog.serve.page import COLOURS

    assert set(COLOURS) == set(SHOWN_STATES) and len(set(COLOURS.values())) == len(COLOURS)
    mapped: dict[str, str] = {}

    def walk(x: object) -> None:
        if isinstance(x, dict):
            if "color" in x and x.get("text") in COLOURS:
                assert mapped.setdefault(x["text"], x["color"]) == x["color"]
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)

    walk(json.loads(dashboard()))
    assert mapped == COLOURS


def test_incidents_say_a_reason_once_the_advice_its_incident_and_a_spent_budget_its_refill() -> (
    None
):
    store = Store(None)
    a_day(store, "srv-wedged", NOW)
    for k in (1, 2):  # two newer incidents with one reason, the newest with no advice
        ref = store.open_incident("srv-wedged", NOW - 600 * k, "wedged", "the same reason", {})
        store.close_incident(ref, NOW - 600 * k + 30, "restarted", 5.0)
    days = Days(store, lambda: STEP, lambda: NOW, time.monotonic).of(["srv-wedged"])
    doc = changed(status_doc(NOW, ("wedged",)), 0, budget_left=0, budget_refill_s=1500.0)
    html = render(doc, days, NOW, 10)
    table = html.split("Recent incidents")[1]
    assert table.count("the same reason") == 1 and ">as #2<" in table
    advised = re.search(r"Advice from incident #(\d+) \(([^)]*)\)", html)
    assert advised is not None and advised.group(1) == "1" and advised.group(2) == "10.0 h ago"
    assert "<dd>0: spent, one more in 25 min</dd>" in html
