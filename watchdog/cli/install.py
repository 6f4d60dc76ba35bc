"""Commands that install the watchdog and servers as services: install, uninstall, server
install/uninstall."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import click

from mlx_watchdog.cli.app import config_option, err, escape, load_or_exit, suggest

if TYPE_CHECKING:
    from mlx_watchdog.service import JobUser


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
json_option = click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print what was (or would be) written and run as JSON; problems still go to stderr.",
)


def _target(kind: str | None, system_wide: bool, preview: bool = False) -> Any:
    from mlx_watchdog import service
    from mlx_watchdog.act.managers import System

    try:
        return service.target(
            cast(service.ServiceKind, kind or service.default_kind()),
            System(),
            system_wide=system_wide,
            preview=preview,
        )
    except service.ServiceError as exc:
        raise click.ClickException(str(exc)) from None


@click.command()
@config_option
@target_option
@system_option
@dry_run_option
@json_option
def install(
    config_path: Path | None, target: str | None, system_wide: bool, dry_run: bool, as_json: bool
) -> None:
    """Install the watchdog as a launchd job or a systemd unit, and start it.

    Runs again safely: the job is replaced with the new file. A missing config file is
    created from the template first. Without a GUI login on a Mac the job goes into the user's
    launchd domain (it does not start at boot); --system makes it start at boot.
    """
    from mlx_watchdog import service
    from mlx_watchdog.config import write_template

    tgt = _target(target, system_wide, preview=dry_run)
    user = _job_user(system_wide, preview=dry_run)
    if dry_run and system_wide and os.getuid() != 0:
        err.print("a preview: installing it needs sudo")
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
    job = service.WatchdogJob(path, home, os.environ, service.interpreter(), writable)
    plan = tgt.watchdog_plan(job)
    doc = _carry_out(plan, dry_run, as_json)
    if as_json:
        _json({**doc, "config": str(path)})


def _job_user(system_wide: bool, preview: bool = False) -> JobUser | None:
    from mlx_watchdog import service

    if not system_wide:
        return None
    try:
        return service.job_user(os.environ, preview=preview)
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
@json_option
def uninstall(target: str | None, system_wide: bool, dry_run: bool, as_json: bool) -> None:
    """Stop the watchdog's service and remove its file (config and history stay)."""
    tgt = _target(target, system_wide)
    plan = tgt.uninstall_plan(tgt.watchdog_label, home=Path.home(), env=os.environ)
    doc = _carry_out(plan, dry_run, as_json)
    if as_json:
        _json(doc)


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
@json_option
def server_install(
    config_path: Path | None,
    model: str,
    port: int,
    draft_model: str | None,
    name: str | None,
    target: str | None,
    system_wide: bool,
    dry_run: bool,
    as_json: bool,
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
    problem = missing_server_extra("the service runs")
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
    unit: dict[str, Any] | None = None
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
        unit = _carry_out(plan, dry_run, as_json)
    block = to_toml({"server": [entry]})
    doc = {"server": entry, "config": str(path), "service": unit, "dry_run": dry_run}
    if dry_run:
        if as_json:
            _json({**doc, "added": None})
        else:
            click.echo(f"# would add to {path}:\n{block}", nl=False)
        return
    with _owned_by(user, path):
        added = append_server(path, block)
    if as_json:
        _json({**doc, "added": str(added)})
    else:
        click.echo(f"added server {name} to {added}")
    said = "reload a running watchdog to watch it: `mlx-watchdog install` or kill -HUP its PID"
    err.print(escape(suggest(said, config_path)))


@server.command("uninstall")
@click.argument("name")
@target_option
@dry_run_option
@json_option
def server_uninstall(name: str, target: str | None, dry_run: bool, as_json: bool) -> None:
    """Stop and remove the server service NAME (its config entry stays; remove it by hand)."""
    tgt = _target(target, False)
    plan = tgt.uninstall_plan(tgt.server_label(name), home=Path.home(), env=os.environ)
    doc = _carry_out(plan, dry_run, as_json)
    if as_json:
        _json(doc)


def _carry_out(plan: Any, dry_run: bool, as_json: bool = False) -> dict[str, Any]:
    """Write and run a plan (or show it: `dry_run`); what was done, as JSON prints it. With
    `as_json` nothing goes to stdout here: the caller prints the document."""
    from mlx_watchdog import service

    doc: dict[str, Any] = {
        "file": str(plan.path),
        "action": "remove" if plan.content is None else "write",
        "domain": plan.domain,
        "steps": [step.show() for step in plan.steps],
        "dry_run": dry_run,
        "hints": list(plan.hints),
    }
    if dry_run:
        doc["content"] = None if plan.content is None else plan.content.decode()
        if plan.content is None:
            doc["installed"] = plan.path.exists()
        if not as_json:
            if plan.content is None and not plan.path.exists():
                click.echo(
                    f"# nothing is installed: no {plan.path}; the steps below would only make "
                    "sure no such job is loaded"
                )
            elif plan.content is None:
                click.echo(f"# would remove {plan.path}")
            else:
                click.echo(f"# would write {plan.path} (mode 0644):")
                click.echo(plan.content.decode(), nl=False)
            click.echo(f"# would run ({plan.domain}):")
            for step in plan.steps:
                click.echo("  " + step.show())
    else:
        from mlx_watchdog.act.managers import System

        try:
            doc["done"] = service.apply(plan, System())
        except service.ServiceError as exc:
            if as_json:
                _json({**doc, "done": None, "error": str(exc)})
            raise click.ClickException(str(exc)) from None
        if not as_json:
            for line in doc["done"]:
                click.echo(line)
    for hint in plan.hints:
        err.print(f"hint: {escape(hint)}", soft_wrap=True)
    return doc


def _json(doc: dict[str, Any]) -> None:
    import json

    click.echo(json.dumps(doc, indent=2))


COMMANDS = (install, uninstall, server)
