"""Every command an output suggests runs as typed: the config it was given (not the default
path), the server it speaks of and the incident it names (judge/commands.py)."""

from __future__ import annotations

import html
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

from mlx_watchdog.cli import cli
from mlx_watchdog.config import load_config
from mlx_watchdog.judge.commands import suggest
from mlx_watchdog.record.document import ShownIncident
from mlx_watchdog.record.store import Store
from mlx_watchdog.serve.notes import notes
from mlx_watchdog.serve.page import render
from mlx_watchdog.serve.status import from_history
from tests.builders import a_history
from tests.conftest import free_port

SUGGESTED = re.compile(r"(?:`|<code>)(mlx-watchdog [^`<]+)(?:`|</code>)")
# Read-only: run for real. The rest act on a server: parsed as typed, not run.
READ_ONLY = {"status", "history", "doctor", "config"}


def test_suggest_completes_what_a_command_needs() -> None:
    said = "read `mlx-watchdog history --show` of an incident; `mlx-watchdog calibrate` measures it"
    assert suggest(said, "/my conf.toml", server="mlx-1", incident=7) == (
        "read `mlx-watchdog history --config '/my conf.toml' --show 7` of an incident; "
        "`mlx-watchdog calibrate --config '/my conf.toml' --server mlx-1` measures it"
    )
    assert suggest(said, server="s") == (
        "read `mlx-watchdog history --server s` of an incident; "
        "`mlx-watchdog calibrate --server s` measures it"
    )
    assert (
        suggest("`mlx-watchdog history --show 3`", incident=7) == "`mlx-watchdog history --show 3`"
    )
    assert (
        suggest("`mlx-watchdog config init`", "c.toml")
        == "`mlx-watchdog config init --config c.toml`"
    )


def test_every_suggested_command_runs_as_typed(tmp_path: Path) -> None:
    """A config away from the default path, a history with incidents and a hold: the commands
    status, the page, history and the missing-config error suggest each run (or parse) as
    printed, for that config."""
    state = tmp_path / "state"
    cfg = tmp_path / "elsewhere.toml"
    cfg.write_text(
        f'[watchdog]\nstate_dir = "{state}"\n\n'
        f'[[server]]\nname = "mlx-1"\nurl = "http://127.0.0.1:{free_port()}"\nmanager = "none"\n'
    )
    state.mkdir(mode=0o700)
    a_history(state / "history.db", "mlx-1", time.time())
    config = load_config(cfg)
    store = Store(state / "history.db")
    shown = from_history(config.servers[0], store, time.time())
    store.close()
    from dataclasses import replace

    from mlx_watchdog.record.document import Status, WatchdogLine

    wedged = replace(
        shown, state="wedged", cause="deadlock", incident=ShownIncident(1, "wedged", time.time())
    )
    said = [n.text + " " + n.next for n in notes(wedged, config=str(cfg))]
    page = html.unescape(
        render(Status(WatchdogLine(running=True), (wedged,)), {}, time.time(), 10, str(cfg))
    )
    outputs = [*said, page]
    for args in (["status"], ["history"], ["history", "--show", "1"], ["doctor"]):
        done = run(*args, "--config", str(cfg))
        outputs.append(done.stdout + done.stderr)
    missing = run("status", "--config", str(tmp_path / "nothing-here.toml"))
    outputs.append(missing.stderr)
    commands = {c.strip().rstrip(".,;") for text in outputs for c in SUGGESTED.findall(text)}
    assert len(commands) >= 5, commands
    for command in sorted(commands):
        argv = shlex.split(command)[1:]
        assert "--config" in argv, command
        if argv[0] in ("calibrate", "history") and "--show" not in argv:
            assert "--server" in argv, command  # the server it speaks of, not another
        if argv[0] in READ_ONLY:
            done = run(*argv)
            assert done.returncode in (0, 1, 2, 3) and "Traceback" not in done.stderr, command
            assert "error" not in done.stderr.lower() or argv[:2] == ["config", "init"], (
                command,
                done.stderr,
            )
        else:
            cli.make_context("mlx-watchdog", list(argv))  # parses, as typed, or raises


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mlx_watchdog", *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )
