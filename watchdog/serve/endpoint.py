"""The watchdog's own HTTP endpoint: what load balancers, Prometheus and the CLI ask.

`GET /healthz` and `/healthz/<name>` answer 200 while a server can take traffic and 503 when it
is wedged, dead, down, starting, draining or restarting; `GET /status` is JSON; `GET /metrics`
is the Prometheus text format; `GET /` is the status page for people (serve/page.py).
`POST /servers/<name>/restart|drain|undrain` need the bearer token from a file only the user
can read, and go through the daemon's one restart path.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import hmac
import http.server
import json
import logging
import os
import secrets
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Protocol

from mlx_watchdog.config.values import GUARDED_ROUTES, is_loopback
from mlx_watchdog.cycle import Conflict  # 409: the ask repeats what runs or just ran
from mlx_watchdog.record.document import Status
from mlx_watchdog.record.private import UnsafeState, private_dir, read_private
from mlx_watchdog.sense.bounded import Cutoff
from mlx_watchdog.serve.page import HEADERS as PAGE_HEADERS

log = logging.getLogger("mlx_watchdog")

ACTIONS = ("restart", "drain", "undrain")
MAX_ACTION_BODY = 1024  # an action carries no body to speak of
MAX_CONNECTIONS = 32
IDLE_TIMEOUT = 10.0  # seconds a connection may send nothing
CONNECTION_LIFETIME = 30.0  # seconds a connection may last in all (a byte-a-second sender)
KEEP_ALIVE = 20.0  # after this, an answer says "Connection: close": a keep-alive client reconnects
TOO_MANY = (
    b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 21\r\n"
    b"Connection: close\r\nRetry-After: 1\r\n\r\ntoo many connections\n"
)


class Backend(Protocol):
    """What the endpoint asks of the daemon: its status, metrics, page and actions."""

    def status(self) -> Status:
        """The watchdog and one ServerStatus per server."""

    def prometheus(self) -> tuple[bytes, str]:
        """The Prometheus exposition and its content type."""

    def page(self) -> str:
        """The status page (serve/page.py)."""

    def act(self, name: str, action: str) -> str:
        """Queue `action` for server `name`; the message to answer. KeyError: no such server;
        Conflict: it would repeat what is already running or just done."""


def ensure_token(path: Path) -> str:
    """The token in `path`, created (mode 0600, never world-readable) when it does not exist."""
    private_dir(path.parent)
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
    token = read_private(path).strip()  # a planted symlink is refused, never believed
    if len(token) < 16:
        raise UnsafeState(f"{path} holds no usable token; remove it and restart the watchdog")
    return token


class Handler(http.server.BaseHTTPRequestHandler):
    """The endpoint's routes; `make_handler` binds them to a backend and its token."""

    backend: Backend
    token: str
    guarded: tuple[str, ...] = ()  # the GET routes that need the token too (beyond loopback)
    server_version = "mlx-watchdog"
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT

    def log_message(self, format: str, *args: Any) -> None:
        pass  # a load balancer polling every second must not fill the log

    def setup(self) -> None:
        self.began = time.monotonic()
        super().setup()

    def handle_one_request(self) -> None:
        self.server.mark(self.connection, idle=True)  # type: ignore[attr-defined]
        super().handle_one_request()

    def parse_request(self) -> bool:
        # Idle until its headers are whole: one that sends them a byte at a time is the
        # first to go when the connections are all taken.
        whole = super().parse_request()
        self.server.mark(self.connection, idle=not whole)  # type: ignore[attr-defined]
        return whole

    def do_GET(self) -> None:
        path = self.path.split("?", 1)[0].rstrip("/") or "/"
        parts = path.strip("/").split("/")
        if path in self.guarded and not self._authorized():
            self.close_connection = True
            self._error(401, f"{path} needs the bearer token here (the api-token file)")
            return
        if path == "/":
            plain, packed = _encoded(self.backend.page())
            gzip_ok = "gzip" in self.headers.get("Accept-Encoding", "").lower()
            headers = {**PAGE_HEADERS, "Vary": "Accept-Encoding"}
            if gzip_ok:
                headers["Content-Encoding"] = "gzip"
            body = packed if gzip_ok else plain
            self._send(200, body, "text/html; charset=utf-8", headers)
        elif path == "/status":
            self._json(200, self.backend.status().to_json())
        elif path == "/metrics":
            body, ctype = self.backend.prometheus()
            self._send(200, body, ctype)
        elif parts[0] == "healthz" and len(parts) <= 2:
            self._health(parts[1] if len(parts) == 2 else None)
        elif len(parts) == 3 and parts[0] == "servers" and parts[2] in ACTIONS:
            self._error(405, "use POST", allow="POST")
        else:
            self._error(404, f"no such path: {path}")

    def do_POST(self) -> None:
        parts = self.path.split("?", 1)[0].strip("/").split("/")
        if not (len(parts) == 3 and parts[0] == "servers" and parts[2] in ACTIONS):
            self.close_connection = True  # its body, if any, is never read
            if parts[0] in ("", "status", "metrics", "healthz"):
                self._error(405, "use GET", allow="GET")
            else:
                self._error(404, f"no such path: /{'/'.join(parts)}")
            return
        # Who asks comes before what they send: a body is read only for the token holder.
        if not self._authorized():
            self.close_connection = True
            self._error(401, "a bearer token is needed (the api-token file in state_dir)")
            return
        problem = self._read_body()
        if problem is not None:
            self.close_connection = True
            self._error(*problem)
            return
        try:
            message = self.backend.act(parts[1], parts[2])
        except KeyError:
            self._error(404, f'no server named "{parts[1]}"')
            return
        except Conflict as exc:
            self._error(409, str(exc))
            return
        self._json(202, {"server": parts[1], "action": parts[2], "message": message})

    def do_PUT(self) -> None:
        self.close_connection = True
        self._error(405, "use GET or POST", allow="GET, POST")

    do_DELETE = do_PATCH = do_HEAD = do_OPTIONS = do_TRACE = do_CONNECT = do_PUT

    def _authorized(self) -> bool:
        given = self.headers.get("Authorization", "")
        return hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode())

    def _read_body(self) -> tuple[int, str] | None:
        """Read the (small, unused) body an action may carry; why not, as (code, message)."""
        length = self.headers.get("Content-Length")
        if self.headers.get("Transfer-Encoding"):
            return 411, "send Content-Length, not Transfer-Encoding"
        if length is None:
            return 411, "Content-Length is required"
        if not length.isascii() or not length.isdigit():
            return 400, f"Content-Length {length[:20]!r} is not a number of bytes"
        if int(length) > MAX_ACTION_BODY:
            return 413, f"a body of at most {MAX_ACTION_BODY} bytes"
        if int(length):
            self.rfile.read(int(length))
        return None

    def _health(self, name: str | None) -> None:
        doc = self.backend.status()
        servers = list(doc.servers)
        if name is not None:
            servers = [s for s in servers if s.name == name]
            if not servers:
                self._error(404, f'no server named "{name}"')
                return
        ok = bool(servers) and all(s.serving for s in servers)
        if "application/json" in self.headers.get("Accept", ""):
            brief = [
                {"name": s.name, "state": s.state, "serving": s.serving, "reason": s.reason}
                for s in servers
            ]
            problem = doc.watchdog.history_problem
            self._json(200 if ok else 503, {"ok": ok, "servers": brief, "history_problem": problem})
            return
        lines = [f"{s.name} {'ok' if s.serving else 'unavailable'}: {s.reason}" for s in servers]
        self._send(200 if ok else 503, ("\n".join(lines) + "\n").encode(), "text/plain")

    def _json(self, code: int, doc: object) -> None:
        self._send(code, json.dumps(doc, default=str).encode(), "application/json")

    def _error(self, code: int, message: str, allow: str | None = None) -> None:
        headers = {"Allow": allow} if allow else {}
        self._send(code, json.dumps({"error": message}).encode(), "application/json", headers)

    def _send(
        self, code: int, body: bytes, ctype: str, headers: dict[str, str] | None = None
    ) -> None:
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if time.monotonic() - self.began >= KEEP_ALIVE:
            # Closed between two answers, never cut mid-request at CONNECTION_LIFETIME.
            self.close_connection = True
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)


@functools.lru_cache(maxsize=2)
def _encoded(page: str) -> tuple[bytes, bytes]:
    """The page as bytes, and gzipped (a page of twenty servers' days is some 800 kB of HTML
    and a tenth of that gzipped): each done once per page rendered, not once per request."""
    plain = page.encode()
    return plain, gzip.compress(plain, compresslevel=6, mtime=0)


def make_handler(
    backend: Backend, token: str, guarded: tuple[str, ...] = ()
) -> type[http.server.BaseHTTPRequestHandler]:
    """`guarded`: the GET routes that need the token too (beyond loopback)."""
    bound = {"backend": backend, "token": token, "guarded": guarded}
    return type("BoundHandler", (Handler,), bound)


class _Server(http.server.ThreadingHTTPServer):
    """At most MAX_CONNECTIONS open at once, each idle for at most IDLE_TIMEOUT and open for at
    most CONNECTION_LIFETIME. The probing and the endpoint share the process's open files
    (launchd's default is 256): a client that opens hundreds of connections and sends nothing,
    or its headers a byte at a time, must not leave the watchdog unable to probe, nor a load
    balancer unanswered. When all are taken, the one idle longest (no request under way) is
    closed for the newcomer."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._open: dict[socket.socket, tuple[float, bool]] = {}  # since, idle
        self._guard = threading.Condition()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that goes away mid-answer is routine (a load balancer's timeout, Ctrl-C on
        curl): one debug line, not socketserver's traceback on stderr each time."""
        exc = sys.exc_info()[1]
        if isinstance(exc, OSError):
            log.debug("a client of the endpoint went away: %s", exc)
            return
        log.error("the endpoint failed on a request", exc_info=exc)

    def mark(self, sock: socket.socket, idle: bool) -> None:
        with self._guard:
            if sock in self._open:
                self._open[sock] = (time.monotonic() if idle else self._open[sock][0], idle)

    def process_request(self, request: Any, client_address: Any) -> None:
        with self._guard:
            if len(self._open) >= MAX_CONNECTIONS:
                idle = [(since, s) for s, (since, i) in self._open.items() if i]
                if idle:
                    _, oldest = min(idle, key=lambda pair: pair[0])
                    with contextlib.suppress(OSError):
                        oldest.shutdown(socket.SHUT_RDWR)
                self._guard.wait_for(lambda: len(self._open) < MAX_CONNECTIONS, timeout=1.0)
            if len(self._open) >= MAX_CONNECTIONS:  # every one is a request under way
                with contextlib.suppress(OSError):
                    request.sendall(TOO_MANY)
                self.shutdown_request(request)
                return
            self._open[request] = (time.monotonic(), True)
        cutoff = Cutoff(CONNECTION_LIFETIME)
        cutoff.watch(request)
        cutoff.__enter__()

        def serve() -> None:
            try:
                self.process_request_thread(request, client_address)
            finally:
                cutoff.__exit__()
                with self._guard:
                    self._open.pop(request, None)
                    self._guard.notify_all()

        threading.Thread(target=serve, name="endpoint-request", daemon=True).start()


def start(
    backend: Backend, host: str, port: int, token: str, open_routes: tuple[str, ...] = ()
) -> tuple[http.server.ThreadingHTTPServer, threading.Thread]:
    """Serve in a background thread; OSError when the address cannot be bound. Beyond
    loopback, /status (and the page at /, which shows the same) and /metrics need the token
    unless named in `open_routes`; /healthz is always open (load balancers)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type("Server", (_Server,), {"address_family": family})
    guarded = () if is_loopback(host) else tuple(r for r in GUARDED_ROUTES if r not in open_routes)
    guarded += ("/",) if "/status" in guarded else ()  # the page shows what /status does
    server = server_class((host, port), make_handler(backend, token, guarded))
    thread = threading.Thread(target=server.serve_forever, name="endpoint", daemon=True)
    thread.start()
    return server, thread
