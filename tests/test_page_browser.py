"""The status page in a real browser: Debian's chromium, driven by Playwright.

Each state renders with its colour, the charts have as many points and bars as the history
holds, nothing is fetched from another host, the console stays empty (a style the policy
did not allow would be an error there), and it reads the same with JavaScript off. The last
test is a real run: a daemon watching the real mlx_lm.server, and a server of ours that hangs
until the daemon restarts it.

Set MLX_WATCHDOG_SHOTS to a folder to keep the screenshots (docs/endpoint.md's come from there).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from mlx_watchdog.config import parse_config
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.judge.states import SHOWN_STATES
from mlx_watchdog.record.store import Store
from mlx_watchdog.serve.endpoint import start
from mlx_watchdog.serve.page import COLOURS
from tests.builders import command_server, watchdog_config
from tests.conftest import BadByPidfile, DaemonThread, Running, until
from tests.pageday import NOW, PageBackend, a_day, changed, status_doc

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

if CHROMIUM is None:
    if os.environ.get("CI"):  # .ci/run installs it: its absence there is a fault, not a skip
        raise RuntimeError("chromium is not installed; .ci/run installs Debian's chromium")
    pytest.skip("needs chromium (Debian's package)", allow_module_level=True)

sync_api = pytest.importorskip("playwright.sync_api")


@dataclass
class Visit:
    """A page as the browser got it, with everything it said and asked for on the way."""

    page: Any
    console: list[str] = field(default_factory=list)
    requests: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture
def visit(browser: Any) -> Iterator[Callable[..., Visit]]:
    contexts = []

    def go(url: str, *, javascript: bool = True, width: int = 1100) -> Visit:
        context = browser.new_context(
            java_script_enabled=javascript, viewport={"width": width, "height": 900}
        )
        contexts.append(context)
        page = context.new_page()
        v = Visit(page)
        page.on("console", lambda m: v.console.append(f"{m.type}: {m.text}"))
        page.on("pageerror", lambda e: v.console.append(f"pageerror: {e}"))
        page.on("request", lambda r: v.requests.append(r.url))
        response = page.goto(url, wait_until="load")
        assert response is not None and response.status == 200
        return v

    yield go
    for context in contexts:
        context.close()


def shot(v: Visit, name: str, tmp_path: Path, part: str | None = None) -> None:
    """The whole page, or the `part` a selector names."""
    folder = Path(os.environ.get("MLX_WATCHDOG_SHOTS") or tmp_path)
    folder.mkdir(parents=True, exist_ok=True)
    if part is None:
        v.page.screenshot(path=str(folder / name), full_page=True)
    else:
        v.page.locator(part).screenshot(path=str(folder / name))
    assert (folder / name).stat().st_size > 10_000  # a picture, not an empty frame


def ttft_points(section: Any) -> tuple[int, int]:
    """The TTFT chart's points (each line's and each lone dot) and how many lines and dots."""
    lines = section.locator("polyline.ttft, circle.ttft")
    points = lines.evaluate_all(
        "shapes => shapes.map(s => s.points ? s.points.numberOfItems : 1).reduce((a, b) => a + b, 0)"
    )
    return points, lines.count()


def _rgb(colour: str) -> str:
    r, g, b = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return f"rgb({r}, {g}, {b})"


@pytest.fixture
def every_state() -> Iterator[str]:
    """Our endpoint serving a page of one server per state, each with the same known day."""
    store = Store(None)
    written = {s: a_day(store, f"srv-{s}", NOW) for s in SHOWN_STATES}
    server, _ = start(PageBackend(store, status_doc(NOW)), "127.0.0.1", 0, "t" * 20)
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", written  # type: ignore[misc]
    finally:
        server.shutdown()
        server.server_close()


def test_every_state_renders_with_its_colour_and_its_day(
    visit: Callable[..., Visit], every_state: Any, tmp_path: Path
) -> None:
    url, written = every_state
    v = visit(url)
    origin = url.rstrip("/")
    for state in SHOWN_STATES:
        section = v.page.locator(f"#server-srv-{state}")
        assert section.get_attribute("data-state") == state
        badge = section.locator(".badge")
        assert badge.inner_text() == state
        assert badge.evaluate("e => getComputedStyle(e).backgroundColor") == _rgb(COLOURS[state])
        w = written[state]
        assert ttft_points(section) == (w.probes_with_token, w.ttft_lines)
        runs = section.locator("rect.run")
        assert runs.count() == len(w.runs)
        assert [runs.nth(i).get_attribute("class").split()[1] for i in range(runs.count())] == [
            f"s-{s}" for s in w.runs
        ]
        bars = section.locator("rect.restarts")
        assert {
            int(bars.nth(i).get_attribute("data-hour")): int(
                bars.nth(i).get_attribute("data-count")
            )
            for i in range(bars.count())
        } == w.restarts_by_hour
        assert section.locator("rect.gave-up").count() == len(w.gave_up_by_hour)
        assert section.locator("tr.incident").count() == w.incidents
        assert "clients 150 s" in section.locator("p.calibration").inner_text()
    wedged = v.page.locator("#server-srv-wedged rect.s-wedged").first
    assert wedged.evaluate("e => getComputedStyle(e).fill") == _rgb(COLOURS["wedged"])
    assert v.console == []
    assert v.requests and all(r.startswith(origin) for r in v.requests)
    shot(v, "status-page-states.png", tmp_path)
    shot(v, "status-page-day.png", tmp_path, "#server-srv-wedged")


def test_it_reads_the_same_without_javascript_and_on_a_phone(
    visit: Callable[..., Visit], every_state: Any, tmp_path: Path
) -> None:
    url, written = every_state
    v = visit(url, javascript=False, width=390)
    assert v.page.locator("section.server").count() == len(SHOWN_STATES)
    healthy = v.page.locator("#server-srv-healthy")
    assert ttft_points(healthy)[0] == written["healthy"].probes_with_token
    scroll, client = v.page.evaluate(
        "[document.documentElement.scrollWidth, document.documentElement.clientWidth]"
    )
    assert scroll <= client  # nothing wider than the phone's screen
    assert v.console == []
    shot(v, "status-page-phone.png", tmp_path)


def test_the_page_reloads_by_itself(visit: Callable[..., Visit]) -> None:
    """The page asks the browser to load it again (its reload period: 1 s here, a probe
    interval's in the daemon), with no script: the browser comes back by itself."""
    store = Store(None)
    a_day(store, "srv-healthy", NOW)
    doc = status_doc(NOW)
    server, _ = start(PageBackend(store, doc, reload_s=1), "127.0.0.1", 0, "t" * 20)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        v = visit(url, javascript=False)
        assert 'http-equiv="refresh" content="1"' in v.page.content()
        with v.page.expect_request(lambda r: r.url == url, timeout=10_000):
            pass  # waits at the block's end for the browser's next load of the page
    finally:
        server.shutdown()
        server.server_close()


def test_a_real_run_shows_a_wedge_healed_beside_the_healthy_server(
    visit: Callable[..., Visit],
    batched_server: Running,
    hanging: BadByPidfile,
    run_daemon: Callable[[object], DaemonThread],
    tmp_path: Path,
) -> None:
    """A daemon watching the real mlx_lm.server, and one of ours that holds every request
    until the `command` manager replaces it with one that serves."""
    real = {"wedge_after": "20s", "max_busy": "60s", "hard_timeout": "2m"}
    servers = [
        {"name": "mlx", "url": batched_server.url, "probe": real},
        {**command_server(hanging.url, hanging.pidfile, hanging.port), "name": "hung"},
    ]
    config = parse_config(watchdog_config(tmp_path / "state", servers, interval="1s"))
    t = run_daemon(Daemon(config).open())
    store = t.daemon.store

    def healed() -> bool:
        done = [i for i in store.incidents(0, "hung") if i.closed_at is not None]
        return bool(done) and len(store.ttfts("hung", done[0].closed_at or 0)) >= 3

    until(healed, 60, "the wedge healed and three tokens since")
    until(lambda: len(store.ttfts("mlx", 0)) >= 3, 30, "three tokens from mlx_lm.server")
    t.daemon.days.fresh_s = 0.0  # the page reads the history as it is now
    host, port = t.daemon.endpoint.server_address[:2]  # type: ignore[union-attr]
    v = visit(f"http://{host}:{port}/")
    mlx, hung = v.page.locator("#server-mlx"), v.page.locator("#server-hung")
    assert mlx.get_attribute("data-state") == "healthy"
    assert hung.get_attribute("data-state") == "healthy"
    row = hung.locator("tr.incident td")
    assert hung.locator("tr.incident").count() == 1 and row.nth(2).inner_text() == "wedged"
    assert (
        row.nth(5).inner_text() == "restart (command): recovered"
        and row.nth(6).inner_text() == "restarted"
    )
    assert hung.locator("rect.restarts").count() == 1  # one hour, one restart
    assert hung.locator("rect.restarts").get_attribute("data-count") == "1"
    states = [
        hung.locator("rect.run").nth(i).get_attribute("class").split()[1]
        for i in range(hung.locator("rect.run").count())
    ]
    assert "s-wedged" in states and states[-1] == "s-healthy"
    shown, _ = ttft_points(mlx)
    assert 3 <= shown <= len(store.ttfts("mlx", 0))  # the daemon goes on probing
    assert ttft_points(hung)[0] >= 3
    assert v.console == []
    assert all(r.startswith(f"http://{host}:{port}/") for r in v.requests)
    shot(v, "status-page.png", tmp_path)


@pytest.mark.parametrize("width", [1280, 390])
def test_at_a_desks_and_a_phones_width_nothing_overflows_and_the_address_stays_whole(
    visit: Callable[..., Visit], width: int, tmp_path: Path
) -> None:
    """At 1280 px (a laptop) and 390 px (a phone): no sideways scrolling, every state's badge
    in its own colour, and a long address wraps between its parts, never inside host:port."""
    store = Store(None)
    for state in SHOWN_STATES:
        a_day(store, f"srv-{state}", NOW)
    doc = changed(status_doc(NOW), 0, url="http://inference-box-01.lab.example.com:8080/mlx")
    server, _ = start(PageBackend(store, doc), "127.0.0.1", 0, "t" * 20)
    try:
        v = visit(f"http://127.0.0.1:{server.server_address[1]}/", width=width)
        scroll, client = v.page.evaluate(
            "[document.documentElement.scrollWidth, document.documentElement.clientWidth]"
        )
        assert scroll <= client
        address = v.page.locator("div.addr dd").first
        assert address.inner_text() == "http://inference-box-01.lab.example.com:8080/mlx"
        dd = address.bounding_box()
        assert dd is not None
        for part in address.locator("span.nb").all():  # each whole on one line, inside
            box = part.bounding_box()
            assert part.evaluate("e => e.getClientRects().length") == 1, part.inner_text()
            assert box is not None and box["x"] + box["width"] <= dd["x"] + dd["width"] + 1
        port = address.locator("span.nb", has_text=":8080")
        assert port.inner_text() == "com:8080"  # the port never parted from its host
        colours = {
            v.page.locator(f"#server-srv-{s} .badge").evaluate(
                "e => getComputedStyle(e).backgroundColor"
            )
            for s in SHOWN_STATES
        }
        assert len(colours) == len(SHOWN_STATES)
        assert v.console == []
        shot(v, f"status-page-{width}.png", tmp_path)
    finally:
        server.shutdown()
        server.server_close()
