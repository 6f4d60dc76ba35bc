"""The configuration written back: `config check` (the effective settings, secrets masked), the
commented template, and a server block appended to a file. All of it from the schema's metadata.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import MISSING, Field
from pathlib import Path
from typing import Any

from mlx_watchdog.config.parse import keys, load_config
from mlx_watchdog.config.schema import (
    Config,
    ConfigError,
    ProbeSettings,
    RestartSettings,
    ServerConfig,
    WatchdogSettings,
)
from mlx_watchdog.config.values import DEFAULT_LISTEN

_SECRET_ENV = re.compile(r"KEY|TOKEN|SECRET|PASS|AUTH|CREDENTIAL", re.IGNORECASE)


def mask_url(url: str) -> str:
    """Apprise and webhook URLs carry their tokens inline: keep only the scheme."""
    scheme, sep, rest = url.partition("://")
    return f"{scheme}://***" if sep and rest else "***"


def _plain(f: Field[Any], value: Any) -> Any:
    show = f.metadata.get("show")
    if show is not None:
        return show(value)
    if isinstance(value, tuple):
        return list(value)
    if isinstance(value, Path):
        return str(value)
    if isinstance(value, Mapping):
        return dict(value)
    return value


def _section(obj: Any, *, keep_empty: tuple[str, ...] = ()) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in keys(type(obj)):
        value = getattr(obj, f.name)
        if f.name not in keep_empty and (value is None or value == () or value == {}):
            continue  # not set
        out[f.name] = _plain(f, value)
    return out


def effective(config: Config) -> dict[str, Any]:
    """The configuration in force, as plain data, with every secret masked."""
    w = config.watchdog
    watchdog = _section(w, keep_empty=("alerts", "on_event"))
    watchdog["listen"] = "off" if w.listen_port is None else f"{w.listen_host}:{w.listen_port}"
    watchdog["alerts"] = [mask_url(a) for a in w.alerts]
    servers = []
    for s in config.servers:
        entry = _section(s)
        if s.credentials is not None:  # said to be there, never shown
            scheme, _, rest = s.url.partition("://")
            entry["url"] = f"{scheme}://***@{rest}"
        if s.env:
            entry["env"] = {k: "***" if _SECRET_ENV.search(k) else v for k, v in s.env.items()}
        entry["probe"] = _section(s.probe)
        entry["restart"] = _section(s.restart)
        servers.append(entry)
    return {"watchdog": watchdog, "server": servers}


def _scalar(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, list):
        return "[" + ", ".join(_scalar(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{ " + ", ".join(f"{k} = {_scalar(x)}" for k, x in v.items()) + " }"
    return json.dumps(str(v))


def to_toml(data: Mapping[str, Any]) -> str:
    """Enough TOML for `effective()`: tables, arrays of tables, scalars, lists of strings."""
    lines: list[str] = []

    def table(header: str, body: Mapping[str, Any]) -> None:
        lines.append(header)
        subs = []
        for k, v in body.items():
            if isinstance(v, dict) and k in ("probe", "restart"):
                subs.append((k, v))
            else:
                lines.append(f"{k} = {_scalar(v)}")
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


def _commented(f: Field[Any], written: set[str]) -> str:
    """One template line: the default, or an example (marked so) when there is none."""
    has_default = f.default is not MISSING or f.default_factory is not MISSING
    default = f.default_factory() if f.default_factory is not MISSING else f.default
    if has_default and default not in (None, (), {}):
        value, note = _plain(f, default), ""
    else:
        value, note = f.metadata["example"], "" if f.name in written else "example; "
    if isinstance(value, str) and value.startswith(str(Path.home())):
        value = "~" + value[len(str(Path.home())) :]
    line = ("" if f.name in written else "# ") + f"{f.name} = {_scalar(value)}"
    return _with_doc(line, note + f.metadata["doc"])


def _with_doc(line: str, doc: str) -> str:
    if len(line) > 34:
        return f"# ({doc})\n{line}"  # too long to share a line with its note
    return f"{line:<36}# {doc}"


def template() -> str:
    head = [
        "# mlx-watchdog configuration. Every key but a server's url has a default; the commented",
        "# values are those defaults (or examples, where it says so). Durations need a unit:",
        '# "500ms", "30s", "15m", "1h".',
        "",
        "[watchdog]",
    ]
    lines = head + [_commented(f, set()) for f in keys(WatchdogSettings) if f.name != "state_dir"]
    listen = _with_doc(
        f"# listen = {json.dumps(DEFAULT_LISTEN)}", 'its /healthz, /status, /metrics; or "off"'
    )
    lines.insert(len(head) + 1, listen)
    state_dir = next(f for f in keys(WatchdogSettings) if f.name == "state_dir")
    lines.insert(len(head) + 2, _commented(state_dir, set()))
    lines += ["", "[[server]]"]
    lines += [_commented(f, {"name", "url"}) for f in keys(ServerConfig)]
    for name, cls in (("probe", ProbeSettings), ("restart", RestartSettings)):
        lines += ["", f"[server.{name}]"] + [_commented(f, set()) for f in keys(cls)]
    return "\n".join(lines) + "\n"


def write_template(path: Path, *, force: bool = False) -> Path:
    if path.exists() and not force:
        raise ConfigError(f"{path} already exists; pass --force to overwrite it")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(template())
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
