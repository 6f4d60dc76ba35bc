"""prometheus: the rules and the dashboard for watching many machines' watchdogs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click


@click.group()
def prometheus() -> None:
    """Print Prometheus alert rules or a Grafana dashboard for the watchdogs' /metrics."""


@prometheus.command("rules")
@click.option(
    "--runbook-base",
    help="The absolute URL of docs/runbook.md (e.g. in your repository): each alert's "
    "runbook_url, a link in Alertmanager. Without it the links are relative (docs/runbook.md#...).",
)
def prometheus_rules(runbook_base: str | None) -> None:
    """Alert and recording rules: wedged, a person needed, restarts, a silent watchdog, ..."""
    from urllib.parse import urlsplit

    from mlx_watchdog import fleet
    from mlx_watchdog.cli.app import err

    if runbook_base is None:
        err.print(
            "runbook_url is relative (docs/runbook.md#...): no link in Alertmanager; give "
            "--runbook-base https://.../docs/runbook.md to make it one"
        )
    elif (
        urlsplit(runbook_base).scheme not in ("http", "https") or not urlsplit(runbook_base).netloc
    ):
        raise click.UsageError(
            f"--runbook-base {runbook_base!r} must be an absolute http(s) URL, e.g. "
            "https://github.com/you/mlx-watchdog/blob/main/docs/runbook.md"
        )
    try:
        text = fleet.rules(runbook_base or fleet.RUNBOOK)
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    click.echo(text, nl=False)


@prometheus.command("dashboard")
def prometheus_dashboard() -> None:
    """A Grafana dashboard (JSON): state per server, TTFT, restarts, connections, budget."""
    from mlx_watchdog import fleet

    click.echo(fleet.dashboard(), nl=False)


@click.command()
@click.argument("urls", nargs=-1, required=True)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the status documents and rows as JSON."
)
@click.option(
    "--token-file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A file holding the bearer token the watchdogs want beyond loopback (their api-token).",
)
@click.option(
    "--cacert",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="CA certificates (PEM) for https endpoints signed by your own CA.",
)
@click.option(
    "--token-in-clear",
    is_flag=True,
    help="Send the token to plain-http endpoints beyond loopback too (readable on the way).",
)
def fleet(
    urls: tuple[str, ...],
    as_json: bool,
    token_file: Path | None,
    cacert: Path | None,
    token_in_clear: bool,
) -> None:
    """Several watchdogs side by side: URLS are their endpoints (http://mac-1.lan:9464, or
    https://host/path behind a TLS proxy; certificates are verified).

    Per server: state, restarts and incidents over the last day, and clients that gave up per
    hour (how often each machine is provoked). Exit code: the worst server's (as for status),
    3 when a watchdog does not answer.
    """
    import functools
    import json
    import sys

    from mlx_watchdog import fleet as core
    from mlx_watchdog.fleet.peers import check_url, fetch_status, tls
    from mlx_watchdog.sense.files import open_regular

    for u in urls:
        problem = check_url(u)
        if problem is not None:
            raise click.BadParameter(f"{u}: {problem}", param_hint="URLS")
    token = None
    if token_file is not None:
        try:
            with open_regular(token_file) as fh:
                token = fh.read(4096).decode().strip()
        except (OSError, UnicodeDecodeError) as exc:
            raise click.BadParameter(f"{token_file}: {exc}", param_hint="--token-file") from None
    try:
        verify = tls(cacert)
    except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
        raise click.BadParameter(f"{cacert}: {exc}", param_hint="--cacert") from None
    fetch = functools.partial(
        fetch_status, token=token, verify=verify, token_in_clear=token_in_clear
    )
    docs = core.gather([u.rstrip("/") for u in urls], fetch)
    table = core.rows(docs)
    if as_json:
        click.echo(json.dumps({"machines": docs, "rows": table}, indent=2, default=str))
    else:
        _print(table)
    sys.exit(core.worst_exit(docs))


def _print(table: list[dict[str, Any]]) -> None:
    from rich.table import Table

    from mlx_watchdog.cli.app import PIPE_WIDTH, STATE_STYLE, escape, out

    view = Table(box=None, padding=(0, 1), header_style="dim")
    for column in (
        "machine",
        "server",
        "state",
        "restarts 24h",
        "incidents 24h",
        "gave up / h",
        "budget",
    ):
        key = {"machine": "machine", "server": "server", "state": "state"}.get(column)
        widest = max((len(str(r.get(key, ""))) for r in table), default=0) if key else 0
        view.add_column(column, no_wrap=True, min_width=max(len(column), widest))
    # Cut to fit a terminal; whole into a pipe (the console is wide there).
    wide = out.width >= PIPE_WIDTH
    view.add_column("reason", no_wrap=True, overflow="ellipsis", max_width=None if wide else 44)
    for r in table:
        style = STATE_STYLE.get(r["state"], "bold red")
        view.add_row(
            escape(r["machine"]),
            escape(r["server"]),
            f"[{style}]{r['state']}[/]",
            *(
                "-" if r.get(k) is None else str(r[k])
                for k in ("restarts_24h", "incidents_24h", "gave_up_per_hour", "budget_left")
            ),
            escape(str(r.get("reason") or r.get("why", ""))),
        )
    out.print(view)


COMMANDS = (prometheus, fleet)
