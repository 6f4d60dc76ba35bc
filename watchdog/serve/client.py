"""How the CLI talks to a running daemon: find it, ask its status, ask it to act.

The daemon writes its endpoint's address to `state_dir/daemon.json` and the bearer token to
`state_dir/api-token`; without a live daemon, status comes from the history database.
"""

from __future__ import annotations

import json
import os
import socket
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mlx_watchdog.config import Config
from mlx_watchdog.record.document import Status, WatchdogLine
from mlx_watchdog.record.private import UnsafeState, read_private
from mlx_watchdog.sense.text import BadJson, load_json

STATUS_TIMEOUT = 5.0  # seconds for a whole answer
MAX_STATUS_ANSWER = 8 << 20  # a status document of many servers is some kB
TOKEN_FILE = "api-token"
DAEMON_FILE = "daemon.json"  # where the running daemon's endpoint is, for the CLI


class DaemonNotRunning(Exception):
    """No watchdog answers for this state_dir; the message says what was found."""


class NoPage(Exception):
    """The watchdog runs, but its page cannot be opened as asked; the message says why."""


class ActionRefused(Exception):
    """The daemon answered an action with an error; the message is its answer."""


def daemon_url(state_dir: Path) -> str:
    path = state_dir / DAEMON_FILE
    try:
        record = json.loads(read_private(path))
        pid, url = int(record["pid"]), str(record["url"])
        if pid <= 0:  # 0 and -1 would ask about a whole process group
            raise ValueError(f"PID {pid}")
    except FileNotFoundError:
        raise DaemonNotRunning(f"the watchdog is not running (no {path})") from None
    except (
        OSError,
        ValueError,
        KeyError,
        TypeError,
        OverflowError,
        RecursionError,
        UnsafeState,
    ) as exc:
        raise DaemonNotRunning(f"{path} is unreadable ({exc})") from None
    if not _alive(pid):
        raise DaemonNotRunning(f"the watchdog is not running (PID {pid} in {path} is gone)")
    return url


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process: it exists
    return True


def _request(
    url: str, method: str, path: str, headers: dict[str, str] | None = None
) -> tuple[int, bytes]:
    """One HTTP/1.0 request to the daemon's own endpoint on this machine, on a bare socket: the
    standard library's HTTP clients import the email package, and `status` is run often."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    lines = [f"{method} {path} HTTP/1.0", f"Host: {parts.netloc}", "Content-Length: 0"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    deadline = time.monotonic() + STATUS_TIMEOUT  # in all: a peer that trickles is cut off too
    try:
        with socket.create_connection((host, port), timeout=STATUS_TIMEOUT) as sock:
            sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
            chunks: list[bytes] = []
            size = 0
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise DaemonNotRunning(
                        f"the watchdog at {url} did not answer within {STATUS_TIMEOUT:g}s"
                    )
                sock.settimeout(left)
                chunk = sock.recv(65536)
                if not chunk:
                    break
                size += len(chunk)
                if size > MAX_STATUS_ANSWER:
                    raise DaemonNotRunning(
                        f"the watchdog at {url} sent more than {MAX_STATUS_ANSWER} bytes"
                    )
                chunks.append(chunk)
    except OSError as exc:
        raise DaemonNotRunning(f"the watchdog at {url} does not answer ({exc})") from None
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].split()
    if len(status_line) < 2 or not status_line[1].isdigit():
        raise DaemonNotRunning(f"the watchdog at {url} sent no HTTP answer")
    return int(status_line[1]), body


def live_status(state_dir: Path) -> Status:
    url = daemon_url(state_dir)
    try:  # beyond loopback /status needs it; this user's own daemon's token is readable
        token: str | None = read_private(state_dir / TOKEN_FILE).strip()
    except (OSError, UnsafeState):
        token = None
    return Status.from_json(remote_status(url, token))


def remote_status(url: str, token: str | None = None) -> dict[str, Any]:
    """The status document of the watchdog whose endpoint is at `url` (http://host:port)."""
    headers = {"Authorization": f"Bearer {token}"} if token else None
    status, body = _request(url, "GET", "/status", headers)
    try:
        if status != 200:
            raise ValueError(f"HTTP {status}")
        doc = load_json(body)  # a fleet peer's text is from outside: whole strings
        if not isinstance(doc, dict) or not isinstance(doc.get("servers"), list):
            raise ValueError("not a status document")
    except (ValueError, RecursionError) as exc:
        raise DaemonNotRunning(f"the watchdog at {url} does not answer ({exc})") from None
    return doc


def page_url(state_dir: Path) -> str:
    """The running watchdog's status page, checked to answer without a token (a browser sends
    none). A wildcard address (0.0.0.0, ::) is opened on this machine's loopback."""
    url = daemon_url(state_dir)
    parts = urlsplit(url)
    if parts.hostname in ("0.0.0.0", "::"):
        url = f"http://{'127.0.0.1' if parts.hostname == '0.0.0.0' else '[::1]'}:{parts.port}"
    status, _ = _request(url, "GET", "/")
    if status == 401:
        raise NoPage(
            f"the page at {url}/ needs the API token, as /status does, because the endpoint "
            'listens beyond loopback: add "/status" to watchdog.open_routes to open both to '
            "your network, or listen on 127.0.0.1"
        )
    if status != 200:
        raise NoPage(f"the watchdog at {url} answered HTTP {status} for its page")
    return url + "/"


def history_status(config: Config, why: str, now: float | None = None) -> Status:
    """The status document built from the history database, saying why it is not live."""
    from mlx_watchdog.record.store import open_history
    from mlx_watchdog.serve.status import from_history

    now = time.time() if now is None else now
    store = open_history(config.watchdog.state_dir, create=False)
    try:
        servers = [from_history(s, store, now) for s in config.servers]
    finally:
        store.close()
    return Status(WatchdogLine(running=False, why=why), tuple(servers))


def act(state_dir: Path, name: str, action: str) -> str:
    url = daemon_url(state_dir)
    try:
        token = read_private(state_dir / TOKEN_FILE).strip()
    except (OSError, UnsafeState) as exc:
        raise DaemonNotRunning(f"cannot read the token {state_dir / TOKEN_FILE}: {exc}") from None
    status, body = _request(
        url, "POST", f"/servers/{name}/{action}", {"Authorization": f"Bearer {token}"}
    )
    try:
        doc = load_json(body)
        if not isinstance(doc, dict):
            raise BadJson("not an object")
    except BadJson:
        doc = {"error": body[:200].decode(errors="replace")}
    if status != 202:
        raise ActionRefused(str(doc.get("error", doc)))
    return str(doc["message"])
