"""A systemd unit's progress read from its journal (the default where a unit's output goes),
through the fake journalctl: from a cursor, bounded, only while the probe waits; and the daemon
waiting out an abandoned prefill of a unit instead of restarting it."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from mlx_watchdog.config import parse_config
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.demo.run import send
from mlx_watchdog.sense.progress import JournalProgress, progress_reader, progress_source
from tests.builders import badserver_argv, watchdog_config
from tests.conftest import DaemonThread, FakeServices, free_port, until

UNIT = "mlx-server.service"
STEP = "2026-12-03 19:34:{s:02d},000 - INFO - Prompt processing progress: {done}/12036"


def load_unit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> None:
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    folder = tmp_path / "config" / "systemd" / "user"
    folder.mkdir(parents=True, exist_ok=True)
    (folder / UNIT).write_text(
        f"[Service]\nExecStart={shlex.join(argv)}\nEnvironment=PATH={os.environ['PATH']}\n"
    )
    subprocess.run(["systemctl", "--user", "daemon-reload"], check=True)
    subprocess.run(["systemctl", "--user", "start", UNIT], check=True)


def printer(lines: Path) -> list[str]:
    """A unit that prints each line appended to `lines`, unbuffered, as a server logs."""
    script = lines.with_name("printer.py")
    script.write_text(
        "import sys, time\n"
        f"fh = open({str(lines)!r})\n"
        "while True:\n"
        "    line = fh.readline()\n"
        "    if line:\n"
        "        print(line.rstrip(), flush=True)\n"
        "    else:\n"
        "        time.sleep(0.02)\n"
    )
    return [sys.executable, str(script)]


def test_the_journal_is_read_from_a_cursor_and_from_its_tail_after_a_pause(
    tmp_path: Path, fake_services: FakeServices, monkeypatch: pytest.MonkeyPatch
) -> None:
    lines = tmp_path / "lines"
    lines.write_text("Starting httpd\n")
    load_unit(tmp_path, monkeypatch, printer(lines))
    mono = [0.0]
    wall = time.mktime(time.strptime("2026-12-03 19:34:50", "%Y-%m-%d %H:%M:%S"))
    reader = JournalProgress(UNIT, wall=lambda: wall, mono=lambda: mono[0])
    until(lambda: reader.read() is None and reader._cursor, 10, "the first entry")
    with lines.open("a") as fh:
        fh.write(STEP.format(s=40, done=2048) + "\n" + STEP.format(s=44, done=4096) + "\n")
    said = until(lambda: (p := reader.read()) and p.rate_tps and p, 10, "two steps")
    assert (said.done, said.total, said.rate_tps) == (4096, 12036, 512.0)  # type: ignore[union-attr]
    calls = [c for c in fake_services.calls() if c[0] == "journalctl"]
    assert "--after-cursor" in calls[-1]  # only what came since the last look
    # After a pause the journal is read from its tail, never from an old cursor's backlog.
    mono[0] += 60.0
    reader.read()
    assert "--after-cursor" not in [c for c in fake_services.calls() if c[0] == "journalctl"][-1]
    # A cursor journalctl refuses (rotated away) is a named problem, then the tail again.
    reader._cursor = "s=gone;i=1"
    mono[0] += 1.0
    assert reader.read() is None and "Failed to seek to cursor" in str(reader.problem)
    mono[0] += 1.0
    said = reader.read()
    assert reader.problem is None and said is not None and said.done == 4096


def test_progress_is_read_from_where_each_manager_puts_the_output(tmp_path: Path) -> None:
    doc = watchdog_config(
        tmp_path / "state",
        [
            {"name": "own", "url": "http://127.0.0.1:1", "manager": "process", "command": ["x"]},
            {"name": "unit", "url": "http://127.0.0.1:2", "manager": "systemd", "unit": UNIT},
            {"name": "far", "url": "http://127.0.0.1:3"},
        ],
    )
    own, unit, far = parse_config(doc).servers
    assert own.log_file == tmp_path / "state" / "logs" / "own.log"
    assert progress_source(own) == f"the server's log {own.log_file}"
    assert isinstance(progress_reader(unit), JournalProgress)
    assert progress_source(unit) == f"the journal of {UNIT}"
    assert progress_source(far) is None


def test_the_daemon_waits_out_an_abandoned_prefill_of_a_unit_read_from_its_journal(
    tmp_path: Path,
    fake_services: FakeServices,
    monkeypatch: pytest.MonkeyPatch,
    run_daemon: Callable[[object], DaemonThread],
) -> None:
    """The config a user writes for a systemd unit names no log: the journal is read."""
    port = free_port()
    load_unit(tmp_path, monkeypatch, badserver_argv(port, "prefill"))
    server = {
        "name": "unit",
        "url": f"http://127.0.0.1:{port}",
        "manager": "systemd",
        "unit": UNIT,
        "match": "badserver",
        "probe": {"slow_after": "500ms", "wedge_after": "1s", "startup_grace": "10m"},
        "restart": {"max_restarts": 3, "backoff": "1s"},
    }
    t = run_daemon(Daemon(parse_config(watchdog_config(tmp_path / "state", [server]))).open())
    w = t.daemon.cycles["unit"]
    until(lambda: w.verdict is not None and w.verdict.state == "healthy", 30, "serving")
    pid = w.manager.pid()
    assert send(f"http://127.0.0.1:{port}", "word " * 8000, timeout=0.3) == "gave up"
    until(lambda: any(e.kind == "recovered" for e in t.daemon.store.events()), 30, "recovered")
    events = [e for e in t.daemon.store.events() if e.kind != "gave_up"]
    said = "\n".join(f"{e.kind}: {e.message}" for e in events)
    assert [e.kind for e in events] == ["detected", "clearing", "recovered"], said
    clearing = next(e for e in t.daemon.store.events() if e.kind == "clearing")
    assert clearing.message.startswith("waiting for the abandoned prefill to finish (")
    assert t.daemon.store.restarts("unit", 0.0) == [] and w.manager.pid() == pid


def test_a_unit_that_floods_its_journal_with_garbage_costs_a_bounded_look(
    tmp_path: Path, fake_services: FakeServices, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Binary noise, escape sequences and lines over journald's LineMax: each look reads at
    most READ_MAX bytes within its time limit, and a progress line after them is still read."""
    from mlx_watchdog.sense.progress import READ_MAX

    lines = tmp_path / "lines"
    noise = "\x1b[2J\x00\u202e" + "x" * 200_000
    lines.write_text(noise + "\n" + noise + "\n", encoding="utf-8")
    load_unit(tmp_path, monkeypatch, printer(lines))
    wall = time.mktime(time.strptime("2026-12-03 19:34:50", "%Y-%m-%d %H:%M:%S"))
    reader = JournalProgress(UNIT, wall=lambda: wall)
    until(lambda: reader.read() is None and reader._cursor, 10, "the noise in the journal")
    assert reader.problem is None
    with lines.open("a") as fh:
        fh.write(STEP.format(s=40, done=2048) + "\n" + STEP.format(s=44, done=4096) + "\n")
    said = until(lambda: (p := reader.read()) and p.rate_tps and p, 10, "two steps after it")
    assert said.done == 4096  # type: ignore[union-attr]
    assert len(reader._fetch()) <= READ_MAX


def test_a_journal_of_long_lines_still_yields_a_cursor(
    tmp_path: Path, fake_services: FakeServices, monkeypatch: pytest.MonkeyPatch
) -> None:
    """500 lines of 8 kB are more than a look reads (READ_MAX), so journalctl's cursor line
    never came: the cursor stayed unset and every look read the whole flood again. A look cut
    short reads fewer lines next, until the cursor fits; progress after it is read."""
    lines = tmp_path / "lines"
    lines.write_text(("y" * 8000 + "\n") * 500)
    load_unit(tmp_path, monkeypatch, printer(lines))
    journal = ["journalctl", "--user", "-u", UNIT, "-o", "cat", "-n", "1000"]
    until(
        lambda: subprocess.run(journal, capture_output=True).stdout.count(b"\n") >= 500,
        20,
        "the flood in the journal",
    )
    wall = time.mktime(time.strptime("2026-12-03 19:34:50", "%Y-%m-%d %H:%M:%S"))
    reader = JournalProgress(UNIT, wall=lambda: wall)
    until(lambda: reader.read() is None and reader._cursor, 20, "a cursor past the flood")
    with lines.open("a") as fh:
        fh.write(STEP.format(s=40, done=2048) + "\n" + STEP.format(s=44, done=4096) + "\n")
    said = until(lambda: (p := reader.read()) and p.rate_tps and p, 10, "two steps after it")
    assert said.done == 4096  # type: ignore[union-attr]
