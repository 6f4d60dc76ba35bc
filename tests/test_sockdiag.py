"""The kernel's socket table for one port (Linux): the same sockets psutil finds, a fraction
of the cost, and psutil again whenever the kernel cannot be asked."""

from __future__ import annotations

import os
import socket
import struct
import sys
from collections.abc import Iterator

import psutil
import pytest

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.sense import sockdiag
from mlx_watchdog.sense.process import Inspector, ProcessTable
from tests.conftest import until

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="netlink is Linux's")


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen()
    yield srv
    srv.close()


def seen_by_psutil(port: int) -> list[tuple[str, int, int | None]]:
    return sorted(
        (c.status, c.laddr.port, c.raddr.port if c.raddr else None)
        for c in psutil.Process().net_connections("tcp4")
        if c.laddr.port == port
    )


@linux
def test_the_kernel_lists_the_ports_sockets_as_psutil_does(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    served = socket.create_connection(("127.0.0.1", port))
    a, _ = listener.accept()
    left = socket.create_connection(("127.0.0.1", port))
    b, _ = listener.accept()
    left_port = left.getsockname()[1]
    left.close()  # the client gave up: the server's end waits in CLOSE_WAIT
    until(lambda: ("CLOSE_WAIT", port, left_port) in seen_by_psutil(port), 5, "CLOSE_WAIT")
    mine = sockdiag.sockets(port, [socket.AF_INET])
    owned = sockdiag.owned_inodes(os.getpid())
    ours = sorted(
        (s.status, s.laddr.port, s.raddr.port if s.raddr else None)
        for s in mine
        if s.inode in owned
    )
    assert ours == seen_by_psutil(port)
    assert {s.status for s in mine} >= {"LISTEN", "ESTABLISHED", "CLOSE_WAIT"}
    for s in (served, a, b):
        s.close()


def _tcp_info_received(sock: socket.socket) -> int:
    """The kernel's own count for one socket, through getsockopt(TCP_INFO)."""
    info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    return int(struct.unpack_from("=Q", info, 128)[0])


@linux
def test_each_socket_says_how_many_bytes_its_peer_sent(listener: socket.socket) -> None:
    """A request's size, read on the server's side: the same for the same request sent again,
    as the kernel counts it for that socket, on a live connection and one whose client left."""
    port = listener.getsockname()[1]
    sizes = {}
    clients, ends = [], []
    for n in (70_001, 70_001, 1_234):
        c = socket.create_connection(("127.0.0.1", port))
        a, _ = listener.accept()
        c.sendall(b"x" * n)
        got = 0
        while got < n:
            got += len(a.recv(1 << 20))
        clients.append(c)
        ends.append(a)
        sizes[c.getsockname()[1]] = n
    clients[0].close()  # the first client gave up: its request stays counted in CLOSE_WAIT
    until(
        lambda: any(s.status == "CLOSE_WAIT" for s in sockdiag.sockets(port, [socket.AF_INET])),
        5,
        "CLOSE_WAIT",
    )
    found = {
        s.raddr.port: s for s in sockdiag.sockets(port, [socket.AF_INET]) if s.raddr is not None
    }
    for end in ends[1:]:
        peer = end.getpeername()[1]
        assert found[peer].received == _tcp_info_received(end) == sizes[peer]
    first = found[ends[0].getpeername()[1]]
    assert first.status == "CLOSE_WAIT"
    assert first.received is not None and 70_001 <= first.received <= 70_002  # its FIN counts
    assert all(s.quiet_ms is not None and s.quiet_ms < 60_000 for s in found.values())
    for s in (*clients[1:], *ends):
        s.close()


@linux
def test_a_half_closed_client_is_owned_and_an_orphan_is_not(listener: socket.socket) -> None:
    """The clients' side, by remote port: a client that shut down its sending side still
    holds its socket (FIN_WAIT2, an inode); one that closed leaves an orphan (inode 0)."""
    port = listener.getsockname()[1]
    waiting = socket.create_connection(("127.0.0.1", port))
    a, _ = listener.accept()
    waiting.shutdown(socket.SHUT_WR)
    gone = socket.create_connection(("127.0.0.1", port))
    b, _ = listener.accept()
    gone_addr = gone.getsockname()
    gone.close()
    until(
        lambda: any(
            s.laddr.port == gone_addr[1] and s.status == "FIN_WAIT2"
            for s in sockdiag.sockets(port, [socket.AF_INET], local=False)
        ),
        5,
        "the orphan in FIN_WAIT2",
    )
    server = ("127.0.0.1", port)
    clients = {("127.0.0.1", waiting.getsockname()[1]): server, ("127.0.0.1", gone_addr[1]): server}
    assert ProcessTable().half_closed(clients, port) == {("127.0.0.1", waiting.getsockname()[1])}
    # The same client address seen connected to another listener's address says nothing here.
    elsewhere = {("127.0.0.1", waiting.getsockname()[1]): ("127.0.0.2", port)}
    assert ProcessTable().half_closed(elsewhere, port) == set()
    for s in (waiting, a, b):
        s.close()


@pytest.mark.parametrize(
    "data",
    [
        b"\x05\x00\x00\x00",  # shorter than a header
        struct.pack("=IHHII", 9999, 20, 0, 1, 0),  # a length past the end
        struct.pack("=IHHII", 20, 2, 0, 1, 0) + struct.pack("=i", -13),  # the kernel refused
    ],
    ids=["short", "too-long", "refused"],
)
def test_a_malformed_or_refused_answer_is_unavailable_never_a_crash(data: bytes) -> None:
    try:
        found, done = sockdiag.parse(data, 1)
    except sockdiag.Unavailable as exc:
        assert "netlink" in str(exc) or "refused" in str(exc)
    else:
        assert found == [] and done is False


def _diag_message(attributes: bytes) -> bytes:
    """One well-formed socket answer (127.0.0.1:8080 <- :5000, CLOSE_WAIT, inode 7) with
    `attributes` after it, as the kernel appends INET_DIAG_INFO."""
    addr = socket.inet_aton("127.0.0.1") + bytes(12)
    body = (
        struct.pack("=BBBB", socket.AF_INET, 8, 0, 0)
        + struct.pack(">HH16s16s", 8080, 5000, addr, addr)
        + bytes(12)  # interface, cookie
        + struct.pack("=IIIII", 0, 0, 0, 0, 7)
        + attributes
    )
    return struct.pack("=IHHII", 16 + len(body), 20, 0, 1, 0) + body


@pytest.mark.parametrize(
    ("attributes", "received"),
    [
        (b"", None),  # no INET_DIAG_INFO: an older kernel
        (struct.pack("=HH", 4 + 60, 2) + bytes(60), None),  # too short to hold the count
        (struct.pack("=HH", 9999, 2) + bytes(200), None),  # a length past the message
        (struct.pack("=HH", 2, 2), None),  # a length shorter than its own header
        (struct.pack("=HH", 4 + 136, 2) + bytes(128) + struct.pack("=Q", 4242), 4242),
    ],
    ids=["none", "short", "too-long", "tiny", "whole"],
)
def test_a_sockets_byte_count_is_read_only_where_whole(attributes: bytes, received: int) -> None:
    (found,), done = sockdiag.parse(_diag_message(attributes), 1)
    assert not done and found.status == "CLOSE_WAIT" and found.inode == 7
    assert found.received == received


def test_where_the_kernel_cannot_be_asked_psutil_is_read(
    listener: socket.socket, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refused(*_: object, **__: object) -> list[sockdiag.Socket]:
        raise sockdiag.Unavailable("refused here")

    monkeypatch.setattr(sockdiag, "sockets", refused)
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    a, _ = listener.accept()
    table = ProcessTable()
    server = ServerConfig("s", f"http://127.0.0.1:{port}", match="python")
    sample = Inspector(server, table=table).sample(pid=os.getpid())
    assert table.diag is False and sample.live == 1 and sample.abandoned == 0
    client.close()
    until(lambda: Inspector(server, table=table).sample(pid=os.getpid()).abandoned == 1, 5, "gone")
    a.close()


@linux
def test_each_socket_says_how_much_the_server_sent_on_it_and_when(listener: socket.socket) -> None:
    """What the server answered on each connection, acknowledged by its peer, as the kernel
    counts it (getsockopt(TCP_INFO) on the same socket): a streamed answer grows, a waiting
    request has had nothing."""
    port = listener.getsockname()[1]
    fed = socket.create_connection(("127.0.0.1", port))
    a, _ = listener.accept()
    starved = socket.create_connection(("127.0.0.1", port))
    b, _ = listener.accept()
    a.sendall(b"y" * 5_000)
    got = 0
    while got < 5_000:
        got += len(fed.recv(1 << 20))

    def by_peer() -> dict[int, sockdiag.Socket]:
        return {
            s.raddr.port: s for s in sockdiag.sockets(port, [socket.AF_INET]) if s.raddr is not None
        }

    until(lambda: by_peer()[fed.getsockname()[1]].acked == 5_000, 5, "the answer acknowledged")
    found = by_peer()
    info = a.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    assert found[fed.getsockname()[1]].acked == struct.unpack_from("=Q", info, 120)[0] == 5_000
    assert found[starved.getsockname()[1]].acked == 0
    sent_quiet = found[fed.getsockname()[1]].sent_quiet_ms
    assert sent_quiet is not None and sent_quiet < 60_000
    for s in (fed, starved, a, b):
        s.close()


def test_a_proc_net_table_of_garbage_gives_no_inode_and_no_crash() -> None:
    """The tables held_closed reads are the kernel's, but are read within bounds and by
    column: a line cut short, text where a number is, or binary gives no inode."""
    from mlx_watchdog.sense.sockdiag import _inodes

    good = b"  sl  local rem st q tr rt uid timeout inode\n   0: a b 01 q t r 0 0 4242 1 x\n"
    assert _inodes("tcp", good) == {4242}
    hostile = (
        b"header\n0: a b\n\xff\xfe\x00 garbage\n1: a b c d e f g h -7\n2: a b c d e f g h x9\n"
    )
    assert _inodes("tcp", hostile) == set()
    assert _inodes("unix", b"Num Ref\n0000: 00000002 0 0 0001 01 777 /run/x\n") == {777}
