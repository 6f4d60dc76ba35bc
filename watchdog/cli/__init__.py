"""The `mlx-watchdog` command. Each module defines its commands; they are registered here."""

from __future__ import annotations

from mlx_watchdog.cli import advise, compare, fleet, install, ops, watch
from mlx_watchdog.cli.app import cli

for _module in (watch, ops, install, advise, compare, fleet):
    for _command in _module.COMMANDS:
        cli.add_command(_command)


def main() -> None:
    cli(prog_name="mlx-watchdog")
