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

    click.echo(fleet.rules(runbook_base), nl=False)


@prometheus.command("dashboard")
def prometheus_dashboard() -> None:
    """A Grafana dashboard (JSON): state per server, TTFT, restarts, connections, budget."""
    from mlx_watchdog import fleet

    click.echo(fleet.dashboard(), nl=False)


COMMANDS = (prometheus,)
