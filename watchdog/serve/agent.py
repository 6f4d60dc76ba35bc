"""HAProxy's agent check, served: one answer a connection, naming one server's fitness.

HAProxy connects to `watchdog.agent` every `agent-inter`, sends its `agent-send` string (the
server's name and a newline), reads one line and closes. One watchdog watching several servers
is so checked per server, which `option httpchk` (one path a backend) cannot do. The answer is
the one /healthz gives, in the agent's words (HAProxy 2.6 configuration.txt, "agent-check"):
"up ready" while it can take requests, "drain" while the watchdog or a person drains it (no new
requests, those on it finish), "down #<why>" otherwise (HAProxy then hands the requests queued
for it to another server). Only an agent's "up ready" undoes its own "down" and "drain", so
every answer says both words.
"""

from __future__ import annotations

import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable
from typing import Any

from mlx_watchdog.act.rotation import Rotation
from mlx_watchdog.cycle.crew import SETTLE_S
from mlx_watchdog.record.document import ServerStatus, Status
from mlx_watchdog.sense.text import printable

log = logging.getLogger("mlx_watchdog")

MAX_NAME = 256  # bytes of agent-send read at most
# HAProxy checks each server every agent-inter (2 s by default): a few connections at once.
# More than MAX_OPEN at once are closed unanswered (HAProxy counts a failed agent check as no
# change: its health check decides), so a flood of idle connections costs at most MAX_OPEN
# threads for NAME_WAIT each; BACKLOG keeps a burst from being refused by the kernel.
MAX_OPEN = 32
BACKLOG = 128
NAME_WAIT = 0.5  # s: HAProxy sends agent-send at once; without one, the only server answers
UP, DRAIN = "up ready", "drain"


def answer(doc: Status, asked: str, now: float | None = None) -> str:
    """The agent's line for the server `asked` names (the only one when it names none), at
    wall time `now` (None: the servers' own times are not weighed)."""
    servers = list(doc.servers)
    if not asked:
        if len(servers) != 1:
            return f"down #agent-send names no server and this watchdog watches {len(servers)}"
        return fitness(servers[0])
    s = next((s for s in servers if s.name == asked), None)
    if s is None:
        return f"down #no server named {_said(asked)} here"
    said = fitness(s)
    others = [o for o in servers if o.name != s.name]
    kept = said != UP and others and not s.restarting and not s.draining
    if kept and not any(_settled(o, now) for o in others):
        # The last of this watchdog's servers in: out, HAProxy would answer every request 503;
        # in, they wait in its queue for the first server back (Turns restarts one at a time).
        return UP
    return said


def _settled(s: ServerStatus, now: float | None) -> bool:
    """Serving, and for long enough that the balancer has taken it back."""
    if not s.serving:
        return False
    return now is None or s.state_since is None or now - s.state_since >= SETTLE_S


def fitness(s: ServerStatus) -> str:
    if s.serving:
        return UP
    if s.draining and not s.restarting:
        return DRAIN
    why = "restarting" if s.restarting else s.state
    if s.held_behind and not s.restarting:
        why = f"{s.state}: holding requests behind abandoned work"
    return f"down #{_said(why)}"


def _said(text: str) -> str:
    """Outside text as one short description: printable, no comma (it ends HAProxy's)."""
    return printable(text)[:80].replace(",", ";")


class _Handler(socketserver.BaseRequestHandler):
    server: _Agent

    def handle(self) -> None:
        sock: socket.socket = self.request
        name = _read_name(sock, time.monotonic() + NAME_WAIT)
        try:
            doc = self.server.status(None)
            line = answer(doc, name, time.time())
        except Exception:  # the daemon's status failing must not leave HAProxy hanging
            log.exception("the agent check could not read the status")
            line, doc = "down #the watchdog cannot read its status", None
        try:
            sock.sendall(line.encode() + b"\n")
        except OSError:
            return  # HAProxy gave up: its next check asks again
        known = [s.name for s in doc.servers] if doc is not None else []
        whom = name or (known[0] if len(known) == 1 else None)
        if whom in known:
            self.server.rotation.told(whom, line == UP)


def _read_name(sock: socket.socket, deadline: float) -> str:
    """The agent-send line, read under a deadline and a size cap; "" when none came."""
    got = b""
    while b"\n" not in got and len(got) < MAX_NAME:
        left = deadline - time.monotonic()
        if left <= 0:
            break
        sock.settimeout(left)
        try:
            chunk = sock.recv(MAX_NAME - len(got))
        except OSError:
            break
        if not chunk:
            break
        got += chunk
    return got.split(b"\n", 1)[0].decode("utf-8", "replace").strip()


class _Agent(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = BACKLOG

    def __init__(
        self,
        address: tuple[str, int],
        status: Callable[[str | None], Status],
        rotation: Rotation,
    ) -> None:
        self.status, self.rotation = status, rotation
        self.open = threading.BoundedSemaphore(MAX_OPEN)
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.address_family = family
        super().__init__(address, _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.open.acquire(blocking=False):
            self.shutdown_request(request)  # over the cap: closed, no thread
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.open.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.debug("agent check from %s failed", client_address, exc_info=True)


def start(
    host: str,
    port: int,
    status: Callable[[str | None], Status],
    rotation: Rotation | None = None,
) -> _Agent:
    """Serve the agent check on (host, port) in a thread; `status(name)` gives that server's
    document (every server's for None); what it tells the balancer goes to `rotation`.
    `shutdown()` and `server_close()` end it."""
    agent = _Agent((host, port), status, rotation or Rotation())
    threading.Thread(target=agent.serve_forever, name="agent", daemon=True).start()
    return agent
