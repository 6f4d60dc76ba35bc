"""`compare`: two servers measured the same way, side by side."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from mlx_watchdog.cli.app import config_option, err, escape, load_or_exit, or_exit, out, unmoved
from mlx_watchdog.judge.states import UNKNOWN_EXIT

if TYPE_CHECKING:
    from mlx_watchdog.advice.compare import Comparison
    from mlx_watchdog.config import Config, ServerConfig


@click.command()
@config_option
@click.argument("server_a")
@click.argument("server_b")
@click.option(
    "--prompt-tokens", default="4k", show_default=True, help="The long prompt's size, in tokens."
)
@click.option("--model-a", help="The model to name in requests to A (default: none).")
@click.option("--model-b", help="The model to name in requests to B (default: none).")
@click.option(
    "--timeout",
    "limit",
    default="10m",
    show_default=True,
    help="At most this long for each server, in all; then it gives up (exit 3).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the measurements as JSON.")
def compare(
    config_path: Path | None,
    server_a: str,
    server_b: str,
    prompt_tokens: str,
    model_a: str | None,
    model_b: str | None,
    limit: str,
    as_json: bool,
) -> None:
    """Measure two servers the same way and print them side by side.

    SERVER_A and SERVER_B are URLs or names of configured servers. For each: the first token
    of a tiny prompt, prefill and decode rates, the same long prompt twice (the prompt cache),
    and the decode rate of 1, 2 and 4 streams at once (batching). It sends long prompts, so
    it refuses while either server is busy. Exit 0; 1 when it refused; 3 when a server was
    not measured (an error, or not within --timeout).
    """
    import json

    from mlx_watchdog.advice.calibrate import parse_tokens
    from mlx_watchdog.config import parse_duration

    cfg = load_or_exit(config_path)
    tokens = or_exit(lambda: parse_tokens(prompt_tokens, "--prompt-tokens"))
    seconds = or_exit(lambda: parse_duration(limit, "--timeout"))
    a = or_exit(lambda: _side(cfg, server_a, "a", model_a))
    b = or_exit(lambda: _side(cfg, server_b, "b", model_b))
    if a.url == b.url:
        raise click.UsageError("SERVER_A and SERVER_B are the same server")
    _refuse_busy(cfg, a, b)
    result = _measure(a, b, tokens, seconds, quiet=as_json)
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
        return
    _print(result)


def _refuse_busy(cfg: Config, a: ServerConfig, b: ServerConfig) -> None:
    """Exit 1 when either server has clients: long prompts would make them wait."""
    from mlx_watchdog.advice.calibrate import refusal
    from mlx_watchdog.record.left_probes import left_probes

    left = left_probes(cfg.watchdog.state_dir)
    for side in (a, b):
        why, _ = refusal(side, left)
        if why is not None:
            err.print(
                f"[yellow]not comparing:[/yellow] {side.name} ({side.url}): {escape(why)}; the "
                "comparison sends long prompts that everyone behind them would wait for. Try "
                "again when both are idle.",
                soft_wrap=True,
            )
            sys.exit(1)


def _measure(
    a: ServerConfig, b: ServerConfig, tokens: int, seconds: float, *, quiet: bool
) -> Comparison:
    """Compare; nothing is shown when another process serves either side afterwards."""
    from mlx_watchdog.advice.compare import compare as run_compare

    return unmoved(
        [a, b],
        lambda say: run_compare(a, b, tokens, say=say, timeout=seconds),
        quiet=quiet,
        failed=UNKNOWN_EXIT,
        mixed="no comparison, its figures mix two processes; compare again once both serve",
    )


def _print(result: Comparison) -> None:
    from rich.table import Table

    from mlx_watchdog.advice.compare import findings, table

    grid = Table(box=None, padding=(0, 2), header_style="dim")
    grid.add_column("")
    grid.add_column(f"A: {result.a.name}")
    grid.add_column(f"B: {result.b.name}")
    for row in table(result):
        grid.add_row(*(escape(cell) for cell in row))
    out.print(grid)
    for line in findings(result):
        out.print(f"- {escape(line)}", soft_wrap=True)


def _side(cfg: Config, spec: str, letter: str, model: str | None) -> ServerConfig:
    """A URL (named by its host and port) or a configured server's name."""
    from dataclasses import replace
    from urllib.parse import urlsplit

    from mlx_watchdog.config import ServerConfig, parse_url

    if spec.startswith(("http://", "https://")):
        url = parse_url(spec, f"SERVER_{letter.upper()}")
        server = ServerConfig(name=urlsplit(url).netloc, url=url)
    else:
        server = cfg.server(spec)
    return replace(server, model=model) if model else server


COMMANDS = (compare,)
