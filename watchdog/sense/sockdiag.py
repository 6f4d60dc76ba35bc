"""Linux's socket table for one port, asked of the kernel (NETLINK_SOCK_DIAG, as `ss` does).

psutil reads /proc/net/tcp and tcp6 whole for every look: each socket of the machine, TIME_WAITs
included, parsed in Python. On a busy machine that was most of a probe's CPU. The kernel can
filter instead: a dump of the TCP sockets whose local (or remote) port is the server's, with
their state, addresses and inode, TIME_WAIT left out. A socket's inode is 0 once no process
holds it (an orphan the kernel finishes closing), so "owned by a process" needs no scan.

Each socket comes with the bytes it has received (tcp_info's `tcpi_bytes_received`, asked
with INET_DIAG_INFO): on the server's side of a client's connection, the size of what the
client sent, its request. A client that resends the same prompt sends about as many bytes.

Anything unexpected (not Linux, a kernel or sandbox that refuses) raises `Unavailable`, and the
caller reads psutil's table as before.
"""

from __future__ import annotations

import os
import socket
import struct
import sys
from collections.abc import Iterable
from dataclasses import dataclass

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST, NLM_F_DUMP = 0x1, 0x300
NLMSG_ERROR, NLMSG_DONE = 2, 3
INET_DIAG_REQ_BYTECODE = 1
INET_DIAG_INFO = 2  # an answer's attribute: struct tcp_info
INFO_EXT = 1 << (INET_DIAG_INFO - 1)  # the request's ext bit for it
# struct tcp_info (include/uapi/linux/tcp.h): tcpi_last_data_sent (ms) at 44,
# tcpi_last_data_recv (ms) at 52, tcpi_bytes_acked (u64, since Linux 4.1) at 120 and
# tcpi_bytes_received (u64, since Linux 4.1) at 128.
_LAST_RECV = struct.Struct("=I")
_LAST_SENT_AT = 44
_LAST_RECV_AT = 52
_RECEIVED = struct.Struct("=Q")
_ACKED_AT = 120
_RECEIVED_AT = 128
_ATTR = struct.Struct("=HH")  # rtattr: len, type
BC_S_GE, BC_S_LE, BC_D_GE, BC_D_LE = 2, 3, 4, 5
MAX_BYTES = 8 << 20  # the answer's cap: a port with more sockets than this is not a server's

# The kernel's TCP states (include/net/tcp_states.h), as psutil names them.
TCP_STATES = {
    1: "ESTABLISHED",
    2: "SYN_SENT",
    3: "SYN_RECV",
    4: "FIN_WAIT1",
    5: "FIN_WAIT2",
    6: "TIME_WAIT",
    7: "CLOSE",
    8: "CLOSE_WAIT",
    9: "LAST_ACK",
    10: "LISTEN",
    11: "CLOSING",
}
WANTED = sum(1 << s for s in TCP_STATES if TCP_STATES[s] != "TIME_WAIT")  # no owner, never a client

_HEADER = struct.Struct("=IHHII")  # nlmsghdr: len, type, flags, seq, pid
_REQUEST = struct.Struct("=BBBBI")  # family, protocol, ext, pad, states; then the 48-byte id
_MESSAGE = struct.Struct("=BBBB")  # family, state, timer, retrans; then the id
_ID = struct.Struct(">HH16s16s")  # sport, dport, src, dst (network order); if, cookie follow
_TAIL = struct.Struct("=IIIII")  # expires, rqueue, wqueue, uid, inode


class Unavailable(Exception):
    """The kernel's socket diagnostics cannot be used here: read psutil's table instead."""


@dataclass(frozen=True)
class SocketAddress:
    """An (ip, port) pair as psutil's connections carry it."""

    ip: str
    port: int


@dataclass(frozen=True)
class Socket:
    """One TCP socket, in the shape the inspector reads from psutil's connections."""

    family: int
    status: str
    laddr: SocketAddress
    raddr: SocketAddress | None
    inode: int
    received: int | None = None  # bytes received on it (its peer's request, for a server)
    quiet_ms: int | None = None  # since it last received data
    acked: int | None = None  # bytes sent on it that its peer acknowledged (a server's answer)
    sent_quiet_ms: int | None = None  # since it last sent data


def _port_filter(port: int, *, local: bool) -> bytes:
    """Bytecode for "the local (or remote) port is `port`": >= and <= it. A false test jumps
    past the end, which rejects; the last true one lands on the end, which accepts."""
    ge, le = (BC_S_GE, BC_S_LE) if local else (BC_D_GE, BC_D_LE)
    return struct.pack("=BBHBBH", ge, 8, 20, 0, 0, port) + struct.pack(
        "=BBHBBH", le, 8, 12, 0, 0, port
    )


def _request(family: int, port: int, local: bool, seq: int) -> bytes:
    code = _port_filter(port, local=local)
    attribute = struct.pack("=HH", 4 + len(code), INET_DIAG_REQ_BYTECODE) + code
    body = _REQUEST.pack(family, socket.IPPROTO_TCP, INFO_EXT, 0, WANTED) + bytes(48) + attribute
    return (
        _HEADER.pack(
            _HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST | NLM_F_DUMP, seq, 0
        )
        + body
    )


def _ip(family: int, raw: bytes) -> str:
    return socket.inet_ntop(family, raw[:4] if family == socket.AF_INET else raw)


def parse(data: bytes, seq: int) -> tuple[list[Socket], bool]:
    """The sockets in one read of the answer, and whether the dump is done."""
    found: list[Socket] = []
    offset = 0
    while offset + _HEADER.size <= len(data):
        length, kind, _, got_seq, _ = _HEADER.unpack_from(data, offset)
        if length < _HEADER.size or offset + length > len(data):
            raise Unavailable(f"a malformed netlink message ({length} bytes)")
        start, end = offset + _HEADER.size, offset + length
        offset += (length + 3) & ~3
        if got_seq != seq:
            continue
        if kind == NLMSG_DONE:
            return found, True
        if kind == NLMSG_ERROR:
            (code,) = struct.unpack_from("=i", data, start)
            raise Unavailable(f"the kernel refused: {os.strerror(-code) if code else 'error'}")
        if kind != SOCK_DIAG_BY_FAMILY or length < _HEADER.size + 72:
            continue
        family, state, _, _ = _MESSAGE.unpack_from(data, start)
        sport, dport, src, dst = _ID.unpack_from(data, start + 4)
        inode = _TAIL.unpack_from(data, start + 52)[4]
        if family not in (socket.AF_INET, socket.AF_INET6) or state not in TCP_STATES:
            continue
        remote = SocketAddress(_ip(family, dst), dport) if dport else None
        info = _info(data, start + 72, end)
        local = SocketAddress(_ip(family, src), sport)
        found.append(Socket(family, TCP_STATES[state], local, remote, inode, *info))
    return found, False


Info = tuple[int | None, int | None, int | None, int | None]
NO_INFO: Info = (None, None, None, None)


def _info(data: bytes, at: int, end: int) -> Info:
    """The bytes received and ms since the last, the bytes sent and acknowledged and ms since
    the last sent, from a message's INET_DIAG_INFO attribute (None where the kernel sent none,
    or one too short to hold them)."""
    while at + _ATTR.size <= end:
        size, kind = _ATTR.unpack_from(data, at)
        if size < _ATTR.size or at + size > end:
            return NO_INFO
        if kind == INET_DIAG_INFO:
            info = data[at + _ATTR.size : at + size]
            return (
                _field(info, _RECEIVED_AT, _RECEIVED),
                _field(info, _LAST_RECV_AT, _LAST_RECV),
                _field(info, _ACKED_AT, _RECEIVED),
                _field(info, _LAST_SENT_AT, _LAST_RECV),
            )
        at += (size + 3) & ~3
    return NO_INFO


def _field(info: bytes, offset: int, shape: struct.Struct) -> int | None:
    """One field of a struct tcp_info; None where an older kernel's is too short for it."""
    if len(info) < offset + shape.size:
        return None
    return int(shape.unpack_from(info, offset)[0])


def sockets(port: int, families: Iterable[int], *, local: bool = True) -> list[Socket]:
    """TCP sockets (TIME_WAIT left out) whose local port is `port` (`local`), or whose remote
    port is (the clients' side of their connections)."""
    if not sys.platform.startswith("linux"):
        raise Unavailable("not Linux")
    found: list[Socket] = []
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(2.0)
            for seq, family in enumerate(families, start=1):
                nl.sendall(_request(family, port, local, seq))
                total, done = 0, False
                while not done:
                    data = nl.recv(1 << 16)
                    total += len(data)
                    if not data or total > MAX_BYTES:
                        raise Unavailable(f"the answer for port {port} ended or grew too big")
                    more, done = parse(data, seq)
                    found += more
    except (OSError, struct.error) as exc:
        raise Unavailable(f"socket diagnostics: {exc}") from exc
    return found


def owned_inodes(pid: int) -> set[int]:
    """The inodes of the sockets process `pid` holds (its /proc/PID/fd links)."""
    folder = f"/proc/{pid}/fd"
    inodes: set[int] = set()
    for fd in os.listdir(folder):
        try:
            target = os.readlink(f"{folder}/{fd}")
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


# Every socket a process can hold is listed in one of these, but a TCP connection reset (or
# closed) under a process that keeps its descriptor: the kernel unhashes it from every table.
LISTED = (
    "tcp",
    "tcp6",
    "udp",
    "udp6",
    "udplite",
    "udplite6",
    "raw",
    "raw6",
    "icmp",
    "icmp6",
    "unix",
    "netlink",
    "packet",
)
TABLE_MAX = 8 << 20  # bytes of each table read at most


def held_closed(owned: set[int]) -> set[int] | None:
    """Which of these socket inodes (a process's) no table lists: connections closed or reset
    under the process while it still holds them (a server whose handler works on a request
    whose client is gone). None when a table cannot be read, or is too large."""
    listed: set[int] = set()
    for name in LISTED:
        try:
            with open(f"/proc/net/{name}", "rb") as fh:
                text = fh.read(TABLE_MAX + 1)
        except FileNotFoundError:
            continue  # a family this kernel does not have
        except OSError:
            return None
        if len(text) > TABLE_MAX:
            return None
        listed |= _inodes(name, text)
    return owned - listed


def _inodes(name: str, text: bytes) -> set[int]:
    """The inode column of one /proc/net table (unix: the 7th field; netlink: the 10th;
    packet: the 9th; the inet tables: the 10th)."""
    column = {"unix": 6, "netlink": 9, "packet": 8}.get(name, 9)
    found: set[int] = set()
    for line in text.splitlines()[1:]:
        fields = line.split()
        if len(fields) > column and fields[column].isdigit():
            found.add(int(fields[column]))
    return found


def holder(inodes: Iterable[int], match: str = "") -> dict[int, int]:
    """The PIDs holding these socket inodes ({inode: pid}), looked for among this machine's
    processes, those whose command line holds `match` first (the server is usually the first
    looked at: psutil's way maps every socket of every process). Processes not ours to read
    are passed over."""
    wanted = set(inodes)
    found: dict[int, int] = {}
    if not wanted:
        return found
    pids = [int(name) for name in os.listdir("/proc") if name.isdigit()]
    if match:
        needle = match.encode()

        def likely(pid: int) -> bool:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    return needle in fh.read(1 << 16).replace(b"\0", b" ")
            except OSError:
                return False

        pids.sort(key=lambda pid: not likely(pid))
    for pid in pids:
        try:
            held = owned_inodes(pid) & wanted
        except OSError:
            continue  # gone, or another user's
        for inode in held:
            found[inode] = pid
        wanted -= held
        if not wanted:
            break
    return found
