"""What psutil says about a real server process (the misbehaving one, in its own process)."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import psutil
import pytest

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.sense.process import Inspector, ProcessTable, is_local_host
from tests.conftest import Running


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
    def listener(self, port: int) -> int | None:
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
