"""Another machine's watchdog, read for `fleet`: its /status over http or https (certificates
verified), under a total deadline and a byte cap, the endpoint's path kept."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DEADLINE = 5.0  # per machine, in all: one that trickles must not hold the table
CAP = 8 << 20


class PeerError(Exception):
    """The peer's /status could not be had; the message says why, in words."""


def check_url(url: str) -> str | None:
    """Why `url` cannot name a watchdog's endpoint, or None. Credentials are refused: the URL is
    printed in every row, and the token goes with --token-file."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises on a port that is not a number
    except ValueError as exc:
        return str(exc)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "give it as http://host:port or https://host:port[/path]"
    if "@" in parts.netloc:
        return "credentials in the URL would be printed with it; use --token-file"
    if parts.query or parts.fragment:
        return "a query or fragment is not part of an endpoint"
    return None


def tls(cacert: Path | None) -> Any:
    """What httpx verifies certificates with: its default bundle, or the CAs in `cacert`
    (ssl.SSLError or OSError for a file that holds none)."""
    if cacert is None:
        return True
    import ssl

    return ssl.create_default_context(cafile=str(cacert))


def in_clear(url: str) -> bool:
    """A token sent to `url` would cross a network readable: plain http beyond loopback."""
    from mlx_watchdog.config.values import is_loopback

    parts = urlsplit(url)
    return parts.scheme == "http" and not is_loopback(parts.hostname or "")


def fetch_status(
    url: str,
    *,
    token: str | None = None,
    verify: Any = True,
    deadline: float = DEADLINE,
    token_in_clear: bool = False,
) -> dict[str, Any]:
    """The document at `url`/status, parsed as the watchdog reads any answer (bounded JSON).
    The token goes only over https or loopback, unless `token_in_clear`."""
    import httpx

    from mlx_watchdog.sense.bounded import get
    from mlx_watchdog.sense.text import BadJson, load_json

    headers = {"Accept": "application/json"}
    withheld = bool(token) and in_clear(url) and not token_in_clear
    if token and not withheld:
        headers["Authorization"] = f"Bearer {token}"
    try:
        status, body = get(
            url.rstrip("/") + "/status", headers=headers, deadline=deadline, cap=CAP, verify=verify
        )
    except httpx.HTTPError as exc:
        raise PeerError(f"no answer: {exc or type(exc).__name__}") from None
    if status == 401 and withheld:
        raise PeerError(
            "HTTP 401: it wants its token, which is not sent over plain http beyond loopback "
            "(anyone on the way could read it): give its endpoint as https, or pass "
            "--token-in-clear on a network you trust"
        )
    if status == 401:
        raise PeerError("HTTP 401: it wants its token (--token-file)")
    if status != 200:
        raise PeerError(f"HTTP {status}")
    try:
        doc = load_json(body)
    except BadJson as exc:
        raise PeerError(f"not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise PeerError("not a status document")
    return doc
