"""Cancelling abandoned requests through the server's own route, where its kind has one.

Shapes from each project's source. SGLang (sgl-project/sglang, `http_server.py` at 0025436):
`POST /abort_request` with `{"rid": "", "abort_all": true}`, 200 with no body. vllm-mlx 0.4.1
(waybarrios/vllm-mlx 4b654c0, `server.py`) and Rapid-MLX (raullenchai/Rapid-MLX 0059a95,
`routes/health.py`): `GET /v1/status` lists `requests` (`request_id`, `status`, `phase`,
`elapsed_s`, `prompt_tokens`); `POST /v1/requests/{request_id}/cancel` cancels one, 404 when it
is unknown or finished.

Only the requests of clients that left are cancelled: a listed request older than every live
client's connection (the watchdog first sees each connection at a known time, at most an
interval after it opened, so a request must be older than the oldest live connection's age plus
LIVE_SLACK plus that interval), never the probe's (the one whose age is nearest the probe's
wait), never one younger than the probe (a client that came since). A request with no age (a
vllm-mlx SimpleEngine request in prefill reports `elapsed_s` 0.0 until its first output) is
never taken for an old one. SGLang lists no request ids over HTTP, so it is told to abort all,
which is done only when no live client is connected (the probe's request goes too; the next
probe replaces it).
"""

from __future__ import annotations

import json
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.sense.bounded import Overdue, send
from mlx_watchdog.sense.request import auth_headers, tls
from mlx_watchdog.sense.text import BadJson, load_json

CANCEL_TIMEOUT = 5.0  # seconds for each call
CANCEL_BUDGET = 10.0  # seconds for all the calls of one cancel: it runs inside a tick
MAX_CANCEL_ANSWER = 1 << 20  # bytes of a status or cancel answer
MAX_CANCELS = 32  # requests cancelled in one go at most
PROBE_NEAR = 1.0  # s: the listed request whose age is this near the probe's wait is the probe
YOUNGER = 0.5  # s: a request younger than the probe by more than this came since
LIVE_SLACK = 0.5  # s: besides an interval: the ages are rounded and read at different times


@dataclass(frozen=True)
class Cancelled:
    """How a cancel through the server's own route went: taken or not, and how many."""

    ok: bool  # the server took every cancel asked of it
    detail: str
    count: int = 0


Send = Callable[..., tuple[int, bytes]]


def cancel_abandoned(
    server: ServerConfig,
    probe_age_s: float,
    live_age_s: float | None = None,
    *,
    call: Send = send,
    mono: Callable[[], float] = time.monotonic,
) -> Cancelled:
    """Cancel the requests of clients that left: not the probe's (waiting `probe_age_s`), not
    newer ones, and none a live client may have sent (`live_age_s`: the oldest live
    connection's age as the watchdog saw it, interval included; None: none is connected),
    within CANCEL_BUDGET seconds in all."""
    style = server.profile.cancel
    ends = mono() + CANCEL_BUDGET

    def bounded(*args: Any, **kw: Any) -> tuple[int, bytes]:
        left = min(CANCEL_TIMEOUT, ends - mono())
        if left <= 0:
            raise Overdue(f"the cancel took longer than {CANCEL_BUDGET:g}s in all")
        return call(*args, **{**kw, "deadline": left})

    try:
        if style == "abort_all":
            if live_age_s is not None:
                return Cancelled(
                    False, "a live client is connected: abort_all would end its request too"
                )
            return _abort_all(server, bounded)
        if style == "by_id":
            return _by_id(server, probe_age_s, live_age_s, bounded)
    except (httpx.HTTPError, OSError) as exc:
        return Cancelled(False, f"the server's cancel route did not answer: {_said(exc)}")
    return Cancelled(False, f"{server.profile.title} has no route to cancel a request")


def _abort_all(server: ServerConfig, call: Send) -> Cancelled:
    body = json.dumps({"rid": "", "abort_all": True}).encode()
    status, _ = _call(server, call, "POST", "/abort_request", body)
    if status != 200:
        return Cancelled(False, f"POST /abort_request answered {status}")
    return Cancelled(True, "POST /abort_request (abort_all) answered 200", 1)


def _by_id(
    server: ServerConfig, probe_age_s: float, live_age_s: float | None, call: Send
) -> Cancelled:
    status, text = _call(server, call, "GET", "/v1/status")
    if status != 200:
        return Cancelled(False, f"GET /v1/status answered {status}")
    try:
        ids = abandoned_ids(load_json(text), probe_age_s, live_age_s)
    except (BadJson, ValueError) as exc:
        return Cancelled(False, f"GET /v1/status: {exc}")
    if not ids:
        whose = "the probe's" if live_age_s is None else "the probe's and live clients'"
        return Cancelled(False, f"GET /v1/status lists no request but {whose}")
    done, refused = 0, []
    for request_id in ids[:MAX_CANCELS]:
        path = f"/v1/requests/{urllib.parse.quote(request_id, safe='')}/cancel"
        answer, _ = _call(server, call, "POST", path)
        if answer == 200:
            done += 1
        elif answer != 404:  # 404: it finished meanwhile, which is as good
            refused.append(f"{request_id}: {answer}")
    if refused:
        return Cancelled(False, f"cancelled {done}; refused {', '.join(refused)}", done)
    return Cancelled(True, f"cancelled {done} of {len(ids)} request(s) of clients that left", done)


def abandoned_ids(doc: object, probe_age_s: float, live_age_s: float | None = None) -> list[str]:
    """The ids in a `/v1/status` document that are neither the probe's, nor newer, nor as
    young as a live connection (`live_age_s`, None when none is connected)."""
    requests = doc.get("requests") if isinstance(doc, dict) else None
    if not isinstance(requests, list):
        raise ValueError('no "requests" list')
    aged: list[tuple[str, float]] = []
    for r in requests:
        rid = r.get("request_id") if isinstance(r, dict) else None
        elapsed = r.get("elapsed_s") if isinstance(r, dict) else None
        if not isinstance(rid, str) or not 0 < len(rid) <= 200 or isinstance(elapsed, bool):
            continue
        if rid in (".", "..") or "/" in rid:
            continue  # quoted, it would still name another route
        if isinstance(elapsed, (int, float)):
            aged.append((rid, float(elapsed)))
    near = min(aged, key=lambda a: abs(a[1] - probe_age_s), default=None)
    probe = near[0] if near is not None and abs(near[1] - probe_age_s) < PROBE_NEAR else None
    floor = probe_age_s - YOUNGER
    if live_age_s is not None:
        floor = max(floor, live_age_s + LIVE_SLACK)
    return [rid for rid, age in aged if rid != probe and age > floor]


def _call(
    server: ServerConfig, call: Send, method: str, path: str, body: bytes | None = None
) -> tuple[int, bytes]:
    headers = {**auth_headers(server), "Content-Type": "application/json"}
    return call(
        method,
        server.url + path,
        headers=headers,
        deadline=CANCEL_TIMEOUT,
        cap=MAX_CANCEL_ANSWER,
        body=body,
        verify=tls(),
    )


def _said(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
