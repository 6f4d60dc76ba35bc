"""The server's last words, kept before a restart: stacks, log tail, sockets, within 2 s."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlx_watchdog.sense import dump as dump_module
from mlx_watchdog.sense.dump import BUDGET, LOG_TAIL_MAX, take


@pytest.fixture
def listening() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A Python process that listens, accepts one client and then hangs in a named function."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    code = (
        "import socket, time\n"
        "def stuck_in_prefill(conn):\n"
        "    time.sleep(600)\n"
        f"s = socket.create_server(('127.0.0.1', {port}))\n"
        "print('ready', flush=True)\n"
        "conn, _ = s.accept()\n"
        "stuck_in_prefill(conn)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"
    try:
        yield proc, port
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


def test_a_hung_servers_stack_log_tail_and_sockets_are_kept(
    listening: tuple[subprocess.Popen[bytes], int], tmp_path: Path
) -> None:
    proc, port = listening
    client = socket.create_connection(("127.0.0.1", port))
    client.close()  # a client that left: the server's side is in CLOSE_WAIT
    log = tmp_path / "server.log"
    log.write_text("".join(f"line {n}\n" for n in range(20_000)))  # about 200 kB
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        d = take(proc.pid, log)
        # Both sides settle on their own time under load: the stack and the departed client.
        if d.stack and "stuck_in_prefill" in d.stack and any("CLOSE_WAIT" in s for s in d.sockets):
            break
        time.sleep(0.2)
    assert d.stack is not None and "stuck_in_prefill" in d.stack, d.stack_problem
    assert d.stack_problem is None and d.pid == proc.pid
    assert d.log_tail is not None and d.log_tail.endswith("line 19999\n")
    assert d.log_tail.startswith("line ") and len(d.log_tail) <= LOG_TAIL_MAX
    assert any(f":{port} LISTEN" in s for s in d.sockets), d.sockets
    assert any("CLOSE_WAIT" in s for s in d.sockets), d.sockets
    assert d.to_json()["sockets"] == list(d.sockets)


def test_a_stack_tool_that_hangs_is_cut_off_within_the_budget(tmp_path: Path) -> None:
    timeouts: list[float] = []

    def hangs(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
        timeouts.append(float(kw["timeout"]))  # type: ignore[arg-type]
        raise subprocess.TimeoutExpired(argv, float(kw["timeout"]))  # type: ignore[arg-type]

    d = take(os.getpid(), None, run=hangs)
    assert d.stack is None and d.stack_problem is not None
    assert "took longer than" in d.stack_problem
    assert len(timeouts) == 1 and 0 < timeouts[0] <= BUDGET


@pytest.mark.parametrize(
    ("command", "why"),
    [
        (None, "py-spy is not installed"),
        (["/nonexistent/py-spy", "dump", "--pid", "1"], "py-spy could not run"),
        (
            [sys.executable, "-c", "import sys; sys.exit('Permission denied')"],
            "failed: Permission denied",
        ),
    ],
)
def test_a_stack_that_cannot_be_had_says_why(
    monkeypatch: pytest.MonkeyPatch, command: list[str] | None, why: str
) -> None:
    monkeypatch.setattr(dump_module, "stack_command", lambda pid: command)
    d = take(os.getpid(), None)
    assert d.stack is None and d.stack_problem is not None and why in d.stack_problem


def test_a_gone_server_and_an_odd_log_are_said_not_raised(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    d = take(None, fifo)  # a FIFO where the log was: no hang on its open
    assert d.stack_problem == "no server process to dump" and d.sockets == ()
    assert (
        d.log_tail is None and d.log_problem is not None and "not a regular file" in d.log_problem
    )
    gone = take(None, tmp_path / "missing.log")
    assert gone.log_problem is not None and "No such file" in gone.log_problem


def test_a_stack_tool_that_prints_bytes_not_utf8_is_read_with_replacement(tmp_path: Path) -> None:
    """A stack tool's output is outside bytes: stray ones are replaced, never a failure of the
    tick or of the restart that takes the dump."""
    import subprocess
    import sys

    from mlx_watchdog.sense.dump import stack_text

    script = "import sys; sys.stdout.buffer.write(b'Thread 1 (idle): \\xff\\xfe main\\n')"
    text, problem = stack_text(
        1, 10.0, subprocess.run, command=lambda pid: [sys.executable, "-c", script]
    )
    assert problem is None and text is not None
    assert text.startswith("Thread 1 (idle): ") and "\ufffd" in text
