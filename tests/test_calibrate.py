"""Calibration: the fit and the advice, and the real server measured."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from mlx_watchdog.advice.calibrate import Calibration, Fit, Point, advise, fit, parse_tokens
from mlx_watchdog.judge.advice import MARGIN, article, incident_advice
from mlx_watchdog.judge.estimate import curve
from mlx_watchdog.record.store import Store
from tests.conftest import Running, mlx_watchdog, wait_until_serving


def points_of(f: Fit, sizes: list[int]) -> list[Point]:
    return [Point(n, f.prefill_s(n)) for n in sizes]


def test_fit_recovers_a_quadratic_prefill() -> None:
    true = Fit(a=0.05, b=1 / 2000, c=1e-8)
    got = fit(points_of(true, [1000, 4000, 16000, 32000]))
    for n in (2000, 64000, 128000):
        assert got.prefill_s(n) == pytest.approx(true.prefill_s(n), rel=1e-6)


def test_fit_falls_back_to_a_line() -> None:
    got = fit([Point(1000, 1.0), Point(3000, 3.0)])
    assert got.c == 0 and got.prefill_s(6000) == pytest.approx(6.0)
    # Points that bend downwards (noise) never predict a shrinking prefill.
    bent = fit([Point(1000, 1.0), Point(2000, 2.5), Point(3000, 3.0)])
    assert bent.c == 0 and bent.b > 0


def test_advice_outwaits_the_prediction_and_orders_the_layers() -> None:
    cal = Calibration("s", 0.0, (), Fit(0.1, 1 / 500, 2e-9), decode_tps=20.0)
    a = advise(cal, 64 * 1024, answer_tokens=1000)
    predicted = cal.fit.prefill_s(64 * 1024) + 1000 / 20.0
    assert a.client_s >= predicted * MARGIN and a.client_s % 30 == 0
    assert a.client_s < a.agent_s < a.load_balancer_s


@pytest.mark.parametrize(("text", "n"), [("64k", 65536), ("4096", 4096), ("1.5k", 1536)])
def test_parse_tokens(text: str, n: int) -> None:
    assert parse_tokens(text, "--max-prompt") == n


def test_parse_tokens_names_the_option() -> None:
    with pytest.raises(ValueError, match='--sizes = "lots" is not a token count'):
        parse_tokens("lots", "--sizes")


def test_incident_advice_with_and_without_a_calibration() -> None:
    assert incident_advice([], None) is None
    bare = incident_advice([238.0, 239.5, 241.0, 240.0], None)
    assert bare is not None and bare.startswith("4 clients gave up after 238-241 s of waiting")
    assert "well above 241 s" in bare and "calibrate" in bare
    last = {"advice": {"prompt_tokens": 49 * 1024, "prefill_s": 190.0, "client_s": 300}}
    told = incident_advice([238.0, 241.0], last)
    assert told == (
        "2 clients gave up after 238-241 s of waiting; a 49k-token prompt needs about 190 s "
        "here (last calibration); raise their timeouts to at least 390 s"
    )  # 241 s x 1.5, rounded up to 30 s, is more than the calibrated 300 s
    # Two left, one of them between two looks: both counted, and the unseen wait said so.
    both = incident_advice([238.0], None, gone=2)
    assert both is not None and both.startswith(
        "2 clients gave up after 238 s of waiting (1 of them left before a look saw how long"
    )
    eight = {"advice": {"prompt_tokens": 8 * 1024, "prefill_s": 30.0, "client_s": 60}}
    assert "; an 8k-token prompt needs about 30 s" in str(incident_advice([40.0], eight))


@pytest.mark.parametrize(
    ("label", "said"),
    [("8k", "an"), ("11k", "an"), ("18,500", "an"), ("800", "an"), ("110k", "a"), ("1,000", "a")],
)
def test_a_number_takes_the_article_it_is_said_with(label: str, said: str) -> None:
    assert article(label) == said


# -- against the real server ---------------------------------------------------------------


def calibrate(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return mlx_watchdog("calibrate", "--url", url, *args, timeout=300)


@pytest.mark.real_server
def test_calibrate_the_real_server(batched_server: Running, tmp_path: Path) -> None:
    proc = calibrate(batched_server.url, "--sizes", "500,2k,6k", "--max-prompt", "16k", "--json")
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    points = doc["points"]
    assert [p["prompt_tokens"] for p in points] == sorted(p["prompt_tokens"] for p in points)
    assert (
        abs(points[0]["prompt_tokens"] - 500) < 150
        and abs(points[-1]["prompt_tokens"] - 6144) < 600
    )
    assert all(p["prefill_s"] > 0 for p in points)
    assert points[0]["prefill_s"] < points[-1]["prefill_s"]  # more prompt, more time
    assert all((p["cached_tokens"] or 0) < 64 for p in points)  # the unique prefix works
    # Each prompt's size is kept, so a request's bytes on a socket read as tokens here.
    found = curve(doc)
    assert found is not None and 1.0 < found.bytes_per_token < 20.0
    assert all(p["prompt_bytes"] > p["prompt_tokens"] for p in points)
    assert doc["decode_tps"] > 0 and doc["decode_note"] is None
    cal = Calibration.from_json(doc)
    advice = doc["advice"]
    assert advice["prompt_tokens"] == 16 * 1024
    # The advice includes the answer: 1024 tokens (the default) at the measured decode rate.
    assert advice["answer_s"] == pytest.approx(1024 / doc["decode_tps"], abs=0.01)
    need = cal.fit.prefill_s(16 * 1024) + advice["answer_s"]
    assert advice["client_s"] >= need * MARGIN
    state = Path(os.environ["XDG_STATE_HOME"]) / "mlx-watchdog" / "history.db"
    stored = Store(state).last_calibration(f"mlx-{batched_server.port}")
    assert stored is not None and stored["advice"] == advice

    proxy = tmp_path / "litellm.yaml"
    proxy.write_text(
        "model_list:\n  - model_name: local\n    litellm_params:\n"
        f'      {{model: openai/x, api_base: "{batched_server.url}/v1", timeout: 1}}\n'
    )
    human = calibrate(
        batched_server.url,
        "--sizes",
        "500,2k",
        "--max-prompt",
        "64k",
        "--litellm-config",
        str(proxy),
    )
    assert human.returncode == 0, human.stderr
    assert "A 64k-token prompt needs about" in human.stdout
    assert "load balancer" in human.stdout and "extrapolated" in human.stdout
    assert (
        '"local"' in human.stderr and "timeout 1 s" in human.stderr and "below the" in human.stderr
    )


@pytest.mark.real_server
def test_calibrate_refuses_while_a_client_is_served(
    serial_server: Running, uploading_client: Callable[[Running], object]
) -> None:
    # A client in the middle of sending its request: served, and costing the server nothing
    # (a 24k-token prompt did the same, and each test then waited ~50 s for its prefill).
    uploading_client(serial_server)
    proc = calibrate(serial_server.url, "--sizes", "500,2k")
    assert proc.returncode == 1 and "not calibrating" in proc.stderr and "--force" in proc.stderr
    assert "1 client(s) are being served right now" in proc.stderr


def test_a_server_restarted_while_measured_is_told_apart(
    bad_server: Callable[..., Running],
) -> None:
    """calibrate and compare keep nothing measured across a restart (a running watchdog's, or
    anyone's): the listening process before and after must be the same one."""
    from mlx_watchdog.advice.calibrate import replaced, serving_process
    from mlx_watchdog.config import ServerConfig

    first = bad_server("ok")
    server = ServerConfig(name="s", url=first.url)
    before = serving_process(server)
    assert before is not None and before[0] == first.proc.pid
    assert replaced(server, before) is None
    first.stop()
    assert "nothing listens now" in (replaced(server, before) or "")
    second = bad_server("ok", port=first.port)
    why = replaced(server, before) or ""
    assert f"PID {first.proc.pid}, now PID {second.proc.pid}" in why
    assert replaced(server, None) is None  # a server on another machine: nothing to compare


@pytest.mark.real_server
def test_the_maintenance_windows_calibration_is_kept(
    batched_server: Running, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What `run`'s maintenance window calls: the real server measured, kept like calibrate's."""
    from mlx_watchdog.advice import calibrate as module
    from mlx_watchdog.config import ServerConfig

    server = ServerConfig(name="mac1", url=batched_server.url)
    store = Store(tmp_path / "history.db")
    monkeypatch.setattr(module, "MAINTENANCE_SIZES", (500, 2048))  # the tiny model: a line
    said = module.maintenance_calibration(server, store)
    assert said.startswith("calibrated: a ") and "clients need a timeout of at least" in said
    kept = store.last_calibration("mac1")
    assert kept is not None and kept["advice"]["client_s"] > 0 and len(kept["points"]) == 2
    store.close()


@pytest.mark.real_server
def test_each_step_is_estimated_before_it_and_one_past_the_bound_left_out(
    batched_server: Running,
) -> None:
    """Two points are enough to extrapolate: each larger step says its time before it is
    sent, and one that would outlast the bound is not sent at all (the fit goes on)."""
    from mlx_watchdog.advice.calibrate import run_calibration
    from mlx_watchdog.config import ServerConfig

    said: list[str] = []
    server = ServerConfig(name="s", url=batched_server.url)
    cal = run_calibration(server, [500, 2048, 10**9], say=said.append, timeout=60.0)
    assert any(m.startswith("prefilling about 2048 tokens (about ") for m in said), said
    assert any(
        m.startswith("not prefilling 1000000000 tokens: about ") and "past the 60 s bound" in m
        for m in said
    ), said
    sizes = [p.prompt_tokens for p in cal.points]
    assert len(sizes) == 2 and abs(sizes[0] - 500) < 150 and abs(sizes[1] - 2048) < 500, sizes


@pytest.mark.real_server
def test_an_interrupted_calibration_says_what_it_left_and_records_it_as_its_own(
    batched_server: Running,
) -> None:
    """Ctrl-C in the middle of a long step closes the connection, but the server prefills on
    for nobody: calibrate says so, and its connection is on record as the watchdog's own, so a
    running watchdog never blames a client for it."""
    import signal
    import sys
    import time

    run = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mlx_watchdog",
            "calibrate",
            "--url",
            batched_server.url,
            "--sizes",
            "500,12k",
        ],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert run.stderr is not None
        lines = []
        for line in run.stderr:
            lines.append(line)
            if line.startswith("prefilling about 12288 tokens (about "):
                break
        else:
            pytest.fail("".join(lines))
        record = Path(os.environ["XDG_STATE_HOME"]) / "mlx-watchdog" / "left-probes.json"
        deadline = time.monotonic() + 30
        # The 12k prompt's connection on record (the 500's may still be: a shortened entry is
        # written with the next one).
        before = _kept_long(record)
        while time.monotonic() < deadline and not _kept_long(record) - before:
            time.sleep(0.05)
        run.send_signal(signal.SIGINT)
        _, rest = run.communicate(timeout=60)
    finally:
        if run.poll() is None:
            run.kill()
            run.wait()
    said = "".join(lines) + rest
    assert run.returncode == 1, said
    assert "interrupted: " in said and "goes on prefilling the 12288-token prompt" in said
    entries = json.loads(_read(record))
    assert any(e[2] > time.time() + 600 for e in entries), entries
    wait_until_serving(batched_server)  # what it left, prefilled to its end here


def _kept_long(record: Path) -> set[int]:
    """The ports of the entries kept for the calibration's bound (30 min), not a check's."""
    import time

    text = _read(record)
    return {e[1] for e in json.loads(text) if e[2] > time.time() + 600} if text else set()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
