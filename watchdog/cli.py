"""Command line: parse, call the core, print. The core never imports click or rich."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shlex
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit

import click
from rich.console import Console, Group
from rich.markup import escape
from rich.table import Table

from . import __version__
from .check import CheckResult, LeftProbes, check_once, with_wedge_after
from .config import (
    Config,
    ConfigError,
    ServerConfig,
    append_server,
    effective,
    load_config,
    parse_duration,
    parse_url,
    resolve_config_path,
    to_toml,
    write_template,
)
from .managers import System
from .verdict import UNKNOWN_EXIT

STATE_STYLE = {
    "healthy": "bold green",
    "slow": "bold yellow",
    "busy": "bold yellow",
    "starting": "bold cyan",
    "wedged": "bold red",
    "dead": "bold red",
    "down": "bold red",
}

out = Console(highlight=False)
err = Console(stderr=True, highlight=False)

config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Config file (default: $MLX_WATCHDOG_CONFIG or ~/.config/mlx-watchdog/config.toml).",
)


def _load(config_path: Path | None) -> Config:
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        err.print(f"[red]config error:[/red] {escape(str(exc))}", soft_wrap=True)
        sys.exit(UNKNOWN_EXIT)
    for warning in config.warnings:
        err.print(f"[yellow]warning:[/yellow] {escape(warning)}", soft_wrap=True)
    return config


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mlx-watchdog")
def cli() -> None:
    """Liveness watchdog for local LLM servers: tells a wedged mlx_lm.server from a busy one."""


@cli.command()
@config_option
@click.option("--url", help="Probe this server URL instead of the configured ones.")
@click.option("--server", "server_name", help="Probe only the configured server of this name.")
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
    if url and server_name:
        raise click.UsageError("give --url or --server, not both")
    config = _load(config_path)
    try:
        servers = _pick(config, url, server_name)
        if wedge_after is not None:
            seconds = parse_duration(wedge_after, "--wedge-after")
            servers = [replace(s, probe=with_wedge_after(s.probe, seconds)) for s in servers]
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
    with ThreadPoolExecutor(max_workers=len(servers)) as pool:
        left = LeftProbes(config.watchdog.state_dir / "left-probes.json")
        results = list(pool.map(lambda s: check_once(s, left=left), servers))
    if as_json:
        docs = [_result_json(r) for r in results]
        click.echo(json.dumps(docs[0] if len(docs) == 1 else docs, indent=2))
    else:
        for r in results:
            _print_result(r)
    sys.exit(max(r.verdict.exit_code for r in results))


def _pick(config: Config, url: str | None, name: str | None) -> list[ServerConfig]:
    if url:
        clean = parse_url(url, "--url")
        port = urlsplit(clean).port or 80
        base = config.servers[0] if len(config.servers) == 1 else None
        probe_settings = base.probe if base else ServerConfig("x", clean).probe
        return [ServerConfig(name=f"mlx-{port}", url=clean, probe=probe_settings)]
    if name:
        return [config.server(name)]
    return list(config.servers)


def _result_json(r: CheckResult) -> dict[str, Any]:
    return {
        "server": r.server.name,
        "url": r.server.url,
        "state": r.verdict.state,
        "reason": r.verdict.reason,
        "exit_code": r.verdict.exit_code,
        "evidence": r.verdict.evidence,
    }


def _print_result(r: CheckResult) -> None:
    v = r.verdict
    out.print(
        f"[bold]{r.server.name}[/bold] {r.server.url}  [{STATE_STYLE[v.state]}]{v.state.upper()}[/]"
    )
    out.print(escape(v.reason), soft_wrap=True)
    e = v.evidence
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


@cli.command()
@config_option
def run(config_path: Path | None) -> None:
    """Run the watchdog in the foreground, as launchd and systemd start it.

    SIGTERM or SIGINT stop it (a managed process server is stopped too); SIGHUP reloads the
    config, keeping the running one if the new one is bad.
    """
    from .daemon import Daemon

    setup_logging()
    config = _load(config_path)
    sys.exit(Daemon(config, config_path=config_path).run())


def setup_logging() -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%Y-%m-%dT%H:%M:%S")
    )
    root = logging.getLogger("mlx_watchdog")
    root.addHandler(handler)
    root.setLevel(logging.INFO)


@cli.command()
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
    from .demo import missing_server_extra, run_demo

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

    handler = _SayHandler(say)
    logging.getLogger("mlx_watchdog").addHandler(handler)
    logging.getLogger("mlx_watchdog").setLevel(logging.INFO)
    with tempfile.TemporaryDirectory(prefix="mlx-watchdog-demo-") as workdir:
        result = run_demo(Path(workdir), port or _free_port(), say=say, timeout=limit)
    logging.getLogger("mlx_watchdog").removeHandler(handler)
    incident = result.incident
    if not result.recovered or incident is None:
        err.print(f"[red]not recovered:[/red] {escape(result.message)}", soft_wrap=True)
        sys.exit(1)
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


class _SayHandler(logging.Handler):
    def __init__(self, say: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self.say = say

    def emit(self, record: logging.LogRecord) -> None:
        self.say(record.getMessage())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@cli.command()
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print the status document as JSON.")
@click.option("--watch", is_flag=True, help="Refresh in place every 2 s until Ctrl-C.")
def status(config_path: Path | None, as_json: bool, watch: bool) -> None:
    """Show what the running watchdog sees, or the last recorded state when it is not running.

    Columns: state, when a probe last got a token, time to first token (median and 95th
    percentile over the last hour), restarts in 24 h, restarts left in the budget, the
    server's PID and memory. Exit code: as for probe (the worst server), or 3 when the
    watchdog is not running.
    """
    from .client import DaemonNotRunning, history_status, live_status

    cfg = _load(config_path)

    def fetch() -> dict[str, Any]:
        try:
            return live_status(cfg.watchdog.state_dir)
        except DaemonNotRunning as exc:
            return history_status(cfg, str(exc))

    doc = fetch()
    if as_json:
        click.echo(json.dumps(doc, indent=2, default=str))
    elif watch:
        from rich.live import Live

        with Live(_status_view(doc), console=out, auto_refresh=False) as live:
            try:
                while True:
                    time.sleep(2.0)
                    doc = fetch()
                    live.update(_status_view(doc), refresh=True)
            except KeyboardInterrupt:
                pass
    else:
        out.print(_status_view(doc))
    sys.exit(_status_exit(doc))


def _status_exit(doc: dict[str, Any]) -> int:
    if not doc["watchdog"].get("running"):
        return UNKNOWN_EXIT
    return max((int(s["exit_code"]) for s in doc["servers"]), default=UNKNOWN_EXIT)


def _status_view(doc: dict[str, Any]) -> Group:
    now = time.time()
    table = Table(box=None, padding=(0, 1), header_style="dim")
    for column in ("server", "state", "last token", "TTFT p50/p95", "restarts", "left", "PID"):
        table.add_column(column, no_wrap=True)
    table.add_column("RSS", no_wrap=True, justify="right")
    notes = []
    for s in doc["servers"]:
        state = s["state"]
        table.add_row(
            s["name"],
            f"[{STATE_STYLE.get(state, 'bold')}]{state}[/]",
            _ago(s.get("last_token_at"), now),
            f"{_ms(s.get('ttft_p50_s'))}/{_ms(s.get('ttft_p95_s'))} ms",
            str(s["restarts_24h"]),
            str(s["budget_left"]),
            "-" if s.get("pid") is None else str(s["pid"]),
            "-" if s.get("rss_bytes") is None else f"{s['rss_bytes'] / 2**20:.0f} MiB",
        )
        flags = [f for f in ("draining", "restarting") if s.get(f)]
        notes.append(
            f"[bold]{s['name']}[/bold] {escape(s['reason'])}"
            + "".join(f" [bold yellow]({f}: /healthz answers 503)[/]" for f in flags)
        )
        if s.get("needs_person"):
            notes.append(f"  [bold red]a person is needed:[/] {escape(s['needs_person'])}")
    w = doc["watchdog"]
    head = (
        f"[green]watchdog running[/green] (PID {w['pid']}, every {w['interval_s']:g}s)"
        if w.get("running")
        else f"[yellow]{escape(w.get('why', 'the watchdog is not running'))}[/yellow]; "
        "showing the last recorded probes"
    )
    return Group(head, table, *notes)


def _ago(at: float | None, now: float) -> str:
    if at is None:
        return "never"
    seconds = max(0.0, now - at)
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f}"


@cli.command()
@config_option
@click.option("--since", default="7d", show_default=True, help='How far back, e.g. "24h".')
@click.option("--server", "server_name", help="Only this server's incidents.")
@click.option("--json", "as_json", is_flag=True, help="Print the incidents as JSON.")
def history(config_path: Path | None, since: str, server_name: str | None, as_json: bool) -> None:
    """List incidents: start, end, outage, reason, actions and outcome."""
    from .store import Store

    cfg = _load(config_path)
    try:
        window = parse_duration(since, "--since")
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    db = cfg.watchdog.state_dir / "history.db"
    if not db.exists():
        incidents = []
    else:
        store = Store(db)
        try:
            incidents = store.incidents(time.time() - window, server_name)
        finally:
            store.close()
    if as_json:
        click.echo(json.dumps([dataclasses.asdict(i) for i in incidents], indent=2))
        return
    if not incidents:
        err.print(f"no incidents in the last {since}")
        return
    table = Table(box=None, padding=(0, 1), header_style="dim")
    for column in ("#", "server", "state", "start", "end", "outage", "actions", "outcome"):
        table.add_column(
            column, no_wrap=column != "actions", min_width=7 if column == "actions" else None
        )
    for i in incidents:
        actions = ", ".join(f"{a['action']}: {a['outcome']}" for a in i.actions) or "-"
        table.add_row(
            str(i.id),
            i.server,
            i.state,
            _clock(i.began_at),
            "open" if i.closed_at is None else _clock(i.closed_at, short=True),
            "-" if i.outage_s is None else f"{i.outage_s:.1f} s",
            escape(actions),
            i.outcome or "-",
        )
    out.print(table)
    for i in incidents:
        out.print(f"[bold]#{i.id}[/bold] {escape(i.reason)}", soft_wrap=True)
        if i.advice:
            out.print(f"    [yellow]advice:[/yellow] {escape(i.advice)}", soft_wrap=True)


def _clock(at: float, short: bool = False) -> str:
    return time.strftime("%H:%M:%S" if short else "%Y-%m-%d %H:%M:%S", time.localtime(at))


def _action(action: str) -> click.Command:
    help_text = {
        "restart": "Restart a server through the running watchdog's one restart path.",
        "drain": "Turn a server's /healthz to 503 (and run drain_command) until undrain.",
        "undrain": "End a drain: /healthz follows the server's state again.",
    }[action]

    @config_option
    @click.argument("name")
    def command(config_path: Path | None, name: str) -> None:
        from .client import ActionRefused, DaemonNotRunning, act

        cfg = _load(config_path)
        try:
            message = act(cfg.watchdog.state_dir, name, action)
        except DaemonNotRunning as exc:
            err.print(f"[red]error:[/red] {escape(str(exc))}; start it with `mlx-watchdog run`")
            sys.exit(UNKNOWN_EXIT)
        except ActionRefused as exc:
            raise click.ClickException(str(exc)) from None
        click.echo(message)

    command.__doc__ = help_text
    return click.command(action, help=help_text)(command)


for _name in ("restart", "drain", "undrain"):
    cli.add_command(_action(_name))


target_option = click.option(
    "--target",
    type=click.Choice(["launchd", "systemd"]),
    help="launchd (macOS) or systemd --user (Linux); default: this platform's.",
)
dry_run_option = click.option(
    "--dry-run", is_flag=True, help="Print the file and the commands; change nothing."
)


@cli.command()
@config_option
@target_option
@dry_run_option
def install(config_path: Path | None, target: str | None, dry_run: bool) -> None:
    """Install the watchdog as a launchd agent or a systemd user unit, and start it.

    Runs again safely: the job is replaced with the new file. A missing config file is
    created from the template first.
    """
    from . import service

    kind = cast(service.Target, target or service.default_target())
    path = resolve_config_path(config_path)[0].expanduser().absolute()
    if path.exists():
        _load(path)
    elif dry_run:
        err.print(f"would write a config template to {path}")
    else:
        write_template(path)
        err.print(f"wrote a config template to {path}; edit it, then run install again")
    content = service.watchdog_content(
        kind, config=path, home=Path.home(), env=os.environ, python=service.interpreter()
    )
    label = service.WATCHDOG_LABEL if kind == "launchd" else service.WATCHDOG_UNIT
    plan = service.install_plan(
        kind, label=label, content=content, home=Path.home(), env=os.environ, uid=os.getuid()
    )
    _carry_out(plan, dry_run)


@cli.command()
@target_option
@dry_run_option
def uninstall(target: str | None, dry_run: bool) -> None:
    """Stop the watchdog's service and remove its file (config and history stay)."""
    from . import service

    kind = cast(service.Target, target or service.default_target())
    label = service.WATCHDOG_LABEL if kind == "launchd" else service.WATCHDOG_UNIT
    plan = service.uninstall_plan(
        kind, label=label, home=Path.home(), env=os.environ, uid=os.getuid()
    )
    _carry_out(plan, dry_run)


@cli.group()
def server() -> None:
    """Install or remove an mlx_lm.server service that the watchdog manages."""


@server.command("install")
@config_option
@click.option("--model", required=True, help="Model folder or repo id, as mlx_lm.server takes it.")
@click.option("--port", type=int, default=8080, show_default=True, help="Port to serve on.")
@click.option("--draft-model", help="Draft model for speculative decoding (serves serially).")
@click.option("--name", help="The server's name in the config (default: mlx-PORT).")
@target_option
@dry_run_option
def server_install(
    config_path: Path | None,
    model: str,
    port: int,
    draft_model: str | None,
    name: str | None,
    target: str | None,
    dry_run: bool,
) -> None:
    """Install mlx_lm.server as a service and add it to the config with the matching manager."""
    from . import service
    from .demo import missing_server_extra

    kind = cast(service.Target, target or service.default_target())
    name = name or f"mlx-{port}"
    url = f"http://127.0.0.1:{port}"
    path = resolve_config_path(config_path)[0].expanduser().absolute()
    problem = missing_server_extra()
    if problem is not None:
        if not dry_run:
            raise click.ClickException(problem)
        err.print(f"[yellow]warning:[/yellow] {escape(problem)}", soft_wrap=True)
    existing = _load(path).servers if path.exists() else ()
    for other in existing:
        if other.name == name or other.url == url:
            raise click.ClickException(
                f'{path} already has server "{other.name}" at {other.url}; '
                "choose another --name/--port, or edit that entry"
            )
    content, log = service.server_content(
        kind,
        name=name,
        args=service.server_args(model, port, draft_model),
        home=Path.home(),
        env=os.environ,
        python=service.interpreter(),
    )
    label = service.server_label(name) if kind == "launchd" else service.server_unit(name)
    plan = service.install_plan(
        kind, label=label, content=content, home=Path.home(), env=os.environ, uid=os.getuid()
    )
    entry: dict[str, Any] = {"name": name, "url": url, "manager": kind}
    if kind == "launchd":
        entry.update(label=label, plist=str(plan.path), log_file=str(log))
    else:
        entry.update(unit=label)
    block = to_toml({"server": [entry]})
    _carry_out(plan, dry_run)
    if dry_run:
        click.echo(f"# would add to {path}:\n{block}", nl=False)
        return
    added = append_server(path, block)
    click.echo(f"added server {name} to {added}")
    err.print("reload a running watchdog to watch it: `mlx-watchdog install` or kill -HUP its PID")


@server.command("uninstall")
@click.argument("name")
@target_option
@dry_run_option
def server_uninstall(name: str, target: str | None, dry_run: bool) -> None:
    """Stop and remove the server service NAME (its config entry stays; remove it by hand)."""
    from . import service

    kind = cast(service.Target, target or service.default_target())
    label = service.server_label(name) if kind == "launchd" else service.server_unit(name)
    plan = service.uninstall_plan(
        kind, label=label, home=Path.home(), env=os.environ, uid=os.getuid()
    )
    _carry_out(plan, dry_run)


def _carry_out(plan: Any, dry_run: bool) -> None:
    from . import service

    if dry_run:
        if plan.content is None:
            click.echo(f"# would remove {plan.path}")
        else:
            click.echo(f"# would write {plan.path} (mode 0644):")
            click.echo(plan.content.decode(), nl=False)
        click.echo("# would run:")
        for argv in plan.commands:
            click.echo("  " + shlex.join(argv))
    else:
        try:
            for line in service.apply(plan, System()):
                click.echo(line)
        except service.ServiceError as exc:
            raise click.ClickException(str(exc)) from None
    for hint in plan.hints:
        err.print(f"hint: {hint}")


@cli.command()
@config_option
@click.option("--server", "server_name", help="The configured server to calibrate.")
@click.option("--url", help="Calibrate this server URL instead of a configured one.")
@click.option(
    "--sizes", default="1k,4k,16k", show_default=True, help="Prompt sizes to measure, in tokens."
)
@click.option(
    "--max-prompt", help="The largest prompt clients send, e.g. 64k (default: the context length)."
)
@click.option(
    "--answer-tokens", default=1024, show_default=True, help="The longest answer clients ask for."
)
@click.option("--force", is_flag=True, help="Calibrate even though the server is busy.")
@click.option(
    "--litellm-config",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Warn when this LiteLLM config's timeouts are below the need.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the measurements and advice as JSON.")
def calibrate(
    config_path: Path | None,
    server_name: str | None,
    url: str | None,
    sizes: str,
    max_prompt: str | None,
    answer_tokens: int,
    force: bool,
    litellm_config: Path | None,
    as_json: bool,
) -> None:
    """Measure prefill and decode speed and print the timeout each client layer needs.

    Sends prompts of the given sizes with a unique prefix (no prompt cache helps), fits how the
    time to the first token grows with the prompt, stores the result in the history and turns
    it into timeouts for the client, an agent framework and the load balancer. It is heavy on a
    serial server, so it refuses while the server is busy unless --force.
    """
    from .calibrate import (
        CalibrationError,
        advise,
        context_length,
        parse_tokens,
        refusal,
        run_calibration,
        tokens_label,
    )
    from .store import Store

    if url and server_name:
        raise click.UsageError("give --url or --server, not both")
    cfg = _load(config_path)
    try:
        servers = _pick(cfg, url, server_name)
        sizes_n = [parse_tokens(s, "--sizes") for s in sizes.split(",") if s.strip()]
        limit = parse_tokens(max_prompt, "--max-prompt") if max_prompt else None
    except (ConfigError, ValueError) as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        sys.exit(UNKNOWN_EXIT)
    if len(servers) != 1:
        raise click.UsageError("several servers are configured; name one with --server")
    if len(sizes_n) < 2:
        raise click.UsageError("--sizes needs at least two sizes, like 1k,4k,16k")
    server = servers[0]
    why, cmdline = refusal(server)
    if why is not None and not force:
        err.print(
            f"[yellow]not calibrating {server.name}:[/yellow] {escape(why)}; calibration sends "
            "long prompts that everyone behind them would wait for. Try again when it is idle, "
            "or pass --force.",
            soft_wrap=True,
        )
        sys.exit(1)
    say = (lambda _: None) if as_json else (lambda m: err.print(escape(m), style="dim"))
    try:
        cal = run_calibration(server, sizes_n, say=say)
    except CalibrationError as exc:
        raise click.ClickException(str(exc)) from None
    assumed = limit is None and context_length(cmdline) is None
    prompt = limit or context_length(cmdline) or 32 * 1024
    advice = advise(cal, prompt, answer_tokens)
    store = Store(cfg.watchdog.state_dir / "history.db")
    store.save_calibration(server.name, cal.at, {**cal.to_json(), "advice": advice.to_json()})
    store.close()
    if as_json:
        doc = {**cal.to_json(), "advice": advice.to_json(), "max_prompt_assumed": assumed}
        click.echo(json.dumps(doc, indent=2))
        return
    table = Table(box=None, padding=(0, 1), header_style="dim")
    for column in ("prompt tokens", "first token after", "prefill rate"):
        table.add_column(column, justify="right")
    for p in cal.points:
        table.add_row(
            str(p.prompt_tokens),
            f"{p.prefill_s:.2f} s",
            f"{p.prompt_tokens / p.prefill_s:.0f} tok/s",
        )
    out.print(f"[bold]{server.name}[/bold] {server.url}")
    out.print(table)
    decode = f"{cal.decode_tps:.1f} tok/s" if cal.decode_tps else "not measured"
    out.print(f"decode: {decode}")
    size = tokens_label(prompt)
    note = " (assumed; pass --max-prompt)" if assumed else ""
    out.print(
        f"A {size}-token prompt{note} needs about {advice.prefill_s:.0f} s of prefill here, "
        f"and a {answer_tokens}-token answer about {advice.answer_s:.0f} s more.",
        soft_wrap=True,
    )
    largest = max(p.prompt_tokens for p in cal.points)
    if prompt > 4 * largest:
        out.print(
            f"[yellow]This is extrapolated from prompts up to {largest} tokens; measure closer "
            f"to it for a firmer figure (--sizes ...,{size}).[/yellow]",
            soft_wrap=True,
        )
    out.print("Set these timeouts at least (no layer may give up before the server answers):")
    out.print(f"  client request timeout   {advice.client_s} s")
    out.print(f"  agent framework          {advice.agent_s} s")
    out.print(f"  load balancer / proxy    {advice.load_balancer_s} s")
    if litellm_config is not None:
        from .doctor import litellm_findings

        cfg_one = dataclasses.replace(cfg, servers=(server,))
        for f in litellm_findings(litellm_config, cfg_one, {server.name: advice}):
            if f.level != "ok":
                err.print(f"[yellow]{f.level}:[/yellow] {escape(f.detail)}", soft_wrap=True)


@cli.command()
@config_option
@click.option("--server", "server_name", help="The configured server to drill.")
@click.option("--url", help="Drill this server URL instead of a configured one.")
@click.option(
    "--prompt",
    "prompt_size",
    default="16k",
    show_default=True,
    help="Tokens in the abandoned prompt.",
)
@click.option(
    "--give-up-after", default="3s", show_default=True, help="When the drill's client gives up."
)
@click.option(
    "--max-wait", default="10m", show_default=True, help="Then restart through the watchdog."
)
@click.option("--yes", is_flag=True, help="Run it: the server stalls for its other clients.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def drill(
    config_path: Path | None,
    server_name: str | None,
    url: str | None,
    prompt_size: str,
    give_up_after: str,
    max_wait: str,
    yes: bool,
    as_json: bool,
) -> None:
    """Reproduce the abandoned-request wedge on purpose and measure how long it lasts.

    Sends one long unique prompt, gives up on it mid-prefill, then measures how long a tiny
    request waits. Without --yes it only says what it would do. It ends when the server answers
    again, or restarts it through the running watchdog after --max-wait. Exit 0 when the server
    answered again, 1 when it had to be restarted or did not come back.
    """
    from .calibrate import parse_tokens, refusal
    from .drill import plan, restart_through_daemon, run_drill

    if url and server_name:
        raise click.UsageError("give --url or --server, not both")
    cfg = _load(config_path)
    try:
        servers = _pick(cfg, url, server_name)
        tokens = parse_tokens(prompt_size, "--prompt")
        give_up = parse_duration(give_up_after, "--give-up-after")
        limit = parse_duration(max_wait, "--max-wait")
    except (ConfigError, ValueError) as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        sys.exit(UNKNOWN_EXIT)
    if len(servers) != 1:
        raise click.UsageError("several servers are configured; name one with --server")
    server = servers[0]
    if not yes:
        err.print(escape(plan(server, tokens, give_up)), soft_wrap=True)
        err.print("Run it again with --yes to go ahead.")
        sys.exit(1)
    why, _ = refusal(server)
    if why is not None:
        raise click.ClickException(f"not drilling {server.name}: {why}; try when it is idle")
    say = (lambda _: None) if as_json else (lambda m: err.print(escape(m), style="dim"))
    result = run_drill(
        server,
        prompt_tokens=tokens,
        give_up_after=give_up,
        max_wait=limit,
        restart=restart_through_daemon(cfg.watchdog.state_dir),
        say=say,
    )
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        out.print(escape(result.summary()), soft_wrap=True)
    sys.exit(0 if result.stall_s is not None else 1)


@cli.command()
@config_option
@click.option(
    "--litellm-config",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A LiteLLM proxy config to check: timeouts, retries and fallbacks.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
def doctor(config_path: Path | None, litellm_config: Path | None, as_json: bool) -> None:
    """Check what decides whether the wedge can happen here, and say how to fix it.

    Config, service, the watchdog's endpoint, each server (a generation, the probe's cost,
    serial serving, API key file, last calibration) and, with --litellm-config, the proxy's
    timeouts, retries and fallbacks. Exit 0 all ok, 1 warnings, 2 problems.
    """
    from .doctor import exit_code, run_doctor

    cfg = _load(config_path)
    findings = []
    style = {"ok": "green", "warning": "yellow", "problem": "bold red"}
    for f in run_doctor(cfg, litellm=litellm_config):
        findings.append(f)
        if not as_json:
            line = (
                f"[{style[f.level]}]{f.level:8}[/] [bold]{escape(f.what)}[/bold] {escape(f.detail)}"
            )
            out.print(line, soft_wrap=True)
            if f.fix:
                out.print(f"         fix: {escape(f.fix)}", style="dim", soft_wrap=True)
    if as_json:
        click.echo(json.dumps([dataclasses.asdict(f) for f in findings], indent=2))
    sys.exit(exit_code(findings))


@cli.group()
def config() -> None:
    """Check or create the configuration file."""


@config.command("check")
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print the effective config as JSON.")
def config_check(config_path: Path | None, as_json: bool) -> None:
    """Validate the config and print the effective settings, secrets masked."""
    cfg = _load(config_path)
    data = effective(cfg)
    if as_json:
        click.echo(
            json.dumps({"source": str(cfg.source) if cfg.source else None, **data}, indent=2)
        )
        return
    source = str(cfg.source) if cfg.source else "no config file: the embedded default"
    err.print(f"config ok ({source})", style="green")
    click.echo(to_toml(data), nl=False)


@config.command("init")
@config_option
@click.option("--force", is_flag=True, help="Overwrite an existing file.")
def config_init(config_path: Path | None, force: bool) -> None:
    """Write a commented config template (default: ~/.config/mlx-watchdog/config.toml)."""
    path, _ = resolve_config_path(config_path)
    try:
        written = write_template(path, force=force)
    except ConfigError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"wrote {written}")


def main() -> None:
    cli(prog_name="mlx-watchdog")
