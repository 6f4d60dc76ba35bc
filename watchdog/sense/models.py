"""`GET /v1/models`, and the model lists servers that load on demand keep."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeGuard

import httpx

from mlx_watchdog.config import ServerConfig
from mlx_watchdog.config.profiles import InMemory
from mlx_watchdog.sense.answer import excerpt
from mlx_watchdog.sense.bounded import TooLarge, get
from mlx_watchdog.sense.findings import EMPTY_MODELS_FIX, Clock, ModelsCheck
from mlx_watchdog.sense.request import MAX_BODY, auth_headers, refused, tls
from mlx_watchdog.sense.text import REPLACEMENT, BadJson, load_json

EMPTY_BODY = (
    f"200 with an empty body (a missing Hugging Face cache folder does this): {EMPTY_MODELS_FIX}"
)


def check_models(
    server: ServerConfig,
    *,
    mono: Clock = time.monotonic,
    transport: httpx.BaseTransport | None = None,
    on_connect: Callable[[tuple[str, int]], None] | None = None,
) -> ModelsCheck:
    """GET /v1/models under `models_timeout` in all and a 1 MiB cap. `on_connect` learns the
    connection's client address: the server may hold it after a timeout, and it is the
    watchdog's own, never a client's."""
    start = mono()
    seconds = server.probe.models_timeout

    def done(
        status: int | None, finding: str, detail: str, ids: tuple[str, ...] = ()
    ) -> ModelsCheck:
        return ModelsCheck(status, finding == "ok", finding, detail, ids, mono() - start)

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
        return done(None, "refused" if refused(exc) else "error", str(exc))
    except TooLarge:
        return done(None, "too_large", "body over 1 MiB")
    except httpx.TimeoutException:
        return done(None, "timeout", f"no whole answer within {seconds:g}s")
    except httpx.HTTPError as exc:
        return done(None, "error", f"{type(exc).__name__}: {exc}")
    if status != 200:
        return done(status, "http_error", f"HTTP {status}: {excerpt(body)}")
    if not body.strip():
        return done(status, "empty_body", EMPTY_BODY)
    try:
        data = load_json(body)
    except BadJson as exc:
        return done(status, "invalid_json", f"{exc}: {excerpt(body, 60)}")
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
        if nameable(name):
            names.append(name)
    return tuple(names)


def model_ids(data: object) -> tuple[str, ...] | None:
    """The ids a /v1/models answer lists; None when it has no "data" list."""
    entries = data.get("data") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        return None
    return tuple(e["id"] for e in entries if isinstance(e, dict) and nameable(e.get("id")))


def nameable(name: object) -> TypeGuard[str]:
    """A model name a request can carry back as the server spelled it: a string, not empty,
    that had no lone surrogate (`load_json` made those U+FFFD)."""
    return isinstance(name, str) and bool(name) and REPLACEMENT not in name


def models_in_memory(
    server: ServerConfig,
    *,
    on_connect: Callable[[tuple[str, int]], None] | None = None,
) -> tuple[str, ...] | None:
    """The models a server that loads on demand holds now (its profile's list), under
    `models_timeout` and the 1 MiB cap; None where it has no such list or it cannot be read."""
    memory = server.profile.in_memory
    if memory is None:
        return None
    try:
        status, body = get(
            server.url + memory.path,
            headers=auth_headers(server),
            deadline=server.probe.models_timeout,
            cap=MAX_BODY,
            verify=tls(),
            on_connect=on_connect,
        )
        return in_memory(load_json(body), memory) if status == 200 else None
    except (httpx.HTTPError, BadJson, OSError):
        return None
