"""What every request to a server carries: its TLS context, its credentials, a size cap."""

from __future__ import annotations

import base64
import errno
import functools
import ssl
from typing import Any
from urllib.parse import unquote

from mlx_watchdog.config import ServerConfig

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


def refused(exc: BaseException) -> bool:
    seen: BaseException | None = exc
    while seen is not None:
        if (
            isinstance(seen, ConnectionRefusedError)
            or getattr(seen, "errno", None) == errno.ECONNREFUSED
        ):
            return True
        seen = seen.__cause__ or seen.__context__
    return "connection refused" in str(exc).lower()
