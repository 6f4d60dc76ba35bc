"""The generation probe and the `/v1/models` check.

The probe is one tiny streaming chat completion. It runs in its own thread so the caller can
watch the server's process while it waits, and it never gives up early: the connection stays
open up to `hard_timeout`, because a probe that disconnects is one more abandoned request.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import functools
import json
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any
from urllib.parse import unquote

import httpx

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.config.profiles import InMemory
from mlx_watchdog.sense.bounded import BadJson, Cutoff, TooLarge, get, load_json, read_capped
from mlx_watchdog.sense.findings import (
    DEAD_FINDINGS,
    DOWN_FINDINGS,
    OK,
    Clock,
    ModelsCheck,
    ProbeFinding,
    ProbeSnapshot,
)

__all__ = [
    "DEAD_FINDINGS",
    "DOWN_FINDINGS",
    "OK",
    "ModelsCheck",
    "Probe",
    "ProbeFinding",
    "ProbeSnapshot",
]


MAX_BODY = 1 << 20  # a 1-token answer is a few kB; more means the server ignores max_tokens
MAX_ERROR_BODY = 64 << 10
CONNECT_TIMEOUT = 10.0


def probe_body(server: ServerConfig) -> dict[str, Any]:
    # No "seed" (it forces serial serving) and no "model" unless configured (a different
    # name makes mlx_lm.server load that model).
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": server.probe.prompt}],
        "max_tokens": server.probe.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    if server.model:
        body["model"] = server.model
    return body


@functools.cache
def tls() -> ssl.SSLContext:
    """One TLS context for every probe: building one loads the CA store (~30 ms of CPU).
    The same CA bundle httpx uses by default (certifi)."""
    import certifi

    return ssl.create_default_context(cafile=certifi.where())


def auth_headers(server: ServerConfig) -> dict[str, str]:
    """The API key as a bearer token; else the URL's `user:password@` as basic auth."""
    key = server.api_key()
    if key:
        return {"Authorization": f"Bearer {key}"}
    if server.credentials:
        user, _, password = server.credentials.partition(":")
        pair = f"{unquote(user)}:{unquote(password)}".encode()
        return {"Authorization": "Basic " + base64.b64encode(pair).decode()}
    return {}


class Probe:
    """One generation probe in flight. `start()` it, then read `snapshot()` at any time."""

    def __init__(
        self,
        server: ServerConfig,
        *,
        clock: Clock = time.time,
        transport: httpx.BaseTransport | None = None,
        on_connect: Callable[[tuple[str, int]], None] | None = None,
    ) -> None:
        self.server = server
        self._clock = clock
        self._on_connect = on_connect
        self._transport = transport
        self._lock = threading.Lock()
        self._snap = ProbeSnapshot(started_at=clock())
        self._sock: socket.socket | None = None
        self.local_address: tuple[str, int] | None = None  # excluded from the live clients
        self._aborted = False
        self._cutoff = Cutoff(server.probe.hard_timeout)
        self._thread = threading.Thread(target=self._run, name=f"probe-{server.name}", daemon=True)

    def start(self) -> Probe:
        with self._lock:
            self._snap = ProbeSnapshot(started_at=self._clock())
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
                    self._snap, finding=finding, detail=detail, done_at=self._clock()
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
            self._set(connected_at=self._clock())
        elif event == "http11.receive_response_headers.complete":
            self._set(headers_at=self._clock())

    def _run(self) -> None:
        with self._cutoff:
            self._exchange()
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
                self._post(client, server, headers, hard)
        except httpx.HTTPError as exc:
            if self._cutoff.fired and not self._aborted:
                return  # _run judges what came by the deadline
            self._failed(exc, hard)

    def _failed(self, exc: httpx.HTTPError, hard: float) -> None:
        if isinstance(exc, httpx.ConnectError):
            refused = _refused(exc)
            self._finish(ProbeFinding.REFUSED if refused else ProbeFinding.CONNECT_ERROR, str(exc))
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
                self._set(headers_at=self._clock())
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
            if self._clock() - snap.started_at > hard:
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
        """A 200 answer that is not a stream: accept a proper non-streaming completion."""
        if body.lstrip()[:1] == b"<":
            return ProbeFinding.HTML_ERROR, "200 with an HTML page"
        try:
            data = load_json(body)
        except BadJson as exc:
            return ProbeFinding.INVALID_JSON, f"{exc}: {_excerpt(body)}"
        if not isinstance(data, dict):
            return ProbeFinding.INVALID_JSON, _excerpt(body)
        if "error" in data:
            return (
                ProbeFinding.HTTP_ERROR,
                f"200 with error: {_excerpt(json.dumps(data['error']).encode())}",
            )
        now = self._clock()
        usage = _dict(data.get("usage"))
        choices = _list(data.get("choices"))
        text = ""
        finish = None
        for ch in choices:
            if isinstance(ch, dict):
                msg = _dict(ch.get("message"))
                text += str(msg.get("content") or "") + str(msg.get("reasoning_content") or "")
                finish = ch.get("finish_reason") or finish
        tokens = _int(usage.get("completion_tokens")) or (1 if text else 0)
        self._set(
            tokens=tokens,
            finish_reason=finish,
            first_data_at=now,
            first_token_at=now if tokens else None,
            **_usage(usage),
        )
        if finish == "error":
            return ProbeFinding.FINISH_ERROR, "non-streaming answer"
        return (
            (OK, "non-streaming answer")
            if tokens
            else (ProbeFinding.ZERO_TOKENS, "non-streaming answer")
        )

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
        now = self._clock()
        if self.snapshot().first_data_at is None:
            self._set(first_data_at=now)
        if payload == b"[DONE]":
            if self.snapshot().tokens == 0:
                self._finish(ProbeFinding.DONE_WITHOUT_TOKEN, "[DONE] with no token")
            else:
                self._finish(OK)
            return "done"
        try:
            event = load_json(payload)
        except BadJson:
            self._finish(ProbeFinding.INVALID_JSON, _excerpt(payload))
            return "done"
        if not isinstance(event, dict):
            self._finish(ProbeFinding.INVALID_JSON, _excerpt(payload))
            return "done"
        if "error" in event:
            self._finish(ProbeFinding.STREAM_ERROR, _excerpt(json.dumps(event["error"]).encode()))
            return "done"
        snap = self.snapshot()
        tokens = snap.tokens
        finish = snap.finish_reason
        for ch in _list(event.get("choices")):
            if not isinstance(ch, dict):
                continue
            delta = _dict(ch.get("delta"))
            # Count tokens, not text: a reasoning model's first token can be empty content.
            if (
                delta.get("content")
                or delta.get("reasoning_content")
                or delta.get("reasoning")
                or delta.get("tool_calls")
            ):
                tokens += 1
            finish = ch.get("finish_reason") or finish
        usage = event.get("usage") if isinstance(event.get("usage"), dict) else None
        if usage is not None:
            tokens = max(tokens, _int(usage.get("completion_tokens")))
        changes: dict[str, Any] = {"tokens": tokens, "finish_reason": finish}
        if usage is not None:
            changes.update(_usage(usage))
        if tokens and snap.first_token_at is None:
            changes["first_token_at"] = now
        self._set(**changes)
        if finish == "error":
            self._finish(ProbeFinding.FINISH_ERROR, 'finish_reason "error"')
            return "done"
        return "data"


def classify_error(status: int, ctype: str, body: bytes | None) -> tuple[ProbeFinding, str]:
    if body is None:
        return ProbeFinding.BODY_TOO_LARGE, f"HTTP {status} with a huge body"
    if status in (401, 403):
        return ProbeFinding.AUTH_FAILED, f"HTTP {status}: check api_key_file"
    if "text/html" in ctype or body.lstrip()[:1] == b"<":
        return ProbeFinding.HTML_ERROR, f"HTTP {status} with an HTML page"
    try:
        data = load_json(body)
    except BadJson:
        return ProbeFinding.HTTP_ERROR, f"HTTP {status}: {_excerpt(body)}"
    if isinstance(data, dict) and "error" in data:
        err = data["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        if status == 503 and "loading" in str(msg).lower():
            return ProbeFinding.LOADING, f"HTTP 503: {_excerpt(str(msg).encode())}"
        return ProbeFinding.HTTP_ERROR, f"HTTP {status}: {_excerpt(str(msg).encode())}"
    return ProbeFinding.HTTP_ERROR, f"HTTP {status}: {_excerpt(body)}"


# -- /v1/models ----------------------------------------------------------------------------


def check_models(
    server: ServerConfig,
    *,
    clock: Clock = time.time,
    transport: httpx.BaseTransport | None = None,
    on_connect: Callable[[tuple[str, int]], None] | None = None,
) -> ModelsCheck:
    """GET /v1/models under `models_timeout` in all and a 1 MiB cap. `on_connect` learns the
    connection's client address: the server may hold it after a timeout, and it is the
    watchdog's own, never a client's."""
    start = clock()
    seconds = server.probe.models_timeout

    def done(
        status: int | None, finding: str, detail: str, ids: tuple[str, ...] = ()
    ) -> ModelsCheck:
        return ModelsCheck(status, finding == "ok", finding, detail, ids, clock() - start)

    try:
        headers = auth_headers(server)
    except OSError as exc:
        return done(None, "error", f"cannot read api_key_file: {exc.strerror}")
    try:
        status, body = get(
            server.url + "/v1/models",
            headers=headers,
            deadline=seconds,
            cap=MAX_BODY,
            transport=transport,
            verify=tls(),
            on_connect=on_connect,
        )
    except httpx.ConnectError as exc:
        return done(None, "refused" if _refused(exc) else "error", str(exc))
    except TooLarge:
        return done(None, "too_large", "body over 1 MiB")
    except httpx.TimeoutException:
        return done(None, "timeout", f"no whole answer within {seconds:g}s")
    except httpx.HTTPError as exc:
        return done(None, "error", f"{type(exc).__name__}: {exc}")
    if status != 200:
        return done(status, "http_error", f"HTTP {status}: {_excerpt(body)}")
    if not body.strip():
        return done(
            status,
            "empty_body",
            "200 with an empty body (a missing Hugging Face cache folder does this)",
        )
    try:
        data = load_json(body)
    except BadJson as exc:
        return done(status, "invalid_json", f"{exc}: {_excerpt(body, 60)}")
    ids = model_ids(data)
    if ids is None:
        return done(status, "invalid_json", 'no "data" list')
    if server.model and server.model not in ids:
        return done(
            status, "not_listed", f'"{server.model}" is not among {len(ids)} listed models', ids
        )
    return done(status, "ok", f"{len(ids)} models listed", ids)


def in_memory(doc: object, memory: InMemory) -> tuple[str, ...]:
    """The model names a server's in-memory list (`InMemory`) holds, in its order."""
    entries = doc.get(memory.items) if isinstance(doc, dict) else None
    names: list[str] = []
    for entry in entries if isinstance(entries, list) else ():
        if not isinstance(entry, dict):
            continue
        if memory.instances:
            loaded = entry.get(memory.instances)
            entry = loaded[0] if isinstance(loaded, list) and loaded else None
            if not isinstance(entry, dict):
                continue
        name = entry.get(memory.name)
        if isinstance(name, str) and name:
            names.append(name)
    return tuple(names)


def model_ids(data: object) -> tuple[str, ...] | None:
    """The ids a /v1/models answer lists; None when it has no "data" list."""
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return None
    return tuple(str(e["id"]) for e in entries if isinstance(e, dict) and "id" in e)


def _usage(usage: dict[str, Any]) -> dict[str, Any]:
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return {
        "prompt_tokens": _int(usage.get("prompt_tokens")) if "prompt_tokens" in usage else None,
        "cached_tokens": _int(cached) if cached is not None else None,
    }


def _refused(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if (
            isinstance(seen, ConnectionRefusedError)
            or getattr(seen, "errno", None) == errno.ECONNREFUSED
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return "connection refused" in str(exc).lower()


def _dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def _excerpt(body: bytes, limit: int = 120) -> str:
    text = body.decode(errors="replace").strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit] + "..."
