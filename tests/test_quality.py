"""The package stays typed (mypy strict), lint-clean and layered; all run as part of the suite."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests import background

ROOT = Path(__file__).parent.parent


def run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )


def test_mypy_strict() -> None:
    code, out = background.result("mypy")
    assert code == 0, out


def test_ruff() -> None:
    code, out = background.result("ruff")
    assert code == 0, out


def test_layers_and_no_click_or_rich_in_the_core() -> None:
    """The import-linter contracts in pyproject.toml: each layer imports only those below it."""
    code, out = background.result("lint-imports")
    assert code == 0, out
    assert "3 kept, 0 broken" in out


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    result = run("pip", "wheel", "--no-deps", "-q", "-w", str(out), ".")
    assert result.returncode == 0, result.stdout + result.stderr
    (built,) = out.glob("*.whl")
    return built


def test_the_wheel_ships_every_module_and_template(wheel: Path) -> None:
    """A plain (not editable) install must have all of it: subpackages are easy to forget."""
    with zipfile.ZipFile(wheel) as zf:
        shipped = set(zf.namelist())
    wanted = {
        f"mlx_watchdog/{p.relative_to(ROOT / 'watchdog')}"
        for p in (ROOT / "watchdog").rglob("*.py")
    }
    wanted |= {"mlx_watchdog/py.typed", "mlx_watchdog/fleet/rules.yml"}
    wanted |= {"mlx_watchdog/fleet/dashboard.json"}
    wanted |= {f"mlx_watchdog/{p.relative_to(ROOT)}" for p in (ROOT / "launchd").glob("*.plist")}
    wanted |= {f"mlx_watchdog/{p.relative_to(ROOT)}" for p in (ROOT / "units").glob("*.service")}
    assert wanted - shipped == set()
    assert not any(name.startswith("watchdog/") for name in shipped)
    (license_file,) = (n for n in shipped if n.endswith(".dist-info/licenses/LICENSE"))
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read(license_file) == (ROOT / "LICENSE").read_bytes()
        assert (
            "License-Expression: MIT"
            in zf.read(license_file.replace("licenses/LICENSE", "METADATA")).decode()
        )


def test_installs_beside_the_watchdog_library(wheel: Path, tmp_path: Path) -> None:
    """The filesystem-events library `watchdog` and mlx-watchdog live in one environment."""
    target = tmp_path / "site"
    result = run(
        "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel), "watchdog"
    )
    assert result.returncode == 0, result.stdout + result.stderr
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "import watchdog.events, mlx_watchdog, mlx_watchdog.judge.budget;"
        "print(watchdog.events.FileSystemEventHandler.__name__);"
        "print(mlx_watchdog.__file__); print(watchdog.__file__)"
    )
    # -S: only the target folder, not this checkout's editable install.
    done = subprocess.run(
        [sys.executable, "-S", "-c", code, str(target)], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    handler, ours, theirs = done.stdout.split()
    assert handler == "FileSystemEventHandler"
    assert ours.startswith(str(target / "mlx_watchdog"))
    assert theirs.startswith(str(target / "watchdog"))


def test_every_public_class_says_what_it_owns() -> None:
    """A docstring on every public class and protocol (a newcomer reads those first)."""
    import ast

    missing = [
        f"{path.relative_to(ROOT)}:{node.lineno} {node.name}"
        for path in sorted((ROOT / "watchdog").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ClassDef)
        and not node.name.startswith("_")
        and ast.get_docstring(node) is None
    ]
    assert not missing, missing


def test_no_name_is_bound_twice_at_a_modules_top() -> None:
    """A constant, function or class bound twice at a module's top: the second wins, and an
    edit of the first does nothing (record/db.py carried four such constants)."""
    import ast
    import collections

    twice = []
    for path in sorted((ROOT / "watchdog").rglob("*.py")):
        names: list[str] = []
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign):
                names += [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.append(node.target.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.append(node.name)
        counted = collections.Counter(names)
        twice += [f"{path.relative_to(ROOT)} {n}" for n, k in counted.items() if k > 1]
    assert not twice, twice


# Each command module's list for cli/__init__.py: one meaning in each.
SHARED_NAMES = {"COMMANDS"}


def test_each_type_and_constant_has_one_meaning() -> None:
    """A class, type alias or constant is defined in one module: `Kind`, `Plan`, `Run`,
    `STATES` and `Address` each meant two things, and `GAP_PROBES`, `PLIST_MAX` and
    `REPLACE_TIMEOUT` were one value kept in two places."""
    import ast
    import collections

    where: dict[str, list[str]] = collections.defaultdict(list)
    for path in sorted((ROOT / "watchdog").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                names = [node.name]
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names = [node.target.id]
            else:
                continue
            for name in names:
                if name.lstrip("_")[:1].isupper() and len(name) > 1 and name not in SHARED_NAMES:
                    where[name].append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, twice


WRITES = {
    "record_probe",
    "add_event",
    "open_incident",
    "set_advice",
    "add_action",
    "close_incident",
    "add_dump",
    "start_restart",
    "finish_restart",
    "hold",
    "release",
    "interrupt_unfinished",
}


def test_a_cycle_writes_only_through_its_ledger() -> None:
    """What a cycle learns reaches the history, the tally, the sinks and the alerts through
    cycle/ledger.py only: no store write, tally change, sink or alerter call elsewhere in cycle/."""
    import ast

    found = []
    for path in sorted((ROOT / "watchdog" / "cycle").glob("*.py")):
        if path.name in ("ledger.py", "crew.py"):  # the writer; the sinks' fan-out
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            owner = ast.unparse(node.value)
            if (owner.endswith("store") and node.attr in WRITES) or (
                owner.endswith(("tally", "sink", "alerter")) and node.attr != "tally"
            ):
                if owner.endswith("tally") and node.attr in READS:
                    continue
                found.append(f"{path.name}:{node.lineno} {owner}.{node.attr}")
    assert not found, found


# The Daemon's methods that run on threads other than a server's job (the endpoint's, the
# calendar's, the main loop), and what of a Cycle they may touch: its published view, its
# queue of asks, its ledger (an event said about it), the main thread's own retired flag.
OTHER_THREADS = {"status", "page", "stalled", "look_at_sight", "_residents", "act", "rotate_logs"}
SHOWN = {"shown", "ask", "ledger", "retired"}


def test_other_threads_read_a_cycle_only_through_its_published_view() -> None:
    """A cycle is written by its job; the endpoint, the calendar and the daemon's loop read
    its frozen `shown` view (replaced whole), never a live deque, flag or verdict of it."""
    import ast

    def touched(tree: ast.AST, where: str) -> list[str]:
        return [
            f"{where}:{node.lineno} {node.value.id}.{node.attr}"
            for node in ast.walk(tree)
            if isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in ("c", "cycle")
            and node.attr not in SHOWN
        ]

    found, methods = [], set()
    daemon = ast.parse((ROOT / "watchdog" / "daemon" / "run.py").read_text())
    for node in ast.walk(daemon):
        if isinstance(node, ast.FunctionDef) and node.name in OTHER_THREADS:
            methods.add(node.name)
            found += touched(node, f"run.py {node.name}")
    assert methods == OTHER_THREADS  # a renamed method would escape the check
    for path in [
        ROOT / "watchdog" / "daemon" / "calendar.py",
        *(ROOT / "watchdog" / "serve").glob("*.py"),
    ]:
        found += touched(ast.parse(path.read_text()), path.name)
    assert not found, found


READS = {
    "restart_cost",
    "restarts",
    "cured",
    "restarts_served",
    "restarts_asked",
    "last_restart",
    "figures",
}
MODULE_LINES = 700  # a module longer than this has a seam to split at; functions: ruff's limits


def test_every_module_keeps_the_size_limit() -> None:
    long = {
        str(path.relative_to(ROOT)): n
        for path in sorted((ROOT / "watchdog").rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MODULE_LINES
    }
    assert not long, f"over {MODULE_LINES} lines: {long}"


def test_tests_import_only_shared_helpers() -> None:
    """A test module imports helpers (conftest, builders, judging...), never another test
    module: moving or deleting a test must not break the others."""
    import ast

    found = [
        f"{path.name}:{node.lineno} {node.module}"
        for path in sorted((ROOT / "tests").rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        and node.module is not None
        and node.module.split(".")[-1].startswith("test_")
    ]
    assert not found, found
