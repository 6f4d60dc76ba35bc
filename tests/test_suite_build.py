"""The suite's own set-up on a fresh machine: the llama-server build runs before the first test
and a missing tool is one clear error, not a column of E."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests import llamacpp

ROOT = Path(__file__).parent.parent


def _pytest(tmp_path: Path, *args: str, path: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("LLAMA_SERVER", "PYTEST_ADDOPTS")}
    env |= {"PATH": path, "XDG_CACHE_HOME": str(tmp_path / "empty-cache")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=120,
    )


def test_no_cmake_and_no_compiler_is_one_error_that_names_them(tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    run = _pytest(tmp_path, "tests/test_llama_server.py", path=str(bare))
    out = run.stdout + run.stderr
    assert run.returncode == 4, out
    assert "install cmake and a C++ compiler" in out
    assert "-m 'not llama_server'" in out
    assert " E" not in out and "ERROR" not in out, out
    assert not (tmp_path / "empty-cache" / "mlx-watchdog-tests" / llamacpp.NAME).exists()


def test_leaving_the_llama_tests_out_needs_no_build(tmp_path: Path) -> None:
    bare = tmp_path / "bin"
    bare.mkdir()
    run = _pytest(tmp_path, "tests/test_llama_server.py", "-m", "not llama_server", path=str(bare))
    assert run.returncode == 5, run.stdout + run.stderr  # every test there was deselected
    assert "deselected" in run.stdout


def test_a_failed_stage_names_its_log_and_shows_its_tail(tmp_path: Path) -> None:
    log = tmp_path / "build.log"
    said: list[str] = []
    script = "import sys; print('[ 37%] Building x'); print('boom: no such header'); sys.exit(2)"
    try:
        llamacpp._run("compile", [sys.executable, "-c", script], log, said.append)
    except llamacpp.BuildError as e:
        message = str(e)
    else:
        raise AssertionError("a failing stage raised nothing")
    assert said == ["llama-server build: compile"]
    assert f"compile failed (exit 2); the whole log is {log}" in message
    assert "boom: no such header" in message
    assert llamacpp._percent(log) == 37
