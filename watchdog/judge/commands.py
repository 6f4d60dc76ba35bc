"""The commands the watchdog suggests, made to run as typed: for the config it was started with
(`--config`, where that is not the default), the server it speaks of and the incident it names.
Every output that suggests a command passes it through `suggest`: status, the page, doctor,
history, the alerts and the errors."""

from __future__ import annotations

import re
import shlex

# A subcommand (two words for the groups), not already given --config.
_COMMAND = re.compile(
    r"\bmlx-watchdog ((?:config|prometheus|server|alert) [a-z-]+|[a-z-]+)(?! --config)"
)
_SHOW = re.compile(r"\bmlx-watchdog history --show(?! \d)")
_CALIBRATE = re.compile(r"\bmlx-watchdog calibrate(?! --server)")


def suggest(
    text: str,
    config: str | None = None,
    *,
    server: str | None = None,
    incident: int | None = None,
) -> str:
    """`text` with each `mlx-watchdog ...` it suggests completed: the incident number after
    `history --show` (or the server's history where no incident is known), the server after
    `calibrate`, and `--config PATH` after each subcommand when `config` is given."""
    if incident is not None:
        text = _SHOW.sub(f"mlx-watchdog history --show {incident}", text)
    elif server is not None:
        text = _SHOW.sub(f"mlx-watchdog history --server {shlex.quote(server)}", text)
    if server is not None:
        text = _CALIBRATE.sub(f"mlx-watchdog calibrate --server {shlex.quote(server)}", text)
    if config is None:
        return text
    where = shlex.quote(config)
    return _COMMAND.sub(lambda m: f"mlx-watchdog {m.group(1)} --config {where}", text)
