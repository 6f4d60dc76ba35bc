"""What every command shares: the group, the consoles, the config option, loading the config.

rich is imported on first use: a command that prints JSON, and `--help`, never pay for it.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar
from urllib.parse import urlsplit

import click

from mlx_watchdog import __version__
from mlx_watchdog.judge import commands
from mlx_watchdog.judge.states import UNKNOWN_EXIT, State

if TYPE_CHECKING:
    from rich.console import Console

    from mlx_watchdog.config import Config, ServerConfig


PIPE_WIDTH = 1000


class _LazyConsole:
    def __init__(self, stderr: bool) -> None:
        self._stderr = stderr
        self._console: Console | None = None

    def get(self) -> Console:
        if self._console is None:
            stream = sys.stderr if self._stderr else sys.stdout
            # Into a pipe or a file, rows are not cut to 80 columns (as kubectl and docker
            # keep theirs): whatever reads them gets them whole. COLUMNS still rules.
            piped = not stream.isatty() and not os.environ.get("COLUMNS")
            width = {"width": PIPE_WIDTH} if piped else {}
            # A table's cells are padded to their column: into a pipe, no line ends in spaces.
            trimmed = {"file": _Trimmed(self._stderr)} if not stream.isatty() else {}
            self._console = safe_console(stderr=self._stderr, highlight=False, **width, **trimmed)
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.get(), name)


class _Trimmed:
    """The command's stdout or stderr (whichever it is at each write), each line written
    without its trailing spaces."""

    def __init__(self, stderr: bool) -> None:
        self._stderr = stderr
        self._pending = ""

    @property
    def _stream(self) -> Any:
        return sys.stderr if self._stderr else sys.stdout

    @property
    def encoding(self) -> str:
        return getattr(self._stream, "encoding", None) or "utf-8"

    def write(self, text: str) -> int:
        *lines, self._pending = (self._pending + text).split("\n")
        if lines:
            self._stream.write("".join(line.rstrip(" ") + "\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        if self._pending:
            self._stream.write(self._pending)
            self._pending = ""
        self._stream.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return int(self._stream.fileno())


def safe_console(**options: Any) -> Console:
    """A rich Console that shows the control characters of every string it renders (a server's
    text in a reason, a table cell, a thread name) as escapes, never acting on the terminal:
    every string rich prints passes `render_str`."""
    from rich.console import Console

    from mlx_watchdog.sense.text import printable

    class SafeConsole(Console):
        """A Console that shows control characters as escapes in every string it renders."""

        def render_str(self, text: str, **kwargs: Any) -> Any:
            return super().render_str(printable(text, lines=True), **kwargs)

    return SafeConsole(**options)


def echo(text: str) -> None:
    """click.echo of outside text (a stack, a log's lines), its control characters shown."""
    from mlx_watchdog.sense.text import printable

    click.echo(printable(text, lines=True))


out: Any = _LazyConsole(stderr=False)
err: Any = _LazyConsole(stderr=True)


def escape(text: str) -> str:
    """User text printed through rich: brackets stay text, not markup."""
    from rich.markup import escape as rich_escape

    return rich_escape(text)


STATE_STYLE: dict[str, str] = {
    State.HEALTHY: "bold green",
    State.SLOW: "bold yellow",
    State.BUSY: "bold yellow",
    State.STARTING: "bold cyan",
    State.WEDGED: "bold red",
    State.DEAD: "bold red",
    State.DOWN: "bold red",
}

T = TypeVar("T")


config_option = click.option(
    "--config",
    "config_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Config file (default: $MLX_WATCHDOG_CONFIG or ~/.config/mlx-watchdog/config.toml).",
)


def suggest(text: str, config_path: Path | None, server: str | None = None) -> str:
    """`text` with every command it suggests carrying the --config given to this one, so that
    it works when typed as shown ($MLX_WATCHDOG_CONFIG, when that is how it came, is already
    in the shell that runs it), and the server it speaks of (judge/commands.py)."""
    return commands.suggest(text, None if config_path is None else str(config_path), server=server)


def server_names(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[str]:
    """Shell completion of a server's name, from the config the command line names (or the
    default one); nothing when it cannot be read (a completion never prints an error)."""
    from mlx_watchdog.config import ConfigError, load_config

    given = ctx.params.get("config_path")
    try:
        config = load_config(Path(given) if given else None)
    except (ConfigError, OSError):
        return []
    return [s.name for s in config.servers if s.name.startswith(incomplete)]


def running_or_loaded(config_path: Path | None) -> tuple[Config | None, Path]:
    """The config and its state folder; or, when the config on disk has an error (a typo
    since the watchdog started) and a watchdog runs on the folder it names, None and that
    folder, said on stderr, so that the commands that read what it recorded still answer.
    With no watchdog running, the error (exit 3), as before."""
    from mlx_watchdog.config import ConfigError, load_config, state_dir_of
    from mlx_watchdog.serve.client import DAEMON_FILE

    try:
        config = load_config(config_path)
    except ConfigError as exc:
        state_dir = state_dir_of(config_path)
        if not (state_dir / DAEMON_FILE).exists():
            load_or_exit(config_path)  # says the error and exits
        said = suggest(
            f"{exc}; showing what the watchdog recorded in {state_dir} (a running watchdog "
            "keeps the config it loaded; `mlx-watchdog config check` says what to fix)",
            config_path,
        )
        err.print(f"[yellow]config error:[/yellow] {escape(said)}", soft_wrap=True)
        return None, state_dir
    for warning in config.warnings:
        err.print(f"[yellow]warning:[/yellow] {escape(warning)}", soft_wrap=True)
    return config, config.watchdog.state_dir


def load_or_exit(config_path: Path | None) -> Config:
    from mlx_watchdog.config import ConfigError, load_config

    try:
        config = load_config(config_path)
    except ConfigError as exc:
        said = suggest(str(exc), config_path)
        err.print(f"[red]config error:[/red] {escape(said)}", soft_wrap=True)
        sys.exit(UNKNOWN_EXIT)
    for warning in config.warnings:
        err.print(f"[yellow]warning:[/yellow] {escape(warning)}", soft_wrap=True)
    return config


# Each command and the module under cli/ that defines it (in its COMMANDS), imported when the
# command is asked for; a test holds this map to the modules.
MODULES = {
    **dict.fromkeys(("probe", "run", "demo", "config"), "watch"),
    **dict.fromkeys(("alert", "status", "open", "history", "restart", "drain", "undrain"), "ops"),
    **dict.fromkeys(("install", "uninstall", "server"), "install"),
    **dict.fromkeys(("calibrate", "drill", "doctor"), "advise"),
    "compare": "compare",
    **dict.fromkeys(("prometheus", "fleet"), "fleet"),
}


class Group(click.Group):
    """click's group, with the monitoring convention's exit codes: a usage error (a typo, an
    unknown option, two options that exclude each other) exits 3, "unknown", never click's 2,
    which a check reads as critical (wedged, dead or down). A command's module is imported
    when the command is asked for (`MODULES`)."""

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *MODULES})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in MODULES:
            module = importlib.import_module(f"mlx_watchdog.cli.{MODULES[cmd_name]}")
            for command in module.COMMANDS:
                self.add_command(command)
        return super().get_command(ctx, cmd_name)

    def main(
        self,
        args: Any = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.UsageError as exc:
            exc.show()
            sys.exit(UNKNOWN_EXIT)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except (click.exceptions.Abort, EOFError, KeyboardInterrupt):
            click.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="mlx-watchdog")
def cli() -> None:
    """Liveness watchdog for local LLM servers: tells a wedged mlx_lm.server from a busy one."""


def pick_servers(config: Config, url: str | None, name: str | None) -> list[ServerConfig]:
    from mlx_watchdog.config import ServerConfig, parse_url

    if url:
        clean = parse_url(url, "--url")
        port = urlsplit(clean).port or 80
        base = config.servers[0] if len(config.servers) == 1 else None
        probe_settings = base.probe if base else ServerConfig("x", clean).probe
        return [ServerConfig(name=f"mlx-{port}", url=clean, probe=probe_settings)]
    if name:
        return [config.server(name)]
    return list(config.servers)


def unmoved(
    servers: Sequence[ServerConfig],
    measure: Callable[[Callable[[str], None]], T],
    *,
    quiet: bool,
    failed: int,
    mixed: str,
) -> T:
    """What `measure` finds (told its progress unless `quiet`). A measurement that fails exits
    `failed`; when another process serves one of `servers` afterwards its figures mix two
    processes: `mixed` is said and it exits 1."""
    from mlx_watchdog.advice.calibrate import CalibrationError, replaced, serving_process

    say = (lambda _: None) if quiet else (lambda m: err.print(escape(m), style="dim"))
    before = [serving_process(s) for s in servers]
    try:
        found = measure(say)
    except CalibrationError as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        sys.exit(failed)
    for server, was in zip(servers, before, strict=True):
        moved = replaced(server, was)
        if moved is not None:
            err.print(f"[yellow]{mixed}:[/yellow] {escape(moved)}", soft_wrap=True)
            sys.exit(1)
    return found


def or_exit(parse: Callable[[], T]) -> T:
    """What `parse` returns; a bad value is an error naming it, exit 3."""
    from mlx_watchdog.config import ConfigError

    try:
        return parse()
    except (ConfigError, ValueError) as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}", soft_wrap=True)
        sys.exit(UNKNOWN_EXIT)
