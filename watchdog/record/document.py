"""The status document, typed: one `ServerStatus` per server and the watchdog's own line.

What /status serves and what `status`, the page, /metrics and /healthz read, by attribute. JSON
only at the edges: `to_json()` is the wire format; `from_json()` reads a daemon's answer back,
each field checked against its type (a missing or malformed one is its default, never a crash:
a daemon of another version, or a peer, may say less or otherwise). Cheap to import: `status`
reads it without the daemon's stack.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, get_args, get_origin

from mlx_watchdog.judge.budget import LastRestart
from mlx_watchdog.judge.states import UNKNOWN, UNKNOWN_EXIT

T = TypeVar("T")


@dataclass(frozen=True)
class ShownIncident:
    """The incident open now, as a status document names it."""

    id: int | None
    state: str
    began_at: float


@dataclass(frozen=True)
class Waiting:
    """A wait for abandoned work to clear instead of a restart, while it lasts."""

    waited_s: float
    restart_in_s: float
    prefill_total: int | None = None
    cure: str = "wait"  # "cancel": the abandoned requests were cancelled, waiting for the slot
    restart_cost_s: float | None = None  # what the wait is weighed against: the restart,
    destroyed_s: float | None = None  # and the work it would destroy


@dataclass(frozen=True)
class ServerStatus:
    """One server as the watchdog sees it now (or, without a daemon, as its last probe did)."""

    name: str
    url: str = ""
    manager: str = "none"
    state: str = UNKNOWN
    reason: str = ""
    serving: bool = False
    exit_code: int = UNKNOWN_EXIT
    judged_at: float | None = None
    state_since: float | None = None
    draining: bool = False
    restarting: bool = False
    blind: bool = False  # the verdict is too old to say anything about the server now
    verdict_age_s: float | None = None
    needs_person: str | None = None
    last_token_at: float | None = None
    ttft_p50_s: float | None = None
    ttft_p95_s: float | None = None
    ttft_samples: int = 0
    restarts_24h: int = 0
    incidents_24h: int = 0
    gave_up_24h: int = 0
    budget_left: int = 0
    pid: int | None = None
    rss_bytes: int | None = None
    cpu_percent: float | None = None
    abandoned_connections: int | None = None
    live_connections: int | None = None
    kind: str = "mlx_lm"
    models_finding: str | None = None
    cause: str | None = None  # why it fails (judge/cause.py), while its verdict is a failing one
    cause_because: str | None = None
    server_report: str | None = None
    server_prefill: str | None = None  # what its log says of the prefill it does
    progress_problem: str | None = None
    server_running: int | None = None
    server_waiting: int | None = None
    incident: ShownIncident | None = None
    last_restart: LastRestart | None = None
    clearing: Waiting | None = None
    restart_cost_s: float | None = None  # to the first token: measured, or the default
    restart_cost_measured: int = 0
    budget_refill_s: float | None = None  # when the oldest restart in the window stops counting
    restart_backoff_s: float | None = None  # the budget's backoff: no restart before this
    cannot_run: str | None = None  # the program a restart runs cannot run: nothing will help
    # Requests wait behind work nobody waits for (abandoned connections, and the probe past
    # slow_after without a token): with restart.drain, traffic is moved away at this sign.
    held_behind: bool = False

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, doc: object) -> ServerStatus:
        return _read(cls, doc if isinstance(doc, dict) else {})


@dataclass(frozen=True)
class WatchdogLine:
    """The watchdog itself: running (with its PID and interval) or not, and why."""

    pid: int | None = None
    version: str | None = None
    started_at: float | None = None
    interval_s: float | None = None
    running: bool = False
    history_problem: str | None = None  # the history fell back to memory, or skipped a write
    why: str | None = None  # not running: what was found instead

    def to_json(self) -> dict[str, Any]:
        if self.running:
            return {k: v for k, v in dataclasses.asdict(self).items() if k != "why"}
        return {"running": False, "why": self.why}

    @classmethod
    def from_json(cls, doc: object) -> WatchdogLine:
        return _read(cls, doc if isinstance(doc, dict) else {})


@dataclass(frozen=True)
class Status:
    """The whole document: the watchdog and each of its servers."""

    watchdog: WatchdogLine
    servers: tuple[ServerStatus, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {"watchdog": self.watchdog.to_json(), "servers": [s.to_json() for s in self.servers]}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Status:
        servers = doc.get("servers")
        return cls(
            WatchdogLine.from_json(doc.get("watchdog")),
            tuple(ServerStatus.from_json(s) for s in servers if isinstance(s, dict))
            if isinstance(servers, list)
            else (),
        )

    def server(self, name: str) -> ServerStatus | None:
        return next((s for s in self.servers if s.name == name), None)


class _Unread(ValueError):
    """A field without a default is missing or of another type."""


def _read(cls: type[T], doc: dict[str, Any]) -> T:
    """`cls` from a JSON object: each field that holds a value of its type, the rest their
    defaults. _Unread when a field without a default cannot be read (a server's name: "?")."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        ok, value = _typed(hints[f.name], doc[f.name]) if f.name in doc else (False, None)
        if ok:
            values[f.name] = value
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            if cls is not ServerStatus:
                raise _Unread(f.name)
            values[f.name] = "?"
    return cls(**values)


_SCALARS: dict[object, Callable[[object], bool]] = {
    bool: lambda v: isinstance(v, bool),
    int: lambda v: isinstance(v, int) and not isinstance(v, bool),
    float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
    str: lambda v: isinstance(v, str),
}


def _typed(hint: Any, value: object) -> tuple[bool, Any]:
    """Whether `value` is of type `hint` (as JSON carries it), and the value as that type."""
    options = get_args(hint) if get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    if value is None:
        return type(None) in options, None
    for option in options:
        check = _SCALARS.get(option)
        if check is not None and check(value):
            return True, float(value) if option is float else value  # type: ignore[arg-type]
        if (
            isinstance(option, type)
            and dataclasses.is_dataclass(option)
            and isinstance(value, dict)
        ):
            try:
                return True, _read(option, value)
            except _Unread:
                return False, None
    return False, None
