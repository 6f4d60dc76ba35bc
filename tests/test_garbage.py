"""Every parser of an answer from outside, fed garbage (hypothesis): a named finding, never an
exception. The answers go through the real httpx client over a mock transport, so what is
tested is the code path the daemon runs."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlx_watchdog.config import ProbeSettings, ServerConfig
from mlx_watchdog.config.profiles import KINDS, PROFILES
from mlx_watchdog.sense.findings import ProbeFinding
from mlx_watchdog.sense.load import LoadReader, parse_prometheus, read_report
from mlx_watchdog.sense.models import check_models
from mlx_watchdog.sense.probe import Probe
from mlx_watchdog.sense.text import MAX_DEPTH, BadJson, finite_count, load_json
from tests.conftest import mlx_watchdog

PROBE = ProbeSettings(slow_after=0.5, wedge_after=1.0, hard_timeout=5.0, models_timeout=2.0)
MODELS_FINDINGS = {"ok", "http_error", "empty_body", "invalid_json", "not_listed", "too_large"}
REPORT_FINDINGS = {"ok", "http_error", "invalid", "timeout", "error", "too_large"}

HOSTILE_JSON = [
    b"Infinity",
    b"NaN",
    b"-Infinity",
    b"1e400",
    b'{"active_requests": 1e400}',
    b'{"active_requests": Infinity}',
    b'{"active_requests": NaN}',
    b'{"active_requests": -3}',
    b'{"active_requests": ' + b"9" * 400 + b"}",
    b"[" * 500_000,
    b"[" * 500_000 + b"]" * 500_000,
    b'{"a":' * 100 + b"1" + b"}" * 100,
    b"\xff\xfe{}",
    b'{"data": "' + b"\\" * 11 + b'"}',
]
HOSTILE_PROMETHEUS = [
    b"llamacpp:requests_processing +Inf\n",
    b"llamacpp:requests_processing -Inf\n",
    b"llamacpp:requests_processing NaN\n",
    b"llamacpp:requests_processing -1\n",
    b"llamacpp:requests_processing 1e308\n" * 3,
    b"llamacpp:n_decode_total 1e308\nllamacpp:n_decode_total 1e308\n",
    b'llamacpp:requests_processing{a="}"} 1\n',
    b"llamacpp:requests_processing 1e9999\n",
]


def server(kind: str = "mlx_lm", **probe: float) -> ServerConfig:
    return ServerConfig(
        name="g",
        url="http://127.0.0.1:9",
        kind=kind,  # type: ignore[arg-type]
        match=PROFILES[kind].match,  # type: ignore[index]
        probe=replace(PROBE, **probe),
    )


def answering(
    body: bytes, status: int = 200, ctype: str = "application/json"
) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            status, stream=httpx.ByteStream(body), headers={"content-type": ctype}
        )

    return httpx.MockTransport(handler)


def test_load_json_refuses_what_python_would_accept_or_crash_on() -> None:
    for body in [*HOSTILE_JSON[:4], b"[" * 500000, b"\xff\xfe{}"]:
        with pytest.raises(BadJson):
            load_json(body)
    assert load_json(b'{"a": [1, 2.5, "x"]}') == {"a": [1, 2.5, "x"]}
    nested = b'{"a":' * MAX_DEPTH + b"1" + b"}" * MAX_DEPTH
    assert load_json(nested) is not None
    with pytest.raises(BadJson, match="nested deeper"):
        load_json(b'{"a":' * (MAX_DEPTH + 1) + b"1" + b"}" * (MAX_DEPTH + 1))
    assert load_json(b'["[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[["]')
    assert finite_count(10**400) is None and finite_count(float("inf")) is None
    assert finite_count(-1) is None and finite_count(True) == 1.0 and finite_count(3) == 3.0


@pytest.mark.parametrize("kind", [k for k in KINDS if PROFILES[k].load is not None])
def test_each_kind_names_a_hostile_report(kind: str) -> None:
    route = PROFILES[kind].load
    assert route is not None
    bodies = HOSTILE_PROMETHEUS if route.format == "prometheus" else HOSTILE_JSON
    for body in bodies:
        report = read_report(route, 200, body)
        assert report.finding in REPORT_FINDINGS, (body[:40], report)
        for value in (report.running, report.waiting, report.loaded):
            assert value is None or 0 <= value <= 1e9


def test_prometheus_infinities_are_invalid_not_a_crash() -> None:
    route = PROFILES["llama.cpp"].load
    assert route is not None
    assert parse_prometheus("x +Inf\n") == {"x": float("inf")}
    inf = read_report(route, 200, b"llamacpp:requests_processing +Inf\n")
    assert (inf.finding, inf.detail) == (
        "invalid",
        "llamacpp:requests_processing = inf is not a count",
    )
    summed = read_report(route, 200, b"llamacpp:requests_processing 1e308\n" * 3)
    assert summed.finding == "invalid" and "not a count" in summed.detail
    negative = read_report(route, 200, b"llamacpp:requests_processing -1\n")
    assert negative.finding == "invalid" and "-1.0" in negative.detail


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(body=st.binary(max_size=2000), kind=st.sampled_from([k for k in KINDS if PROFILES[k].load]))
def test_any_report_body_is_a_finding(body: bytes, kind: str) -> None:
    route = PROFILES[kind].load
    assert route is not None
    report = read_report(route, 200, body)
    assert report.finding in REPORT_FINDINGS


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(doc=json_values, kind=st.sampled_from(["vllm-mlx", "mlx-openai-server", "ollama"]))
def test_any_json_report_is_a_finding_with_sane_counts(doc: object, kind: str) -> None:
    route = PROFILES[kind].load  # type: ignore[index]
    assert route is not None
    body = json.dumps(doc, allow_nan=True).encode()
    wrapped = json.dumps(
        {
            "queue_stats": {"queue_stats": {"active_requests": doc}},
            "active_requests": doc,
            "models": doc,
        },
        allow_nan=True,
    ).encode()
    for b in (body, wrapped):
        report = read_report(route, 200, b)
        assert report.finding in REPORT_FINDINGS
        assert report.running is None or 0 <= report.running <= 1e9


@settings(max_examples=200, deadline=None)
@given(
    body=st.binary(max_size=3000) | st.sampled_from(HOSTILE_JSON),
    status=st.sampled_from([200, 404, 500]),
)
def test_any_models_answer_is_a_finding(body: bytes, status: int) -> None:
    check = check_models(server(), transport=answering(body, status))
    assert check.finding in MODELS_FINDINGS


def _sse(parts: list[bytes]) -> bytes:
    return b"".join(b"data: " + p + b"\n\n" for p in parts)


@settings(max_examples=300, deadline=None)
@given(
    body=st.binary(max_size=3000)
    | st.lists(
        st.sampled_from([*HOSTILE_JSON[:9], b"{}", b"[DONE]", b'{"choices": [1]}']), max_size=4
    ).map(_sse)
    | st.sampled_from(HOSTILE_JSON),
    ctype=st.sampled_from(["text/event-stream", "application/json", "text/html", ""]),
    status=st.sampled_from([200, 401, 500, 503]),
)
def test_any_generation_answer_is_a_finding(body: bytes, ctype: str, status: int) -> None:
    snap = Probe(server(), transport=answering(body, status, ctype)).run()
    assert isinstance(snap.finding, ProbeFinding)
    assert snap.tokens >= 0


@settings(max_examples=100, deadline=None)
@given(
    body=st.binary(max_size=2000) | st.sampled_from(HOSTILE_JSON),
    kind=st.sampled_from(["ollama", "lmstudio"]),
)
def test_the_model_list_of_a_kind_that_loads_on_demand_survives_garbage(
    body: bytes, kind: str
) -> None:
    snap = Probe(server(kind), transport=answering(body)).run()
    assert isinstance(snap.finding, ProbeFinding)


def test_a_report_reader_survives_every_hostile_body() -> None:
    for kind in ("llama.cpp", "vllm-mlx", "mlx-openai-server", "rapid-mlx", "vllm", "ollama"):
        for body in HOSTILE_JSON + HOSTILE_PROMETHEUS:
            report = LoadReader(server(kind), transport=answering(body)).read()
            assert report is not None and report.finding in REPORT_FINDINGS


@pytest.mark.parametrize(
    "text",
    ["", "not json", "[" * 100_000, '{"a": 1}', "[[1, 2]]", '[["ip", "port", "until"]]', "[1e400]"],
)
def test_a_left_probes_record_that_is_not_one_is_read_as_empty_and_rewritten(
    tmp_path: Path, text: str
) -> None:
    from mlx_watchdog.record.left_probes import LeftProbes

    path = tmp_path / "left-probes.json"
    path.write_text(text)
    left = LeftProbes(path)
    assert left.load() == []
    left.add(("127.0.0.1", 50000), keep_for=60.0)
    assert left.load() == [("127.0.0.1", 50000)]


def test_a_left_probes_record_in_a_folder_others_write_is_neither_believed_nor_written(
    tmp_path: Path,
) -> None:
    import json
    import time

    from mlx_watchdog.record.left_probes import LeftProbes

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    path = shared / "left-probes.json"
    path.write_text(json.dumps([["127.0.0.1", 50001, time.time() + 600]]))  # hides a client
    path.chmod(0o600)
    left = LeftProbes(path)
    assert left.load() == []
    left.add(("127.0.0.1", 50002), keep_for=60.0)
    assert "50002" not in path.read_text()
    shared.chmod(0o700)
    assert left.load() == [("127.0.0.1", 50001)]  # the same record, in a folder of its own


def test_an_answered_probes_shorter_keep_is_written_with_the_next_probe(tmp_path: Path) -> None:
    """One write a probe: an answered probe's entry is cut short with the next probe's entry,
    not by a write of its own; until then it is kept as long as first written."""
    from mlx_watchdog.record.left_probes import LeftProbes

    now = [1000.0]
    path = tmp_path / "left-probes.json"
    left = LeftProbes(path, wall=lambda: now[0])
    first, second = ("127.0.0.1", 50000), ("127.0.0.1", 50001)
    left.add(first, keep_for=600.0)
    written = path.read_text()
    left.shorten(first, keep_for=2.0)
    assert path.read_text() == written  # no write of its own
    left.add(second, keep_for=600.0)
    now[0] += 3.0
    assert left.load() == [second]


@pytest.mark.parametrize("planted", ["link", "folder", "fifo"])
def test_a_lock_file_that_is_not_one_is_named_not_a_traceback(tmp_path: Path, planted: str) -> None:
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    lock = state / "daemon.lock"
    if planted == "link":
        lock.symlink_to(tmp_path / "elsewhere")
    elif planted == "folder":
        lock.mkdir()
    else:
        os.mkfifo(lock)
    cfg = tmp_path / "w.toml"
    cfg.write_text(
        f'[watchdog]\nstate_dir = "{state}"\nlisten = "off"\n'
        '[[server]]\nurl = "http://127.0.0.1:9"\n'
    )
    run = mlx_watchdog("run", "--config", str(cfg), timeout=30)
    assert run.returncode == 3, run.stderr
    assert f"{lock} is not" in run.stderr and "remove it" in run.stderr
    assert "Traceback" not in run.stderr


def test_the_process_record_is_never_written_through_a_planted_link(tmp_path: Path) -> None:
    from mlx_watchdog.act.managers import System
    from mlx_watchdog.act.managers.process import ProcessManager
    from mlx_watchdog.config import ServerConfig
    from tests.builders import badserver_argv
    from tests.conftest import free_port

    victim = tmp_path / "precious"
    victim.write_text("precious\n")
    record = tmp_path / "process-s.json"
    record.symlink_to(victim)
    port = free_port()
    server = ServerConfig(
        name="s",
        url=f"http://127.0.0.1:{port}",
        match="badserver",
        manager="process",
        command=tuple(badserver_argv(port)),
    )
    m = ProcessManager(server, System(), record)
    m.start()
    try:
        assert victim.read_text() == "precious\n"
        assert not record.is_symlink() and str(m.pid()) in record.read_text()
        again = ProcessManager(server, System(), record)
        again.start()  # adopts its own child from the record
        assert again.pid() == m.pid()
    finally:
        m.stop()


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[1, 2]",
        '{"pid": -1, "create_time": 1.0}',
        '{"pid": 0, "create_time": 0}',
        '{"pid": "1", "create_time": "soon"}',
        '{"pid": 1e400, "create_time": 1}',
        "[" * 100_000,
        '{"pid": 1}',
        "",
    ],
    ids=["text", "list", "negative", "zero", "strings", "huge", "nested", "partial", "empty"],
)
def test_a_garbage_process_record_adopts_nothing_and_raises_nothing(
    tmp_path: Path, text: str
) -> None:
    """A record a crash cut short, or someone wrote: never a process adopted (and so never one
    signalled as the server), never an exception; the manager starts its own."""
    from mlx_watchdog.act.managers import System
    from mlx_watchdog.act.managers.process import ProcessManager
    from mlx_watchdog.config import ServerConfig

    record = tmp_path / "process-s.json"
    record.write_text(text)
    server = ServerConfig(
        name="s", url="http://127.0.0.1:9", manager="process", command=("true",), match="true"
    )
    assert ProcessManager(server, System(), record)._adoptable() is None


@pytest.mark.parametrize(
    "text",
    [
        '{"pid": -1, "url": "http://x"}',
        '{"pid": 0, "url": "http://x"}',
        '{"pid": 1e400}',
        "[" * 5000,
    ],
    ids=["minus-one", "zero", "huge", "nested"],
)
def test_a_garbage_daemon_record_is_a_daemon_not_running(tmp_path: Path, text: str) -> None:
    """-1 and 0 would have asked the kernel about whole process groups (always 'alive')."""
    from mlx_watchdog.serve.client import DaemonNotRunning, daemon_url

    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "daemon.json").write_text(text)
    (state / "daemon.json").chmod(0o600)
    with pytest.raises(DaemonNotRunning, match="unreadable"):
        daemon_url(state)


@pytest.mark.parametrize(
    "text",
    ["[1, 2]", '{"text_config": [1]}', "[" * 5000, '{"max_position_embeddings": "big"}'],
    ids=["list", "text-config-list", "nested", "text"],
)
def test_a_models_garbage_config_gives_no_context_length(tmp_path: Path, text: str) -> None:
    from mlx_watchdog.advice.calibrate import context_length

    (tmp_path / "config.json").write_text(text)
    assert context_length(["mlx_lm.server", "--model", str(tmp_path)]) is None


def test_a_left_probe_with_a_port_past_any_number_is_read_as_none(tmp_path: Path) -> None:
    from mlx_watchdog.record.left_probes import LeftProbes

    path = tmp_path / "left-probes.json"
    path.write_text('[["127.0.0.1", 1e400, 9e9]]')
    path.chmod(0o600)
    tmp_path.chmod(0o700)
    assert LeftProbes(path).load() == []


GOOD_ADVICE = {
    "prompt_tokens": 4096,
    "answer_tokens": 1024,
    "prefill_s": 12.0,
    "answer_s": 30.0,
    "client_s": 60,
    "agent_s": 75,
    "load_balancer_s": 90,
}


@pytest.mark.parametrize(
    "doc",
    [
        {"at": 1.0, "advice": {**GOOD_ADVICE, "prefill_s": float("nan")}},
        {"at": 1.0, "advice": {**GOOD_ADVICE, "prompt_tokens": float("inf")}},
        {"at": 1.0, "advice": {**GOOD_ADVICE, "client_s": "a minute"}},
        {"at": 1.0, "advice": {**GOOD_ADVICE, "surprise": 1}},  # read: unknown keys are ignored
        {"at": "yesterday", "advice": GOOD_ADVICE},
        {"at": 1.0, "advice": [1, 2]},
        {"at": 1.0, "advice": {"prompt_tokens": 4096}},
    ],
)
def test_a_hand_edited_calibration_is_said_unreadable_by_doctor_and_the_page(
    tmp_path: Path, doc: dict[str, object]
) -> None:
    """Issue 54: a NaN in a calibration dropped `GET /`, and doctor raised on wrong types."""
    from mlx_watchdog.advice.doctor import run_doctor
    from mlx_watchdog.config import parse_config
    from mlx_watchdog.record.rows import calibration_advice
    from mlx_watchdog.record.store import Store

    state = tmp_path / "state"
    state.mkdir()
    store = Store(state / "history.db")
    store.save_calibration("m", 1.0, doc)
    store.close()
    config = parse_config(
        {
            "watchdog": {"state_dir": str(state)},
            "server": [{"name": "m", "url": "http://127.0.0.1:9"}],
        }
    )
    read = calibration_advice(doc)
    said = [f.detail for f in run_doctor(config, home=tmp_path, env={"HOME": str(tmp_path)})]
    if read is None:
        assert any("its last calibration cannot be read" in d for d in said), said
    else:
        assert all(v is None or (isinstance(v, float) and abs(v) < 1e12) for v in read.values())
        assert any(d.startswith("calibrated ") for d in said), said


def test_incident_actions_of_any_type_are_shown_not_raised_on(tmp_path: Path) -> None:
    from tests.builders import one_incident

    config, number = one_incident(tmp_path, "wedged: test", {}, {})
    from mlx_watchdog.record.store import Store

    store = Store(tmp_path / "state" / "history.db")
    for action in ({"action": 5}, {"outcome": ["x"], "at": "yesterday"}, {"detail": {"a": 1}}):
        store.add_action(number, action)
    store.add_action(number, {"action": "[red]wait[/red]", "outcome": "[bold]x", "at": 2.0})
    store.close()
    listed = mlx_watchdog("history", "--config", str(config))
    assert listed.returncode == 0 and "Traceback" not in listed.stderr, listed.stderr
    assert "unknown: unknown" in listed.stdout
    shown = mlx_watchdog("history", "--config", str(config), "--show", str(number))
    assert shown.returncode == 0 and "Traceback" not in shown.stderr, shown.stderr
    assert "[red]wait[/red]: [bold]x" in shown.stdout  # text, never markup
