"""Single values: each converter takes what TOML gave and where it stands, and returns the value
or raises ValueError naming the key and quoting the value; each formatter writes it back."""

from __future__ import annotations

import difflib
import ipaddress
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, cast
from urllib.parse import urlsplit

ManagerKind = Literal["none", "launchd", "systemd", "process", "command"]
MANAGERS: tuple[ManagerKind, ...] = ("none", "launchd", "systemd", "process", "command")

DEFAULT_URL = "http://127.0.0.1:8080"  # mlx_lm.server's own default
DEFAULT_LISTEN = "127.0.0.1:9464"

Convert = Callable[[object, str], Any]

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)", re.ASCII)
MIN_DURATION = 0.001  # below a millisecond nothing the watchdog waits for means anything
MAX_DURATION = 366 * 86400.0  # beyond a year, and far below what a timer can wait
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB)", re.ASCII)
_SIZE_UNITS = {"B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3}
_SIZE_UNITS |= {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def show(value: object) -> str:
    if isinstance(value, str):  # as TOML writes it: control characters escaped, never raw
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return repr(value)


def parse_duration(value: object, where: str) -> float:
    """`"500ms"`, `"30s"`, `"15m"`, `"1h"`, `"1h30m"` -> seconds, from 1 ms to 366 days."""
    seconds: float = duration_range(MIN_DURATION, MAX_DURATION)(value, where)
    return seconds


def duration_range(low: float, high: float) -> Convert:
    """A duration within [low, high]: beyond them nothing the key sets means anything (and a
    timer cannot wait for an arbitrary float)."""

    def convert(value: object, where: str) -> float:
        seconds = _seconds(value, where)
        if not low <= seconds <= high:
            raise ValueError(
                f"{where} = {show(value)} is out of range; write a duration from "
                f'"{format_duration(low)}" to "{format_duration(high)}"'
            )
        return seconds

    return convert


def _seconds(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f'{where} = {show(value)} is not a duration; write it like "30s"')
    if not isinstance(value, str):
        raise ValueError(f'{where} = {show(value)} has no unit; write "{value}s"')
    text = value.strip()
    if re.fullmatch(r"\d+(?:\.\d+)?", text, re.ASCII):
        raise ValueError(f'{where} = {show(value)} has no unit; write "{text}s"')
    if not text or not re.fullmatch(rf"(?:{_DURATION_RE.pattern})+", text):
        raise ValueError(
            f"{where} = {show(value)} is not a duration; use a number with ms, s, m, h or d, "
            f'like "500ms", "30s", "15m" or "1h"'
        )
    seconds = sum(float(n) * _UNITS[u] for n, u in _DURATION_RE.findall(text))
    if seconds <= 0:
        raise ValueError(f"{where} = {show(value)} must be longer than zero")
    return seconds


def format_duration(seconds: float) -> str:
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def parse_size(value: object, where: str) -> int:
    """`"10MB"`, `"512KiB"` -> bytes."""
    text = value.strip() if isinstance(value, str) else None
    match = _SIZE_RE.fullmatch(text) if text else None
    if match is None:
        hint = (
            f'write "{value}MB"'
            if isinstance(value, int) and not isinstance(value, bool)
            else ('use a number with B, KB, MB, GB, KiB, MiB or GiB, like "10MB"')
        )
        raise ValueError(f"{where} = {show(value)} is not a size; {hint}")
    size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])
    if size <= 0:
        raise ValueError(f"{where} = {show(value)} must be larger than zero")
    return size


def format_size(size: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        if size % _SIZE_UNITS[unit] == 0:
            return f"{size // _SIZE_UNITS[unit]}{unit}"
    return f"{size}B"


def parse_str(value: object, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where} = {show(value)} must be a non-empty string")
    return value


def parse_name(value: object, where: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValueError(
            f"{where} = {show(value)} is not a valid name; use letters, digits, '.', '_' or '-'"
        )
    return value


def parse_bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where} = {show(value)} must be true or false")
    return value


def int_range(low: int, high: int) -> Convert:
    def convert(value: object, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(f"{where} = {show(value)} must be a whole number from {low} to {high}")
        return value

    return convert


def float_range(low: float, high: float) -> Convert:
    def convert(value: object, where: str) -> float:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not low <= value <= high
        ):
            raise ValueError(f"{where} = {show(value)} must be a number from {low:g} to {high:g}")
        return float(value)

    return convert


def parse_url(value: object, where: str) -> str:
    text = parse_str(value, where)
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f'{where} = {show(value)} must be an http(s) URL, like "{DEFAULT_URL}"')
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ValueError(f"{where} = {show(value)} has an invalid port") from None
    # A path is a reverse proxy's prefix ("https://gw.lan/mlx"): the routes go after it. The
    # OpenAI base URL clients are given ends in /v1; the watchdog adds /v1 itself.
    path = parts.path.rstrip("/")
    if path.endswith("/v1") or parts.query or parts.fragment:
        base = f"{parts.scheme}://{parts.netloc}{path.removesuffix('/v1')}"
        raise ValueError(
            f"{where} = {show(value)} must be the server's base URL, without /v1, a query "
            f'or a fragment, like "{base}"'
        )
    return f"{parts.scheme}://{parts.netloc}{path}"


def parse_listen(value: object, where: str) -> tuple[str, int | None]:
    text = parse_str(value, where)
    if text == "off":
        return "127.0.0.1", None
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not _digits(port) or not 0 <= int(port) < 65536:
        raise ValueError(
            f'{where} = {show(value)} must be host:port, like "{DEFAULT_LISTEN}", or "off"'
        )
    return host, int(port)


def parse_agent(value: object, where: str) -> tuple[str, int] | None:
    """`agent`: where HAProxy's agent check asks (host:port), or "off"."""
    host, port = parse_listen(value, where)
    return None if port is None else (host, port)


def show_agent(value: tuple[str, int] | None) -> str:
    return "off" if value is None else f"{value[0]}:{value[1]}"


def is_loopback(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return host == "localhost"
    # ::ffff:127.0.0.1 is 127.0.0.1 (Python before 3.13 says it is not loopback)
    mapped = getattr(address, "ipv4_mapped", None)
    return bool(address.is_loopback or (mapped is not None and mapped.is_loopback))


def parse_path(value: object, where: str) -> Path:
    text = parse_str(value, where)
    if "\x00" in text:
        raise ValueError(f"{where} = {show(value)} holds a NUL character; no path can")
    return Path(text).expanduser()


def parse_str_list(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{where} = {show(value)} must be a list of strings")
    if any("\x00" in v for v in value):
        raise ValueError(f"{where} = {show(value)} holds a NUL character; no argument can")
    return tuple(cast(list[str], value))


def parse_argv(value: object, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        raise ValueError(
            f"{where} = {show(value)} must be a list of arguments, "
            f"like {json.dumps(value.split())} (it runs without a shell)"
        )
    return parse_str_list(value, where)  # [] means not set


def parse_env(value: object, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ValueError(f'{where} = {show(value)} must be a table of NAME = "value"')
    for k, v in value.items():
        if not isinstance(v, str):
            raise ValueError(f"{where}.{k} = {show(v)} must be a string")
    return dict(value)


def one_of(value: object, choices: Sequence[str], where: str) -> str:
    """`value` when it is one of `choices`; else a ValueError naming the key, the value, the
    choices and the closest one ("did you mean"), as an unknown key gets."""
    if isinstance(value, str) and value in choices:
        return value
    said = f"{where} = {show(value)} must be one of: {', '.join(choices)}"
    if isinstance(value, str):
        close = difflib.get_close_matches(value.lower(), list(choices), n=1, cutoff=0.6)
        if close:
            said += f'; did you mean "{close[0]}"?'
    raise ValueError(said)


def parse_manager(value: object, where: str) -> ManagerKind:
    return cast(ManagerKind, one_of(value, MANAGERS, where))


COMPUTE = ("auto", "cpu", "gpu")


def parse_compute(value: object, where: str) -> str:
    return one_of(value, COMPUTE, where)


def parse_kind(value: object, where: str) -> str:
    from mlx_watchdog.config.profiles import KINDS

    return one_of(value, list(KINDS), where)


def parse_domain(value: object, where: str) -> str:
    """A launchd domain: "gui/<uid>", "user/<uid>" or "system"."""
    text = parse_str(value, where)
    kind, _, uid = text.partition("/")
    if text != "system" and not (kind in ("gui", "user") and _digits(uid)):
        raise ValueError(
            f'{where} = {show(value)} must be a launchd domain: "gui/<uid>", "user/<uid>" '
            'or "system"'
        )
    return text


GUARDED_ROUTES = ("/status", "/metrics")


def parse_open_routes(value: object, where: str) -> tuple[str, ...]:
    routes = parse_str_list(value, where) if value != [] else ()
    for route in routes:
        if route not in GUARDED_ROUTES:
            raise ValueError(
                f"{where} = {show(value)}: {show(route)} is not a route that needs the token; "
                f"use {' or '.join(show(r) for r in GUARDED_ROUTES)}"
            )
    return routes


def _digits(text: str) -> bool:
    """ASCII digits only: "²³".isdigit() is True, and int() then fails naming no key."""
    return text.isascii() and text.isdigit()


DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")


def parse_when(value: object, where: str) -> str:
    """A local time of day, "HH:MM" (daily), or "Sun HH:MM" (weekly); "" for none."""
    if value == "":
        return ""
    text = parse_str(value, where).strip().lower()
    day, _, clock = text.rpartition(" ")
    hour, sep, minute = clock.partition(":")
    ok = sep and _digits(hour) and _digits(minute) and len(minute) == 2
    if not ok or int(hour) > 23 or int(minute) > 59 or day.strip() not in ("", *DAYS):
        raise ValueError(
            f'{where} = {show(value)} must be a local time "HH:MM", or a day and a time '
            f'like "Sun 04:00" (days: {", ".join(d.title() for d in DAYS)})'
        )
    day = day.strip()
    return f"{day} {int(hour):02d}:{minute}" if day else f"{int(hour):02d}:{minute}"


def parse_daily(value: object, where: str) -> str:
    """A local time of day, "HH:MM"; "" for none."""
    when = parse_when(value, where)
    if " " in when:
        raise ValueError(f'{where} = {show(value)} must be a time of day "HH:MM" (daily)')
    return when


def when_fields(when: str) -> dict[str, str]:
    """A parsed time as cron fields: hour, minute, and day_of_week when weekly."""
    day, _, clock = when.rpartition(" ")
    hour, minute = clock.split(":")
    fields = {"hour": str(int(hour)), "minute": str(int(minute))}
    return {**fields, "day_of_week": day} if day else fields
