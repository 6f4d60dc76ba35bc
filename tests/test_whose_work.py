"""Whose work is it: an abandoned request queued behind a live client's holds nobody up until
that client is served (issue 54). Told by signs no client writes: the kernel's byte counts (a
request received, its answer not yet sent) and the order the requests came in."""

from __future__ import annotations

import socket
from collections.abc import Callable
from dataclasses import replace

import psutil
import pytest

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.judge.states import State
from mlx_watchdog.judge.verdict import judge
from mlx_watchdog.sense.findings import Client, ProcessSample
from mlx_watchdog.sense.observation import Observation
from mlx_watchdog.sense.process import Inspector
from tests.conftest import Running, until
from tests.judging import MODELS_OK, T0, S, proc, waiting

NOW = T0 + S.wedge_after + 5


def client(
    status: str,
    sent: float,
    received: int | None = 90_000,
    answered_at: float | None = None,
    port: int = 50000,
) -> Client:
    left = sent + 0.5 if status == "abandoned" else None
    return Client(("127.0.0.1", port), status, sent, left, received, sent, None, answered_at)


def look(*clients: Client, cpu: float = 100.0, now: float = NOW) -> tuple[str, str]:
    base = proc(cpu=cpu)
    sample: ProcessSample = replace(
        base,
        clients=clients,
        live=sum(c.status == "live" for c in clients),
        abandoned=sum(c.status == "abandoned" for c in clients),
    )
    v = judge(Observation(waiting(), sample, MODELS_OK), S, now)
    assert v is not None
    return v.state, v.reason


PATIENT = client("live", T0 - 10.0)
TINY_BEHIND = client("abandoned", T0 - 9.0, received=300, port=50001)


def test_a_request_that_left_behind_a_patient_client_holds_nobody_up() -> None:
    state, reason = look(PATIENT, TINY_BEHIND)
    assert state == State.BUSY, reason
    assert "1 abandoned request sent after it waits behind it" in reason


def test_an_abandoned_request_ahead_of_the_live_one_is_the_wedge() -> None:
    """The seed's loop: the prompt that was given up came first, its resend waits behind it."""
    older = client("abandoned", T0 - 11.0, port=50001)
    state, reason = look(PATIENT, older)
    assert state == State.WEDGED and "holds the server" in reason
    mixed = look(PATIENT, TINY_BEHIND, replace(older, address=("127.0.0.1", 50002)))
    assert mixed[0] == State.WEDGED


def test_a_live_connection_owed_nothing_is_no_one_to_wait_behind() -> None:
    idle_keepalive = client("live", T0 - 10.0, answered_at=T0 - 9.5)
    assert look(idle_keepalive, TINY_BEHIND)[0] == State.WEDGED
    sent_nothing = client("live", T0 - 10.0, received=0)
    assert look(sent_nothing, TINY_BEHIND)[0] == State.WEDGED
    streaming = client("live", T0 - 10.0, answered_at=NOW - 0.2)  # being answered now
    assert look(streaming, TINY_BEHIND)[0] == State.BUSY


def test_without_the_kernels_byte_counts_the_abandoned_work_is_judged_as_before() -> None:
    unknown = replace(TINY_BEHIND, received=None)
    assert look(PATIENT, unknown)[0] == State.WEDGED
    unsized = replace(PATIENT, received=None, sent_at=None)
    assert look(unsized, TINY_BEHIND)[0] == State.WEDGED


def test_the_queue_behind_a_live_client_is_still_bounded() -> None:
    assert look(PATIENT, TINY_BEHIND, cpu=0.0)[0] == State.WEDGED  # idle: nothing is served
    late = T0 + S.max_busy + 1
    state, reason = look(PATIENT, TINY_BEHIND, now=late)
    assert state == State.WEDGED and "max_busy" in reason


def test_a_connection_that_sent_nothing_is_no_client(
    bad_server: Callable[..., Running],
) -> None:
    """A socket held open that asked for nothing is no live client (it kept a wedged server
    "busy" to max_busy, and counted as a client waiting behind the wedge under `drain`); the
    request it then sends makes it one."""
    srv = bad_server("hang")
    inspector = Inspector(ServerConfig("b", srv.url, match="badserver"))
    idle = socket.create_connection(("127.0.0.1", srv.port))
    try:
        until(lambda: _held(srv.proc.pid, srv.port), 10, "the server to hold the connection")
        seen = inspector.sample()
        assert seen.pid == srv.proc.pid and (seen.live, seen.abandoned) == (0, 0), seen
        idle.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
        assert until(lambda: inspector.sample().live == 1, 10, "the request to make a client")
    finally:
        idle.close()


def _held(pid: int, port: int) -> bool:
    return any(
        c.status == psutil.CONN_ESTABLISHED and c.laddr.port == port and c.raddr
        for c in psutil.Process(pid).net_connections("tcp")
    )


def test_a_request_reset_unanswered_under_the_server_is_abandoned_work(
    bad_server: Callable[..., Running],
) -> None:
    """Issue 55: HAProxy's `option abortonclose` (2.6 as Debian ships it) resets the server's
    connection when the client leaves, so it never shows as CLOSE_WAIT: it vanishes while the
    server still has its request. Sent nothing by the server, it counts as abandoned work."""
    import struct

    srv = bad_server("hang")
    inspector = Inspector(ServerConfig("b", srv.url, match="badserver"))
    conn = socket.create_connection(("127.0.0.1", srv.port))
    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
    until(lambda: inspector.sample().live == 1, 10, "the request seen live")
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()  # a reset, as a balancer's abort sends
    seen = until(lambda: (s := inspector.sample()).abandoned == 1 and s, 10, "the departure")
    (left,) = seen.clients
    assert left.departed and left.status == "abandoned" and left.received
    assert seen.live == 0 and inspector.gave_up == 1
    again = inspector.sample()  # still held: the server sent no one anything since
    assert again.abandoned == 1 and inspector.gave_up == 1


def test_a_request_reset_before_any_look_is_counted_from_the_socket_the_server_holds(
    bad_server: Callable[..., Running],
) -> None:
    """A request that lives a second is often reset between two looks: never seen live. The
    server still holds its socket, which no kernel table lists (Linux), until its handler ends:
    that is the count of requests it works on for nobody."""
    import struct
    import sys

    if sys.platform != "linux":
        pytest.skip("read from /proc")
    srv = bad_server("hang")
    inspector = Inspector(ServerConfig("b", srv.url, match="badserver"))
    assert inspector.sample().abandoned == 0
    conn = socket.create_connection(("127.0.0.1", srv.port))
    conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
    until(lambda: _held(srv.proc.pid, srv.port), 10, "the server to hold the connection")
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()
    seen = until(lambda: (s := inspector.sample()).abandoned == 1 and s, 10, "the reset")
    (left,) = seen.clients
    assert left.departed and left.received is None and inspector.gave_up == 1
    assert inspector.sample().abandoned == 1 and inspector.gave_up == 1  # counted once
