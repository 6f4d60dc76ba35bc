"""Every answer from outside is read under a total deadline and a byte cap, and decoded without
an exception escaping: a server that trickles one byte a second, streams forever or nests a
million brackets is a finding, never a tick that hangs or dies.

httpx's timeouts are per read, so a trickle never trips them. A `Cutoff` shuts the request's
socket down at the deadline from one shared timer thread; the blocked read then returns at once.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx

from mlx_watchdog.sense.findings import Address


class Overdue(httpx.TimeoutException):
    """The whole answer did not come within its deadline."""


class TooLarge(httpx.HTTPError):
    """The answer is larger than its cap."""


class _Timers:
    """One thread for every deadline of the process: a timer thread per request would let a
    busy daemon's thread count grow with its servers and their routes."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Callable[[], None]]] = []
        self._cancelled: set[int] = set()
        self._cv = threading.Condition()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None

    def at(self, when: float, action: Callable[[], None]) -> int:
        with self._cv:
            key = next(self._ids)
            heapq.heappush(self._heap, (when, key, action))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="deadlines", daemon=True)
                self._thread.start()
            self._cv.notify()
            return key

    def cancel(self, key: int) -> None:
        with self._cv:
            self._cancelled.add(key)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._heap:
                    self._cv.wait()
                when, key, action = self._heap[0]
                wait = when - time.monotonic()
                if key in self._cancelled:
                    heapq.heappop(self._heap)
                    self._cancelled.discard(key)
                    continue
                if wait > 0:
                    self._cv.wait(wait)
                    continue
                heapq.heappop(self._heap)
            with contextlib.suppress(Exception):
                action()


_TIMERS = _Timers()


class Cutoff:
    """A deadline for one exchange: the sockets it is told of are shut down when it passes."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.fired = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._key: int | None = None

    def __enter__(self) -> Cutoff:
        self._key = _TIMERS.at(self.deadline, self.fire)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._key is not None:
            _TIMERS.cancel(self._key)

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.append(sock)
            late = self.fired
        if late:
            _shut(sock)

    def fire(self) -> None:
        with self._lock:
            self.fired = True
            socks = list(self._socks)
        for sock in socks:
            _shut(sock)

    def trace(
        self, on_connect: Callable[[Address], None] | None = None
    ) -> Callable[[str, dict[str, Any]], None]:
        """An httpx trace hook that hands each new connection's socket to this cutoff."""

        def hook(event: str, info: dict[str, Any]) -> None:
            if event != "connection.connect_tcp.complete":
                return
            stream = info.get("return_value")
            sock = stream.get_extra_info("socket") if stream is not None else None
            if sock is None:
                return
            self.watch(sock)
            if on_connect is not None:
                with contextlib.suppress(OSError):
                    on_connect(sock.getsockname()[:2])

        return hook


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)


def read_capped(response: httpx.Response, cap: int, cutoff: Cutoff) -> bytes:
    """The body, or TooLarge past `cap` bytes, or Overdue past the deadline."""
    parts: list[bytes] = []
    size = 0
    for chunk in response.iter_raw():
        size += len(chunk)
        if size > cap:
            raise TooLarge(f"more than {cap} bytes")
        if cutoff.fired or time.monotonic() > cutoff.deadline:
            raise Overdue(f"the answer took longer than {cutoff.seconds:g}s")
        parts.append(chunk)
    if cutoff.fired:  # the socket was shut under the read: what came is a fragment
        raise Overdue(f"the answer took longer than {cutoff.seconds:g}s")
    return b"".join(parts)


def get(
    url: str,
    *,
    headers: dict[str, str],
    deadline: float,
    cap: int,
    transport: httpx.BaseTransport | None = None,
    verify: Any = True,
    on_connect: Callable[[Address], None] | None = None,
) -> tuple[int, bytes]:
    """GET `url`: (status, body) within `deadline` seconds in all and `cap` bytes.

    Raises httpx.HTTPError: Overdue, TooLarge, or the connection's own error.
    """
    return send(
        "GET",
        url,
        headers=headers,
        deadline=deadline,
        cap=cap,
        transport=transport,
        verify=verify,
        on_connect=on_connect,
    )


def send(
    method: str,
    url: str,
    *,
    headers: dict[str, str],
    deadline: float,
    cap: int,
    body: bytes | None = None,
    transport: httpx.BaseTransport | None = None,
    verify: Any = True,
    on_connect: Callable[[Address], None] | None = None,
) -> tuple[int, bytes]:
    """`method` `url` (with `body`): (status, body) within `deadline` seconds and `cap` bytes."""
    with Cutoff(deadline) as cutoff:
        try:
            with (
                httpx.Client(timeout=deadline, transport=transport, verify=verify) as client,
                client.stream(
                    method,
                    url,
                    headers=headers,
                    content=body,
                    extensions={"trace": cutoff.trace(on_connect)},
                ) as response,
            ):
                return response.status_code, read_capped(response, cap, cutoff)
        except (httpx.TransportError, httpx.StreamError) as exc:
            if cutoff.fired and not isinstance(exc, (TooLarge, Overdue)):
                raise Overdue(f"the answer took longer than {deadline:g}s") from exc
            raise
