"""TOML configuration, validated once into frozen dataclasses.

`schema` is the shape (each key's parser, display and doc in its field metadata), `values` the
single-value converters, `parse` the file to `Config`, `render` the effective settings, the
template and appended server blocks.
"""

from mlx_watchdog.config.parse import (
    CONFIG_ENV,
    default_config_path,
    load_config,
    parse_config,
    resolve_config_path,
    state_dir_of,
)
from mlx_watchdog.config.render import (
    append_server,
    effective,
    mask_url,
    template,
    to_toml,
    write_template,
)
from mlx_watchdog.config.schema import (
    Config,
    ConfigError,
    ProbeSettings,
    RestartSettings,
    ServerConfig,
    WatchdogSettings,
    default_state_dir,
)
from mlx_watchdog.config.values import (
    DEFAULT_LISTEN,
    DEFAULT_URL,
    MANAGERS,
    ManagerKind,
    format_duration,
    format_size,
    parse_duration,
    parse_size,
    parse_url,
    when_fields,
)

__all__ = [
    "CONFIG_ENV",
    "DEFAULT_LISTEN",
    "DEFAULT_URL",
    "MANAGERS",
    "Config",
    "ConfigError",
    "ManagerKind",
    "ProbeSettings",
    "RestartSettings",
    "ServerConfig",
    "WatchdogSettings",
    "append_server",
    "default_config_path",
    "default_state_dir",
    "effective",
    "format_duration",
    "format_size",
    "load_config",
    "mask_url",
    "parse_config",
    "parse_duration",
    "parse_size",
    "parse_url",
    "resolve_config_path",
    "state_dir_of",
    "template",
    "to_toml",
    "when_fields",
    "write_template",
]
