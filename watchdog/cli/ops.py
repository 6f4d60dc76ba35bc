"""Commands that operate the running watchdog and its services: status, history, restart,
drain, undrain, install, uninstall, server install/uninstall."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import click

from mlx_watchdog.cli.app import (
    STATE_STYLE,
    config_option,
    err,
    escape,
    load_or_exit,
    out,
)
from mlx_watchdog.judge.states import UNKNOWN_EXIT

if TYPE_CHECKING:
    from rich.console import Group

    from mlx_watchdog.service import JobUser


@click.command()
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
    import json

    from mlx_watchdog.serve.client import DaemonNotRunning, history_status, live_status

    cfg = load_or_exit(config_path)

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

        with Live(_status_view(doc), console=out.get(), auto_refresh=False) as live:
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
    from rich.console import Group
    from rich.table import Table

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
    if w.get("history_problem"):
        notes.append(f"[bold red]history:[/] {escape(w['history_problem'])}")
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


@click.command()
@config_option
@click.option("--since", default="7d", show_default=True, help='How far back, e.g. "24h".')
@click.option("--server", "server_name", help="Only this server's incidents.")
@click.option("--json", "as_json", is_flag=True, help="Print the incidents as JSON.")
def history(config_path: Path | None, since: str, server_name: str | None, as_json: bool) -> None:
    """List incidents: start, end, outage, reason, actions and outcome."""
    import json

    from rich.table import Table

    from mlx_watchdog.config import ConfigError, parse_duration
    from mlx_watchdog.record.store import open_history

    cfg = load_or_exit(config_path)
    try:
        window = parse_duration(since, "--since")
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        if server_name is not None:
            cfg.server(server_name)
    except ConfigError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        sys.exit(UNKNOWN_EXIT)
    store = open_history(cfg.watchdog.state_dir, create=False)
    try:
        incidents = store.incidents(time.time() - window, server_name)
    finally:
        store.close()
    if as_json:
        import dataclasses

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
    @click.option(
        "--no-wait",
        is_flag=True,
        hidden=action != "restart",
        help="Return once the watchdog has the request, without waiting for the restart's end.",
    )
    def command(config_path: Path | None, name: str, no_wait: bool) -> None:
        from mlx_watchdog.config import ConfigError
        from mlx_watchdog.serve.client import ActionRefused, DaemonNotRunning, act

        cfg = load_or_exit(config_path)
        try:
            server = cfg.server(name)
        except ConfigError as exc:
            err.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
            sys.exit(UNKNOWN_EXIT)
        asked = time.time()
        try:
            message = act(cfg.watchdog.state_dir, name, action)
        except DaemonNotRunning as exc:
            err.print(f"[red]error:[/red] {escape(str(exc))}; start it with `mlx-watchdog run`")
            sys.exit(UNKNOWN_EXIT)
        except ActionRefused as exc:
            raise click.ClickException(str(exc)) from None
        if action != "restart" or no_wait:
            click.echo(message)
            return
        restart, drain = server.restart, server.restart.drain_timeout if server.restart.drain else 0
        bound = drain + restart.stop_grace + restart.command_timeout + server.probe.startup_grace
        sys.exit(_await_restart(cfg, name, asked, bound + 2 * cfg.watchdog.interval + 10))

    command.__doc__ = help_text
    return click.command(action, help=help_text)(command)


def _await_restart(cfg: Any, name: str, asked: float, bound: float) -> int:
    """Follow the asked restart in the daemon's status until it ends; say how, and the exit
    code: 0 it serves again, 2 it does not, 3 the watchdog cannot tell."""
    from mlx_watchdog.serve.client import DaemonNotRunning, live_status

    err.print(f"restart of {name} asked for; waiting for it to end (up to {bound:.0f} s)")
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        try:
            doc = live_status(cfg.watchdog.state_dir)
        except DaemonNotRunning as exc:
            err.print(f"[red]error:[/red] {escape(str(exc))} while the restart ran")
            return UNKNOWN_EXIT
        server: dict[str, Any] = next(
            (s for s in doc.get("servers", []) if s.get("name") == name), {}
        )
        last = server.get("last_restart") or {}
        at, outcome = last.get("at"), last.get("outcome")
        if isinstance(at, (int, float)) and at >= asked - 1 and outcome is not None:
            took = float(last.get("finished_at") or at) - at
            if outcome == "recovered":
                click.echo(f"restarted {name}: serving again after {took:.1f} s")
                return 0
            click.echo(f"restart of {name} {outcome} after {took:.1f} s: {server.get('reason')}")
            return UNKNOWN_EXIT if outcome == "interrupted" else 2
        time.sleep(0.5)
    err.print(f"the restart of {name} had not ended after {bound:.0f} s; see `mlx-watchdog status`")
    return UNKNOWN_EXIT


target_option = click.option(
    "--target",
    type=click.Choice(["launchd", "systemd"]),
    help="launchd (macOS) or systemd (Linux); default: this platform's.",
)
system_option = click.option(
    "--system",
    "system_wide",
    is_flag=True,
    help="As root (sudo): a LaunchDaemon or system unit that starts at boot with nobody logged "
    "in, running as the user who ran sudo.",
)
dry_run_option = click.option(
    "--dry-run", is_flag=True, help="Print the file and the commands; change nothing."
)


def _target(kind: str | None, system_wide: bool) -> Any:
    from mlx_watchdog import service
    from mlx_watchdog.act.managers import System

    try:
        return service.target(
            cast(service.Kind, kind or service.default_kind()), System(), system_wide=system_wide
        )
    except service.ServiceError as exc:
        raise click.ClickException(str(exc)) from None


@click.command()
@config_option
@target_option
@system_option
@dry_run_option
def install(config_path: Path | None, target: str | None, system_wide: bool, dry_run: bool) -> None:
    """Install the watchdog as a launchd job or a systemd unit, and start it.

    Runs again safely: the job is replaced with the new file. A missing config file is
    created from the template first. Without a GUI login on a Mac the job goes into the user's
    launchd domain (it does not start at boot); --system makes it start at boot.
    """
    from mlx_watchdog import service
    from mlx_watchdog.config import write_template

    tgt = _target(target, system_wide)
    user = _job_user(system_wide)
    path = _config_path(config_path, user)
    writable: list[Path] = []
    if path.exists():
        with _as_home(user):
            cfg = load_or_exit(path)
        if user is not None:
            _readable_or_exit(path, user)
            writable = [cfg.watchdog.state_dir]
            writable += [s.log_file.parent for s in cfg.servers if s.log_file is not None]
    elif dry_run:
        err.print(f"would write a config template to {path}")
    else:
        with _owned_by(user, path):
            write_template(path)
        err.print(f"wrote a config template to {path}; edit it, then run install again")
    home = user.home if user is not None else Path.home()
    plan = tgt.watchdog_plan(
        config=path, home=home, env=os.environ, python=service.interpreter(), writable=writable
    )
    _carry_out(plan, dry_run)


def _job_user(system_wide: bool) -> JobUser | None:
    from mlx_watchdog import service

    if not system_wide:
        return None
    try:
        return service.job_user(os.environ)
    except service.ServiceError as exc:
        raise click.ClickException(str(exc)) from None


def _config_path(given: Path | None, user: JobUser | None) -> Path:
    """The config the job reads: under --system, in the job user's home by default (sudo's
    `HOME` may be root's, which that user cannot read)."""
    from mlx_watchdog.config import CONFIG_ENV, resolve_config_path

    if user is not None and given is None and not os.environ.get(CONFIG_ENV):
        return user.home / ".config" / "mlx-watchdog" / "config.toml"
    return resolve_config_path(given)[0].expanduser().absolute()


def _readable_or_exit(path: Path, user: JobUser) -> None:
    from mlx_watchdog import service

    blocked = service.unreadable_by(path, user)
    if blocked is not None:
        raise click.ClickException(
            f"the job runs as {user.name}, who cannot read {blocked}, so not {path}; put the "
            f"config under {user.home} (the default without --config) or make it readable"
        )


@contextmanager
def _as_home(user: JobUser | None) -> Iterator[None]:
    """Read the config as the job will: `~` and the default state folder in its user's home."""
    if user is None:
        yield
        return
    saved = {k: os.environ.get(k) for k in ("HOME", "XDG_STATE_HOME", "XDG_CONFIG_HOME")}
    os.environ["HOME"] = str(user.home)
    os.environ.pop("XDG_STATE_HOME", None)
    os.environ.pop("XDG_CONFIG_HOME", None)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextmanager
def _owned_by(user: JobUser | None, path: Path) -> Iterator[None]:
    """Root writing a file for the job's user: the file and the folders made for it are theirs."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    yield
    if user is not None:
        for made in missing:
            if made.exists():
                os.chown(made, user.uid, user.gid)


@click.command()
@target_option
@system_option
@dry_run_option
def uninstall(target: str | None, system_wide: bool, dry_run: bool) -> None:
    """Stop the watchdog's service and remove its file (config and history stay)."""
    tgt = _target(target, system_wide)
    _carry_out(tgt.uninstall_plan(tgt.watchdog_label, home=Path.home(), env=os.environ), dry_run)


@click.group()
def server() -> None:
    """Install or remove an mlx_lm.server service that the watchdog manages."""


@server.command("install")
@config_option
@click.option("--model", required=True, help="Model folder or repo id, as mlx_lm.server takes it.")
@click.option("--port", type=int, default=8080, show_default=True, help="Port to serve on.")
@click.option("--draft-model", help="Draft model for speculative decoding (serves serially).")
@click.option("--name", help="The server's name in the config (default: mlx-PORT).")
@target_option
@system_option
@dry_run_option
def server_install(
    config_path: Path | None,
    model: str,
    port: int,
    draft_model: str | None,
    name: str | None,
    target: str | None,
    system_wide: bool,
    dry_run: bool,
) -> None:
    """Install mlx_lm.server as a service and add it to the config with the matching manager.

    With --system the server runs as the watchdog's own child (manager = "process") under the
    watchdog's system job: a watchdog running as a user may not restart a system job.
    """
    from mlx_watchdog import service
    from mlx_watchdog.config import append_server, to_toml
    from mlx_watchdog.demo.run import missing_server_extra

    name = name or f"mlx-{port}"
    url = f"http://127.0.0.1:{port}"
    user = _job_user(system_wide)
    path = _config_path(config_path, user)
    problem = missing_server_extra()
    if problem is not None:
        if not dry_run:
            raise click.ClickException(problem)
        err.print(f"[yellow]warning:[/yellow] {escape(problem)}", soft_wrap=True)
    with _as_home(user):
        existing = load_or_exit(path).servers if path.exists() else ()
    for other in existing:
        if other.name == name or other.url == url:
            raise click.ClickException(
                f'{path} already has server "{other.name}" at {other.url}; '
                "choose another --name/--port, or edit that entry"
            )
    args = service.server_args(model, port, draft_model)
    entry: dict[str, Any] = {"name": name, "url": url}
    if system_wide:
        command = [service.interpreter(), "-m", "mlx_lm", "server", *args]
        env = {k: os.environ[k] for k in service.SERVER_ENV if os.environ.get(k)}
        entry.update(manager="process", command=command, **({"env": env} if env else {}))
    else:
        tgt = _target(target, system_wide)
        plan, keys = tgt.server_plan(
            name=name, args=args, home=Path.home(), env=os.environ, python=service.interpreter()
        )
        entry.update(manager=tgt.kind, **keys)
        _carry_out(plan, dry_run)
    block = to_toml({"server": [entry]})
    if dry_run:
        click.echo(f"# would add to {path}:\n{block}", nl=False)
        return
    with _owned_by(user, path):
        added = append_server(path, block)
    click.echo(f"added server {name} to {added}")
    err.print("reload a running watchdog to watch it: `mlx-watchdog install` or kill -HUP its PID")


@server.command("uninstall")
@click.argument("name")
@target_option
@dry_run_option
def server_uninstall(name: str, target: str | None, dry_run: bool) -> None:
    """Stop and remove the server service NAME (its config entry stays; remove it by hand)."""
    tgt = _target(target, False)
    plan = tgt.uninstall_plan(tgt.server_label(name), home=Path.home(), env=os.environ)
    _carry_out(plan, dry_run)


def _carry_out(plan: Any, dry_run: bool) -> None:
    from mlx_watchdog import service

    if dry_run:
        if plan.content is None:
            click.echo(f"# would remove {plan.path}")
        else:
            click.echo(f"# would write {plan.path} (mode 0644):")
            click.echo(plan.content.decode(), nl=False)
        click.echo(f"# would run ({plan.domain}):")
        for step in plan.steps:
            click.echo("  " + step.show())
    else:
        try:
            from mlx_watchdog.act.managers import System

            for line in service.apply(plan, System()):
                click.echo(line)
        except service.ServiceError as exc:
            raise click.ClickException(str(exc)) from None
    for hint in plan.hints:
        err.print(f"hint: {escape(hint)}", soft_wrap=True)


COMMANDS = (
    status,
    history,
    *(_action(name) for name in ("restart", "drain", "undrain")),
    install,
    uninstall,
    server,
)
