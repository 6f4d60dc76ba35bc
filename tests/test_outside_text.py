"""Text from outside that no encoder accepts (a JSON-escaped lone surrogate) or that would act
on a terminal never blinds the watchdog: it is mended where it is parsed, and a probe whose
reading fails anyway ends with a finding, so the next tick probes afresh."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from mlx_watchdog.act.check import check_once
from mlx_watchdog.config import ServerConfig
from mlx_watchdog.config.profiles import PROFILES
from mlx_watchdog.sense.findings import OwnFault, ProbeFinding
from mlx_watchdog.sense.models import in_memory, model_ids
from mlx_watchdog.sense.probe import Probe
from mlx_watchdog.sense.round import Checker
from mlx_watchdog.sense.text import load_json, printable, whole
from tests.builders import watched
from tests.conftest import Running
from tests.hostile import SURROGATE_ERROR, SURROGATE_NAMES, set_answers

GEN = "/v1/chat/completions"


def test_a_lone_surrogate_is_mended_where_json_is_parsed() -> None:
    doc = load_json(b'{"a\\udcff": ["x\\ud800y", {"k": "\\ud83d\\ude00"}]}')
    assert doc == {"a\ufffd": ["x\ufffdy", {"k": "\U0001f600"}]}  # a proper pair stays whole
    json.dumps(doc, ensure_ascii=False).encode()  # would raise on a surrogate
    assert load_json('"\ud800"') == "\ufffd"  # a str handed in with one already
    assert whole("ok \udfff") == "ok \ufffd"


def test_printable_shows_controls_instead_of_acting_on_them() -> None:
    hostile = "a\x1b]0;title\x07b\x1b[2Jc\x00d\u202ee\x9bf\ud800"
    shown = printable(hostile)
    assert shown == "a\\x1b]0;title\\x07b\\x1b[2Jc\\x00d\\u202ee\\x9bf\ufffd"
    assert printable("one\ntwo\tthree", lines=True) == "one\ntwo\tthree"
    assert printable("one\ntwo") == "one\\x0atwo"
    # The line and paragraph separators: a terminal or a log reader may break a line there.
    assert printable("a\u2028b\u2029c", lines=True) == "a\\u2028b\\u2029c"
    shown.encode()


def test_names_that_cannot_be_sent_back_are_skipped() -> None:
    doc = load_json(SURROGATE_NAMES)
    assert model_ids(doc) == ("bad-model",)
    ollama = PROFILES["ollama"].in_memory
    assert ollama is not None and in_memory(doc, ollama) == ()


@pytest.fixture
def srv(module_bad_server: Callable[..., Running]) -> Running:
    server = module_bad_server("ok", kind="ollama")
    set_answers(server.url, {GEN: None, "/api/ps": None, "/v1/models": None})
    return server


def ollama(url: str) -> ServerConfig:
    return watched(url, kind="ollama", match="badserver")


def test_an_error_with_a_lone_surrogate_is_dead_with_its_message(srv: Running) -> None:
    set_answers(srv.url, {GEN: {"status": 500, "body": SURROGATE_ERROR}})
    v = check_once(ollama(srv.url)).verdict
    assert (v.state, v.evidence.probe_finding) == ("dead", "http_error"), v.reason
    assert "HTTP 500: bad \ufffd" in v.reason
    v.reason.encode()


def test_a_serving_ollama_whose_list_names_a_surrogate_is_left_alone(srv: Running) -> None:
    set_answers(
        srv.url, {"/api/ps": {"body": SURROGATE_NAMES}, "/v1/models": {"body": SURROGATE_NAMES}}
    )
    v = check_once(ollama(srv.url)).verdict
    assert v.state == "healthy", v.reason


def test_a_probe_whose_reading_fails_ends_with_a_finding(srv: Running) -> None:
    def broken(request: httpx.Request) -> httpx.Response:
        raise RuntimeError("boom \ud800 \x1b[2J")

    server = ollama(srv.url)
    probe = Probe(server, transport=httpx.MockTransport(broken)).start()
    assert probe.wait(10), "the probe thread did not end"
    snap = probe.snapshot()
    assert snap.finding == ProbeFinding.PROBE_FAILED
    assert "RuntimeError: boom \ufffd \\x1b[2J" in snap.detail

    # The round says the watchdog could not look (never a verdict on the server), and the
    # next round sends a fresh probe, which the server answers.
    checker = Checker(server)
    checker.probe = probe
    with pytest.raises(OwnFault, match="failed reading the answer"):
        checker.observe(srv.proc.pid)
    assert checker.probe is None
    fresh = checker.start()
    assert fresh is not probe and fresh.wait(10)
    assert fresh.snapshot().finding == ProbeFinding.OK


HOSTILE = "a\x1b]0;title\x07b\x1b[2Jc\x00d\u202ee"


def raw_controls(text: str) -> list[str]:
    return [ch for ch in text if ch in "\x1b\x07\x00\u202e"]


def test_every_string_rich_renders_shows_its_controls() -> None:
    from rich.table import Table

    from mlx_watchdog.cli.app import safe_console

    console = safe_console(record=True, width=200)
    table = Table("server", "reason")
    table.add_row("m", HOSTILE)
    console.print(table)
    console.print(f"reason: {HOSTILE}")
    shown = console.export_text()
    assert raw_controls(shown) == [] and shown.count("\\x1b[2J") == 2


def test_history_show_prints_a_servers_text_as_escapes(tmp_path: Path) -> None:
    """A reason, a stack's thread name and a log's line, each with escapes a terminal acts on,
    through `history --show` (its report upstream too): shown, never acted on."""
    from tests.builders import one_incident
    from tests.conftest import mlx_watchdog

    evidence = {"cause": "metal_error", "cause_because": f"its log: {HOSTILE}"}
    stack = f'Thread 1 (idle): "{HOSTILE}"\n    f (x.py:1)\n'
    dump = {"pid": 1, "stack": stack, "log_tail": HOSTILE + "\n", "kind": "mlx_lm"}
    dump["versions"] = [f"mlx_lm 0.1{HOSTILE}"]  # a dist-info folder's name, planted
    config, number = one_incident(tmp_path, f"wedged: {HOSTILE}", evidence, dump)
    shown = mlx_watchdog("history", "--config", str(config), "--show", str(number))
    assert shown.returncode == 0, shown.stderr
    assert "For a bug report upstream" in shown.stdout
    assert raw_controls(shown.stdout) == [], shown.stdout
    assert shown.stdout.count("\\x1b[2J") >= 4  # the reason, the stack, the log, the report
