"""The watchdog's own HTTP endpoint: what load balancers, Prometheus and the CLI ask.

`GET /healthz` and `/healthz/<name>` answer 200 while a server can take traffic and 503 when it
is wedged, dead, down, starting, draining or restarting; `GET /status` is JSON; `GET /metrics`
is the Prometheus text format. `POST /servers/<name>/restart|drain|undrain` need the bearer
token from a file only the user can read, and go through the daemon's one restart path.
"""

from __future__ import annotations

import contextlib
import hmac
import http.server
import json
import logging
import os
import secrets
import socket
import threading
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("mlx_watchdog")

ACTIONS = ("restart", "drain", "undrain")


class Backend(Protocol):
    def status(self) -> dict[str, Any]:
        """{"servers": [one status dict per server, with "name", "state", "serving", ...]}."""

    def prometheus(self) -> tuple[bytes, str]:
        """The Prometheus exposition and its content type."""

    def act(self, name: str, action: str) -> str:
        """Queue `action` for server `name`; the message to answer. KeyError: no such server."""


def ensure_token(path: Path) -> str:
    """The token in `path`, created (mode 0600, never world-readable) when it does not exist."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileExistsError):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(secrets.token_urlsafe(32) + "\n")
    return path.read_text().strip()


def make_handler(backend: Backend, token: str) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "mlx-watchdog"
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass  # a load balancer polling every second must not fill the log

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0].rstrip("/") or "/"
            parts = path.strip("/").split("/")
            if path == "/status":
                self._json(200, backend.status())
            elif path == "/metrics":
                body, ctype = backend.prometheus()
                self._send(200, body, ctype)
            elif parts[0] == "healthz" and len(parts) <= 2:
                self._health(parts[1] if len(parts) == 2 else None)
            elif len(parts) == 3 and parts[0] == "servers" and parts[2] in ACTIONS:
                self._error(405, "use POST", allow="POST")
            else:
                self._error(404, f"no such path: {path}")

        def do_POST(self) -> None:
            parts = self.path.split("?", 1)[0].strip("/").split("/")
            if self.headers.get("Content-Length"):
                self.rfile.read(int(self.headers["Content-Length"]))
            if not (len(parts) == 3 and parts[0] == "servers" and parts[2] in ACTIONS):
                if parts[0] in ("status", "metrics", "healthz"):
                    self._error(405, "use GET", allow="GET")
                else:
                    self._error(404, f"no such path: /{'/'.join(parts)}")
                return
            given = self.headers.get("Authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
                self._error(401, "a bearer token is needed (the api-token file in state_dir)")
                return
            try:
                message = backend.act(parts[1], parts[2])
            except KeyError:
                self._error(404, f'no server named "{parts[1]}"')
                return
            self._json(202, {"server": parts[1], "action": parts[2], "message": message})

        def do_PUT(self) -> None:
            self._error(405, "use GET or POST", allow="GET, POST")

        do_DELETE = do_PATCH = do_PUT

        def _health(self, name: str | None) -> None:
            doc = backend.status()
            servers = doc["servers"]
            if name is not None:
                servers = [s for s in servers if s["name"] == name]
                if not servers:
                    self._error(404, f'no server named "{name}"')
                    return
            ok = bool(servers) and all(s["serving"] for s in servers)
            if "application/json" in self.headers.get("Accept", ""):
                brief = [{k: s[k] for k in ("name", "state", "serving", "reason")} for s in servers]
                problem = doc["watchdog"].get("history_problem")
                self._json(
                    200 if ok else 503, {"ok": ok, "servers": brief, "history_problem": problem}
                )
                return
            lines = [
                f"{s['name']} {'ok' if s['serving'] else 'unavailable'}: {s['reason']}"
                for s in servers
            ]
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
            self.end_headers()
            self.wfile.write(body)

    return Handler


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True


def start(
    backend: Backend, host: str, port: int, token: str
) -> tuple[http.server.ThreadingHTTPServer, threading.Thread]:
    """Serve in a background thread; OSError when the address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server_class = type("Server", (_Server,), {"address_family": family})
    server = server_class((host, port), make_handler(backend, token))
    thread = threading.Thread(target=server.serve_forever, name="endpoint", daemon=True)
    thread.start()
    return server, thread
