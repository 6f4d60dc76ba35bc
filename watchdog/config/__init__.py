"""TOML configuration, validated once into frozen dataclasses.

Every error names where it is (`server "qwen": probe.wedge_after`), quotes the value and says
what is expected. All errors of a file are reported together, so one run fixes them all.
"""

from __future__ import annotations

import difflib
import ipaddress
import itertools
import json
import os
import re
import stat
import sys
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, cast
from urllib.parse import urlsplit

Manager = Literal["none", "launchd", "systemd", "process", "command"]
MANAGERS: tuple[Manager, ...] = ("none", "launchd", "systemd", "process", "command")

DEFAULT_URL = "http://127.0.0.1:8080"  # mlx_lm.server's own default
DEFAULT_LISTEN = "127.0.0.1:9464"
CONFIG_ENV = "MLX_WATCHDOG_CONFIG"

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")
_DURATION_RE = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


class ConfigError(Exception):
    """The configuration cannot be used; the message lists every problem found."""


@dataclass(frozen=True)
class ProbeSettings:
    prompt: str = "ping"
    max_tokens: int = 1
    slow_after: float = 10.0
    wedge_after: float = 60.0
    max_busy: float = 900.0
    startup_grace: float = 120.0
    hard_timeout: float = 1800.0
    models_timeout: float = 5.0
    # Below this CPU share a process with connected clients is idle, not serving them.
    idle_cpu_percent: float = 1.0


@dataclass(frozen=True)
class RestartSettings:
    max_restarts: int = 3
    window: float = 3600.0
    backoff: float = 30.0
    drain: bool = False
    drain_timeout: float = 120.0
    drain_command: tuple[str, ...] = ()
    undrain_command: tuple[str, ...] = ()
    command_timeout: float = 120.0  # for restart_command, drain_command, undrain_command
    stop_grace: float = 10.0  # SIGTERM to SIGKILL, for manager = "process"


@dataclass(frozen=True)
class ServerConfig:
    name: str
    url: str
    api_key_file: Path | None = None
    model: str | None = None
    manager: Manager = "none"
    label: str | None = None
    plist: Path | None = None  # launchd: default ~/Library/LaunchAgents/<label>.plist
    unit: str | None = None
    command: tuple[str, ...] = ()
    restart_command: tuple[str, ...] = ()
    match: str = "mlx_lm"
    env: Mapping[str, str] = field(default_factory=dict)
    log_file: Path | None = None
    probe: ProbeSettings = field(default_factory=ProbeSettings)
    restart: RestartSettings = field(default_factory=RestartSettings)

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)

    def api_key(self) -> str | None:
        """Read the key at use time, so a rotated key needs no reload."""
        if self.api_key_file is None:
            return None
        return self.api_key_file.read_text().strip() or None


@dataclass(frozen=True)
class WatchdogSettings:
    interval: float = 30.0
    listen_host: str = "127.0.0.1"
    listen_port: int | None = 9464  # None: no endpoint ("off"); 0: any free port
    state_dir: Path = field(default_factory=lambda: default_state_dir())
    alerts: tuple[str, ...] = ()
    on_event: tuple[str, ...] = ()
    log_max_size: int = 10 * 2**20  # the watchdog's own log and each server's log_file
    log_keep: int = 3


@dataclass(frozen=True)
class Config:
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


def default_config_path(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "mlx-watchdog" / "config.toml"


def resolve_config_path(
    path: Path | None, env: Mapping[str, str] | None = None
) -> tuple[Path, bool]:
    """The file to read, and whether the user named it (then it must exist)."""
    env = os.environ if env is None else env
    if path is not None:
        return path, True
    if env.get(CONFIG_ENV):
        return Path(env[CONFIG_ENV]), True
    return default_config_path(env), False


def default_state_dir() -> Path:
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / "mlx-watchdog"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "mlx-watchdog"


def parse_duration(value: object, where: str) -> float:
    """`"500ms"`, `"30s"`, `"15m"`, `"1h"`, `"1h30m"` -> seconds."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(f'{where} = {_show(value)} is not a duration; write it like "30s"')
    if not isinstance(value, str):
        raise ValueError(f'{where} = {_show(value)} has no unit; write "{value}s"')
    text = value.strip()
    if re.fullmatch(r"\d+(?:\.\d+)?", text):
        raise ValueError(f'{where} = {_show(value)} has no unit; write "{text}s"')
    if not text or not re.fullmatch(rf"(?:{_DURATION_RE.pattern})+", text):
        raise ValueError(
            f"{where} = {_show(value)} is not a duration; use a number with ms, s, m, h or d, "
            f'like "500ms", "30s", "15m" or "1h"'
        )
    seconds = sum(float(n) * _UNITS[u] for n, u in _DURATION_RE.findall(text))
    if seconds <= 0:
        raise ValueError(f"{where} = {_show(value)} must be longer than zero")
    return seconds


_SIZE_RE = re.compile(r"(\d+(?:\.\d+)?)\s*(B|KB|MB|GB|KiB|MiB|GiB)")
_SIZE_UNITS = {"B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3}
_SIZE_UNITS |= {"KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


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
        raise ValueError(f"{where} = {_show(value)} is not a size; {hint}")
    size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2)])
    if size <= 0:
        raise ValueError(f"{where} = {_show(value)} must be larger than zero")
    return size


def format_size(size: int) -> str:
    for unit in ("GiB", "MiB", "KiB"):
        if size % _SIZE_UNITS[unit] == 0:
            return f"{size // _SIZE_UNITS[unit]}{unit}"
    return f"{size}B"


def format_duration(seconds: float) -> str:
    if seconds < 1:
        return f"{round(seconds * 1000)}ms"
    for unit, size in (("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{int(seconds // size)}{unit}"
    return f"{seconds:g}s"


def load_config(path: Path | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Read and validate the configuration.

    `path` wins, then `$MLX_WATCHDOG_CONFIG`, then the default path; a missing default file
    means the embedded default: one server at mlx_lm.server's default address.
    """
    env = os.environ if env is None else env
    source, explicit = resolve_config_path(path, env)
    if not source.exists():
        if explicit:
            raise ConfigError(
                f"config file {source} does not exist; `mlx-watchdog config init` writes one"
            )
        return parse_config({}, source=None)
    try:
        data = tomllib.loads(source.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror}") from None
    return parse_config(data, source=source)


def parse_config(data: Mapping[str, Any], source: Path | None = None) -> Config:
    errors: list[str] = []
    warnings: list[str] = []
    _unknown(data, {"watchdog", "server"}, "", errors)
    watchdog = _watchdog(_table(data.get("watchdog", {}), "[watchdog]", errors), errors)

    raw_servers = data.get("server", [])
    if not isinstance(raw_servers, list) or not all(isinstance(s, dict) for s in raw_servers):
        errors.append("server must be written as [[server]] tables")
        raw_servers = []
    if not raw_servers:
        raw_servers = [{"url": DEFAULT_URL}]
    servers = [_server(raw, i, errors, warnings) for i, raw in enumerate(raw_servers)]

    seen: set[str] = set()
    for server in servers:
        if server is not None:
            if server.name in seen:
                errors.append(f'server "{server.name}": name is used twice; names must be unique')
            seen.add(server.name)
    if errors:
        where = f"{source}: " if source else ""
        raise ConfigError(where + ("\n" + where).join(errors))
    if watchdog.listen_port is not None and not _loopback(watchdog.listen_host):
        warnings.append(
            f'watchdog.listen = "{watchdog.listen_host}:{watchdog.listen_port}" is reachable from '
            "other machines: /healthz, /status and /metrics answer anyone there (the POST "
            "actions still need the token)"
        )
    return Config(
        watchdog=watchdog,
        servers=tuple(s for s in servers if s is not None),
        source=source,
        warnings=tuple(warnings),
    )


# -- sections ------------------------------------------------------------------------------

_WATCHDOG_KEYS = {f.name for f in fields(WatchdogSettings)} - {"listen_host", "listen_port"} | {
    "listen"
}
_SERVER_KEYS = {f.name for f in fields(ServerConfig)}
_PROBE_KEYS = {f.name for f in fields(ProbeSettings)}
_RESTART_KEYS = {f.name for f in fields(RestartSettings)}


def _watchdog(raw: Mapping[str, Any], errors: list[str]) -> WatchdogSettings:
    _unknown(raw, _WATCHDOG_KEYS, "[watchdog]", errors)
    d = WatchdogSettings()
    c = _Collector("watchdog.", errors)
    interval = c.get(raw, "interval", parse_duration, d.interval)
    host, port = c.get(raw, "listen", _parse_listen, (d.listen_host, d.listen_port))
    state_dir = c.get(raw, "state_dir", _parse_path, d.state_dir)
    alerts = c.get(raw, "alerts", _parse_str_list, ())
    on_event = c.get(raw, "on_event", _parse_argv, ())
    log_max_size = c.get(raw, "log_max_size", parse_size, d.log_max_size)
    log_keep = c.get(raw, "log_keep", _int_range(0, 100), d.log_keep)
    return WatchdogSettings(
        interval, host, port, state_dir, alerts, on_event, log_max_size, log_keep
    )


def _server(
    raw: Mapping[str, Any], index: int, errors: list[str], warnings: list[str]
) -> ServerConfig | None:
    name_value = raw.get("name")
    label = f'server "{name_value}"' if isinstance(name_value, str) else f"server #{index + 1}"
    c = _Collector(f"{label}: ", errors)
    _unknown(raw, _SERVER_KEYS, f"{label}: [server]", errors)

    if "url" not in raw:
        errors.append(f'{label}: url is required, like url = "{DEFAULT_URL}"')
        return None
    url = c.get(raw, "url", parse_url, DEFAULT_URL)
    name = c.get(raw, "name", _parse_name, f"mlx-{urlsplit(url).port or 80}")
    api_key_file = c.get(raw, "api_key_file", _parse_path, None)
    manager = c.get(raw, "manager", _parse_manager, "none")
    server = ServerConfig(
        name=name,
        url=url,
        api_key_file=api_key_file,
        model=c.get(raw, "model", _parse_str, None),
        manager=manager,
        label=c.get(raw, "label", _parse_str, None),
        plist=c.get(raw, "plist", _parse_path, None),
        unit=c.get(raw, "unit", _parse_str, None),
        command=c.get(raw, "command", _parse_argv, ()),
        restart_command=c.get(raw, "restart_command", _parse_argv, ()),
        match=c.get(raw, "match", _parse_str, "mlx_lm"),
        env=c.get(raw, "env", _parse_env, {}),
        log_file=c.get(raw, "log_file", _parse_path, None),
        probe=_probe(
            _table(raw.get("probe", {}), f"{label}: [server.probe]", errors), label, errors
        ),
        restart=_restart(
            _table(raw.get("restart", {}), f"{label}: [server.restart]", errors), label, errors
        ),
    )
    needs = {
        "launchd": "label",
        "systemd": "unit",
        "process": "command",
        "command": "restart_command",
    }
    if manager in needs and not getattr(server, needs[manager]):
        errors.append(f'{label}: manager = "{manager}" needs {needs[manager]} to be set')
    if api_key_file is not None:
        _check_key_file(api_key_file, label, errors, warnings)
    return server


_SPANS = ("slow_after", "wedge_after", "max_busy", "hard_timeout")  # each at most the next


def _probe(raw: Mapping[str, Any], label: str, errors: list[str]) -> ProbeSettings:
    _unknown(raw, _PROBE_KEYS, f"{label}: [server.probe]", errors)
    d = ProbeSettings()
    c = _Collector(f"{label}: probe.", errors)
    written = {key: c.get(raw, key, parse_duration, None) for key in _SPANS if key in raw}
    slow, wedge, busy, hard = (written.get(key) for key in _SPANS)
    # What the user left out is derived from what they wrote, so only written values conflict.
    if wedge is None:
        ceiling = busy if busy is not None else (hard / 2 if hard is not None else d.wedge_after)
        wedge = max(slow or 0.0, min(d.wedge_after, ceiling))
    if slow is None:
        slow = min(d.slow_after, wedge / 2)
    if busy is None:
        busy = max(wedge, min(d.max_busy, hard / 2) if hard is not None else d.max_busy)
    if hard is None:
        hard = max(d.hard_timeout, 2 * busy)
    p = ProbeSettings(
        prompt=c.get(raw, "prompt", _parse_str, d.prompt),
        max_tokens=c.get(raw, "max_tokens", _int_range(1, 64), d.max_tokens),
        slow_after=slow,
        wedge_after=wedge,
        max_busy=busy,
        startup_grace=c.get(raw, "startup_grace", parse_duration, d.startup_grace),
        hard_timeout=hard,
        models_timeout=c.get(raw, "models_timeout", parse_duration, d.models_timeout),
        idle_cpu_percent=c.get(
            raw, "idle_cpu_percent", _float_range(0.0, 100.0), d.idle_cpu_percent
        ),
    )
    if c.ok:
        values = [(key, getattr(p, key)) for key in _SPANS if key in written]
        for (a, va), (b, vb) in itertools.combinations(values, 2):
            if va > vb or (b == "hard_timeout" and va == vb):
                errors.append(
                    f'{label}: probe.{a} = "{format_duration(va)}" must be '
                    f"{'shorter than' if b == 'hard_timeout' else 'at most'} "
                    f'probe.{b} = "{format_duration(vb)}"'
                )
    return p


def _restart(raw: Mapping[str, Any], label: str, errors: list[str]) -> RestartSettings:
    _unknown(raw, _RESTART_KEYS, f"{label}: [server.restart]", errors)
    d = RestartSettings()
    c = _Collector(f"{label}: restart.", errors)
    return RestartSettings(
        max_restarts=c.get(raw, "max_restarts", _int_range(0, 1000), d.max_restarts),
        window=c.get(raw, "window", parse_duration, d.window),
        backoff=c.get(raw, "backoff", parse_duration, d.backoff),
        drain=c.get(raw, "drain", _parse_bool, d.drain),
        drain_timeout=c.get(raw, "drain_timeout", parse_duration, d.drain_timeout),
        drain_command=c.get(raw, "drain_command", _parse_argv, ()),
        undrain_command=c.get(raw, "undrain_command", _parse_argv, ()),
        command_timeout=c.get(raw, "command_timeout", parse_duration, d.command_timeout),
        stop_grace=c.get(raw, "stop_grace", parse_duration, d.stop_grace),
    )


def _check_key_file(path: Path, label: str, errors: list[str], warnings: list[str]) -> None:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        errors.append(f'{label}: api_key_file = "{path}" does not exist')
        return
    except OSError as exc:
        errors.append(f'{label}: api_key_file = "{path}" cannot be read: {exc.strerror}')
        return
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        warnings.append(
            f'{label}: api_key_file = "{path}" can be read by other users '
            f"(mode {stat.S_IMODE(mode):04o}); run: chmod 600 {path}"
        )


# -- helpers -------------------------------------------------------------------------------


class _Collector:
    """Runs converters, turning their ValueError into one error line and a default."""

    def __init__(self, prefix: str, errors: list[str]) -> None:
        self.prefix = prefix
        self.errors = errors
        self.ok = True

    def get(self, raw: Mapping[str, Any], key: str, convert: Any, default: Any) -> Any:
        if key not in raw:
            return default
        try:
            return convert(raw[key], self.prefix + key)
        except ValueError as exc:
            self.errors.append(str(exc))
            self.ok = False
            return default


def _show(value: object) -> str:
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _unknown(raw: Mapping[str, Any], known: set[str], where: str, errors: list[str]) -> None:
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
            hint = (
                f'; did you mean "{close[0]}"?'
                if close
                else f"; known keys: {', '.join(sorted(known))}"
            )
            prefix = f"{where}: " if where else ""
            errors.append(f'{prefix}unknown key "{key}"{hint}')


def _table(value: object, where: str, errors: list[str]) -> Mapping[str, Any]:
    if isinstance(value, dict):
        return value
    errors.append(f"{where} must be a table, not {_show(value)}")
    return {}


def _parse_str(value: object, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where} = {_show(value)} must be a non-empty string")
    return value


def _parse_name(value: object, where: str) -> str:
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValueError(
            f"{where} = {_show(value)} is not a valid name; use letters, digits, '.', '_' or '-'"
        )
    return value


def _parse_bool(value: object, where: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{where} = {_show(value)} must be true or false")
    return value


def _int_range(low: int, high: int) -> Any:
    def convert(value: object, where: str) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ValueError(
                f"{where} = {_show(value)} must be a whole number from {low} to {high}"
            )
        return value

    return convert


def _float_range(low: float, high: float) -> Any:
    def convert(value: object, where: str) -> float:
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not low <= value <= high
        ):
            raise ValueError(f"{where} = {_show(value)} must be a number from {low:g} to {high:g}")
        return float(value)

    return convert


def parse_url(value: object, where: str) -> str:
    text = _parse_str(value, where)
    parts = urlsplit(text)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f'{where} = {_show(value)} must be an http(s) URL, like "{DEFAULT_URL}"')
    try:
        parts.port  # noqa: B018 - raises on a bad port
    except ValueError:
        raise ValueError(f"{where} = {_show(value)} has an invalid port") from None
    if parts.path not in ("", "/"):
        raise ValueError(
            f"{where} = {_show(value)} must be the server's base URL without a path, "
            f'like "{parts.scheme}://{parts.netloc}"'
        )
    return f"{parts.scheme}://{parts.netloc}"


def _parse_listen(value: object, where: str) -> tuple[str, int | None]:
    text = _parse_str(value, where)
    if text == "off":
        return "127.0.0.1", None
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(
            f'{where} = {_show(value)} must be host:port, like "{DEFAULT_LISTEN}", or "off"'
        )
    return host, int(port)


def _loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _parse_path(value: object, where: str) -> Path:
    return Path(_parse_str(value, where)).expanduser()


def _parse_str_list(value: object, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{where} = {_show(value)} must be a list of strings")
    return tuple(cast(list[str], value))


def _parse_argv(value: object, where: str) -> tuple[str, ...]:
    if isinstance(value, str):
        raise ValueError(
            f"{where} = {_show(value)} must be a list of arguments, "
            f"like {json.dumps(value.split())} (it runs without a shell)"
        )
    return _parse_str_list(value, where)  # [] means not set


def _parse_env(value: object, where: str) -> dict[str, str]:
    if not isinstance(value, dict):
        raise ValueError(f'{where} = {_show(value)} must be a table of NAME = "value"')
    for k, v in value.items():
        if not isinstance(v, str):
            raise ValueError(f"{where}.{k} = {_show(v)} must be a string")
    return dict(value)


def _parse_manager(value: object, where: str) -> Manager:
    if value not in MANAGERS:
        raise ValueError(f"{where} = {_show(value)} must be one of: {', '.join(MANAGERS)}")
    return value


# -- showing and writing -------------------------------------------------------------------

_SECRET_ENV = re.compile(r"KEY|TOKEN|SECRET|PASS|AUTH|CREDENTIAL", re.IGNORECASE)


def mask_url(url: str) -> str:
    """Apprise and webhook URLs carry their tokens inline: keep only the scheme."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}://***" if sep and rest else "***"


def effective(config: Config) -> dict[str, Any]:
    """The configuration in force, as plain data, with every secret masked."""
    w = config.watchdog
    servers = []
    for s in config.servers:
        parts = urlsplit(s.url)
        url = s.url if parts.password is None else s.url.replace(f":{parts.password}@", ":***@")
        entry: dict[str, Any] = {"name": s.name, "url": url, "manager": s.manager, "match": s.match}
        for key in ("api_key_file", "model", "label", "plist", "unit", "log_file"):
            value = getattr(s, key)
            if value is not None:
                entry[key] = str(value)
        for key in ("command", "restart_command"):
            if getattr(s, key):
                entry[key] = list(getattr(s, key))
        if s.env:
            entry["env"] = {k: "***" if _SECRET_ENV.search(k) else v for k, v in s.env.items()}
        entry["probe"] = _plain(s.probe)
        entry["restart"] = _plain(s.restart)
        servers.append(entry)
    return {
        "watchdog": {
            "interval": format_duration(w.interval),
            "listen": "off" if w.listen_port is None else f"{w.listen_host}:{w.listen_port}",
            "state_dir": str(w.state_dir),
            "alerts": [mask_url(a) for a in w.alerts],
            "on_event": list(w.on_event),
            "log_max_size": format_size(w.log_max_size),
            "log_keep": w.log_keep,
        },
        "server": servers,
    }


_DURATION_FIELDS = {
    "command_timeout",
    "stop_grace",
    "slow_after",
    "wedge_after",
    "max_busy",
    "startup_grace",
    "hard_timeout",
    "models_timeout",
    "window",
    "backoff",
    "drain_timeout",
}


def _plain(settings: ProbeSettings | RestartSettings) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in vars(settings).items():
        if key in _DURATION_FIELDS:
            out[key] = format_duration(value)
        elif isinstance(value, tuple):
            if value:
                out[key] = list(value)
        else:
            out[key] = value
    return out


def to_toml(data: Mapping[str, Any]) -> str:
    """Enough TOML for `effective()`: tables, arrays of tables, scalars, lists of strings."""
    lines: list[str] = []

    def scalar(v: Any) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, list):
            return "[" + ", ".join(scalar(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {scalar(x)}" for k, x in v.items()) + " }"
        return json.dumps(str(v))

    def table(header: str, body: Mapping[str, Any]) -> None:
        lines.append(header)
        subs = []
        for k, v in body.items():
            if isinstance(v, dict) and k in ("probe", "restart"):
                subs.append((k, v))
            else:
                lines.append(f"{k} = {scalar(v)}")
        lines.append("")
        for k, v in subs:
            table(f"[server.{k}]", v)

    for key, value in data.items():
        if isinstance(value, list):
            for item in value:
                table(f"[[{key}]]", item)
        else:
            table(f"[{key}]", value)
    return "\n".join(lines).rstrip() + "\n"


TEMPLATE = """\
# mlx-watchdog configuration. Every key but a server's url has a default; the commented
# values are those defaults. Durations need a unit: "500ms", "30s", "15m", "1h".

[watchdog]
# interval = "30s"              # how often each server is checked
# listen = "127.0.0.1:9464"     # the watchdog's own /healthz, /status, /metrics; or "off"
# state_dir = "~/.local/state/mlx-watchdog"   # history database and token
# alerts = ["ntfy://my-topic"]  # Apprise URLs
# on_event = ["/usr/local/bin/notify"]        # gets each event as JSON on stdin
# log_max_size = "10MiB"        # its own log (under launchd) and each server's log_file
# log_keep = 3                  # rotated copies kept: log.1 (newest) .. log.3

[[server]]
name = "mlx"
url = "http://127.0.0.1:8080"
# api_key_file = "~/.config/mlx-watchdog/api-key"   # chmod 600
# model = "mlx-community/Qwen3-4B-4bit"  # leave out: the probe uses the served default
# manager = "none"              # none | launchd | systemd | process | command
# label = "com.example.mlx-server"      # launchd
# plist = "~/Library/LaunchAgents/com.example.mlx-server.plist"    # launchd, for bootstrap
# unit = "mlx-server.service"           # systemd --user
# command = ["mlx_lm.server", "--model", "...", "--port", "8080"]   # process
# restart_command = ["/usr/local/bin/restart-mlx"]                 # command
# match = "mlx_lm"              # the server's command line must contain this
# env = { HF_HUB_CACHE = "/path/to/hub" }
# log_file = "~/Library/Logs/mlx-server.log"

[server.probe]
# prompt = "ping"               # fixed, so the prompt cache makes the probe nearly free
# max_tokens = 1
# slow_after = "10s"            # a token later than this is "slow" (left out: at most
#                               # half of wedge_after; thresholds left out follow those written)
# wedge_after = "60s"           # zero tokens this long, with nobody served: "wedged"
# max_busy = "15m"              # busy with live clients longer than this: "wedged"
# startup_grace = "2m"          # a (re)started server may take this long to serve
# hard_timeout = "30m"          # the probe itself never gives up before this
# models_timeout = "5s"
# idle_cpu_percent = 1.0        # below this, connected clients are not being served

[server.restart]
# max_restarts = 3              # per window
# window = "1h"
# backoff = "30s"               # grows between attempts
# drain = false
# drain_timeout = "2m"
# drain_command = ["/usr/local/bin/lb", "drain", "mlx"]
# undrain_command = ["/usr/local/bin/lb", "undrain", "mlx"]
# command_timeout = "2m"        # for restart_command and the drain commands
# stop_grace = "10s"            # manager = "process": SIGTERM, then SIGKILL after this
"""


def write_template(path: Path, *, force: bool = False) -> Path:
    if path.exists() and not force:
        raise ConfigError(f"{path} already exists; pass --force to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TEMPLATE)
    return path


def append_server(path: Path, block: str) -> Path:
    """Add a `[[server]]` block to the config file (made if missing), keeping what is there.

    The result is validated; if it does not load, the file is put back as it was.
    """
    before = path.read_text() if path.exists() else None
    head = (
        before
        if before is not None
        else (
            "# mlx-watchdog configuration; `mlx-watchdog config init --config OTHER` shows every key.\n"
        )
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(head.rstrip("\n") + "\n\n" + block)
    try:
        load_config(path)
    except ConfigError:
        if before is None:
            path.unlink()
        else:
            path.write_text(before)
        raise
    return path
