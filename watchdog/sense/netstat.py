"""Bytes per TCP connection on macOS, without root: `netstat -anv -p tcp` prints, for every
connection, its cumulative `rxbytes`/`txbytes` and its owner (network_cmds `main.c`; the
kernel filters nothing for a user). psutil gives no byte counts there. There is no "time since
the last data" either: it is the time since a count last moved between two looks (`Mover`).

Three layouts were seen (shared/macos/, network_cmds at the commits SOURCES.md names): macOS 14
has no byte columns; 15 prints `rxbytes txbytes rhiwat shiwat pid epid`; 26 prints `rxbytes
txbytes rhiwat shiwat process:pid`, the process name right-aligned in 16 characters and free
to hold spaces. So a row is never split past `shiwat` from the left: the first six fields come
from the left, the last eight from the right, and the header's tokens say what lies between.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_watchdog.sense.tool import ToolRun, Unreadable, answer, bounded

NETSTAT = ("netstat", "-anv", "-p", "tcp")
NETSTAT_TIMEOUT = 2.0
NETSTAT_CAP = 8 << 20  # bytes: tens of thousands of connections, well under this
ROWS_MAX = 100_000
LEFT, RIGHT = 6, 8  # Proto Recv-Q Send-Q Local Foreign (state) | state ... fltrs
TCP_NAMES = {  # netstat's names, as psutil names them
    "ESTABLISHED": "ESTABLISHED",
    "CLOSE_WAIT": "CLOSE_WAIT",
    "FIN_WAIT_1": "FIN_WAIT1",
    "FIN_WAIT_2": "FIN_WAIT2",
    "LISTEN": "LISTEN",
    "SYN_SENT": "SYN_SENT",
    "SYN_RECEIVED": "SYN_RECV",
    "LAST_ACK": "LAST_ACK",
    "CLOSING": "CLOSING",
    "TIME_WAIT": "TIME_WAIT",
    "CLOSED": "CLOSE",
}

Endpoint = tuple[str, int]


@dataclass(frozen=True)
class Connection:
    """One TCP connection as netstat prints it."""

    local: Endpoint
    remote: Endpoint | None  # None: not connected (a listener)
    state: str  # psutil's name for it
    rx: int | None  # bytes received so far; None: this macOS prints no byte counts
    tx: int | None
    pid: int | None  # the last process that used it; None where the layout has none


def read(run: ToolRun | None = None) -> list[Connection]:
    """Every TCP connection of the machine, under a deadline and a byte cap."""
    out = answer(list(NETSTAT), run or bounded(NETSTAT_CAP, NETSTAT_TIMEOUT), NETSTAT_CAP)
    return parse(out.decode("utf-8", "replace"))


def parse(text: str) -> list[Connection]:
    """The rows of `netstat -anv -p tcp`; a row that does not fit its header is skipped."""
    lines = text.splitlines()
    head = next((i for i, line in enumerate(lines[:5]) if line.startswith("Proto")), None)
    if head is None:
        raise Unreadable("netstat's answer has no header line (Proto ...)")
    middle = _middle(lines[head].split())
    rows: list[Connection] = []
    for line in lines[head + 1 : head + 1 + ROWS_MAX]:
        row = _row(line.split(), middle)
        if row is not None:
            rows.append(row)
    return rows


def _middle(header: list[str]) -> str:
    """What stands between `(state)` and the last eight columns: "process:pid" (macOS 26),
    "pid epid" (15, with bytes), "no bytes" (14)."""
    if "process:pid" in header:
        return "process:pid"
    if "rxbytes" in header and "pid" in header:
        return "pid epid"
    if "pid" in header:
        return "no bytes"
    raise Unreadable("netstat's header names no owner column (run with -v)")


def _row(fields: list[str], middle: str) -> Connection | None:
    if len(fields) < LEFT + RIGHT + 1 or not fields[0].startswith("tcp"):
        return None
    local, remote = _endpoint(fields[3]), _endpoint(fields[4])
    state = TCP_NAMES.get(fields[5])
    rest = fields[LEFT:-RIGHT]
    if local is None or state is None:
        return None
    try:
        if middle == "process:pid":
            if len(rest) < 5:
                return None
            rx, tx, pid = int(rest[0]), int(rest[1]), int(" ".join(rest[4:]).rsplit(":", 1)[1])
        elif middle == "pid epid":
            if len(rest) != 6:
                return None
            rx, tx, pid = int(rest[0]), int(rest[1]), int(rest[4])
        else:
            if len(rest) != 4:
                return None
            rx, tx, pid = None, None, int(rest[2])
    except (ValueError, IndexError):
        return None
    if min(x for x in (rx, tx, pid) if x is not None) < 0:
        return None
    return Connection(local, remote, state, rx, tx, pid)


def _endpoint(text: str) -> Endpoint | None:
    """`a.b.c.d.port`, `::1.port`, `*.port`; None for `*.*` or anything else."""
    host, _, port = text.rpartition(".")
    if not host or not port.isdigit() or int(port) > 65535:
        return None
    return ("0.0.0.0" if host == "*" else host, int(port))


class Mover:
    """When each connection's counts last moved, across looks: netstat keeps no such time."""

    def __init__(self) -> None:
        self._seen: dict[tuple[Endpoint, Endpoint], tuple[int, int, float, float]] = {}

    def quiet(self, row: Connection, now: float) -> tuple[int | None, int | None]:
        """ms since its rx and its tx last moved; None where no earlier look saw it."""
        if row.remote is None or row.rx is None or row.tx is None:
            return None, None
        key = (row.local, row.remote)
        before = self._seen.get(key)
        if before is None:
            self._seen[key] = (row.rx, row.tx, now, now)
            return None, None
        rx_at = before[2] if row.rx == before[0] else now
        tx_at = before[3] if row.tx == before[1] else now
        self._seen[key] = (row.rx, row.tx, rx_at, tx_at)
        return round((now - rx_at) * 1000), round((now - tx_at) * 1000)

    def keep(self, keys: set[tuple[Endpoint, Endpoint]], port: int) -> None:
        """Forget the connections on `port` that are gone (one table serves every server:
        another port's are its own to keep)."""
        for key in [k for k in self._seen if k[0][1] == port and k not in keys]:
            del self._seen[key]
