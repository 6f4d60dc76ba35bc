"""The bench's side of a run: the real server it owns, and what it measures from outside.

`Box` is the server process and the service manager in one: a watcher's "restart" is
`box.restart(by)`, recorded with its time. `Prober` sends one tiny real request at a time with
a long timeout and records when each was served: "service is back" is read from those
timestamps, never from what a watcher claims.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
TINY = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def tiny_request(url: str, timeout: float) -> bool:
    """A one-token request answered with a token (JSON, or the SSE stream the tests'
    misbehaving server always sends)."""
    try:
        r = httpx.post(url + "/v1/chat/completions", json=TINY, timeout=timeout)
        if r.status_code != 200:
            return False
        if r.headers.get("content-type", "").startswith("text/event-stream"):
            return '"content"' in r.text
        return int(r.json()["usage"]["completion_tokens"]) >= 1
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        return False


@dataclass
class Box:
    argv: list[str]
    port: int
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    restarts: list[tuple[float, str]] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    closed: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def pid(self) -> int | None:
        proc = self.proc
        return proc.pid if proc is not None and proc.poll() is None else None

    def start(self, wait: bool = True, timeout: float = 180.0) -> None:
        with self.log.open("ab") as fh:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=fh,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, **self.env},
                start_new_session=True,
            )
        if wait:
            deadline = time.monotonic() + timeout
            while not tiny_request(self.url, timeout=10):
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise RuntimeError(f"the server did not serve:\n{self.log.read_text()[-2000:]}")
                time.sleep(0.2)

    def kill(self) -> None:
        """A crash: the process is gone, nobody restarts it unless a watcher does."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def close(self) -> None:
        """The run is over: stop the server, and no later restart may start another."""
        with self.lock:
            self.closed = True
            self.stop()

    def restart(self, by: str) -> None:
        """What a service manager does: stop (TERM, then KILL), start again, return."""
        with self.lock:
            if self.closed:
                return
            self.restarts.append((time.time(), by))
            self.stop()
            self.start(wait=False)

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@dataclass
class Served:
    sent: float
    done: float
    ok: bool


class Prober(threading.Thread):
    """One tiny request at a time, long timeout: when is the server serving?"""

    def __init__(self, url: str, period: float, timeout: float = 600.0) -> None:
        super().__init__(daemon=True)
        self.url, self.period, self.timeout = url, period, timeout
        self.log: list[Served] = []
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            sent = time.time()
            ok = tiny_request(self.url, self.timeout)
            self.log.append(Served(sent, time.time(), ok))
            self.stopped.wait(self.period)

    def back_after(self, t0: float, slow: float = 1.0) -> float | None:
        """Seconds from t0 until a tiny request is served again after the first one that
        failed or waited longer than `slow`; 0.0 when none did (no outage seen)."""
        after = [s for s in self.log if s.sent >= t0]
        bad = next((i for i, s in enumerate(after) if not s.ok or s.done - s.sent > slow), None)
        if bad is None:
            return 0.0
        served = next((s for s in after[bad:] if s.ok), None)
        return None if served is None else served.done - t0

    def cut_off(self, restarts: list[float]) -> int:
        """Requests that were waiting when a restart came, and failed because of it."""
        return sum(1 for s in self.log if not s.ok and any(s.sent <= t <= s.done for t in restarts))


def python() -> str:
    return sys.executable
