"""probe, run, demo and config: the commands that check a server or set the watchdog up."""

from __future__ import annotations

import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from mlx_watchdog.cli.app import (
    STATE_STYLE,
    config_option,
    err,
    escape,
    load_or_exit,
    out,
    pick_servers,
    server_names,
)
from mlx_watchdog.judge.states import UNKNOWN_EXIT

if TYPE_CHECKING:
    from mlx_watchdog.act.check import CheckResult
    from mlx_watchdog.config import Config
    from mlx_watchdog.daemon.heartbeat import Notifier


@click.command()
@config_option
@click.option("--url", help="Probe this server URL instead of the configured ones.")
@click.option(
    "--server",
    "server_name",
    shell_complete=server_names,
    help="Probe only the configured server of this name.",
)
@click.option("--wedge-after", help='Judge a zero-token wait this long (e.g. "20s").')
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object per server.")
def probe(
    config_path: Path | None,
    url: str | None,
    server_name: str | None,
    wedge_after: str | None,
    as_json: bool,
) -> None:
    """Send one tiny generation request and judge the server from what it and its process do.

    Exit code: 0 healthy, 1 slow/busy/starting, 2 wedged/dead/down, 3 unknown.
    """
    import json

    from mlx_watchdog.config import ConfigError, parse_duration

    if url and server_name:
        raise click.UsageError("give --url or --server, not both")
    from concurrent.futures import ThreadPoolExecutor

    from mlx_watchdog.act.check import check_once
    from mlx_watchdog.record.left_probes import left_probes

    config = load_or_exit(config_path)
    try:
        servers = pick_servers(config, url, server_name)
        if wedge_after is not None:
            seconds = parse_duration(wedge_after, "--wedge-after")
            servers = [replace(s, probe=s.probe.around("wedge_after", seconds)) for s in servers]
    except (ConfigError, ValueError) as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        sys.exit(UNKNOWN_EXIT)
    if not as_json:
        for s in servers:
            err.print(
                f"probing {s.name} at {s.url} (judging a zero-token wait after "
                f"{s.probe.wedge_after:g}s)...",
                style="dim",
            )
    from mlx_watchdog.sense.findings import OwnFault

    with ThreadPoolExecutor(max_workers=len(servers)) as pool:
        left = left_probes(config.watchdog.state_dir)
        try:
            results = list(pool.map(lambda s: check_once(s, left=left), servers))
        except OwnFault as exc:  # the watchdog cannot look: unknown, never the server's fault
            err.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
            sys.exit(UNKNOWN_EXIT)
    if as_json:
        docs = [_result_json(r) for r in results]
        click.echo(json.dumps(docs[0] if len(docs) == 1 else docs, indent=2))
    else:
        for r in results:
            _print_result(r)
    sys.exit(max(r.verdict.exit_code for r in results))


def _result_json(r: CheckResult) -> dict[str, Any]:
    return {
        "server": r.server.name,
        "url": r.server.url,
        "state": r.verdict.state,
        "reason": r.verdict.reason,
        "exit_code": r.verdict.exit_code,
        "evidence": r.verdict.evidence.to_json(),
    }


def _print_result(r: CheckResult) -> None:
    from rich.table import Table

    v = r.verdict
    out.print(
        f"[bold]{r.server.name}[/bold] {r.server.url}  [{STATE_STYLE[v.state]}]{v.state.upper()}[/]"
    )
    out.print(escape(v.reason), soft_wrap=True)
    e = v.evidence.to_json()
    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(style="dim")
    table.add_column()
    phases = e.get("phases", {})
    for label, key in (
        ("connect", "connect_s"),
        ("headers", "headers_s"),
        ("first data", "first_data_s"),
        ("first token", "first_token_s"),
        ("done", "done_s"),
    ):
        table.add_row(label, _secs(phases.get(key)))
    table.add_row("waited", _secs(e.get("waited_s")))
    table.add_row("bytes / tokens", f"{e['bytes']} / {e['tokens']} ({e['keepalives']} keepalives)")
    if e.get("cached_tokens") is not None:
        table.add_row("prompt cache", f"{e['cached_tokens']} of {e['prompt_tokens']} tokens cached")
    table.add_row("probe", escape(f"{e['probe_finding']} {e.get('probe_detail') or ''}".strip()))
    table.add_row("/v1/models", f"{e.get('models_status') or '-'} {e.get('models_finding') or ''}")
    if e.get("pid") is not None:
        cpu = "-" if e.get("cpu_percent") is None else f"{e['cpu_percent']:.0f}%"
        rss = "-" if e.get("rss_bytes") is None else f"{e['rss_bytes'] / 2**20:.0f} MiB"
        table.add_row("process", f"PID {e['pid']}, CPU {cpu}, RSS {rss}")
        table.add_row(
            "connections", f"{e['live_connections']} live, {e['abandoned_connections']} abandoned"
        )
    if e.get("process_error"):
        table.add_row("process", escape(e["process_error"]))
    out.print(table)


def _secs(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


@click.command()
@config_option
@click.option(
    "--wait-for-config",
    is_flag=True,
    help="With a config file that is bad at start, log why and wait until it is fixed instead "
    "of exiting 3 (the installed services run with it: a service manager would restart a "
    "watchdog that exits in a loop, and show the loop, not the reason).",
)
def run(config_path: Path | None, wait_for_config: bool) -> None:
    """Run the watchdog in the foreground, as launchd and systemd start it.

    SIGTERM or SIGINT stop it (a managed process server is stopped too); SIGHUP reloads the
    config, keeping the running one if the new one is bad.
    """
    # httpx imports its own command line (click, rich, pygments) with itself: about 5 MiB of a
    # long-running process that never uses it. Blocked before httpx is first imported.
    sys.modules.setdefault("httpx._main", None)  # type: ignore[arg-type]
    from mlx_watchdog.advice.calibrate import maintenance_calibration
    from mlx_watchdog.daemon import Daemon

    setup_logging()
    from mlx_watchdog.daemon.heartbeat import Notifier

    notifier = Notifier()
    if wait_for_config:
        config = _wait_for_config(config_path, notifier)
    else:
        config = load_or_exit(config_path)
    from mlx_watchdog.record.private import AlreadyRunning, UnsafeState

    try:
        daemon = Daemon(
            config, config_path=config_path, notifier=notifier, maintain=maintenance_calibration
        ).open()
    except (AlreadyRunning, UnsafeState) as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        sys.exit(UNKNOWN_EXIT)
    # A thread woken for a probe due gets the interpreter within 1 ms, not the default 5:
    # the page served to many clients must not push the probing late (bench/page_load.py).
    sys.setswitchinterval(0.001)
    sys.exit(daemon.run())


def _wait_for_config(config_path: Path | None, notifier: Notifier) -> Config:
    """The config, once it is good: each new problem logged once, the file read every 2 s.
    SIGTERM or SIGINT meanwhile end the wait (exit 0: a stop asked for, not a failure). A
    service manager is told the watchdog is up and waiting, so it neither times the start out
    nor restarts it in a loop; `systemctl status` shows the problem."""
    import logging
    import signal
    import threading

    from mlx_watchdog.config import ConfigError, load_config

    log = logging.getLogger("mlx_watchdog")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    said = None
    while True:
        try:
            config = load_config(config_path)
        except ConfigError as exc:
            if str(exc) != said:
                said = str(exc)
                log.error("config error; waiting for the file to be fixed: %s", exc)
                notifier.send("READY=1", f"STATUS=waiting for a good config: {said[:200]}")
            notifier.send("WATCHDOG=1")
            if stop.wait(2.0):
                sys.exit(0)
            continue
        if said is not None:
            log.info("the config is good now; starting")
        for warning in config.warnings:
            log.warning("%s", warning)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        return config


def setup_logging() -> None:
    import logging

    from mlx_watchdog.sense.text import printable

    class OneLine(logging.Formatter):
        """A server's text in a message (a reason, a log line) is shown, never acted on:
        its escapes and newlines cannot forge log lines or move a terminal's cursor."""

        def formatMessage(self, record: logging.LogRecord) -> str:
            return printable(super().formatMessage(record))

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(OneLine("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%dT%H:%M:%S"))
    root = logging.getLogger("mlx_watchdog")
    root.addHandler(handler)
    root.setLevel(logging.INFO)


@click.command()
@click.option("--port", type=int, default=0, help="Port for the demo server (default: a free one).")
@click.option(
    "--timeout",
    default="5m",
    show_default=True,
    help="Give up when the server has not recovered by then.",
)
def demo(port: int, timeout: str) -> None:
    """Watch the watchdog heal a real mlx_lm.server wedged by abandoned requests.

    Builds a tiny random-weight model, starts the real server (serial) under the watchdog,
    sends long prompts from clients that give up, and shows detection, restart and recovery.
    Needs the server extra. Exit 0 when the server recovered, 1 when it did not, 3 when the
    demo cannot run.
    """
    import logging
    import tempfile

    from mlx_watchdog.config import parse_duration
    from mlx_watchdog.demo.run import SayHandler, free_port, missing_server_extra, run_demo

    try:
        limit = parse_duration(timeout, "--timeout")
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    problem = missing_server_extra()
    if problem is not None:
        err.print(f"[red]cannot run the demo:[/red] {escape(problem)}", soft_wrap=True)
        sys.exit(UNKNOWN_EXIT)
    started = time.monotonic()

    def say(message: str) -> None:
        err.print(
            f"[dim]{time.monotonic() - started:6.1f}s[/dim] {escape(message)}", soft_wrap=True
        )

    handler = SayHandler(say)
    logging.getLogger("mlx_watchdog").addHandler(handler)
    logging.getLogger("mlx_watchdog").setLevel(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="mlx-watchdog-demo-") as workdir:
        result = run_demo(Path(workdir), port or free_port(), say=say, timeout=limit)
    logging.getLogger("mlx_watchdog").removeHandler(handler)
    incident = result.incident
    if not result.recovered or incident is None:
        err.print(f"[red]not recovered:[/red] {escape(result.message)}", soft_wrap=True)
        sys.exit(1)
    from rich.table import Table

    table = Table(show_header=False, box=None, padding=(0, 2))
    table.add_column(style="dim")
    table.add_column()
    table.add_row("verdict", escape(incident.reason))
    table.add_row("detected", f"{result.detected_after_s:.1f} s after the clients gave up")
    table.add_row("restarts", str(result.restarts))
    table.add_row("time to recover", _secs(incident.recover_s))
    table.add_row("outage", _secs(incident.outage_s))
    out.print("[bold green]recovered[/bold green]: the wedged server serves again")
    out.print(table)
    out.print(
        "The lasting fix is at the cause: no client or load balancer in front of the server "
        "may give up before a long prefill can finish."
    )


@click.group()
def config() -> None:
    """Check or create the configuration file."""


@config.command("check")
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print the effective config as JSON.")
def config_check(config_path: Path | None, as_json: bool) -> None:
    """Validate the config and print the effective settings, secrets masked."""
    import json

    from mlx_watchdog.config import effective, to_toml
    from mlx_watchdog.config.programs import unrunnable

    cfg = load_or_exit(config_path)
    data = effective(cfg)
    problems = unrunnable(cfg)
    if as_json:
        source = str(cfg.source) if cfg.source else None
        click.echo(json.dumps({"source": source, "problems": problems, **data}, indent=2))
        sys.exit(1 if problems else 0)
    source = str(cfg.source) if cfg.source else "no config file: the embedded default"
    for problem in problems:
        err.print(f"[red]problem:[/red] {escape(problem)}", soft_wrap=True)
    if problems:
        err.print(f"config valid but {len(problems)} program(s) cannot be run ({source})")
    else:
        err.print(f"config ok ({source})", style="green")
    click.echo(to_toml(data), nl=False)
    sys.exit(1 if problems else 0)


@config.command("init")
@click.argument("where", required=False, type=click.Path(dir_okay=False, path_type=Path))
@config_option
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
def config_init(where: Path | None, config_path: Path | None, force: bool) -> None:
    """Write a commented config template to WHERE or --config (default:
    $MLX_WATCHDOG_CONFIG or ~/.config/mlx-watchdog/config.toml)."""
    from mlx_watchdog.config import ConfigError, resolve_config_path, write_template

    if where is not None and config_path is not None and where != config_path:
        raise click.UsageError(f"two places given: {where} and --config {config_path}")
    path, _ = resolve_config_path(where or config_path)
    try:
        written = write_template(path, force=force)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote {written}")


COMMANDS = (probe, run, demo, config)
