"""The block for a bug report upstream (`history --show N`): offered for the server's own bugs
only, and pasted in public, so no one's home folder in it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.builders import one_incident
from tests.conftest import mlx_watchdog


def incident_with(tmp_path: Path, cause: str, dump: dict[str, object]) -> tuple[Path, int]:
    """A config and one incident of `cause` in its history, with a restart's dump."""
    evidence = {"cause": cause, "cause_because": "its log: [metal::malloc] ..."}
    return one_incident(
        tmp_path, "wedged: no token", evidence, {"pid": 1, "kind": "mlx_lm", **dump}
    )


def show(config: Path, number: int, home: Path) -> str:
    shown = mlx_watchdog(
        "history", "--config", str(config), "--show", str(number), env={"HOME": str(home)}
    )
    assert shown.returncode == 0, shown.stderr
    return shown.stdout


@pytest.mark.parametrize(
    ("cause", "words"),
    [
        ("abandoned_prefill", "an abandoned request holds the server"),
        ("client_timeouts", "clients time out before their prefill ends"),
        ("memory_pressure", "the machine is out of memory"),
    ],
)
def test_no_report_upstream_for_what_is_not_the_servers_bug(
    tmp_path: Path, cause: str, words: str
) -> None:
    config, number = incident_with(tmp_path, cause, {"stack": "Thread 1\n"})
    said = show(config, number, tmp_path)
    assert "For a bug report upstream" not in said
    assert f"no report upstream: the cause ({words}) is not a bug of the server's; next: " in said


def test_a_report_for_the_servers_bug_names_it_and_holds_no_home_folder(tmp_path: Path) -> None:
    home = tmp_path / "home" / "alice"
    home.mkdir(parents=True)
    site = f"{home}/.venv/lib/python3.11/site-packages/mlx_lm/server.py"
    dump = {
        "stack": f'Thread 7 (idle): "generate"\n    _generate ({site}:812)\n',
        "log_tail": "RuntimeError: [metal::malloc] in /Users/bob/models/qwen\n",
        "versions": ["mlx_lm 0.32.2"],
    }
    config, number = incident_with(tmp_path, "metal_error", dump)
    said = show(config, number, home)
    report = said.split("For a bug report upstream", 1)[1]
    assert 'mlx_lm 0.32.2 (watched as "m")' in report
    assert "~/.venv/lib/python3.11/site-packages/mlx_lm/server.py:812" in report
    assert "in ~/models/qwen" in report
    assert str(home) not in report and "/Users/bob" not in report
