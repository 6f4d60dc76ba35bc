"""The generation probe and the `/v1/models` check.

The probe is one tiny streaming chat completion. It runs in its own thread so the caller can
watch the server's process while it waits, and it never gives up early: the connection stays
open up to `hard_timeout`, because a probe that disconnects is one more abandoned request.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

import httpx

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.sense.answer import classify_error, json_answer, stream_event
from mlx_watchdog.sense.bounded import Cutoff, read_capped
from mlx_watchdog.sense.findings import (
    DEAD_FINDINGS,
    DOWN_FINDINGS,
    OK,
    Clock,
    ModelsCheck,
    ProbeFinding,
    ProbeSnapshot,
)
from mlx_watchdog.sense.models import in_memory, model_ids
from mlx_watchdog.sense.request import (
    CONNECT_TIMEOUT,
    MAX_BODY,
    MAX_ERROR_BODY,
    auth_headers,
    probe_body,
    refused,
    tls,
)
from mlx_watchdog.sense.text import BadJson, load_json, printable

log = logging.getLogger("mlx_watchdog")

__all__ = [
    "DEAD_FINDINGS",
    "DOWN_FINDINGS",
    "OK",
    "ModelsCheck",
    "Probe",
    "ProbeFinding",
    "ProbeSnapshot",
]


class Probe:
    """One generation probe in flight. `start()` it, then read `snapshot()` at any time."""

    def __init__(
        self,
        server: ServerConfig,
        *,
        mono: Clock = time.monotonic,
        transport: httpx.BaseTransport | None = None,
        on_connect: Callable[[tuple[str, int]], None] | None = None,
    ) -> None:
        self.server = server
        self._mono = mono
        self._on_connect = on_connect
        self._transport = transport
        self._lock = threading.Lock()
        self._snap = ProbeSnapshot(started_at=mono())
        self._sock: socket.socket | None = None
        self.local_address: tuple[str, int] | None = None  # excluded from the live clients
        self._aborted = False
        self._cutoff = Cutoff(server.probe.hard_timeout)
        self._thread = threading.Thread(target=self._run, name=f"probe-{server.name}", daemon=True)

    def start(self) -> Probe:
        with self._lock:
            self._snap = ProbeSnapshot(started_at=self._mono())
        self._thread.start()
        return self

    def run(self) -> ProbeSnapshot:
        """Probe in the calling thread, to the end."""
        self._run()
        return self.snapshot()

    def snapshot(self) -> ProbeSnapshot:
        with self._lock:
            return self._snap

    def wait(self, timeout: float | None = None) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def abort(self) -> None:
        """Close the connection from another thread (shutting down: the process is going)."""
        self._aborted = True
        sock = self._sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    # -- the work --------------------------------------------------------------------------

    def _set(self, **changes: Any) -> None:
        with self._lock:
            self._snap = replace(self._snap, **changes)

    def _finish(self, finding: ProbeFinding, detail: str = "", *, overdue: bool = False) -> None:
        if self._cutoff.fired and not overdue and not self._aborted:
            return  # the socket was shut at the deadline: what follows is its echo, not the server
        with self._lock:
            if self._snap.finding is None:
                self._snap = replace(
                    self._snap, finding=finding, detail=detail, done_at=self._mono()
                )

    def _trace(self, event: str, info: dict[str, Any]) -> None:
        if event == "connection.connect_tcp.complete":
            stream = info.get("return_value")
            sock = stream.get_extra_info("socket") if stream is not None else None
            if sock is not None:
                self._sock = sock
                self._cutoff.watch(sock)
                with contextlib.suppress(OSError):
                    self.local_address = sock.getsockname()[:2]
                if self.local_address is not None and self._on_connect is not None:
                    self._on_connect(self.local_address)
            self._set(connected_at=self._mono())
        elif event == "http11.receive_response_headers.complete":
            self._set(headers_at=self._mono())

    def _run(self) -> None:
        try:
            with self._cutoff:
                self._exchange()
        except Exception as exc:  # whatever the answer was, this probe ends and says why
            said = printable(f"{type(exc).__name__}: {exc}")[:300]
            self._finish(
                ProbeFinding.PROBE_FAILED,
                f"the watchdog failed reading the answer ({said})",
                overdue=True,
            )
            log.error("%s: probe failed: %s", self.server.name, said)
        if self._cutoff.fired:
            self._overdue()

    def _overdue(self) -> None:
        """The hard timeout passed, in all: what came by then is the finding."""
        hard = self.server.probe.hard_timeout
        snap = self.snapshot()
        if snap.tokens:
            self._finish(OK, f"served a token; the answer did not end in {hard:g}s", overdue=True)
        elif snap.bytes:
            self._finish(
                ProbeFinding.TRICKLE, f"{snap.bytes} bytes and no token in {hard:g}s", overdue=True
            )
        else:
            self._finish(
                ProbeFinding.NO_RESPONSE,
                f"no byte within the hard timeout of {hard:g}s",
                overdue=True,
            )

    def _exchange(self) -> None:
        hard = self.server.probe.hard_timeout
        timeout = httpx.Timeout(connect=min(CONNECT_TIMEOUT, hard), read=hard, write=30.0, pool=5.0)
        headers = {"Accept": "text/event-stream"}
        try:
            headers.update(auth_headers(self.server))
        except OSError as exc:
            self._finish(ProbeFinding.KEY_UNREADABLE, f"cannot read api_key_file: {exc.strerror}")
            return
        try:
            with httpx.Client(timeout=timeout, transport=self._transport, verify=tls()) as client:
                server = self.server
                if server.profile.needs_model and not server.model:
                    model = self._model_to_probe(client, headers)
                    if model is None:
                        self._finish(
                            ProbeFinding.NO_MODEL,
                            f"{server.profile.title} needs a model named and lists none",
                        )
                        return
                    server = replace(server, model=model)
                self._set(model=server.model)
                self._post(client, server, headers, hard)
        except httpx.HTTPError as exc:
            if self._cutoff.fired and not self._aborted:
                return  # _run judges what came by the deadline
            self._failed(exc, hard)

    def _failed(self, exc: httpx.HTTPError, hard: float) -> None:
        if isinstance(exc, httpx.ConnectError):
            self._finish(
                ProbeFinding.REFUSED if refused(exc) else ProbeFinding.CONNECT_ERROR, str(exc)
            )
        elif isinstance(exc, httpx.ConnectTimeout):
            self._finish(ProbeFinding.CONNECT_TIMEOUT, f"no connection within {CONNECT_TIMEOUT:g}s")
        elif isinstance(exc, httpx.ReadTimeout):
            if self.snapshot().bytes == 0:
                self._finish(
                    ProbeFinding.NO_RESPONSE, f"no byte within the hard timeout of {hard:g}s"
                )
            else:
                self._finish(ProbeFinding.TRICKLE, f"stalled after {self.snapshot().bytes} bytes")
        elif isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
            if self._aborted:
                self._finish(ProbeFinding.ABORTED, "the watchdog closed the probe")
            elif self.snapshot().tokens > 0:
                self._finish(OK, f"served a token, then: {exc}")
            else:
                self._finish(ProbeFinding.RESET, str(exc) or type(exc).__name__)
        else:
            self._finish(ProbeFinding.CONNECT_ERROR, f"{type(exc).__name__}: {exc}")

    def _post(
        self, client: httpx.Client, server: ServerConfig, headers: dict[str, str], hard: float
    ) -> None:
        with client.stream(
            "POST",
            server.url + "/v1/chat/completions",
            json=probe_body(server),
            headers=headers,
            extensions={"trace": self._trace},
        ) as response:
            self._set(status=response.status_code)
            if self.snapshot().headers_at is None:
                self._set(headers_at=self._mono())
            self._read(response, hard)

    def _model_to_probe(self, client: httpx.Client, headers: dict[str, str]) -> str | None:
        """For servers that need a model named (Ollama, LM Studio): one they hold in memory,
        else the first /v1/models lists (which they load). A connection error propagates: it
        is the probe's finding too."""
        memory = self.server.profile.in_memory
        if memory is not None:
            held = self._list(client, headers, memory.path)
            names = in_memory(held, memory) if held is not None else ()
            if names:
                return names[0]
        ids = model_ids(self._list(client, headers, "/v1/models"))
        return ids[0] if ids else None

    def _list(self, client: httpx.Client, headers: dict[str, str], path: str) -> object:
        """One JSON document, under the models check's deadline and size cap; None if bad."""
        seconds = self.server.probe.models_timeout
        with Cutoff(seconds) as cutoff:

            def trace(event: str, info: dict[str, Any]) -> None:
                cutoff.trace()(event, info)
                self._trace(event, info)  # the POST may reuse this connection

            try:
                with client.stream(
                    "GET",
                    self.server.url + path,
                    headers=headers,
                    timeout=seconds,
                    extensions={"trace": trace},
                ) as response:
                    body = read_capped(response, MAX_BODY, cutoff)
                    if response.status_code != 200:
                        return None
                return load_json(body)
            except httpx.ConnectError:
                raise
            except (httpx.HTTPError, BadJson):
                return None

    def _read(self, response: httpx.Response, hard: float) -> None:
        ctype = response.headers.get("content-type", "").lower()
        status = response.status_code
        if status != 200:
            body = self._collect(response, MAX_ERROR_BODY)
            self._finish(*classify_error(status, ctype, body))
            return
        if "text/html" in ctype:
            self._finish(ProbeFinding.HTML_ERROR, "200 with an HTML page")
            return
        if "text/event-stream" not in ctype:
            body = self._collect(response, MAX_BODY)
            if body is not None:
                self._finish(*self._judge_json(body))
            return
        self._read_stream(response, hard)

    def _chunks(self, response: httpx.Response, cap: int) -> Iterator[bytes]:
        hard = self.server.probe.hard_timeout
        for chunk in response.iter_raw():
            size = self.snapshot().bytes + len(chunk)
            self._set(bytes=size)
            if size > cap:
                self._finish(ProbeFinding.BODY_TOO_LARGE, f"more than {cap} bytes")
                return
            snap = self.snapshot()
            if self._mono() - snap.started_at > hard:
                if snap.tokens:
                    self._finish(OK, f"served a token; the stream did not end in {hard:g}s")
                else:
                    self._finish(ProbeFinding.TRICKLE, f"{size} bytes and no token in {hard:g}s")
                return
            yield chunk

    def _collect(self, response: httpx.Response, cap: int) -> bytes | None:
        parts = list(self._chunks(response, cap))
        return None if self.snapshot().done else b"".join(parts)

    def _judge_json(self, body: bytes) -> tuple[ProbeFinding, str]:
        finding, detail, changes = json_answer(body, self._mono())
        if changes:
            self._set(**changes)
        return finding, detail

    def _read_stream(self, response: httpx.Response, hard: float) -> None:
        buf = b""
        saw_data = False
        for chunk in self._chunks(response, MAX_BODY):
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                result = self._line(raw.rstrip(b"\r"))
                if result == "data":
                    saw_data = True
                elif result is not None:
                    return
        if self.snapshot().done:
            return
        if buf.strip():
            if self._line(buf.strip()) is not None and self.snapshot().done:
                return
            saw_data = saw_data or buf.startswith(b"data:")
        snap = self.snapshot()
        if snap.tokens > 0:
            self._finish(OK, "stream ended without [DONE]")
        elif not saw_data:
            self._finish(
                ProbeFinding.NO_DATA_EVENTS, f"{snap.bytes} bytes, {snap.keepalives} keepalives"
            )
        else:
            self._finish(ProbeFinding.ZERO_TOKENS, "the stream ended with no token")

    def _line(self, line: bytes) -> str | None:
        """Handle one SSE line: None to go on, "data" for an event, anything else: finished."""
        if not line:
            return None
        if line.startswith(b":"):
            text = line[1:].strip().decode(errors="replace")
            if text.startswith("keepalive"):
                self._set(
                    keepalives=self.snapshot().keepalives + 1,
                    keepalive_progress=text.removeprefix("keepalive").strip() or None,
                )
            return None
        if not line.startswith(b"data:"):
            return None  # "event:", "id:", "retry:" carry nothing we need
        payload = line[5:].strip()
        now = self._mono()
        if self.snapshot().first_data_at is None:
            self._set(first_data_at=now)
        if payload == b"[DONE]":
            if self.snapshot().tokens == 0:
                self._finish(ProbeFinding.DONE_WITHOUT_TOKEN, "[DONE] with no token")
            else:
                self._finish(OK)
            return "done"
        snap = self.snapshot()
        ended, detail, changes = stream_event(payload, snap.tokens, snap.finish_reason)
        if changes.get("tokens") and snap.first_token_at is None:
            changes["first_token_at"] = now
        if changes:
            self._set(**changes)
        if ended is not None:
            self._finish(ended, detail)
            return "done"
        return "data"
