"""prometheus: the rules and the dashboard for watching many machines' watchdogs."""

from __future__ import annotations

import click


@click.group()
def prometheus() -> None:
    """Print Prometheus alert rules or a Grafana dashboard for the watchdogs' /metrics."""


@prometheus.command("rules")
@click.option(
    "--runbook-base",
    default="README.md",
    show_default=True,
    help="Where the README is (e.g. its URL in your repository): each alert's runbook_url.",
)
def prometheus_rules(runbook_base: str) -> None:
    """Alert and recording rules: wedged, a person needed, restarts, a silent watchdog, ..."""
    from mlx_watchdog import fleet

    try:
        text = fleet.rules(runbook_base)
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
def fleet(urls: tuple[str, ...], as_json: bool) -> None:
    """Several watchdogs side by side: URLS are their endpoints (http://mac-1.lan:9464).

    Per server: state, restarts and incidents over the last day, and clients that gave up per
    hour (how often each machine is provoked). Exit code: the worst server's (as for status),
    3 when a watchdog does not answer.
    """
    import json
    import sys
    from urllib.parse import urlsplit

    from mlx_watchdog import fleet as core
    from mlx_watchdog.serve.client import remote_status

    for u in urls:
        parts = urlsplit(u)
        if parts.scheme != "http" or parts.path.strip("/") or "@" in parts.netloc:
            # Refused rather than read wrongly: the bare-socket client speaks plain HTTP only.
            raise click.UsageError(
                f"{u}: give a watchdog's endpoint as http://host:port (https, a path or "
                "credentials are not supported)"
            )
    docs = core.gather([u.rstrip("/") for u in urls], remote_status)
    table = core.rows(docs)
    if as_json:
        click.echo(json.dumps({"machines": docs, "rows": table}, indent=2, default=str))
    else:
        from rich.table import Table

        from mlx_watchdog.cli.app import STATE_STYLE, escape, out

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
        view.add_column("reason", no_wrap=True, overflow="ellipsis", max_width=44)
        for r in table:
            style = STATE_STYLE.get(r["state"], "bold red")
            view.add_row(
                escape(r["machine"]),
                escape(r["server"]),
                f"[{style}]{r['state']}[/]",
                str(r.get("restarts_24h", "-")),
                str(r.get("incidents_24h", "-")),
                str(r.get("gave_up_per_hour", "-")),
                str(r.get("budget_left", "-")),
                escape(str(r.get("reason") or r.get("why", ""))),
            )
        out.print(view)
    sys.exit(core.worst_exit(docs))


COMMANDS = (prometheus, fleet)
