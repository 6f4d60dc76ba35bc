"""The configuration's shape: frozen dataclasses whose field metadata says how each key is
parsed, shown and documented. Parsing (`parse.py`), `config check` and the template
(`render.py`) all read it, so the template can never disagree with the defaults."""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mlx_watchdog.config.profiles import PROFILES, Kind, Profile
from mlx_watchdog.config.values import (
    Convert,
    ManagerKind,
    duration_range,
    float_range,
    format_duration,
    format_size,
    int_range,
    parse_agent,
    parse_argv,
    parse_bool,
    parse_compute,
    parse_daily,
    parse_domain,
    parse_duration,
    parse_env,
    parse_kind,
    parse_manager,
    parse_name,
    parse_open_routes,
    parse_path,
    parse_size,
    parse_str,
    parse_str_list,
    parse_url,
    parse_when,
    show_agent,
)


class ConfigError(Exception):
    """The configuration cannot be used; the message lists every problem found."""


def setting(
    default: Any = MISSING,
    *,
    parse: Convert,
    doc: str,
    show: Callable[[Any], object] | None = None,
    example: object = None,
    default_factory: Callable[[], Any] | None = None,
) -> Any:
    """A config key: how it is parsed, how it is shown (default: as is), what it is for, and an
    example for the template when it has no default."""
    meta = {"parse": parse, "doc": doc, "show": show, "example": example}
    if default_factory is not None:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)  # MISSING: a required key


def _duration(value: float) -> str:
    return format_duration(value)


SPANS = ("slow_after", "wedge_after", "max_busy", "hard_timeout")  # each at most the next


@dataclass(frozen=True)
class ProbeSettings:
    """How one server is probed and judged: its thresholds and bounds."""

    prompt: str = setting(
        "ping", parse=parse_str, doc="fixed, so the prompt cache makes the probe nearly free"
    )
    max_tokens: int = setting(1, parse=int_range(1, 64), doc="tokens the probe asks for")
    slow_after: float = setting(
        10.0,
        parse=parse_duration,
        show=_duration,
        doc='a token later than this is "slow" (left out: at most half of wedge_after)',
    )
    wedge_after: float = setting(
        60.0,
        parse=parse_duration,
        show=_duration,
        doc='zero tokens this long, with nobody served: "wedged"',
    )
    max_busy: float = setting(
        900.0,
        parse=parse_duration,
        show=_duration,
        doc='busy with live clients longer than this: "wedged"',
    )
    startup_grace: float = setting(
        120.0,
        parse=parse_duration,
        show=_duration,
        doc="a (re)started server may take this long to serve",
    )
    hard_timeout: float = setting(
        1800.0,
        parse=parse_duration,
        show=_duration,
        doc="the probe itself never gives up before this",
    )
    models_timeout: float = setting(
        5.0, parse=parse_duration, show=_duration, doc="for GET /v1/models"
    )
    idle_cpu_percent: float = setting(
        1.0,
        parse=float_range(0.0, 100.0),
        doc="below this share of a core (or of the GPU's time, where the server computes "
        "there), connected clients are not being served",
    )
    skip_on_traffic: bool = setting(
        True,
        parse=parse_bool,
        doc="skip the probe (2 in a row at most) while the server's own token counter shows "
        "live clients served",
    )

    def around(self, key: str, seconds: float) -> ProbeSettings:
        """These settings with one span set, and the others moved as little as it takes to
        keep SPANS in order around it (a hard timeout at least twice max_busy, as derived)."""
        values = {k: getattr(self, k) for k in SPANS}
        values[key] = seconds
        at = SPANS.index(key)
        for lower, upper in reversed(list(itertools.pairwise(SPANS[: at + 1]))):
            values[lower] = min(values[lower], values[upper])
        for lower, upper in itertools.pairwise(SPANS[at:]):
            floor = 2 * values[lower] if upper == "hard_timeout" else values[lower]
            values[upper] = max(values[upper], floor)
        return replace(self, **values)


@dataclass(frozen=True)
class RestartSettings:
    """How one server may be restarted: budget, backoff, drain, the least-cost cure."""

    max_restarts: int = setting(3, parse=int_range(0, 1000), doc="per window")
    window: float = setting(3600.0, parse=parse_duration, show=_duration, doc="the budget's window")
    backoff: float = setting(
        30.0, parse=parse_duration, show=_duration, doc="grows between attempts"
    )
    least_cost: bool = setting(
        True,
        parse=parse_bool,
        doc="cancel or wait out a client's abandoned work when cheaper than a restart; "
        "false: a wedge is always restarted",
    )
    drain: bool = setting(False, parse=parse_bool, doc="drain before a restart")
    drain_timeout: float = setting(
        120.0, parse=parse_duration, show=_duration, doc="wait this long for live clients"
    )
    drain_command: tuple[str, ...] = setting(
        (), parse=parse_argv, doc="runs on drain", example=["/usr/local/bin/lb", "drain", "mlx"]
    )
    undrain_command: tuple[str, ...] = setting(
        (),
        parse=parse_argv,
        doc="runs on undrain",
        example=["/usr/local/bin/lb", "undrain", "mlx"],
    )
    command_timeout: float = setting(
        120.0,
        parse=parse_duration,
        show=_duration,
        doc="for restart_command and the drain commands",
    )
    stop_grace: float = setting(
        10.0,
        parse=parse_duration,
        show=_duration,
        doc='manager = "process": SIGTERM, then SIGKILL after this',
    )


@dataclass(frozen=True)
class ServerConfig:
    """One watched server, validated: where it is, what kind, how it is run and probed."""

    name: str = setting(parse=parse_name, doc="unnamed servers are mlx-<port>", example="mlx")
    url: str = setting(
        parse=parse_url,
        doc="required: the server's base URL (a path is a reverse proxy's prefix; no /v1)",
        example="http://127.0.0.1:8080",
    )
    kind: Kind = setting(
        "mlx_lm",
        parse=parse_kind,
        doc="mlx_lm | llama.cpp | vllm-mlx | rapid-mlx | omlx | mlx-openai-server | lmstudio "
        "| ollama | vllm | sglang | openai: sets match, the model rule and what the server "
        "reports",
    )
    compute: str = setting(
        "auto",
        parse=parse_compute,
        doc="auto | cpu | gpu: where the server's work runs, so where the watchdog reads that "
        "it works (auto: the GPU on macOS, the CPU elsewhere)",
    )
    api_key_file: Path | None = setting(
        None, parse=parse_path, doc="chmod 600", example="~/.config/mlx-watchdog/api-key"
    )
    model: str | None = setting(
        None,
        parse=parse_str,
        doc="leave out: the probe uses the served default",
        example="mlx-community/Qwen3-4B-4bit",
    )
    manager: ManagerKind = setting(
        "none", parse=parse_manager, doc="none | launchd | systemd | process | command"
    )
    label: str | None = setting(
        None, parse=parse_str, doc="launchd", example="com.example.mlx-server"
    )
    plist: Path | None = setting(
        None,
        parse=parse_path,
        doc="launchd, for bootstrap",
        example="~/Library/LaunchAgents/com.example.mlx-server.plist",
    )
    domain: str | None = setting(
        None,
        parse=parse_domain,
        doc="launchd: where the job is loaded (install writes it)",
        example="gui/501",
    )
    unit: str | None = setting(
        None, parse=parse_str, doc="systemd --user", example="mlx-server.service"
    )
    command: tuple[str, ...] = setting(
        (),
        parse=parse_argv,
        doc="process",
        example=["mlx_lm.server", "--model", "...", "--port", "8080"],
    )
    restart_command: tuple[str, ...] = setting(
        (), parse=parse_argv, doc="command", example=["/usr/local/bin/restart-mlx"]
    )
    match: str = setting(
        "mlx_lm",
        parse=parse_str,
        doc="the server's command line must contain this (left out: the kind's)",
    )
    env: Mapping[str, str] = setting(
        parse=parse_env,
        default_factory=dict,
        doc="for manager = process",
        example={"HF_HUB_CACHE": "/path/to/hub"},
    )
    log_file: Path | None = setting(
        None,
        parse=parse_path,
        doc="the server's output, where its prefill progress is read (manager = process: "
        "left out, state_dir/logs/NAME.log)",
        example="~/Library/Logs/mlx-server.log",
    )
    maintenance: str = setting(
        "",
        parse=parse_when,
        doc='a maintenance window, local time ("Sun 04:00" weekly, "04:00" daily): calibrate '
        "when the server is idle; empty: none",
        example="Sun 04:00",
    )
    maintenance_restart: bool = setting(
        False, parse=parse_bool, doc="a planned restart in the maintenance window too"
    )
    probe: ProbeSettings = field(default_factory=ProbeSettings)
    restart: RestartSettings = field(default_factory=RestartSettings)
    # `user:password@` (or a bare token) written in `url`, moved out of it: `url` is shown
    # everywhere (status, probe, logs, alerts, history), this never is.
    credentials: str | None = field(default=None, repr=False, compare=True)

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if "@" in parts.netloc:
            userinfo, _, hostport = parts.netloc.rpartition("@")
            object.__setattr__(self, "url", f"{parts.scheme}://{hostport}{parts.path}")
            object.__setattr__(self, "credentials", userinfo)

    @property
    def behind_proxy(self) -> bool:
        """A URL with a path: a reverse proxy's prefix, whose port is the proxy's."""
        return bool(urlsplit(self.url).path)

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)

    @property
    def profile(self) -> Profile:
        return PROFILES[self.kind]

    def api_key(self) -> str | None:
        """Read the key at use time, so a rotated key needs no reload."""
        if self.api_key_file is None:
            return None
        return self.api_key_file.read_text().strip() or None


def default_state_dir() -> Path:
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "mlx-watchdog"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "mlx-watchdog"


@dataclass(frozen=True)
class WatchdogSettings:
    """The watchdog's own settings: interval, state folder, endpoint, alerts, calendar work."""

    interval: float = setting(
        30.0,
        parse=duration_range(0.1, 86400.0),
        show=_duration,
        doc="how often each server is checked (100ms to 1 day)",
    )
    # `listen` in the file: "host:port" or "off" (listen_port None); port 0 takes a free one.
    listen_host: str = "127.0.0.1"
    listen_port: int | None = 9464
    open_routes: tuple[str, ...] = setting(
        (),
        parse=parse_open_routes,
        doc="beyond loopback, these answer without the token too (/healthz always does; "
        '"/status" opens the status page at / with it)',
        example=["/metrics"],
    )
    agent: tuple[str, int] | None = setting(
        None,
        parse=parse_agent,
        show=show_agent,
        doc='HAProxy\'s agent check asks here (agent-send "<server name>\\n"): each server '
        'answered "up ready", "drain" or "down" as its state says; "off": none',
        example="127.0.0.1:9465",
    )
    state_dir: Path = setting(
        parse=parse_path,
        default_factory=default_state_dir,
        show=str,
        doc="history database and token",
    )
    alerts: tuple[str, ...] = setting(
        (), parse=parse_str_list, doc="Apprise URLs", example=["ntfy://my-topic"]
    )
    on_event: tuple[str, ...] = setting(
        (),
        parse=parse_argv,
        doc="gets each event as JSON on stdin",
        example=["/usr/local/bin/notify"],
    )
    log_max_size: int = setting(
        10 * 2**20,
        parse=parse_size,
        show=format_size,
        doc="its own log (under launchd) and each server's log_file",
    )
    log_keep: int = setting(3, parse=int_range(0, 100), doc="rotated copies kept: log.1 .. log.3")
    daily_summary: str = setting(
        "",
        parse=parse_daily,
        doc="a summary alert of the last 24 h at this local time each day; empty: none",
        example="08:00",
    )


@dataclass(frozen=True)
class Config:
    """The whole config, validated once: the watchdog's settings and every server."""

    watchdog: WatchdogSettings
    servers: tuple[ServerConfig, ...]
    source: Path | None = None
    warnings: tuple[str, ...] = ()

    def server(self, name: str) -> ServerConfig:
        for server in self.servers:
            if server.name == name:
                return server
        names = ", ".join(f'"{s.name}"' for s in self.servers)
        raise ConfigError(f'no server named "{name}"; configured: {names}')
