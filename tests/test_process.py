"""What psutil says about a real server process (the misbehaving one, in its own process)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.sense.process import Inspector, ProcessTable, is_local_host
from tests.conftest import DaemonThread, Running, free_port, until


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def hold(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    body = b"{}"
    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\n" + body)
    return s


def settle(inspector: Inspector, live: int, abandoned: int) -> None:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        ev = inspector.sample()
        if (ev.live, ev.abandoned) == (live, abandoned):
            return
        time.sleep(0.05)
    raise AssertionError(f"never saw {live} live and {abandoned} abandoned: {ev}")


def test_live_and_abandoned_connections_and_their_age(bad_server: Callable[..., Running]) -> None:
    srv = bad_server("hang")
    clock = Clock()
    inspector = Inspector(ServerConfig("b", srv.url, match="badserver"), mono=clock)
    first, second = hold(srv.port), hold(srv.port)
    try:
        settle(inspector, live=2, abandoned=0)
        first.close()
        settle(inspector, live=1, abandoned=1)
        clock.now += 7.5
        ev = inspector.sample()
        assert ev.pid == srv.proc.pid and ev.matches is True
        assert ev.oldest_abandoned(clock.now) == 7.5
        assert {c.status for c in ev.clients} == {"live", "abandoned"}
        assert ev.cpu_percent is not None and ev.rss_bytes and ev.rss_bytes > 0
        assert ev.age(time.time()) is not None
        ev = inspector.sample(exclude=[second.getsockname()[:2]])
        assert (ev.live, ev.abandoned) == (0, 1)
    finally:
        first.close()
        second.close()


def test_a_client_that_half_closes_after_sending_still_waits(
    bad_server: Callable[..., Running],
) -> None:
    """shutdown(SHUT_WR) after the request (as some HTTP clients do) puts the server's socket in
    CLOSE_WAIT, as a departed client's; but the client still holds its socket and reads the
    answer. A client that then closes is gone."""
    srv = bad_server("hang")
    inspector = Inspector(ServerConfig("b", srv.url, match="badserver"), mono=Clock())
    half, gone = hold(srv.port), hold(srv.port)
    try:
        settle(inspector, live=2, abandoned=0)
        half.shutdown(socket.SHUT_WR)
        gone.close()
        settle(inspector, live=1, abandoned=1)
        (client,) = [c for c in inspector.sample().clients if c.status == "live"]
        assert client.address == half.getsockname()[:2]
        half.close()
        settle(inspector, live=0, abandoned=2)
    finally:
        half.close()
        gone.close()


def test_command_line_that_does_not_match_is_noted(bad_server: Callable[..., Running]) -> None:
    srv = bad_server("ok")
    ev = Inspector(ServerConfig("b", srv.url, match="mlx_lm")).sample()
    assert ev.pid == srv.proc.pid and ev.matches is False


def test_no_listener_is_evidence_not_a_crash() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening
        ev = Inspector(ServerConfig("b", f"http://127.0.0.1:{port}")).sample()
    assert ev.pid is None and f"listens on port {port}" in ev.error


class DeniedTable(ProcessTable):
    def listener(self, port: int, host: str | None = None, match: str = "") -> int | None:
        return 123

    def process(self, pid: int) -> psutil.Process:
        raise psutil.AccessDenied(pid)


def test_access_denied_is_evidence() -> None:
    ev = Inspector(ServerConfig("b", "http://127.0.0.1:8080"), table=DeniedTable()).sample()
    assert ev.pid == 123 and ev.abandoned is None
    assert ev.error == "cannot inspect PID 123: AccessDenied"


def test_a_pid_from_a_manager_that_is_gone() -> None:
    proc = psutil.Popen(["true"])
    proc.wait()
    ev = Inspector(ServerConfig("b", "http://127.0.0.1:8080")).sample(pid=proc.pid)
    assert ev.pid is None and ev.error == f"process {proc.pid} exited"


@pytest.mark.parametrize(
    ("host", "local"),
    [("127.0.0.1", True), ("localhost", True), ("::1", True), ("192.0.2.7", False)],
)
def test_local_hosts(host: str, local: bool) -> None:
    assert is_local_host(host) is local


def test_remote_server_is_not_inspected() -> None:
    ev = Inspector(ServerConfig("b", "http://192.0.2.7:8080")).sample()
    assert ev.local is False and ev.pid is None and "another machine" in ev.error


LISTEN_ON = """
import socket, sys, time
s = socket.socket(socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2])))
s.listen()
print("ready", flush=True)
time.sleep(600)
"""


def listening_on(ip: str, port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-c", LISTEN_ON, ip, str(port)], stdout=subprocess.PIPE
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
    return proc


@pytest.mark.parametrize("other", ["::1", "127.0.0.2"])
def test_another_listener_on_the_port_at_another_address_is_not_the_server(
    bad_server: Callable[..., Running], other: str
) -> None:
    """An `ssh -L` forward binds [::1]:P beside a server on 127.0.0.1:P: the port alone does
    not say which is the server, the URL's address does; with the server gone, the other is
    not taken for it."""
    if other == "::1" and not socket.has_ipv6:
        pytest.skip("no IPv6 here")
    srv = bad_server("ok")
    beside = listening_on(other, srv.port)
    try:
        server = ServerConfig("b", srv.url)
        table = ProcessTable()
        assert table.listener(srv.port, "127.0.0.1") == srv.proc.pid
        assert table.listener(srv.port, other) == beside.pid
        assert Inspector(server).sample().pid == srv.proc.pid
        srv.stop()
        until(lambda: table.listener(srv.port, "127.0.0.1") is None, 10, "the server gone")
        gone = Inspector(server).sample()
        assert gone.pid is None and f"listens on port {srv.port}" in gone.error
    finally:
        beside.kill()
        beside.wait()
        assert beside.stdout is not None
        beside.stdout.close()


def test_a_wildcard_listener_serves_the_urls_address_and_an_exact_one_comes_first() -> None:
    from types import SimpleNamespace

    from mlx_watchdog.sense.process import _serves

    def conn(ip: str, port: int = 8080) -> object:
        return SimpleNamespace(status=psutil.CONN_LISTEN, laddr=SimpleNamespace(ip=ip, port=port))

    v4 = frozenset({"127.0.0.1"})
    assert _serves(conn("127.0.0.1"), 8080, v4) == 1
    assert _serves(conn("0.0.0.0"), 8080, v4) == 2 and _serves(conn("::"), 8080, v4) == 2
    assert _serves(conn("::1"), 8080, v4) == 0 and _serves(conn("127.0.0.2"), 8080, v4) == 0
    assert _serves(conn("0.0.0.0"), 8080, frozenset({"::1"})) == 0
    assert _serves(conn("::ffff:127.0.0.1"), 8080, v4) == 1
    assert _serves(conn("127.0.0.1", 8081), 8080, v4) == 0
    assert _serves(conn("10.1.2.3"), 8080, None) == 1  # unresolvable host: the port decides


# The server a process manager starts leaves a child in its own session holding the port, and
# exits: the manager's stop (its process group) does not reach the child.
LEAVES_A_CHILD = """
import os, socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1])))
s.listen(16)
if os.fork() == 0:
    os.setsid()
    with open(sys.argv[2] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(sys.argv[2] + ".tmp", sys.argv[2])
    held = []
    while True:
        held.append(s.accept()[0])  # accepted, never answered
"""


def test_a_child_left_holding_the_port_is_named_for_a_person_and_never_signalled(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    """The server the process manager started is gone, a child it left in its own session
    keeps the port and answers nothing: each failing verdict names the holder and the command
    that ends it; the watchdog, which did not start it, never signals it."""
    port, left = free_port(), tmp_path / "child.pid"
    t, child = _leaves_a_child(tmp_path, run_daemon, LEAVES_A_CHILD, port, left)
    try:
        w = t.daemon.cycles["p"]
        until(lambda: w.verdict is not None and f"PID {child}" in w.verdict.reason, 60, "named")
        assert w.verdict is not None
        reason = w.verdict.reason
        assert f"port {port} is held by PID {child} (" in reason and "holdport" in reason, reason
        # The parent may not have exited yet at that look (a loaded machine): named or "none".
        assert f"kill {child}" in reason and "not by the server process started (" in reason
        t.stop()
        assert psutil.pid_exists(child) and psutil.Process(child).status() != "zombie"
    finally:
        os.kill(child, signal.SIGKILL)


# The same child, which answers each request with a token once told to (a file beside its PID):
# an orphaned server that serves again, still not the one the manager runs.
ANSWERS_LATER = LEAVES_A_CHILD.replace(
    "        held.append(s.accept()[0])  # accepted, never answered",
    """        c = s.accept()[0]
        if not os.path.exists(sys.argv[2] + ".answer"):
            held.append(c)
            continue
        c.settimeout(5)
        got = b""
        while b"\\r\\n\\r\\n" not in got:
            part = c.recv(65536)
            if not part:
                break
            got += part
        chunk = b'data: {"choices":[{"index":0,"delta":{"content":"x"}}]}\\n\\ndata: [DONE]\\n\\n'
        head = b"HTTP/1.1 200 OK\\r\\nContent-Type: text/event-stream\\r\\nConnection: close\\r\\n\\r\\n"
        try:
            c.sendall(head + chunk)
        except OSError:
            pass
        c.close()""",
)


def test_a_child_holding_the_port_that_answers_closes_no_incident_as_recovered_by_itself(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    """Issue 54: the child holding the port was named and the restart counted failed, but its
    next answer closed the incident "recovered by itself". It is said as what it is: answered
    by the process that holds the port, not the server the manager runs."""
    port, left = free_port(), tmp_path / "child.pid"
    t, child = _leaves_a_child(tmp_path, run_daemon, ANSWERS_LATER, port, left)
    try:
        w = t.daemon.cycles["p"]
        until(lambda: w.verdict is not None and f"PID {child}" in w.verdict.reason, 60, "named")
        Path(str(left) + ".answer").touch()
        until(lambda: any(e.kind == "recovered" for e in t.daemon.store.events()), 60, "served")
        said = next(e.message for e in t.daemon.store.events() if e.kind == "recovered")
        assert "recovered by itself" not in said, said
        assert f"answered by PID {child}" in said and "not the server process runs" in said, said
        t.stop()
    finally:
        os.kill(child, signal.SIGKILL)


def _leaves_a_child(
    tmp_path: Path,
    run_daemon: Callable[[object], DaemonThread],
    script_text: str,
    port: int,
    left: Path,
) -> tuple[DaemonThread, int]:
    """A daemon running `script_text` as its `process` server on `port`, and the PID of the
    child it left holding the port (written to `left`)."""
    from mlx_watchdog.config import parse_config
    from mlx_watchdog.daemon import Daemon
    from tests.builders import watchdog_config

    script = tmp_path / "holdport.py"
    script.write_text(script_text)
    server = {
        "name": "p",
        "url": f"http://127.0.0.1:{port}",
        "manager": "process",
        "match": "holdport",
        "command": [sys.executable, str(script), str(port), str(left)],
        "probe": {"slow_after": "300ms", "wedge_after": "1s", "startup_grace": "2s"},
        "restart": {"max_restarts": 1, "window": "1h", "backoff": "200ms"},
    }
    t = run_daemon(Daemon(parse_config(watchdog_config(tmp_path / "state", [server]))).open())
    until(left.exists, 30, "the child left")
    return t, int(left.read_text())
