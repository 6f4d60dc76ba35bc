"""The macOS path, read on Linux: the GPU's time (ioreg) as the sign of work, bytes per
connection (netstat -anv), the judge without CPU evidence. Parsers are fed the real outputs in
tests/data/macos/ (copied with their sources from shared/), each cut short, garbage and
nothing; the fakes in tests/fakes/mac/ stand in for the tools on PATH."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import plistlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_watchdog.advice.doctor import Finding, run_doctor
from mlx_watchdog.config import Config, ConfigError, parse_config
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.judge.clearing import choose, restart_cost
from mlx_watchdog.judge.states import State
from mlx_watchdog.judge.verdict import judge
from mlx_watchdog.record.store import Store
from mlx_watchdog.sense import gpu, netstat, platform, selfdump, unified_log
from mlx_watchdog.sense.findings import WorkSign
from mlx_watchdog.sense.observation import Observation
from mlx_watchdog.sense.process import Inspector, ProcessTable
from mlx_watchdog.sense.sched import clamp
from mlx_watchdog.sense.signs import Signs
from mlx_watchdog.sense.stack import parse_faulthandler
from mlx_watchdog.sense.tool import Unreadable
from mlx_watchdog.sense.work import WorkMeter, computes_on
from tests.builders import mac_like_server, restarts_took, watchdog_config, watched
from tests.conftest import (
    DaemonThread,
    FakeServices,
    Running,
    free_port,
    system_tool,
    until,
)
from tests.judging import MODELS_OK, T0, S, proc, waiting

MACOS = Path(__file__).parent / "data" / "macos"
FAKES = Path(__file__).parent / "fakes" / "mac"


def client(pid: int, name: str, *usage: int, intel: int | None = None) -> dict[str, object]:
    entry: dict[str, object] = {
        "IOObjectClass": "AGXDeviceUserClient",
        "IOUserClientCreator": f"pid {pid}, {name}",
        "CommandQueueCount": 1,
    }
    if usage:
        entry["AppUsage"] = [
            {"API": "Metal", "accumulatedGPUTime": ns, "lastSubmittedTime": 3062414094833}
            for ns in usage
        ]
    if intel is not None:
        entry["accumulatedGPUTime"] = intel
    return entry


def registry(*clients: dict[str, object]) -> bytes:
    return plistlib.dumps(list(clients), fmt=plistlib.FMT_XML)


# -- ioreg ------------------------------------------------------------------------------------


def test_a_process_gpu_time_is_the_sum_over_its_clients_matched_by_pid_not_name() -> None:
    data = registry(
        client(440, "WindowServer", 38738170958),
        client(7001, "python3.12", 1_000, 2_000),  # two command queues
        client(7001, "python3.12", 500),  # a second Metal device open
        client(7002, "python3.12", 9_999_999),  # another server, the same (cut) name
        client(7003, "Intel GPU", intel=77),  # the key on the client itself
    )
    assert gpu.parse(data, 7001) == 3_500
    assert gpu.parse(data, 7002) == 9_999_999
    assert gpu.parse(data, 7003) == 77
    with pytest.raises(Unreadable, match="PID 7004 has no GPU client"):
        gpu.parse(data, 7004)


def test_a_client_with_no_gpu_time_or_a_bad_counter_is_not_counted() -> None:
    data = registry(
        client(7001, "python3.12"),  # a client with neither key
        {"IOUserClientCreator": "pid 7001, python3.12", "AppUsage": [{"accumulatedGPUTime": -5}]},
        {"IOUserClientCreator": "pid 7001, x", "AppUsage": [{"accumulatedGPUTime": True}]},
        {"IOUserClientCreator": 7001, "AppUsage": [{"accumulatedGPUTime": 10}]},
    )
    with pytest.raises(Unreadable, match="no GPU client with a GPU time"):
        gpu.parse(data, 7001)


@pytest.mark.parametrize("name", sorted(p.name for p in MACOS.glob("ioreg_*.txt")))
def test_ioregs_recorded_text_form_is_a_named_finding(name: str) -> None:
    """Only text captures of ioreg exist (no -a plist of AGXDeviceUserClient was found): the
    parser reads none of them as a GPU time, and says why."""
    data = (MACOS / name).read_bytes()
    with pytest.raises(Unreadable, match="not a property list"):
        gpu.parse(data, 440)


def test_ioreg_cut_short_garbage_or_nothing_is_a_named_finding() -> None:
    data = registry(client(7001, "python3.12", 1_000))
    assert gpu.parse(data, 7001) == 1_000
    for end in range(0, len(data) - 1, 7):
        with pytest.raises(Unreadable):
            gpu.parse(data[:end], 7001)
    for bad in (b"", b"  \n", b"\x00\xff{not a plist", b"<plist><array><dict>"):
        with pytest.raises(Unreadable):
            gpu.parse(bad, 7001)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=400))
def test_any_bytes_from_ioreg_are_a_time_or_a_named_finding(data: bytes) -> None:
    with contextlib.suppress(Unreadable):
        assert gpu.parse(data, 1) >= 0


def test_ioreg_that_cannot_run_or_fails_is_unreadable_with_its_words() -> None:
    def missing(argv: list[str]) -> tuple[int, bytes, bytes]:
        raise FileNotFoundError(2, "No such file or directory")

    with pytest.raises(Unreadable, match="ioreg could not run: No such file"):
        gpu.gpu_time_ns(1, missing)
    with pytest.raises(Unreadable, match="ioreg failed: ioreg: invalid destination port"):
        gpu.gpu_time_ns(1, lambda argv: (1, b"", b"ioreg: invalid destination port\n"))
    assert gpu.gpu_time_ns(7, lambda argv: (0, registry(client(7, "p", 5)), b"")) == 5


def test_the_fake_ioreg_answers_as_the_parser_expects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stand-in on PATH, through the real bounded command: a busy server's time climbs."""
    monkeypatch.setenv("PATH", f"{FAKES}:{_path()}")
    monkeypatch.setenv("FAKE_GPU_DIR", str(tmp_path))
    (tmp_path / "4242.gpu").write_text("1000 0\n")
    assert gpu.gpu_time_ns(4242) == 1000
    assert gpu.gpu_time_ns(440) == 38738170958
    for mode, said in (
        ("fail", "ioreg failed"),
        ("garbage", "not a property"),
        ("cut", "not a property"),
    ):
        monkeypatch.setenv("FAKE_IOREG", mode)
        with pytest.raises(Unreadable, match=said):
            gpu.gpu_time_ns(4242)


def _path() -> str:
    import os

    return os.environ.get("PATH", "")


# -- netstat ----------------------------------------------------------------------------------


def test_macos_26_rows_keep_a_process_name_with_spaces_and_its_pid() -> None:
    rows = netstat.parse((MACOS / "netstat_anv_tcp_macOS26_tahoe.txt").read_text())
    assert rows == [
        netstat.Connection(
            ("127.0.0.1", 49515), ("127.0.0.1", 49472), "ESTABLISHED", 118268, 40208, 22712
        ),
        netstat.Connection(
            ("127.0.0.1", 49510), ("127.0.0.1", 49513), "ESTABLISHED", 358, 127, 22712
        ),
    ]


def test_macos_15_rows_read_under_their_own_header() -> None:
    """The 15.1 rows were captured without their header (grep): under the 15 header they read
    with rx, tx and the pid from their own columns; alone they are a named finding."""
    header = (MACOS / "netstat_anv_tcp_header_macOS15_sequoia.txt").read_text()
    body = (MACOS / "netstat_natvln_rows_macOS15.1_M3Max.txt").read_text()
    rows = netstat.parse(header + body)
    assert [(r.remote, r.rx, r.tx, r.pid) for r in rows] == [
        (("34.117.41.85", 443), 9026, 316, 2903),
        (("123.57.223.58", 443), 17368, 1612, 5767),
        (("123.57.223.58", 443), 17330, 1612, 75236),
        (("47.106.66.231", 443), 2480, 1197, 74164),
    ]
    with pytest.raises(Unreadable, match="no header"):
        netstat.parse(body)


def test_macos_14_has_no_byte_counts_and_says_so_by_none() -> None:
    header = (MACOS / "netstat_anv_tcp_header_macOS14_sonoma.txt").read_text()
    row = (
        "tcp4       0      0  127.0.0.1.8080         127.0.0.1.50000        ESTABLISHED  "
        "408256  146988   2903      0 00102 00000104 000000000025c5f1 00000080 01000800      "
        "2      0 000000\n"
    )
    (got,) = netstat.parse(header + row)
    assert (got.local, got.rx, got.tx, got.pid) == (("127.0.0.1", 8080), None, None, 2903)


@pytest.mark.parametrize("name", sorted(p.name for p in MACOS.glob("netstat_*.txt")))
def test_each_recorded_netstat_cut_anywhere_reads_or_is_a_named_finding(name: str) -> None:
    text = (MACOS / name).read_text()
    for end in range(0, len(text), 3):
        try:
            rows = netstat.parse(text[:end])
        except Unreadable:
            continue
        assert all(r.local[1] >= 0 and (r.rx is None or r.rx >= 0) for r in rows)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=600))
def test_any_text_from_netstat_is_rows_or_a_named_finding(text: str) -> None:
    try:
        netstat.parse("Proto Recv-Q (state) rxbytes txbytes process:pid\n" + text)
        netstat.parse(text)
    except Unreadable:
        pass


def test_a_count_that_stops_moving_tells_how_long_it_has_been_quiet() -> None:
    moved = netstat.Mover()
    row = netstat.Connection(("127.0.0.1", 8080), ("127.0.0.1", 50000), "ESTABLISHED", 100, 5, 1)
    assert moved.quiet(row, 10.0) == (None, None)  # first seen: no span yet
    assert moved.quiet(row, 12.5) == (2500, 2500)
    grown = netstat.Connection(row.local, row.remote, row.state, 100, 900, 1)
    assert moved.quiet(grown, 13.0) == (3000, 0)
    other = netstat.Connection(("127.0.0.1", 9090), ("127.0.0.1", 50001), "ESTABLISHED", 7, 7, 2)
    moved.quiet(other, 13.0)
    moved.keep(set(), 9090)  # another server's port looked at: this one's are kept
    assert moved.quiet(grown, 13.5) == (3500, 500)
    assert moved.quiet(other, 14.0) == (None, None)
    moved.keep(set(), 8080)
    assert moved.quiet(grown, 14.0) == (None, None)  # gone, then a new connection


# -- the work sign ----------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_the_gpu_share_comes_from_two_readings_of_one_wait() -> None:
    clock, spent = Clock(), [0]
    meter = WorkMeter(
        watched("http://127.0.0.1:1"), gpu_time=lambda pid: spent[0], mono=clock, on_mac=True
    )
    assert meter.on == "gpu"
    assert meter.read(7, 0.5, waiting=True) == WorkSign("gpu", None, source="ioreg")
    clock.t, spent[0] = 102.0, 1_800_000_000  # 1.8 s of GPU in 2 s
    assert meter.read(7, 0.5, waiting=True).percent == 90.0
    clock.t = 104.0  # flat
    assert meter.read(7, 0.5, waiting=True).percent == 0.0
    assert meter.read(7, 0.5, waiting=False).percent is None  # served: no reading, no baseline
    clock.t = 106.0
    assert meter.read(7, 0.5, waiting=True).percent is None
    clock.t, spent[0] = 107.0, 2_300_000_000
    assert meter.read(8, 0.5, waiting=True).percent is None  # another process: a new baseline


def test_an_unreadable_gpu_is_unknown_with_its_reason_said_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    def broken(pid: int) -> int:
        raise Unreadable("ioreg could not run: No such file or directory")

    meter = WorkMeter(watched("http://127.0.0.1:1"), gpu_time=broken, on_mac=True)
    with caplog.at_level(logging.WARNING):
        seen = [meter.read(7, 0.0, waiting=True) for _ in range(3)]
    assert {w.percent for w in seen} == {None}
    assert seen[0].unknown == "ioreg could not run: No such file or directory"
    assert sum("GPU time cannot be read" in r.message for r in caplog.records) == 1


def test_where_the_work_runs_follows_the_platform_and_the_compute_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = watched("http://127.0.0.1:1")
    monkeypatch.setenv(platform.VARIABLE, "darwin")
    assert platform.is_mac() and computes_on(server) == "gpu"
    monkeypatch.setenv(platform.VARIABLE, "linux")
    assert computes_on(server) == "cpu"
    from dataclasses import replace

    assert computes_on(replace(server, compute="gpu")) == "gpu"
    linux_gpu = WorkMeter(replace(server, compute="gpu"), on_mac=False).read(7, 0.1, waiting=True)
    assert linux_gpu.percent is None and "no reader" in linux_gpu.unknown
    monkeypatch.setenv(platform.VARIABLE, "darwin")
    assert computes_on(replace(server, compute="cpu")) == "cpu"


# -- the judge, with the GPU's evidence -------------------------------------------------------


def look(
    waited: float,
    *,
    live: int = 0,
    abandoned: int = 0,
    cpu: float = 0.8,
    gpu_now: float | None,
    readings: tuple[float, ...] = (),
    unknown: str = "",
) -> tuple[Observation, float]:
    work = WorkSign("gpu", gpu_now, unknown, "ioreg")
    signs = Signs(work=readings, work_on="gpu")
    obs = Observation(
        waiting(), proc(live=live, abandoned=abandoned, cpu=cpu), MODELS_OK, signs=signs, work=work
    )
    return obs, T0 + waited


def test_a_live_clients_gpu_prefill_at_one_percent_cpu_is_busy_not_wedged() -> None:
    obs, now = look(S.wedge_after + 30, live=1, cpu=0.8, gpu_now=97.0, readings=(98.0,) * 10)
    v = judge(obs, S, now)
    assert v is not None and v.state == State.BUSY, v
    assert "GPU 97%" in v.reason and v.evidence.work_on == "gpu"
    # The same look, read as Linux reads it (the CPU its only sign): wedged.
    cpu_only = Observation(obs.probe, obs.process, obs.models, signs=Signs(work=(0.8,) * 10))
    linux = judge(cpu_only, S, now)
    assert linux is not None and linux.state == State.WEDGED and "idle (CPU 0.8%)" in linux.reason


def test_a_gpu_flat_over_three_looks_with_a_live_client_is_wedged() -> None:
    obs, now = look(S.wedge_after + 5, live=1, gpu_now=0.0, readings=(95.0, 0.0, 0.0, 0.0))
    v = judge(obs, S, now)
    assert v is not None and v.state == State.WEDGED
    assert "GPU time has not moved over 3 looks" in v.reason
    once, _ = look(S.wedge_after + 5, live=1, gpu_now=0.0, readings=(95.0, 95.0, 0.0))
    assert judge(once, S, now).state == State.BUSY  # type: ignore[union-attr]


def test_an_unread_gpu_is_busy_up_to_max_busy_and_says_why() -> None:
    why = "ioreg could not run: No such file or directory"
    obs, now = look(S.wedge_after + 5, live=1, gpu_now=None, unknown=why)
    v = judge(obs, S, now)
    assert v is not None and v.state == State.BUSY and why in v.reason
    late, later = look(S.max_busy + 1, live=1, gpu_now=None, unknown=why)
    assert judge(late, S, later).state == State.WEDGED  # type: ignore[union-attr]


def test_abandoned_work_on_an_unread_gpu_is_waited_for_within_the_restart_cost() -> None:
    """No 'idle, restart at once' without the sign: the ski-rental bound holds."""
    obs, now = look(S.wedge_after + 1, abandoned=1, cpu=0.0, gpu_now=None, unknown="x")
    v = judge(obs, S, now)
    assert v is not None and v.state == State.WEDGED
    cure = choose(v.evidence, restart_cost([]), None, now)
    assert cure.wait is not None and "costs less than a restart" in cure.why
    flat, _ = look(S.wedge_after + 1, abandoned=1, gpu_now=0.0, readings=(0.0, 0.0, 0.0))
    cut = choose(judge(flat, S, now).evidence, restart_cost([]), None, now)  # type: ignore[union-attr]
    assert cut.wait is None and "its GPU is idle (3 looks in a row, GPU 0.0% now)" in cut.why


# -- end to end: a Mac-like server under the daemon, its tools faked on PATH ------------------

RATE = 1000  # the stand-in's prefill, tokens a second: 4 bytes of body a token


def mac_server(port: int, gpu_dir: Path) -> dict[str, object]:
    return mac_like_server(port, gpu_dir, rate=RATE, wedge_after="2s", max_busy="2m")


def on_a_mac(monkeypatch: pytest.MonkeyPatch, gpu_dir: Path, where: str = "darwin") -> None:
    monkeypatch.setenv(platform.VARIABLE, where)
    monkeypatch.setenv("PATH", f"{FAKES}:{_path()}")
    monkeypatch.setenv("FAKE_GPU_DIR", str(gpu_dir))


def ask(port: int, seconds: float, leave_after: float | None = None) -> dict[str, object]:
    """A chat request whose prompt takes `seconds` to prefill; its answer, or what cut it."""
    body = json.dumps(
        {"messages": [{"role": "user", "content": "x" * int(seconds * RATE * 4)}], "stream": True}
    )
    got: dict[str, object] = {}
    try:
        with httpx.Client(timeout=httpx.Timeout(leave_after or 120.0)) as c:
            got["status"] = c.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=body)
    except httpx.HTTPError as exc:
        got["error"] = type(exc).__name__
    return got


def serving(store: Store) -> bool:
    return any(p.state == "healthy" for p in store.probes("mac", 0.0))


class MacDaemon:
    """A daemon watching the Mac-like server it runs, once that server has served a probe."""

    def __init__(self, tmp_path: Path, run_daemon: Callable[[object], DaemonThread]) -> None:
        self.port = free_port()
        server = mac_server(self.port, tmp_path)
        config = parse_config(watchdog_config(tmp_path / "state", [server]))
        self.t = run_daemon(Daemon(config).open())
        self.store = self.t.daemon.store
        until(lambda: serving(self.store), 30, "the first healthy probe")
        self.pid = next(int(p.stem) for p in tmp_path.glob("*.gpu"))


@pytest.mark.parametrize(
    ("where", "ioreg", "restarted"),
    [("darwin", "", False), ("darwin", "fail", False), ("linux", "", True)],
    ids=["gpu-read", "gpu-unreadable", "linux-reads-cpu"],
)
def test_a_live_clients_long_gpu_prefill_is_never_restarted_on_a_mac(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    run_daemon: Callable[[object], DaemonThread],
    where: str,
    ioreg: str,
    restarted: bool,
) -> None:
    """One live client's 10 s prefill, the process near 0 % CPU while its GPU works: on a Mac
    it is busy (GPU time climbing, or unknown when ioreg fails: bounded by max_busy), never
    restarted. Read as Linux reads it, the same server is judged idle and restarted under its
    client: the control that shows the sign decides."""
    on_a_mac(monkeypatch, tmp_path, where)
    monkeypatch.setenv("FAKE_IOREG", ioreg)
    monkeypatch.setenv("FAKE_NETSTAT", "garbage" if ioreg else "")
    mac = MacDaemon(tmp_path, run_daemon)
    t, store, port, pid = mac.t, mac.store, mac.port, mac.pid
    cpu_before = sum(psutil.Process(pid).cpu_times()[:2])
    started = time.monotonic()
    got = ask(port, 10.0)
    took = time.monotonic() - started
    cpu = sum(psutil.Process(pid).cpu_times()[:2]) - cpu_before if not restarted else 0.0
    restarts = store.restarts("mac", 0.0)
    reasons = [p.reason for p in store.probes("mac", 0.0) if p.state in ("busy", "wedged")]
    t.stop()
    if restarted:
        assert [r.trigger for r in restarts] == ["wedged"] and "error" in got, (got, reasons)
        assert any("idle (CPU" in r for r in reasons), reasons
        return
    assert restarts == [] and "status" in got, (got, reasons)
    assert cpu < 0.15 * took, f"the stand-in used {cpu:.2f} s of CPU in {took:.1f} s"
    assert reasons and all("wedged" not in r for r in reasons), reasons
    said = "its GPU time cannot be read: ioreg failed" if ioreg else "(GPU 9"
    assert any(said in r for r in reasons), reasons


def test_a_hung_gpu_under_abandoned_work_is_restarted_on_its_flat_gpu_time(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    run_daemon: Callable[[object], DaemonThread],
) -> None:
    """An abandoned long prompt is waited for while the GPU works on it (the restart's cost
    bounds the wait); once the GPU hangs (no token, its time flat), the wait ends on that sign
    within a few looks, long before the bound, and the server is restarted."""
    on_a_mac(monkeypatch, tmp_path)
    restarts_took(tmp_path / "state", "mac", 60.0)  # the wait's bound: a restart costs 60 s
    mac = MacDaemon(tmp_path, run_daemon)
    t, store, port, pid = mac.t, mac.store, mac.port, mac.pid
    since = time.time()
    assert ask(port, 60.0, leave_after=0.5).get("error")  # it gives up; the server works on

    def waits() -> bool:
        return bool(store.events("mac", kind="clearing"))

    until(waits, 30, "the abandoned work to be waited for")
    assert store.restarts("mac", since) == []
    os.kill(pid, signal.SIGUSR1)  # the GPU hangs
    until(lambda: store.restarts("mac", since), 30, "the restart")
    (incident,) = store.incidents(0.0)
    t.stop()
    said = json.dumps(incident.actions)
    assert "its GPU is idle" in said, said
    assert "waiting longer would cost more" not in said, said


@pytest.mark.parametrize(
    ("netstat_mode", "layout", "counted"),
    [("", "26", True), ("", "15", True), ("", "14", False), ("garbage", "26", False)],
)
def test_bytes_per_connection_on_a_mac_come_from_netstat(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    bad_server: Callable[..., Running],
    netstat_mode: str,
    layout: str,
    counted: bool,
) -> None:
    """A client's request size, read as on a Mac: netstat's rxbytes for the server's side of
    its connection (the real connection, printed by the stand-in in each macOS layout). Where
    netstat prints none (macOS 14) or garbage, the size is unknown and the reason is kept."""
    system_tool("ss", "iproute2")
    on_a_mac(monkeypatch, tmp_path)
    monkeypatch.setenv("FAKE_NETSTAT", netstat_mode)
    monkeypatch.setenv("FAKE_NETSTAT_LAYOUT", layout)
    monkeypatch.setenv("FAKE_NETSTAT_NAME", "Python Server")  # a name with a space
    srv = bad_server("hang")
    table = ProcessTable()
    assert table.mac and not table.diag
    inspector = Inspector(watched(srv.url), table=table)
    body = b"x" * 5000
    request = (
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n" + body
    )
    with socket.create_connection(("127.0.0.1", srv.port)) as c:
        c.sendall(request)
        seen = until(lambda: inspector.sample(srv.proc.pid).clients, 10, "the client")
        assert isinstance(seen, tuple)
        if counted:
            sized = until(
                lambda: [x for x in inspector.sample(srv.proc.pid).clients if x.received],
                10,
                "the request's size",
            )
            assert isinstance(sized, list) and [x.received for x in sized] == [len(request)]
            assert table.bytes_problem == ""
        else:
            (client,) = inspector.sample(srv.proc.pid).clients
            assert client.status == "live" and client.received is None
            assert (table.bytes_problem != "") == (netstat_mode == "garbage")


# -- stacks without root: the server dumps its own --------------------------------------------

SERVER_LIKE = """
import threading, time
def _generate():
    threading.Event().wait()
threading.Thread(target=_generate, name="Thread-1 (_generate)", daemon=True).start()
print("ready", flush=True)
time.sleep(600)
"""


def test_a_python_server_is_run_through_the_launcher_and_anything_else_as_it_is(
    tmp_path: Path,
) -> None:
    python = sys.executable
    assert selfdump.wrap([python, "-m", "mlx_lm", "server", "--port", "8080"]) == (
        python,
        str(selfdump.LAUNCHER),
        "-m",
        "mlx_lm",
        "server",
        "--port",
        "8080",
    )
    script = tmp_path / "bin" / "mlx_lm.server"
    script.parent.mkdir()
    script.write_text(f"#!{python}\nimport sys\n")
    script.chmod(0o755)
    env = {"PATH": str(script.parent)}
    assert selfdump.wrap(["mlx_lm.server", "--model", "m"], env) == (
        python,
        str(selfdump.LAUNCHER),
        str(script),
        "--model",
        "m",
    )
    (tmp_path / "bin" / "via-env").write_text("#!/usr/bin/env python3\n")
    (tmp_path / "bin" / "via-env").chmod(0o755)
    env_python = selfdump.wrap(["via-env"], {"PATH": f"{script.parent}:{_path()}"})
    assert env_python is not None and Path(env_python[0]).name == "python3"
    binary = tmp_path / "bin" / "llama-server"
    binary.write_bytes(b"\x7fELF\x02\x01\x01")
    binary.chmod(0o755)
    assert selfdump.wrap(["llama-server", "-m", "x.gguf"], env) is None
    assert selfdump.wrap([python, "-u", "-m", "mlx_lm"]) is None  # flags it does not know
    assert selfdump.wrap(["no-such-program"], env) is None
    assert selfdump.wrap([]) is None


def test_a_launched_server_dumps_every_threads_stack_to_its_log_on_demand(
    tmp_path: Path,
) -> None:
    script, log = tmp_path / "server_like.py", tmp_path / "server.log"
    script.write_text(SERVER_LIKE)
    argv = selfdump.wrap([sys.executable, str(script)])
    assert argv is not None
    with log.open("wb") as fh:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=fh)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        text, problem = selfdump.dump(proc.pid, log)
        assert problem is None and text is not None
        threads = parse_faulthandler(text)
        assert threads is not None and len(threads) == 2
        (gen,) = [t for t in threads if t.generates]
        assert gen.frames[0] == "wait" and "_generate" in gen.frames
        assert proc.poll() is None  # the signal only asked: the server goes on
        again, _ = selfdump.dump(proc.pid, log)  # a second dump reads only the new one
        assert again is not None and again.count("most recent call first") == 2
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]


def test_a_process_not_started_through_the_launcher_is_never_signalled(tmp_path: Path) -> None:
    sent: list[tuple[int, int]] = []
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        text, problem = selfdump.dump(
            proc.pid, tmp_path / "log", kill=lambda pid, sig: sent.append((pid, sig))
        )
    finally:
        proc.kill()
        proc.wait()
    assert text is None and problem is not None and "not started through" in problem
    assert sent == []


def test_faulthandler_dumps_cut_short_or_garbage_read_as_threads_or_none() -> None:
    dump = (
        "Thread 0x00007f2b3c9ff6c0 (most recent call first):\n"
        '  File "/usr/lib/python3.12/threading.py", line 355 in wait\n'
        '  File "/x/mlx_lm/server.py", line 811 in _generate\n'
        "\n"
        "Current thread 0x00007f2b4d1e8740 (most recent call first):\n"
        '  File "/x/mlx_lm/server.py", line 1700 in main\n'
    )
    threads = parse_faulthandler(dump)
    assert threads is not None and [t.frames for t in threads] == [
        ("wait", "_generate"),
        ("main",),
    ]
    for end in range(len(dump)):
        cut = parse_faulthandler(dump[:end])
        assert cut is None or 1 <= len(cut) <= 2
    assert parse_faulthandler("garbage\n\x00 File") is None


def test_a_hung_gpu_with_no_client_is_a_deadlock_told_by_the_servers_own_stack(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    run_daemon: Callable[[object], DaemonThread],
) -> None:
    """On a Mac (py-spy needs root, `sample` has no Python frames) the server the watchdog runs
    dumps its own stacks through the launcher: with its GPU time flat and its generation thread
    there, nothing moving and no client, the cause is a deadlock, named from that stack."""
    on_a_mac(monkeypatch, tmp_path)
    mac = MacDaemon(tmp_path, run_daemon)
    t, store, pid = mac.t, mac.store, mac.pid
    assert selfdump.launched(psutil.Process(pid).cmdline())
    os.kill(pid, signal.SIGUSR1)  # the GPU hangs: the next probe waits for good
    until(lambda: store.restarts("mac", 0.0), 60, "the restart")
    (incident,) = store.incidents(0.0)
    t.stop()
    assert incident.evidence.get("cause") == "deadlock", incident.reason
    assert "its generation thread sits in" in incident.reason, incident.reason
    assert "GPU" in incident.reason, incident.reason


# -- the unified log --------------------------------------------------------------------------


def unified_entry(pid: int, message: str) -> str:
    return json.dumps(
        {"timestamp": "2026-12-07 12:00:00.0+0000", "processID": pid, "eventMessage": message}
    )


def test_the_unified_logs_gpu_failures_are_read_for_the_servers_pid_only() -> None:
    said = " ".join((MACOS / "unifiedlog_IOGPUMetalError_oom_mlxserve321.txt").read_text().split())
    text = "\n".join(
        (
            unified_entry(7, said),
            unified_entry(8, said),  # another process's failure
            unified_entry(7, "an unrelated message of the process"),
            '{"count":3,"finished":1}',
            "garbage {",
        )
    )
    (found,) = unified_log.parse(text, 7)
    assert found.kind == "metal" and "kIOGPUCommandBufferCallbackErrorOutOfMemory" in found.line
    for end in range(0, len(text), 5):
        assert len(unified_log.parse(text[:end], 7)) <= 1
    assert unified_log.parse("", 7) == ()


def test_the_unified_log_is_read_at_most_every_30_s_and_a_failing_log_is_said() -> None:
    clock, calls = Clock(), []

    def run(argv: list[str]) -> tuple[int, bytes, bytes]:
        calls.append(argv)
        return 0, (unified_entry(7, "GPU Timeout Error (00000002:x)") + "\n").encode(), b""

    reader = unified_log.UnifiedLog(run=run, mono=clock, mac=True)
    assert len(reader.read(7, 12.3)) == 1 and len(reader.read(7, 13.0)) == 1
    assert len(calls) == 1 and calls[0][:4] == ["log", "show", "--last", "13s"]
    assert "processID == 7 AND (" in calls[0][-1]
    clock.t += unified_log.READ_EVERY
    reader.read(7, 50.0)
    assert len(calls) == 2
    failing = unified_log.UnifiedLog(
        run=lambda argv: (1, b"", b"log: Could not open log archive\n"), mac=True
    )
    assert failing.read(7, 5.0) == () and "Could not open log archive" in failing.problem
    assert unified_log.UnifiedLog(run=run, mac=False).read(7, 5.0) == ()


def test_a_metal_death_only_macos_logged_names_the_cause(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    run_daemon: Callable[[object], DaemonThread],
) -> None:
    """mlx-serve #321: the GPU fails, the server's own log says nothing, /health answers 200;
    only macOS's unified log has it. Read for the server's PID while the wedge is suspected, it
    names the cause, and the server is restarted at once."""
    on_a_mac(monkeypatch, tmp_path)
    monkeypatch.setenv(
        "FAKE_UNIFIED_LOG", str(MACOS / "unifiedlog_IOGPUMetalError_oom_mlxserve321.txt")
    )
    mac = MacDaemon(tmp_path, run_daemon)
    t, store, pid = mac.t, mac.store, mac.pid
    os.kill(pid, signal.SIGUSR1)
    until(lambda: store.restarts("mac", 0.0), 60, "the restart")
    (incident,) = store.incidents(0.0)
    t.stop()
    assert incident.evidence.get("cause") == "metal_error", incident.reason
    assert "macOS's log for its process: IOGPUMetalError" in incident.reason


# -- doctor: how launchd runs the job, where the stacks come from -----------------------------


def doctor(config: Config, home: Path) -> list[Finding]:
    return list(run_doctor(config, home=home))


def test_doctor_says_how_launchd_runs_the_job_now(
    tmp_path: Path, fake_services: FakeServices
) -> None:
    """`launchctl print`'s spawn type is what runs now (the plist's ProcessType takes effect
    only once the job is loaded again): the background band is said, interactive is fine."""
    uid = os.getuid()
    said: dict[str, Finding] = {}
    for kind in ("Background", "Interactive", None):
        label = f"com.example.mlx-{(kind or 'none').lower()}"
        plist = tmp_path / f"{label}.plist"
        job = {"Label": label, "ProgramArguments": ["/bin/sleep", "600"]}
        plist.write_bytes(plistlib.dumps({**job, **({"ProcessType": kind} if kind else {})}))
        loaded = subprocess.run(["launchctl", "bootstrap", f"gui/{uid}", str(plist)], check=False)
        assert loaded.returncode == 0
        server = {
            "name": "m",
            "url": "http://127.0.0.1:9",
            "manager": "launchd",
            "label": label,
            "plist": str(plist),
            "domain": f"gui/{uid}",
        }
        raw = {"watchdog": {"state_dir": str(tmp_path / "state")}, "server": [server]}
        found = [
            f for f in doctor(parse_config(raw), tmp_path) if "launchd runs its job" in f.detail
        ]
        assert len(found) == 1, found
        said[str(kind)] = found[0]
    assert said["Background"].level == "warning" and "background (5)" in said["Background"].detail
    assert said["Interactive"].level == "ok" and "interactive (4)" in said["Interactive"].detail
    assert said["None"].level == "warning" and "daemon (3)" in said["None"].detail


def test_doctor_names_each_servers_stack_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def source(manager: str) -> Finding:
        server: dict[str, object] = {"name": "m", "url": "http://127.0.0.1:9", "manager": manager}
        if manager == "process":
            server["command"] = [sys.executable, "-m", "mlx_lm", "server"]
        if manager == "launchd":  # as `server install` writes it: through the launcher
            plist = tmp_path / "com.example.mlx.plist"
            args = [sys.executable, str(selfdump.LAUNCHER), "-m", "mlx_lm", "server"]
            plist.write_bytes(
                plistlib.dumps({"Label": "com.example.mlx", "ProgramArguments": args})
            )
            server.update(label="com.example.mlx", plist=str(plist), log_file=str(tmp_path / "l"))
        raw = {"watchdog": {"state_dir": str(tmp_path / "state")}, "server": [server]}
        (found,) = [f for f in doctor(parse_config(raw), tmp_path) if "stacks" in f.detail]
        return found

    monkeypatch.setenv(platform.VARIABLE, "darwin")
    monkeypatch.setattr(os, "geteuid", lambda: 501)  # a user, as the watchdog runs on a Mac
    own = source("process")
    assert own.level == "ok" and "its own dump" in own.detail
    assert source("launchd").detail == own.detail
    none = source("none")
    assert none.level == "warning" and "py-spy needs root on macOS" in none.detail
    assert 'manager = "process"' in (none.fix or "")
    monkeypatch.setenv(platform.VARIABLE, "linux")
    assert source("none").detail == "its stacks: py-spy"


def test_a_compute_key_of_another_value_is_an_error_naming_key_and_value() -> None:
    raw = {"server": [{"name": "m", "url": "http://127.0.0.1:9", "compute": "metal"}]}
    with pytest.raises(ConfigError, match='compute = "metal" must be one of: auto, cpu, gpu'):
        parse_config(raw)


def test_a_gpu_that_climbs_for_ever_is_still_bounded() -> None:
    """A spinning wedge (MLX_METAL_FAST_SYNCH, omlx #2183) climbs with no token: max_busy holds
    with a live client, and the restart's cost bounds the wait for abandoned work."""
    spinning = (100.0,) * 20
    live, now = look(S.max_busy + 1, live=1, gpu_now=100.0, readings=spinning)
    v = judge(live, S, now)
    assert v is not None and v.state == State.WEDGED and "max_busy" in v.reason
    left, at = look(S.wedge_after + 1, abandoned=1, gpu_now=100.0, readings=spinning)
    first = choose(judge(left, S, at).evidence, restart_cost([40.0]), None, at)  # type: ignore[union-attr]
    assert first.wait is not None and first.wait.until <= at + 40.0 + 5.0
    late = at + 46.0
    later, _ = look(S.wedge_after + 47, abandoned=1, gpu_now=100.0, readings=spinning)
    cut = choose(judge(later, S, late).evidence, restart_cost([40.0]), first.wait, late)  # type: ignore[union-attr]
    assert cut.wait is None and "cost more than the restart" in cut.why


def test_the_scheduling_band_is_read_from_ps_on_a_mac(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`ps -o pri=` as macOS prints it (the stand-in): 4 in the background band, 20 for a job
    with no ProcessType, 31 for a process started from a shell; a PID ps cannot find is no
    clamp, said as none."""
    monkeypatch.setenv(platform.VARIABLE, "darwin")
    monkeypatch.setenv("PATH", f"{FAKES}:{_path()}")
    me = os.getpid()
    monkeypatch.setenv("FAKE_PS_PRI", "4")
    assert clamp(me) == "scheduling priority 4 (a normal process has 31)"
    monkeypatch.setenv("FAKE_PS_PRI", "20")
    assert clamp(me) == "scheduling priority 20 (a normal process has 31)"
    monkeypatch.setenv("FAKE_PS_PRI", "31")
    assert clamp(me) is None
    assert clamp(2**22 + 12345) is None  # no such process


def test_doctor_reads_a_jobs_plist_within_bounds_whatever_it_holds(tmp_path: Path) -> None:
    """A server's plist that is garbage, a FIFO or not a job: doctor's Mac checks go on (a
    FIFO once hung it; garbage raised expat's error), and the job's reader says why."""
    from mlx_watchdog.act.managers import System
    from mlx_watchdog.advice.host import mac_findings, read_job

    bad = {
        "garbage": b"<plist><dict><key>x",
        "binary": b"\x00\xff\x00 not a plist",
        "a list": plistlib.dumps([1, 2]),
        "no arguments": plistlib.dumps({"Label": "x"}),
    }
    fifo = tmp_path / "fifo.plist"
    os.mkfifo(fifo)
    paths = [fifo]
    for name, data in bad.items():
        (tmp_path / f"{name}.plist").write_bytes(data)
        paths.append(tmp_path / f"{name}.plist")
    for path in paths:
        server = {"name": "m", "url": "http://127.0.0.1:9", "manager": "launchd", "label": "x"}
        raw = {
            "watchdog": {"state_dir": str(tmp_path / "s")},
            "server": [{**server, "plist": str(path)}],
        }
        found = list(mac_findings(parse_config(raw), tmp_path, System(), python=sys.executable))
        assert all(f.level != "problem" for f in found), found
    assert read_job(fifo)[0] is None and read_job(fifo)[1]
    assert read_job(tmp_path / "garbage.plist")[0] is None
    assert "not a launchd job" in (read_job(tmp_path / "a list.plist")[1] or "")
