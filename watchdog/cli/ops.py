"""Commands that operate the running watchdog: status, open, history, restart, drain, undrain."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from mlx_watchdog.cli.app import (
    STATE_STYLE,
    config_option,
    echo,
    err,
    escape,
    load_or_exit,
    out,
    running_or_loaded,
    server_names,
    suggest,
)
from mlx_watchdog.judge.states import UNKNOWN_EXIT
from mlx_watchdog.record.document import ServerStatus, Status
from mlx_watchdog.serve.notes import ALERT, ASIDE, NOTE, Note
from mlx_watchdog.serve.notes import notes as server_notes

if TYPE_CHECKING:
    from rich.console import Group

    from mlx_watchdog.record.store import Store


@click.command()
@config_option
@click.option("--json", "as_json", is_flag=True, help="Print the status document as JSON.")
@click.option("--watch", is_flag=True, help="Refresh in place every 2 s until Ctrl-C.")
def status(config_path: Path | None, as_json: bool, watch: bool) -> None:
    """Show what the running watchdog sees, or the last recorded state when it is not running.

    Columns: state; traffic (in: a balancer reading /healthz sends it requests; out, drained
    or restart: it does not); how long ago a probe last got a token; the time to first token
    (median and 95th percentile over the last hour, seconds); restarts in 24 h / restarts left
    in the budget; the server's PID and memory. The reason and what to do follow. Exit code:
    as for probe (the worst server), or 3 when the watchdog is not running.
    """

    from mlx_watchdog.serve.client import DaemonNotRunning, history_status, live_status

    cfg, state_dir = running_or_loaded(config_path)

    def fetch() -> Status:
        try:
            return live_status(state_dir)
        except DaemonNotRunning as exc:
            if cfg is None:  # neither the config nor a running watchdog: nothing to show
                load_or_exit(config_path)
            assert cfg is not None
            return history_status(cfg, str(exc))

    doc = fetch()
    if as_json:
        _json_out(doc.to_json())
    elif watch:
        import signal
        import threading

        from rich.live import Live

        # Ctrl-C ends the loop between two refreshes: a KeyboardInterrupt raised inside rich's
        # rendering could leave its live display half torn down (seen: no exit in 30 s).
        stop = threading.Event()
        signal.signal(signal.SIGINT, lambda *_: stop.set())
        signal.signal(signal.SIGTERM, lambda *_: stop.set())
        if not out.is_terminal:  # into a pipe: each refresh printed after the last
            out.print(_status_view(doc, config_path))
            while not stop.wait(2.0):
                doc = fetch()
                out.print()
                out.print(_status_view(doc, config_path))
                out.file.flush()
        else:
            with Live(
                _status_view(doc, config_path), console=out.get(), auto_refresh=False
            ) as live:
                while not stop.wait(2.0):
                    doc = fetch()
                    live.update(_status_view(doc, config_path), refresh=True)
    else:
        out.print(_status_view(doc, config_path))
    sys.exit(_status_exit(doc))


@click.command("open")
@config_option
@click.option("--print-url", is_flag=True, help="Print the page's address; open no browser.")
@click.option("--json", "as_json", is_flag=True, help="Print the address and what was done.")
def open_page(config_path: Path | None, print_url: bool, as_json: bool) -> None:
    """Open the running watchdog's status page (its endpoint's /) in the browser.

    The page is read-only and refreshes by itself; it needs the watchdog running with its
    endpoint (watchdog.listen). Exit code 3 when the watchdog is not running, 1 when it serves
    no page that can be opened, or no browser can be started.
    """
    import webbrowser

    from mlx_watchdog.serve.client import DaemonNotRunning, NoPage, page_url

    cfg = load_or_exit(config_path)
    try:
        url = page_url(cfg.watchdog.state_dir)
    except DaemonNotRunning as exc:
        err.print(f"no status page: {escape(str(exc))}")
        sys.exit(UNKNOWN_EXIT)
    except NoPage as exc:
        err.print(f"no status page: {escape(str(exc))}")
        sys.exit(1)
    if print_url and as_json:
        _json_out({"url": url, "opened": False})
    elif print_url:
        click.echo(url)
    elif webbrowser.open(url):
        if as_json:
            _json_out({"url": url, "opened": True})
        else:
            click.echo(f"opened {url}")
    else:
        err.print(f"no browser could be started here; the page is at {url}")
        sys.exit(1)


def _status_exit(doc: Status) -> int:
    if not doc.watchdog.running:
        return UNKNOWN_EXIT
    return max((s.exit_code for s in doc.servers), default=UNKNOWN_EXIT)


def _status_view(doc: Status, config_path: Path | None = None) -> Group:
    from rich.console import Group
    from rich.table import Table

    now = time.time()
    live = doc.watchdog.running
    config = None if config_path is None else str(config_path)
    # Fits 80 columns with a 20-character server name: one space between columns, none at
    # the edges, every cell short (the words are in the notes below).
    table = Table(box=None, padding=(0, 1), collapse_padding=True, pad_edge=False)
    table.header_style = "dim"
    for column in ("server", "state", "traffic", "token", "TTFT p50/95", "rst/left", "PID"):
        table.add_column(column, no_wrap=True)
    table.add_column("RSS", no_wrap=True, justify="right")
    notes = []
    for s in doc.servers:
        state = s.state
        shown = f"[{STATE_STYLE.get(state, 'bold')}]{state}[/]"
        pid, rss = s.pid, s.rss_bytes
        pid_cell = "-" if pid is None else str(pid)
        rss_cell = "-" if rss is None else _size(rss)
        gone = ""
        if not live:
            # The last recorded probe, not the server now: said as such (dim, and when in the
            # notes), and a PID that has exited since (the watchdog stopped its server) gone.
            shown = f"[dim]{state}[/]"
            if pid is not None and not _alive(pid):
                pid_cell, rss_cell, gone = "gone", "-", f"; PID {pid} has exited since"
        table.add_row(
            s.name,
            shown,
            _traffic(s) if live else "-",
            _ago(s.last_token_at, now, short=True),
            _ttft(s.ttft_p50_s, s.ttft_p95_s),
            f"{s.restarts_24h}/{s.budget_left}",
            pid_cell,
            rss_cell,
        )
        when = "" if live else f" [dim](recorded {_ago(s.judged_at, now)}{gone})[/]"
        notes.append(f"[bold]{s.name}[/bold]{when} {escape(s.reason)}")
        notes += [_note(n) for n in server_notes(s, live=live, config=config)]
    w = doc.watchdog
    head = (
        f"[green]watchdog running[/green] (PID {w.pid}, every {w.interval_s or 0:g}s)"
        if w.running
        else f"[yellow]{escape(w.why or 'the watchdog is not running')}[/yellow]; "
        "showing the last recorded probes"
    )
    if w.history_problem:
        notes.append(f"[bold red]history:[/] {escape(w.history_problem)}")
    return Group(head, table, *notes)


NOTE_STYLE = {ALERT: "bold red", NOTE: "yellow", ASIDE: "dim"}


def _note(n: Note) -> str:
    said = f"  [{NOTE_STYLE.get(n.level, 'bold')}]{escape(n.label)}:[/] {escape(n.text)}"
    return said + (f"\n    [dim]next: {escape(n.next)}[/]" if n.next else "")


def _traffic(s: ServerStatus) -> str:
    """Whether a load balancer reading /healthz sends it requests: in, or out and why."""
    if s.draining:
        return "[yellow]drained[/]"
    if s.restarting:
        return "[yellow]restart[/]"
    return "in" if s.serving else "[red]out[/]"


def _alive(pid: object) -> bool:
    import psutil

    try:
        return isinstance(pid, int) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _ago(at: float | None, now: float, *, short: bool = False) -> str:
    """How long ago: in words for the notes, in a few characters for the table's cells."""
    if at is None:
        return "never"
    seconds = max(0.0, now - at)
    if seconds < 120:
        return f"{seconds:.0f}s" if short else f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m" if short else f"{seconds / 60:.0f} min ago"
    if not short:
        return f"{seconds / 3600:.1f} h ago"
    return f"{seconds / 3600:.0f}h" if seconds < 172800 else f"{seconds / 86400:.0f}d"


def _ttft(p50: float | None, p95: float | None) -> str:
    """The time to first token's median and 95th percentile, in seconds, in a few characters."""
    if p50 is None or p95 is None:
        return "-"

    def short(x: float) -> str:
        return f"{x:.2f}" if x < 10 else f"{x:.0f}"

    return f"{short(p50)}/{short(p95)}s"


def _size(n: int) -> str:
    return f"{n / 2**20:.0f}M" if n < 10 * 2**30 else f"{n / 2**30:.1f}G"


@click.command()
@config_option
@click.option("--since", default="7d", show_default=True, help='How far back, e.g. "24h".')
@click.option(
    "--server", "server_name", shell_complete=server_names, help="Only this server's incidents."
)
@click.option("--json", "as_json", is_flag=True, help="Print the incidents as JSON.")
@click.option(
    "--show",
    "number",
    type=click.IntRange(min=1),
    help="One incident in full: its evidence, what was done, the server's last words.",
)
@click.option("--last", type=click.IntRange(min=1), help="Only the newest N incidents.")
def history(
    config_path: Path | None,
    since: str,
    server_name: str | None,
    as_json: bool,
    number: int | None,
    last: int | None,
) -> None:
    """List incidents, the newest first: start, end, outage, reason, actions and outcome
    (--json: the oldest first, as the history keeps them)."""
    import json

    from rich.table import Table

    from mlx_watchdog.config import ConfigError, parse_duration
    from mlx_watchdog.record.store import open_history

    cfg, state_dir = running_or_loaded(config_path)
    try:
        window = parse_duration(since, "--since")
    except ValueError as exc:
        raise click.UsageError(str(exc)) from None
    try:
        if server_name is not None and cfg is not None:
            cfg.server(server_name)
    except ConfigError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        sys.exit(UNKNOWN_EXIT)
    store = open_history(state_dir, create=False)
    try:
        if number is not None:
            sys.exit(_show(store, number, as_json, config_path))
        incidents = store.incidents(time.time() - window, server_name)
    finally:
        store.close()
    if last is not None:
        incidents = incidents[-last:]
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
    incidents = incidents[::-1]  # the newest first, as people read a log of incidents
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
            advice = suggest(i.advice, config_path, i.server)
            out.print(f"    [yellow]advice:[/yellow] {escape(advice)}", soft_wrap=True)
        for a in i.actions:
            if a.get("action") == "wait":
                out.print(f"    [cyan]wait:[/cyan] {escape(str(a.get('detail')))}", soft_wrap=True)


def _show(store: Store, number: int, as_json: bool, config_path: Path | None) -> int:
    """One incident in full, with the dumps taken before its restarts."""
    import dataclasses
    import json

    incident = store.incident(number)
    if incident is None:
        err.print(f"[red]error:[/red] no incident #{number} in the history")
        return UNKNOWN_EXIT
    dumps = store.dumps(number)
    if as_json:
        click.echo(json.dumps({**dataclasses.asdict(incident), "dumps": dumps}, indent=2))
        return 0
    i = incident
    end = "still open" if i.closed_at is None else f"closed {_clock(i.closed_at)}"
    out.print(f"[bold]#{i.id}[/bold] {i.server} {i.state} from {_clock(i.began_at)}, {end}")
    out.print(f"  {escape(i.reason)}", soft_wrap=True)
    said = {k: v for k, v in i.evidence.items() if v not in (None, "", [], {}, 0)}
    shown = ", ".join(f"{k}={v}" for k, v in sorted(said.items()) if k != "phases")
    out.print(f"  [dim]evidence:[/dim] {escape(shown)}", soft_wrap=True)
    if i.advice:
        advice = suggest(i.advice, config_path, i.server)
        out.print(f"  [yellow]advice:[/yellow] {escape(advice)}", soft_wrap=True)
    for a in i.actions:
        detail = a.get("detail") or ""
        out.print(
            f"  {escape(str(a.get('action')))}: {escape(str(a.get('outcome')))} {escape(str(detail))}"
        )
    if i.outcome:
        out.print(f"  outcome: {escape(i.outcome)}", soft_wrap=True)
    for d in dumps:
        _dump(d)
    from mlx_watchdog.advice.report import report_offered, upstream_report

    why_not = report_offered(i)
    if why_not is not None:
        out.print(f"\n[dim]{escape(why_not)}[/dim]", soft_wrap=True)
        return 0
    out.print("\n[bold]For a bug report upstream[/bold] (paste as is):")
    click.echo(upstream_report(i, dumps))
    return 0


def _dump(d: dict[str, Any]) -> None:
    at = d.get("at")
    when = _clock(at) if isinstance(at, (int, float)) else "?"
    out.print(
        f"\n[bold]before the restart[/bold] ({when}, PID {d.get('pid')}, took {d.get('took_s')} s)"
    )
    stack = d.get("stack")
    out.print("[dim]stacks:[/dim]")
    echo(stack.rstrip() if isinstance(stack, str) else f"  ({d.get('stack_problem')})")
    tail = d.get("log_tail")
    if isinstance(tail, str):
        out.print("[dim]the server's log, its last lines:[/dim]")
        echo("\n".join(tail.rstrip().splitlines()[-40:]))
    elif d.get("log_problem"):
        out.print(f"[dim]the server's log:[/dim] {escape(str(d['log_problem']))}")
    sockets = d.get("sockets")
    if isinstance(sockets, list) and sockets:
        out.print("[dim]its sockets:[/dim]")
        echo("\n".join(f"  {s}" for s in sockets))


def _clock(at: float, short: bool = False) -> str:
    return time.strftime("%H:%M:%S" if short else "%Y-%m-%d %H:%M:%S", time.localtime(at))


def _action(action: str) -> click.Command:
    help_text = {
        "restart": "Restart a server through the running watchdog's one restart path.",
        "drain": "Turn a server's /healthz to 503 (and run drain_command) until undrain.",
        "undrain": "End a drain: /healthz follows the server's state again.",
    }[action]

    @config_option
    @click.argument("name", shell_complete=server_names)
    @click.option(
        "--no-wait",
        is_flag=True,
        hidden=action != "restart",
        help="Return once the watchdog has the request, without waiting for the restart's end.",
    )
    @click.option("--json", "as_json", is_flag=True, help="Print what was done as JSON.")
    def command(config_path: Path | None, name: str, no_wait: bool, as_json: bool) -> None:
        from mlx_watchdog.config import ConfigError
        from mlx_watchdog.serve.client import ActionRefused, DaemonNotRunning, act

        cfg, state_dir = running_or_loaded(config_path)
        try:
            server = cfg.server(name) if cfg is not None else None
        except ConfigError as exc:
            err.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
            sys.exit(UNKNOWN_EXIT)
        asked = time.time()
        try:
            message = act(state_dir, name, action)
        except DaemonNotRunning as exc:
            said = suggest(f"{exc}; start it with `mlx-watchdog run`", config_path)
            err.print(f"[red]error:[/red] {escape(said)}")
            sys.exit(UNKNOWN_EXIT)
        except ActionRefused as exc:
            if as_json:
                _json_out({"server": name, "action": action, "done": False, "refused": str(exc)})
                sys.exit(1)
            raise click.ClickException(str(exc)) from None
        if action != "restart" or no_wait:
            if as_json:
                _json_out({"server": name, "action": action, "done": True, "message": message})
            else:
                echo(message)
            return
        limit = UNREAD_BOUND  # the config on disk cannot say: the longest a restart may take
        if cfg is not None and server is not None:
            restart = server.restart
            drain = restart.drain_timeout if restart.drain else 0
            bound = (
                drain + restart.stop_grace + restart.command_timeout + server.probe.startup_grace
            )
            limit = bound + 2 * cfg.watchdog.interval + 10
        sys.exit(_await_restart(state_dir, name, asked, limit, config_path, as_json))

    command.__doc__ = help_text
    return click.command(action, help=help_text)(command)


@click.group()
def alert() -> None:
    """The alert channels (watchdog.alerts and watchdog.on_event)."""


@alert.command("test")
@config_option
def alert_test(config_path: Path | None) -> None:
    """Send a test alert through every channel the config names, and say which reached.
    Exit 0 all delivered, 1 some failed, 3 none configured."""
    import socket

    from mlx_watchdog.judge.states import EventKind
    from mlx_watchdog.record.alerts import Alerter, Event

    cfg = load_or_exit(config_path)
    settings = cfg.watchdog
    alerter = Alerter(settings.alerts, settings.on_event)
    alerter.close()  # nothing goes through its queue: each channel is tried here, in turn
    if not alerter.channels:
        said = "no channel to test: set watchdog.alerts or watchdog.on_event in the config"
        err.print(escape(suggest(said, config_path)))
        sys.exit(UNKNOWN_EXIT)
    where = cfg.source or "the default config"
    message = f"a test alert from the watchdog on {socket.gethostname()}, sent as {where} says"
    tried = alerter.each(Event(EventKind.TEST, "mlx-watchdog", time.time(), message))
    for name, reached in tried:
        echo(f"{name}: {'delivered' if reached else 'NOT delivered (see above)'}")
    sys.exit(0 if all(reached for _, reached in tried) else 1)


UNREAD_BOUND = 900.0  # seconds: a restart's wait when the config cannot say how long


def _json_out(doc: dict[str, Any]) -> None:
    import json

    click.echo(json.dumps(doc, indent=2, default=str))


def _await_restart(
    state_dir: Path,
    name: str,
    asked: float,
    bound: float,
    config_path: Path | None = None,
    as_json: bool = False,
) -> int:
    """Follow the asked restart in the daemon's status until it ends; say how, and the exit
    code: 0 it serves again, 2 it does not, 3 the watchdog cannot tell."""
    from mlx_watchdog.serve.client import DaemonNotRunning, live_status

    err.print(f"restart of {name} asked for; waiting for it to end (up to {bound:.0f} s)")
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        try:
            doc = live_status(state_dir)
        except DaemonNotRunning as exc:
            err.print(f"[red]error:[/red] {escape(str(exc))} while the restart ran")
            return UNKNOWN_EXIT
        server = doc.server(name)
        last = server.last_restart if server is not None else None
        if server is not None and last is not None and last.at >= asked - 1 and last.outcome:
            at, outcome = last.at, last.outcome
            took = (last.finished_at or at) - at
            code = 0 if outcome == "recovered" else UNKNOWN_EXIT if outcome == "interrupted" else 2
            if as_json:
                _json_out(
                    {
                        "server": name,
                        "action": "restart",
                        "done": True,
                        "outcome": outcome,
                        "took_s": round(took, 1),
                        "reason": server.reason,
                    }
                )
                return code
            if outcome == "recovered":
                click.echo(f"restarted {name}: serving again after {took:.1f} s")
                return 0
            echo(f"restart of {name} {outcome} after {took:.1f} s: {server.reason}")
            return UNKNOWN_EXIT if outcome == "interrupted" else 2
        time.sleep(0.5)
    said = f"the restart of {name} had not ended after {bound:.0f} s; see `mlx-watchdog status`"
    err.print(escape(suggest(said, config_path)))
    if as_json:
        _json_out({"server": name, "action": "restart", "done": False, "outcome": None})
    return UNKNOWN_EXIT


COMMANDS = (
    alert,
    status,
    open_page,
    history,
    *(_action(name) for name in ("restart", "drain", "undrain")),
)
