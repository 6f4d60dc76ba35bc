"""The `mlx-watchdog` command. Each module under cli/ defines its commands (`COMMANDS`); the
group imports a module when one of its commands is asked for (cli/app.py `Group`), so `status`
never pays for `calibrate`'s imports."""

from __future__ import annotations

from mlx_watchdog.cli.app import cli


def main() -> None:
    cli(prog_name="mlx-watchdog")
