"""TOML -> `Config`, validated once. Every error names where it is (`server "qwen":
probe.wedge_after`), quotes the value and says what is expected; all errors of a file are
reported together, so one run fixes them all."""

from __future__ import annotations

import difflib
import itertools
import os
import stat
from collections.abc import Mapping
from dataclasses import Field, fields, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from mlx_watchdog.config.profiles import PROFILES
from mlx_watchdog.config.schema import (
    SPANS,
    Config,
    ConfigError,
    ProbeSettings,
    RestartSettings,
    ServerConfig,
    WatchdogSettings,
)
from mlx_watchdog.config.values import (
    DEFAULT_URL,
    format_duration,
    is_loopback,
    parse_duration,
    parse_listen,
    show,
)

CONFIG_ENV = "MLX_WATCHDOG_CONFIG"


def keys(cls: type) -> list[Field[Any]]:
    """The fields of a section that are keys in the file (they carry a parser)."""
    return [f for f in fields(cls) if "parse" in f.metadata]


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


MAX_CONFIG = 1 << 20


def load_config(path: Path | None = None, env: Mapping[str, str] | None = None) -> Config:
    """Read and validate the configuration.

    `path` wins, then `$MLX_WATCHDOG_CONFIG`, then the default path; a missing default file
    means the embedded default: one server at mlx_lm.server's default address.
    """
    import tomllib  # only here: commands that print --help never parse a file

    env = os.environ if env is None else env
    source, explicit = resolve_config_path(path, env)
    if not source.exists():
        if explicit:
            raise ConfigError(
                f"config file {source} does not exist; `mlx-watchdog config init` writes one"
            )
        return parse_config({}, source=None)
    try:
        raw = source.read_bytes()
        if len(raw) > MAX_CONFIG:
            raise ConfigError(f"{source}: {len(raw)} bytes is not a config file (at most 1 MiB)")
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        raise ConfigError(
            f"{source}: line {line} is not UTF-8 (byte 0x{raw[exc.start]:02x}); save the file "
            "as UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{source}: not valid TOML: {exc}") from None
    except OSError as exc:
        raise ConfigError(f"{source}: cannot read: {exc.strerror or exc}") from None
    return parse_config(data, source=source)


def state_dir_of(path: Path | None = None, env: Mapping[str, str] | None = None) -> Path:
    """The state folder a config names, even when the rest of it is wrong (a typo elsewhere):
    where the running watchdog, started from it before, keeps its record and history. The
    default folder when the file cannot say."""
    import tomllib

    env = os.environ if env is None else env
    try:
        source, _ = resolve_config_path(path, env)
        raw = tomllib.loads(source.read_bytes()[:MAX_CONFIG].decode("utf-8"))
        given = raw.get("watchdog", {}).get("state_dir")
        if isinstance(given, str):
            return parse_config({"watchdog": {"state_dir": given}}).watchdog.state_dir
    except (OSError, ValueError, AttributeError, ConfigError):
        pass
    return parse_config({}).watchdog.state_dir


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
    if watchdog.listen_port is not None and not is_loopback(watchdog.listen_host):
        opened = ", ".join(watchdog.open_routes)
        warnings.append(
            f'watchdog.listen = "{watchdog.listen_host}:{watchdog.listen_port}" is reachable from '
            "other machines: /healthz answers anyone there; /status, /metrics, the status page "
            "and the actions need the token"
            + (f" (but open_routes opens {opened})" if opened else "")
        )
    return Config(
        watchdog=watchdog,
        servers=tuple(_own_log(s, watchdog.state_dir) for s in servers if s is not None),
        source=source,
        warnings=tuple(warnings),
    )


def _own_log(server: ServerConfig, state_dir: Path) -> ServerConfig:
    """A server the watchdog runs writes its output where the watchdog reads its progress:
    `log_file`, else a log of its own in the state folder (rotated like any log_file)."""
    if server.manager != "process" or server.log_file is not None:
        return server
    return replace(server, log_file=state_dir / "logs" / f"{server.name}.log")


# -- sections ------------------------------------------------------------------------------


def _section(
    cls: type, raw: Mapping[str, Any], c: _Collector, skip: tuple[str, ...] = ()
) -> dict[str, Any]:
    """Each key of `cls` that is in `raw`, through its parser; the others keep their default."""
    return {
        f.name: c.get(raw, f.name, f.metadata["parse"]) for f in keys(cls) if f.name not in skip
    }


def _watchdog(raw: Mapping[str, Any], errors: list[str]) -> WatchdogSettings:
    _unknown(raw, {f.name for f in keys(WatchdogSettings)} | {"listen"}, "[watchdog]", errors)
    c = _Collector("watchdog.", errors)
    values = _present(_section(WatchdogSettings, raw, c))
    listen = c.get(raw, "listen", parse_listen)
    if listen is not _ABSENT:
        values["listen_host"], values["listen_port"] = listen
    return WatchdogSettings(**values)


def _server(
    raw: Mapping[str, Any], index: int, errors: list[str], warnings: list[str]
) -> ServerConfig | None:
    name_value = raw.get("name")
    label = f'server "{name_value}"' if isinstance(name_value, str) else f"server #{index + 1}"
    c = _Collector(f"{label}: ", errors)
    known = {f.name for f in keys(ServerConfig)} | {"probe", "restart"}
    _unknown(raw, known, f"{label}: [server]", errors)

    if "url" not in raw:
        errors.append(f'{label}: url is required, like url = "{DEFAULT_URL}"')
        return None
    values = _present(_section(ServerConfig, raw, c))
    url = values.setdefault("url", DEFAULT_URL)
    values.setdefault("name", f"mlx-{urlsplit(url).port or 80}")
    kind = values.get("kind", "mlx_lm")
    values.setdefault("match", PROFILES[kind].match)
    server = ServerConfig(
        **values,
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
    if server.manager in needs and not getattr(server, needs[server.manager]):
        errors.append(
            f'{label}: manager = "{server.manager}" needs {needs[server.manager]} to be set'
        )
    if server.manager != "none" and not server.match.strip():
        errors.append(
            f'{label}: manager = "{server.manager}" needs match (a part of the server\'s '
            f'command line): kind = "{server.kind}" has none to offer'
        )
    if server.api_key_file is not None:
        _check_key_file(server.api_key_file, label, errors, warnings)
    return server


def _probe(raw: Mapping[str, Any], label: str, errors: list[str]) -> ProbeSettings:
    _unknown(raw, {f.name for f in keys(ProbeSettings)}, f"{label}: [server.probe]", errors)
    d = ProbeSettings()
    c = _Collector(f"{label}: probe.", errors)
    values = _present(_section(ProbeSettings, raw, c, skip=SPANS))
    written = {key: c.get(raw, key, parse_duration) for key in SPANS if key in raw}
    written = {k: v for k, v in written.items() if v is not _ABSENT}
    slow, wedge, busy, hard = (written.get(key) for key in SPANS)
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
        **values, slow_after=slow, wedge_after=wedge, max_busy=busy, hard_timeout=hard
    )
    if c.ok:
        spans = [(key, getattr(p, key)) for key in SPANS if key in written]
        for (a, va), (b, vb) in itertools.combinations(spans, 2):
            if va > vb or (b == "hard_timeout" and va == vb):
                errors.append(
                    f'{label}: probe.{a} = "{format_duration(va)}" must be '
                    f"{'shorter than' if b == 'hard_timeout' else 'at most'} "
                    f'probe.{b} = "{format_duration(vb)}"'
                )
    return p


def _restart(raw: Mapping[str, Any], label: str, errors: list[str]) -> RestartSettings:
    _unknown(raw, {f.name for f in keys(RestartSettings)}, f"{label}: [server.restart]", errors)
    c = _Collector(f"{label}: restart.", errors)
    return RestartSettings(**_present(_section(RestartSettings, raw, c)))


def _check_key_file(path: Path, label: str, errors: list[str], warnings: list[str]) -> None:
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        errors.append(f'{label}: api_key_file = "{path}" does not exist')
        return
    except OSError as exc:
        errors.append(f'{label}: api_key_file = "{path}" cannot be read: {exc.strerror}')
        return
    if not stat.S_ISREG(mode):
        what = "a directory" if stat.S_ISDIR(mode) else "not a regular file"
        errors.append(f'{label}: api_key_file = "{path}" is {what}; name the file with the key')
        return
    try:
        with path.open("rb") as fh:
            fh.read(1)
    except OSError as exc:
        errors.append(f'{label}: api_key_file = "{path}" cannot be read: {exc.strerror}')
        return
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        warnings.append(
            f'{label}: api_key_file = "{path}" can be read by other users '
            f"(mode {stat.S_IMODE(mode):04o}); run: chmod 600 {path}"
        )


# -- helpers -------------------------------------------------------------------------------

_ABSENT: Any = object()  # a key that is not in the file, or whose value was refused


def _present(values: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not _ABSENT}


class _Collector:
    """Runs converters, turning their ValueError into one error line."""

    def __init__(self, prefix: str, errors: list[str]) -> None:
        self.prefix = prefix
        self.errors = errors
        self.ok = True

    def get(self, raw: Mapping[str, Any], key: str, convert: Any) -> Any:
        if key not in raw:
            return _ABSENT
        try:
            return convert(raw[key], self.prefix + key)
        except ValueError as exc:
            self.errors.append(str(exc))
            self.ok = False
            return _ABSENT


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
    errors.append(f"{where} must be a table, not {show(value)}")
    return {}
