"""The package stays typed (mypy strict) and lint-clean; both run as part of the suite."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).parent.parent


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True)


def test_mypy_strict() -> None:
    result = run("mypy")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff() -> None:
    result = run("ruff", "check", "watchdog", "tests")
    assert result.returncode == 0, result.stdout + result.stderr


def test_core_never_imports_click_or_rich() -> None:
    for path in (ROOT / "watchdog").glob("*.py"):
        if path.name.startswith("cli") or path.name == "__main__.py":
            continue
        text = path.read_text()
        for lib in ("click", "rich"):
            assert f"import {lib}" not in text and f"from {lib}" not in text, path.name


def test_the_wheel_ships_every_module_and_template(tmp_path: Path) -> None:
    """A plain (not editable) install must have all of it: subpackages are easy to forget."""
    result = run("pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), ".")
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = tmp_path.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        shipped = set(zf.namelist())
    wanted = {str(p.relative_to(ROOT)) for p in (ROOT / "watchdog").rglob("*.py")}
    wanted |= {"watchdog/py.typed"}
    wanted |= {f"watchdog/{p.relative_to(ROOT)}" for p in (ROOT / "launchd").glob("*.plist")}
    wanted |= {f"watchdog/{p.relative_to(ROOT)}" for p in (ROOT / "units").glob("*.service")}
    assert wanted - shipped == set()
