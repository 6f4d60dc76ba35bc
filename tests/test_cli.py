"""The command line, through click's runner and as a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from mlx_watchdog.cli import cli
from tests.conftest import Running, free_port, until


def all_commands(
    group: click.Group, prefix: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], click.Command]]:
    ctx = click.Context(group)
    for name in group.list_commands(ctx):  # the lazy group imports each command's module
        command = group.get_command(ctx, name)
        assert command is not None, name
        yield (*prefix, name), command
        if isinstance(command, click.Group):
            yield from all_commands(command, (*prefix, name))


@pytest.mark.parametrize("path", [p for p, _ in all_commands(cli)], ids=" ".join)
def test_every_command_has_help(path: tuple[str, ...]) -> None:
    result = CliRunner().invoke(cli, [*path, "--help"])
    assert result.exit_code == 0
    _, command = next((p, c) for p, c in all_commands(cli) if p == path)
    assert command.help and len(command.help) > 20
    for param in command.params:
        if isinstance(param, click.Option):
            assert param.help, f"{' '.join(path)} {param.opts[0]} has no help text"


def test_module_entry_point_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mlx_watchdog", "--version"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.startswith("mlx-watchdog, version ")


def test_config_init_writes_a_template_that_checks(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    runner = CliRunner()
    assert runner.invoke(cli, ["config", "init", "--config", str(path)]).exit_code == 0
    again = runner.invoke(cli, ["config", "init", "--config", str(path)])
    assert again.exit_code == 1 and "already exists" in again.output
    checked = runner.invoke(cli, ["config", "check", "--config", str(path), "--json"])
    assert checked.exit_code == 0
    doc = json.loads(checked.stdout)
    assert doc["server"][0]["url"] == "http://127.0.0.1:8080"
    assert doc["server"][0]["probe"]["wedge_after"] == "1m"


def test_config_init_default_path_is_under_xdg_config(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["config", "init"])
    assert result.exit_code == 0
    assert (tmp_path / "config" / "mlx-watchdog" / "config.toml").exists()


def test_config_check_error_exits_3_and_names_key(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        '[[server]]\nname = "qwen"\nurl = "http://127.0.0.1:8080"\n[server.probe]\nwedge_after = "30"\n'
    )
    result = CliRunner().invoke(cli, ["config", "check", "--config", str(path)])
    assert result.exit_code == 3
    assert 'probe.wedge_after = "30" has no unit; write "30s"' in result.output


def test_config_check_never_prints_the_api_key(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("sk-very-secret")
    key.chmod(0o600)
    path = tmp_path / "c.toml"
    path.write_text(
        f'[[server]]\nname = "q"\nurl = "http://127.0.0.1:8080"\napi_key_file = "{key}"\n'
    )
    result = CliRunner().invoke(cli, ["config", "check", "--config", str(path)])
    assert result.exit_code == 0 and str(key) in result.output
    assert "sk-very-secret" not in result.output


def test_probe_with_bad_config_is_unknown(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[watchdog]\ninterval = "fast"\n')
    result = CliRunner().invoke(cli, ["probe", "--config", str(path)])
    assert result.exit_code == 3 and 'watchdog.interval = "fast"' in result.output


def test_probe_unknown_server_is_unknown(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["probe", "--server", "nope"])
    assert result.exit_code == 3 and 'no server named "nope"' in result.output


def test_probe_bad_wedge_after_is_unknown() -> None:
    result = CliRunner().invoke(cli, ["probe", "--wedge-after", "5"])
    assert result.exit_code == 3 and '--wedge-after = "5" has no unit' in result.output


def test_probe_sends_the_api_key(bad_server: Callable[..., Running], tmp_path: Path) -> None:
    srv = bad_server("auth_401")
    key = tmp_path / "key"
    key.write_text("sk-wrong")
    key.chmod(0o600)
    path = tmp_path / "c.toml"
    path.write_text(f'[[server]]\nname = "q"\nurl = "{srv.url}"\napi_key_file = "{key}"\n')
    result = CliRunner().invoke(cli, ["probe", "--config", str(path), "--json"])
    doc = json.loads(result.stdout)
    assert result.exit_code == 2 and doc["state"] == "dead"
    assert doc["evidence"]["probe_finding"] == "auth_failed"
    assert "sk-wrong" not in result.output


def test_probe_human_output_and_exit_code(bad_server: Callable[..., Running]) -> None:
    srv = bad_server("ok")
    proc = subprocess.run(
        [sys.executable, "-m", "mlx_watchdog", "probe", "--url", srv.url],
        capture_output=True,
        text=True,
        timeout=60,
        env=os.environ.copy(),
    )
    assert proc.returncode == 0
    assert "HEALTHY" in proc.stdout and "first token" in proc.stdout


def test_probe_all_servers_exits_with_the_worst(
    bad_server: Callable[..., Running], tmp_path: Path
) -> None:
    good, bad = bad_server("ok"), bad_server("html_500")
    path = tmp_path / "c.toml"
    path.write_text(
        f'[[server]]\nname = "good"\nurl = "{good.url}"\n'
        f'[[server]]\nname = "bad"\nurl = "{bad.url}"\n'
    )
    result = CliRunner().invoke(cli, ["probe", "--config", str(path), "--json"])
    docs = json.loads(result.stdout)
    assert [(d["server"], d["state"]) for d in docs] == [("good", "healthy"), ("bad", "dead")]
    assert result.exit_code == 2


def test_probe_down_json() -> None:
    result = CliRunner().invoke(
        cli, ["probe", "--url", f"http://127.0.0.1:{free_port()}", "--json"]
    )
    doc = json.loads(result.stdout)
    assert result.exit_code == 2
    assert {"server", "url", "state", "reason", "evidence"} <= set(doc)
    for key in (
        "ttft_s",
        "waited_s",
        "bytes",
        "tokens",
        "models_status",
        "models_ok",
        "pid",
        "cpu_percent",
        "abandoned_connections",
        "live_connections",
    ):
        assert key in doc["evidence"]


def test_tables_into_a_pipe_end_no_line_in_spaces() -> None:
    """A table's cells are padded to their column; piped, no line keeps the padding."""
    import time

    from tests.builders import a_history

    state = Path(os.environ["XDG_STATE_HOME"]) / "mlx-watchdog"
    a_history(state / "history.db", "mlx-8080", time.time())
    result = CliRunner().invoke(cli, ["history", "--last", "3"])
    lines = result.output.splitlines()
    assert len(lines) >= 4 and "outcome" in lines[0], result.output
    assert not [line for line in lines if line.endswith(" ")], result.output


def test_status_without_a_daemon_says_so_and_exits_3() -> None:
    result = CliRunner().invoke(cli, ["status"])
    assert result.exit_code == 3
    assert "not running" in result.output and "no probe recorded yet" in result.output
    doc = json.loads(CliRunner().invoke(cli, ["status", "--json"]).stdout)
    assert doc["watchdog"]["running"] is False and doc["servers"][0]["state"] == "unknown"


STATUS_IMPORTS = """
import sys
from mlx_watchdog.cli import cli
try:
    cli(["status", "--json"])
except SystemExit:
    pass
heavy = (
    "httpx",
    "mlx_watchdog.cycle",
    "mlx_watchdog.daemon",
    "mlx_watchdog.sense.probe",
    "mlx_watchdog.cli.advise",
    "mlx_watchdog.cli.watch",
    "mlx_watchdog.cli.install",
)
print(" ".join(m for m in heavy if m in sys.modules), file=sys.stderr)
"""


def test_status_without_a_daemon_does_not_import_the_daemons_stack() -> None:
    """`status` reads a file and the history: the HTTP client, the cycle and the daemon (0.4 s
    of imports, 14x the bare interpreter) are not what it needs (bench/startup.py times it)."""
    done = subprocess.run([sys.executable, "-c", STATUS_IMPORTS], capture_output=True, text=True)
    assert '"running": false' in done.stdout, done.stdout + done.stderr
    assert done.stderr.strip().splitlines()[-1:] in ([], [""]), done.stderr


def test_every_command_is_found_in_the_module_the_group_imports_for_it() -> None:
    """The group imports a command's module when it is asked for: the map names each
    module's commands, all of them and only those."""
    import importlib

    from mlx_watchdog.cli.app import MODULES

    for module in set(MODULES.values()):
        defined = {c.name for c in importlib.import_module(f"mlx_watchdog.cli.{module}").COMMANDS}
        assert defined == {name for name, m in MODULES.items() if m == module}, module
    assert all(CliRunner().invoke(cli, [name, "--help"]).exit_code == 0 for name in MODULES)


def test_history_without_a_database_has_no_incidents() -> None:
    result = CliRunner().invoke(cli, ["history", "--json"])
    assert result.exit_code == 0 and json.loads(result.stdout) == []
    bad = CliRunner().invoke(cli, ["history", "--since", "7"])
    assert bad.exit_code == 3 and "has no unit" in bad.output


USAGE_ERRORS = [
    ["probe", "--url", "http://127.0.0.1:9", "--server", "x"],
    ["probe", "--bogus"],
    ["no-such-command"],
    ["status", "extra"],
    ["history", "--since"],
    ["compare", "only-one"],
    ["config", "check", "--nope"],
]
UNKNOWN_NAMES = [
    ["probe", "--server", "nope"],
    ["history", "--server", "nope"],
    ["compare", "nope", "http://127.0.0.1:9"],
]


@pytest.mark.parametrize("args", USAGE_ERRORS + UNKNOWN_NAMES, ids=" ".join)
def test_a_typo_or_an_unknown_name_exits_3_never_2(args: list[str]) -> None:
    """2 is critical in the monitoring convention: a typo in a check must not page anyone."""
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 3, result.output
    assert "Error" in result.output or "error" in result.output


def test_help_and_version_still_exit_0() -> None:
    assert CliRunner().invoke(cli, ["--help"]).exit_code == 0
    assert CliRunner().invoke(cli, ["--version"]).exit_code == 0
    assert CliRunner().invoke(cli, ["probe", "--help"]).exit_code == 0


def test_status_watch_refreshes_until_interrupted(tmp_path: Path) -> None:
    """Into a pipe (a `| tee`, a log), each refresh is printed as it comes, not held back
    until the end; Ctrl-C ends it between two refreshes."""
    import signal
    import threading

    from mlx_watchdog.sense.stack import Stacker

    config = tmp_path / "w.toml"
    config.write_text(f'[watchdog]\nstate_dir = "{tmp_path / "state"}"\n')
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_watchdog", "status", "--watch", "--config", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "120"},
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(proc.stdout.readline, "")))  # type: ignore[union-attr]
    reader.start()

    def refreshing() -> bool:
        """Its stack (py-spy) is in the refresh loop's wait between two refreshes. A fixed
        wait here raced a slow start under load."""
        sample = Stacker(every=0.0).sample(proc.pid)
        main = (sample.threads or ())[:1] if sample else ()
        return any("status" in t.frames and "Event.wait" in t.frames for t in main)

    try:
        until(lambda: sum("not running" in line for line in lines) >= 2, 60, "two refreshes")
        until(refreshing, 60, "status --watch in its refresh loop")
        assert proc.poll() is None  # it keeps refreshing until Ctrl-C
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
        err = proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        reader.join(10)
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
    out = "".join(lines)
    assert proc.returncode == 3, err  # the watchdog is not running
    assert "mlx-8080" in out and "Traceback" not in err


def test_a_measurement_across_a_replaced_server_is_not_kept(
    bad_server: Callable[..., Running], capsys: pytest.CaptureFixture[str]
) -> None:
    """calibrate and compare keep nothing when another process serves afterwards (exit 1),
    and a measurement that fails exits with the code its command documents."""
    from mlx_watchdog.advice.calibrate import CalibrationError
    from mlx_watchdog.cli.app import unmoved
    from tests.builders import watched

    first = bad_server("ok")
    server = watched(first.url)
    assert unmoved([server], lambda say: "kept", quiet=True, failed=3, mixed="no") == "kept"

    def replace(say: Callable[[str], None]) -> str:
        first.stop()
        bad_server("ok", port=first.port)
        return "measured"

    with pytest.raises(SystemExit) as ended:
        unmoved([server], replace, quiet=True, failed=3, mixed="not kept")
    assert ended.value.code == 1 and "not kept:" in capsys.readouterr().err

    def fail(say: Callable[[str], None]) -> str:
        raise CalibrationError("the server answered nothing")

    with pytest.raises(SystemExit) as ended:
        unmoved([server], fail, quiet=True, failed=3, mixed="no")
    assert ended.value.code == 3 and "the server answered nothing" in capsys.readouterr().err


def test_shell_completion_offers_the_configs_server_names(tmp_path: Path) -> None:
    """`eval "$(_MLX_WATCHDOG_COMPLETE=bash_source mlx-watchdog)"` (the README says how): a
    server's name completes from the config on the command line."""
    script = Path(sys.executable).parent / "mlx-watchdog"
    config = tmp_path / "w.toml"
    config.write_text(
        f'[watchdog]\nstate_dir = "{tmp_path / "s"}"\n'
        '[[server]]\nname = "qwen-big"\nurl = "http://127.0.0.1:9"\n'
        '[[server]]\nname = "llama"\nurl = "http://127.0.0.1:8"\n'
    )

    def complete(words: str) -> list[str]:
        env = {
            **os.environ,
            "_MLX_WATCHDOG_COMPLETE": "bash_complete",
            "COMP_WORDS": words,
            "COMP_CWORD": str(len(words.split()) - (0 if words.endswith(" ") else 1)),
        }
        done = subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=60)
        return [line.split(",", 1)[1] for line in done.stdout.splitlines() if "," in line]

    assert complete(f"mlx-watchdog restart --config {config} q") == ["qwen-big"]
    assert complete(f"mlx-watchdog probe --config {config} --server ") == ["qwen-big", "llama"]
    assert complete(f"mlx-watchdog history --config {tmp_path / 'none.toml'} --server ") == []
    source = subprocess.run(
        [str(script)],
        env={**os.environ, "_MLX_WATCHDOG_COMPLETE": "bash_source"},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "_mlx_watchdog_completion" in source.stdout
