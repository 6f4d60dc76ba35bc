"""What the operating system says about the server process and its client connections.

A `CLOSE_WAIT` socket on the server's port is a client that left while the server still owes it
an answer: the fingerprint of abandoned work. `ESTABLISHED` ones are clients still waiting.
Every psutil call goes through `ProcessTable`, so tests and other platforms can swap it.
Bytes per connection come from the kernel's socket diagnostics on Linux (sense/sockdiag.py)
and from `netstat -anv` on macOS (sense/netstat.py); elsewhere they are unknown.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import psutil

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.sense import netstat, platform, sockdiag
from mlx_watchdog.sense.findings import Address, Client, Clock, ProcessSample
from mlx_watchdog.sense.tool import ToolRun, Unreadable

log = logging.getLogger(__name__)
HALF_CLOSED = frozenset({psutil.CONN_FIN_WAIT1, psutil.CONN_FIN_WAIT2})


FAMILIES = {
    "tcp": (socket.AF_INET, socket.AF_INET6),
    "tcp4": (socket.AF_INET,),
    "tcp6": (socket.AF_INET6,),
}


class ProcessTable:
    """The few psutil calls the watchdog makes, and on Linux the kernel's socket table for
    one port (sense/sockdiag.py) in place of psutil's read of every socket."""

    def __init__(self, *, mac: bool | None = None, netstat_run: ToolRun | None = None) -> None:
        self.mac = platform.is_mac() if mac is None else mac
        # Until the kernel's socket diagnostics fail once: psutil then on (never on a Mac).
        self.diag = not self.mac
        self._resolved: dict[str, frozenset[str]] = {}
        self.netstat_run = netstat_run
        self.moved = netstat.Mover()
        self.bytes_problem = ""  # why bytes per connection cannot be read ("": they can)
        self.mono: Clock = time.monotonic
        self.owned: set[int] | None = None  # the socket inodes the last process read holds

    def connections(self, proc: psutil.Process, port: int, kind: str) -> list[Any]:
        """The process's TCP sockets of that kind: at least those on `port` (all of them,
        from psutil, where the kernel cannot be asked for one port)."""
        if self.diag:
            try:
                on_port = sockdiag.sockets(port, FAMILIES[kind])
                owned = self.owned = sockdiag.owned_inodes(proc.pid)
                return [c for c in on_port if c.inode in owned]
            except FileNotFoundError:
                raise psutil.NoSuchProcess(proc.pid) from None
            except PermissionError:
                raise psutil.AccessDenied(proc.pid) from None
            except sockdiag.Unavailable as exc:
                log.info("reading sockets through psutil: %s", exc)
                self.diag = False
        conns = list(proc.net_connections(kind))
        return self._with_bytes(conns, port) if self.mac else conns

    def held_closed(self) -> set[int] | None:
        """The connections the process last read holds that are closed or reset under it
        (Linux: sockets no kernel table lists, by inode); None where that cannot be read."""
        if not self.diag or self.owned is None:
            return None
        return sockdiag.held_closed(self.owned)

    def _with_bytes(self, conns: list[Any], port: int) -> list[Any]:
        """The connections on `port` with their byte counts from netstat (macOS), read only
        when a client is connected; where netstat fails they stay unknown (said once)."""
        if not any(c.raddr and c.laddr and c.laddr.port == port for c in conns):
            return conns
        try:
            rows = netstat.read(self.netstat_run)
        except Unreadable as exc:
            if str(exc) != self.bytes_problem:
                log.warning("bytes per connection cannot be read: %s", exc)
            self.bytes_problem = str(exc)
            return conns
        self.bytes_problem = ""
        now = self.mono()
        by_ends = {
            (_normal(r.local), _normal(r.remote)): r
            for r in rows
            if r.remote is not None and r.local[1] == port
        }
        self.moved.keep(set(by_ends), port)
        out: list[Any] = []
        for c in conns:
            row = by_ends.get(_ends(c)) if c.raddr and c.laddr else None
            if row is None or row.rx is None:
                out.append(c)
                continue
            rx_quiet, tx_quiet = self.moved.quiet(row, now)
            out.append(
                sockdiag.Socket(
                    c.family,
                    c.status,
                    sockdiag.SocketAddress(c.laddr.ip, c.laddr.port),
                    sockdiag.SocketAddress(c.raddr.ip, c.raddr.port),
                    0,
                    received=row.rx,
                    quiet_ms=rx_quiet,
                    acked=row.tx,
                    sent_quiet_ms=tx_quiet,
                )
            )
        return out

    def listener(self, port: int, host: str | None = None, match: str = "") -> int | None:
        """PID of the process listening on `port` at an address that serves `host` (the one
        the server's URL names: that very address first, then a wildcard), among those this
        user may inspect. A port alone is not the server: an `ssh -L` forward binds [::1]:P
        beside a server on 127.0.0.1:P. `match` names where to look first."""
        ips = self.addresses(host) if host else None
        if self.diag:
            try:
                return self._listener_from_kernel(port, ips, match)
            except (sockdiag.Unavailable, OSError) as exc:
                log.info("finding listeners through psutil: %s", exc)
                self.diag = False
        found: list[tuple[int, int]] = []  # (rank, PID): an exact address before a wildcard
        try:
            for sconn in psutil.net_connections("tcp"):
                if sconn.pid is not None and (rank := _serves(sconn, port, ips)):
                    found.append((rank, int(sconn.pid)))
        except psutil.AccessDenied:
            # macOS allows the system-wide list to root only: look process by process
            for pid, conns in _own_connections():
                found += [(rank, pid) for c in conns if (rank := _serves(c, port, ips))]
        return min(found)[1] if found else None

    def _listener_from_kernel(
        self, port: int, ips: frozenset[str] | None, match: str
    ) -> int | None:
        """The listening sockets on the port from the kernel (sock_diag), their holder from
        the processes' fd tables, the likely one first: psutil parses every socket of the
        machine and maps every process's, which 100 servers' first looks at once took seconds
        each to do."""
        ranked = sorted(
            (rank, s.inode)
            for s in sockdiag.sockets(port, FAMILIES["tcp"])
            if s.inode and (rank := _serves(s, port, ips))
        )
        if not ranked:
            return None
        holders = sockdiag.holder([inode for _, inode in ranked], match)
        return next((holders[inode] for _, inode in ranked if inode in holders), None)

    def addresses(self, host: str) -> frozenset[str] | None:
        """The addresses `host` names (None where it cannot be resolved: the port decides)."""
        if host not in self._resolved:
            try:
                infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
                self._resolved[host] = frozenset(_normal_ip(str(i[4][0])) for i in infos)
            except (OSError, UnicodeError):
                self._resolved[host] = frozenset()
        return self._resolved[host] or None

    def half_closed(self, clients: dict[Address, Address], port: int) -> set[Address]:
        """Of these clients on this machine of the server on `port` (each with the server's
        address it is connected to), those that shut down only their sending side and still
        wait for the answer: their socket to that very address is in FIN_WAIT1 or 2 (its FIN
        sent, acked or not yet) and a process still holds it. A client that closed leaves its
        socket to the kernel (no owner), or none at all; one to another address on the same
        port (another listener) says nothing of this one."""
        if not clients:
            return set()
        owned: list[Any] = []
        if self.diag:
            try:
                owned = [c for c in sockdiag.sockets(port, FAMILIES["tcp"], local=False) if c.inode]
            except sockdiag.Unavailable as exc:
                log.info("reading sockets through psutil: %s", exc)
                self.diag = False
        if not self.diag:
            try:
                owned = [c for c in psutil.net_connections("tcp") if c.pid is not None]
            except psutil.AccessDenied:  # macOS: only root lists every socket
                owned = [c for _, conns in _own_connections() for c in conns]
        return {
            addr
            for c in owned
            if c.status in HALF_CLOSED
            and c.laddr
            and c.raddr
            and (addr := _normal((c.laddr.ip, c.laddr.port))) in clients
            and _normal((c.raddr.ip, c.raddr.port)) == clients[addr]
        }

    def process(self, pid: int) -> psutil.Process:
        return psutil.Process(pid)


def _own_connections() -> Iterable[tuple[int, list[Any]]]:
    """Each process of this user with its TCP sockets."""
    uid = os.getuid()
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            yield int(proc.pid), proc.net_connections("tcp")
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue


def _listens(conn: Any, port: int, ips: frozenset[str] | None = None) -> bool:
    return _serves(conn, port, ips) > 0


def _serves(conn: Any, port: int, ips: frozenset[str] | None) -> int:
    """1 when `conn` listens on `port` at one of `ips` (or `ips` is unknown), 2 at a wildcard
    address that takes them, 0 otherwise."""
    if not (conn.status == psutil.CONN_LISTEN and conn.laddr and conn.laddr.port == port):
        return 0
    if ips is None:
        return 1
    ip = _normal_ip(conn.laddr.ip)
    if ip in ips:
        return 1
    if ip == "::" or (ip == "0.0.0.0" and any(":" not in a for a in ips)):
        return 2
    return 0


def _normal_ip(ip: str) -> str:
    return ip.removeprefix("::ffff:").split("%", 1)[0]


def is_local_host(host: str) -> bool:
    """This machine, by its name, an address of its own, or a name that resolves to one."""
    if is_local_address(host):
        return True
    try:
        ipaddress.ip_address(host)
        return False  # an address, not this machine's
    except ValueError:
        pass
    try:
        return is_local_address(socket.gethostbyname(host))
    except OSError:
        return False


def is_local_address(host: str) -> bool:
    """This machine, told without a DNS query: localhost, its name, or an address of its own."""
    if host in ("localhost", socket.gethostname()):
        return True
    try:
        ip = ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return False
    if ip.is_loopback or ip.is_unspecified:
        return True
    return str(ip) in local_addresses()


def local_addresses() -> set[str]:
    """This machine's interface addresses (loopback's among them)."""
    return {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}


def _normal(addr: Address) -> Address:
    ip, port = addr[0], addr[1]
    return (_normal_ip(ip), int(port))


def _ends(conn: Any) -> tuple[Address, Address]:
    return (_normal((conn.laddr.ip, conn.laddr.port)), _normal((conn.raddr.ip, conn.raddr.port)))


DEPARTED_KEEP = 900.0  # s a request reset unanswered is counted as held work at most


class Inspector:
    """Samples one server's process; keeps what must persist between samples.

    psutil measures CPU between two calls on the same Process object, and a connection's
    first-seen time only means something across samples, so one Inspector lives as long as
    the watch on its server.
    """

    def __init__(
        self,
        server: ServerConfig,
        *,
        table: ProcessTable | None = None,
        mono: Clock = time.monotonic,
        wall: Clock = time.time,
    ) -> None:
        self.server = server
        self.table = table or ProcessTable()
        self.mono = mono  # spans: connection ages, the process's age
        self.wall = wall  # what psutil's create_time is read against
        # Behind a path prefix the port is a reverse proxy's: its listener is not the server.
        self.local = is_local_host(server.host) and not server.behind_proxy
        self._proc: psutil.Process | None = None
        self._proc_first = True
        self._clients: dict[Address, Client] = {}
        self._addresses: set[str] | None = None  # this machine's, read at the first need
        self._kind = "tcp"  # the socket tables read: the listener's family once it is known
        self.gave_up = 0  # clients seen leaving (turning abandoned) since this inspector began
        self._closed_before: set[int] = set()  # the sockets held closed at the last look

    def sample(self, pid: int | None = None, exclude: Iterable[Address] = ()) -> ProcessSample:
        """Look at the server now. `pid` comes from a manager; otherwise the port's listener.

        `exclude` holds the watchdog's own probe addresses: neither live nor abandoned.
        """
        if not self.local:
            where = "behind a proxy" if self.server.behind_proxy else "on another machine"
            return ProcessSample(pid=None, local=False, error=f"the server is {where}")
        now = self.mono()
        port = self.server.port
        guessed = pid is None and self._proc is not None
        try:
            if pid is None:
                # The last listener is checked below; a full scan is costly (every socket).
                pid = (
                    self._proc.pid
                    if self._proc is not None
                    else self.table.listener(port, self.server.host, self.server.match)
                )
        except (psutil.Error, OSError) as exc:
            return ProcessSample(pid=None, error=f"cannot list listening sockets: {exc}")
        if pid is None:
            self._proc = None
            self._clients.clear()
            return ProcessSample(pid=None, error=f"no process of this user listens on port {port}")
        try:
            proc = self._process(pid)
            if self._proc_first:
                self._clients = {}  # another process: the last one's clients are not its own
            with proc.oneshot():
                cmdline = tuple(proc.cmdline())
                # psutil gives wall time; ages are spans on `mono`.
                create_time = now - (self.wall() - proc.create_time())
                rss = int(proc.memory_info().rss)
                cpu = proc.cpu_percent(interval=None)
            conns = self.table.connections(proc, port, self._kind)
        except psutil.NoSuchProcess:
            self._proc = None
            if guessed:
                return self.sample(None, exclude)
            return ProcessSample(pid=None, error=f"process {pid} exited")
        except (psutil.AccessDenied, psutil.ZombieProcess) as exc:
            return ProcessSample(pid=pid, error=f"cannot inspect PID {pid}: {type(exc).__name__}")

        ips = self.table.addresses(self.server.host)
        listening = [c for c in conns if _listens(c, port, ips)]
        if self._kind != "tcp" and not listening:
            self._kind = "tcp"  # a listener of the other family now, or another process
            return self.sample(pid if not guessed else None, exclude)
        if guessed and not listening:
            self._proc = None  # no longer the server: scan for the one that listens now
            return self.sample(None, exclude)
        # Its clients come in on its listener's family: on Linux each family's table costs a
        # read of every socket on the machine (TIME_WAITs included), so only one is read.
        families = {c.family for c in listening}
        if families == {socket.AF_INET}:
            self._kind = "tcp4"
        elif families == {socket.AF_INET6}:
            self._kind = "tcp6"
        seen = self._clients_of(conns, port, exclude, now)
        self._reset_under(seen, now)
        self._clients = seen
        clients = tuple(sorted(seen.values(), key=lambda c: c.first_seen))
        return ProcessSample(
            pid=pid,
            create_time=create_time,
            cmdline=cmdline,
            matches=self.server.match in " ".join(cmdline),
            cpu_percent=None if self._proc_first else cpu,
            rss_bytes=rss,
            abandoned=sum(c.status == "abandoned" for c in clients),
            live=sum(c.status == "live" for c in clients),
            clients=clients,
        )

    def _clients_of(
        self, conns: Iterable[Any], port: int, exclude: Iterable[Address], now: float
    ) -> dict[Address, Client]:
        """The clients on the server's port, each first seen as before; a connection newly in
        CLOSE_WAIT is a client that gave up (counted once). Where the kernel counts a
        connection's bytes, one that has sent none asked for nothing: it is no client, live or
        gone (an idle socket would keep a wedged server "busy" to max_busy)."""
        skip = {_normal(a) for a in exclude}
        seen: dict[Address, Client] = {}
        here = {
            client: _normal((c.laddr.ip, c.laddr.port))
            for c in conns
            if c.raddr
            and c.laddr
            and c.status == psutil.CONN_CLOSE_WAIT
            and self._on_this_machine(c.raddr.ip)
            and (client := _normal((c.raddr.ip, c.raddr.port))) not in skip
        }
        waiting = self.table.half_closed(here, port)
        for conn in conns:
            if not conn.raddr or conn.laddr.port != port:
                continue
            addr = _normal((conn.raddr.ip, conn.raddr.port))
            if addr in skip:
                continue
            if conn.status == psutil.CONN_CLOSE_WAIT and addr not in waiting:
                status = "abandoned"
            elif conn.status == psutil.CONN_CLOSE_WAIT:
                status = "live"  # it half-closed after sending: it still reads
            elif conn.status == psutil.CONN_ESTABLISHED:
                status = "live"
            else:
                continue
            if getattr(conn, "received", None) == 0:
                continue  # it asked nothing yet (a socket held open, a TCP check): no client
            before = self._clients.get(addr)
            first_seen = before.first_seen if before else now
            since = (
                (before.abandoned_since if before and before.abandoned_since else now)
                if status == "abandoned"
                else None
            )
            received, quiet = getattr(conn, "received", None), getattr(conn, "quiet_ms", None)
            sent_at = before.sent_at if before and before.received == received else None
            if sent_at is None and quiet is not None:
                sent_at = now - quiet / 1000.0
            answered, sent_quiet = (
                getattr(conn, "acked", None),
                getattr(conn, "sent_quiet_ms", None),
            )
            answered_at = now - sent_quiet / 1000.0 if answered and sent_quiet is not None else None
            seen[addr] = Client(
                addr, status, first_seen, since, received, sent_at, answered, answered_at
            )
            if status == "abandoned" and (before is None or before.status != "abandoned"):
                self.gave_up += 1
        # When the server last sent any connection data, the watchdog's own probe's included.
        answered = [
            now - quiet / 1000.0
            for conn in conns
            if getattr(conn, "acked", None)
            and (quiet := getattr(conn, "sent_quiet_ms", None)) is not None
        ]
        for left in self._departed(seen, answered, now):
            seen[left.address] = left
        return seen

    def _reset_under(self, seen: dict[Address, Client], now: float) -> None:
        """What the kernel says of requests whose connections were reset under the server
        (Linux): it still holds their sockets, which no table lists, until its handler ends.
        As many departed requests as it holds are kept (the oldest go first when it holds
        fewer: their work ended); those never seen live are added, their sizes unknown."""
        closed = self.table.held_closed()
        if closed is None:
            return
        # Held across two looks: a server that writes to a client gone (its own abandoned
        # request ending, a probe's left request) gets a reset back and closes its socket at
        # the next write, milliseconds later; a request reset under it mid-prefill stays.
        held = len(closed & self._closed_before)
        self._closed_before = closed
        departed = sorted((c for c in seen.values() if c.departed), key=lambda c: c.sent)
        for gone in departed[: max(0, len(departed) - len(closed))]:
            del seen[gone.address]
        kept = min(len(departed), len(closed))
        known = [c for c in self._clients.values() if c.departed and c.received is None]
        for i in range(max(0, held - kept)):
            before = known[i] if i < len(known) else None
            at = before.first_seen if before else now
            if before is None:
                self.gave_up += 1
            addr = before.address if before else ("reset", int(now * 1000) + i)
            seen[addr] = Client(addr, "abandoned", at, at, departed=True)

    def _departed(
        self, seen: dict[Address, Client], answered: list[float], now: float
    ) -> list[Client]:
        """Requests whose connections are gone though the server sent them nothing: reset
        under it (a balancer's abort, HAProxy's `option abortonclose`), so they never show as
        CLOSE_WAIT, while the server still has the work. Each counts as abandoned until the
        server sends a byte to a connection after it left (it got past that work), or for
        DEPARTED_KEEP at most."""
        kept = []
        for addr, c in self._clients.items():
            if addr in seen or not c.received:
                continue
            if not c.departed and (c.status != "live" or c.answered != 0):
                continue  # answered, or seen leaving already: its work is done or counted
            since = c.abandoned_since if c.departed and c.abandoned_since else now
            if now - since > DEPARTED_KEEP or any(at > since for at in answered):
                continue
            if not c.departed:
                self.gave_up += 1
            kept.append(replace(c, status="abandoned", abandoned_since=since, departed=True))
        return kept

    def _on_this_machine(self, ip: str) -> bool:
        if self._addresses is None:
            try:
                self._addresses = local_addresses()
            except OSError:
                self._addresses = set()
        ip = ip.removeprefix("::ffff:")
        return ip.startswith("127.") or ip == "::1" or ip in self._addresses

    def _process(self, pid: int) -> psutil.Process:
        # A new Process object's first cpu_percent() is meaningless; remember whether it is.
        if self._proc is None or self._proc.pid != pid:
            self._proc = self.table.process(pid)
            self._proc_first = True
        else:
            self._proc_first = False
        return self._proc
