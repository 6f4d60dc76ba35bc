"""The quality tools started once, in the background, when the run begins: mypy, ruff and the
import-linter take a core for tens of seconds, and the tests that read their verdicts come
last (test_quality.py); meanwhile the real servers' tests mostly wait on I/O."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).parent.parent
_running: dict[str, tuple[subprocess.Popen[str], Path]] = {}
_folders: list[Path] = []


def _commands(linked: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    python = sys.executable
    return {
        # The folder is watchdog/, the package mlx_watchdog: mypy finds it under its import name.
        "mypy": ([python, "-m", "mypy", "-p", "mlx_watchdog"], {"MYPYPATH": str(linked)}),
        "ruff": ([python, "-m", "ruff", "check", "watchdog", "tests", "bench"], {}),
        "lint-imports": ([str(Path(python).with_name("lint-imports")), "--no-cache"], {}),
    }


def start() -> None:
    """Start each tool once; its output goes to a file (a full pipe would stall it)."""
    if _running:
        return
    folder = Path(tempfile.mkdtemp(prefix="mlxwd-quality-"))
    _folders.append(folder)
    (folder / "mlx_watchdog").symlink_to(ROOT / "watchdog")
    for name, (argv, env) in _commands(folder).items():
        out = folder / f"{name}.out"
        with out.open("w") as f:
            proc = subprocess.Popen(
                argv,
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=f,
                stderr=subprocess.STDOUT,
                text=True,
                env={**os.environ, **env},
            )
        _running[name] = (proc, out)


def result(name: str, timeout: float = 600.0) -> tuple[int, str]:
    """The tool's exit code and output, waiting for it (started now if the run did not)."""
    start()
    proc, out = _running[name]
    code = proc.wait(timeout=timeout)
    return code, out.read_text()


def stop() -> None:
    """End the tools still running (a run cut short), by their PIDs; remove their folder."""
    for proc, _ in _running.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for folder in _folders:
        shutil.rmtree(folder, ignore_errors=True)
