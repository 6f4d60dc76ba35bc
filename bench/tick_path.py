"""How one tick travels through the package: the tick that finds a wedge and restarts it.

A misbehaving server that hangs is watched through the `command` manager; the daemon's ticks run
on this thread under a profiler until a restart has brought the server back. Of that tick it
counts each call from one module of the package into another ("moves"), and those of them that
go from a lower layer back up to a higher one ("climbs back up": callbacks), with the modules
each tick enters, and the calls from cycle/ into record/ (issue 45: what a cycle learns is written
through its ledger only; the rest of cycle/ reads). Layers as in pyproject.toml's contract.

    python bench/tick_path.py
"""

from __future__ import annotations

import collections
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlx_watchdog.config import parse_config  # noqa: E402
from mlx_watchdog.daemon import Daemon  # noqa: E402
from tests.builders import command_server, watchdog_config  # noqa: E402
from tests.conftest import BadByPidfile  # noqa: E402

LAYERS = [
    "cli",
    "advice fleet",
    "demo service",
    "daemon",
    "serve",
    "cycle",
    "act",
    "record",
    "judge",
    "sense",
    "config",
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names.split()}


def module_of(frame: FrameType) -> str | None:
    name = frame.f_globals.get("__name__", "")
    return name.removeprefix("mlx_watchdog.") if name.startswith("mlx_watchdog.") else None


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        bad = BadByPidfile(folder, "hang")
        try:
            server = command_server(bad.url, bad.pidfile, bad.port)
            daemon = Daemon(parse_config(watchdog_config(folder / "state", [server]))).open()
            moves: list[tuple[str, str]] = []

            def profile(frame: FrameType, event: str, arg: Any) -> None:
                if event != "call" or frame.f_back is None:
                    return
                callee, caller = module_of(frame), module_of(frame.f_back)
                if callee and caller and callee != caller:
                    moves.append((caller, callee))

            for _ in range(200):
                moves.clear()
                sys.setprofile(profile)
                try:
                    daemon.tick("bad")
                finally:
                    sys.setprofile(None)
                if daemon.store.restarts("bad", 0.0):
                    break
                time.sleep(0.2)
            else:
                raise SystemExit("no restart within 200 ticks")
            daemon.cycles["bad"].checker.abort()
            daemon.close()
        finally:
            bad.kill()
    climbs = [(a, b) for a, b in moves if RANK[b.split(".")[0]] < RANK[a.split(".")[0]]]
    print(f"the tick that restarted: {len(moves)} moves between modules, {len(climbs)} back up")
    for (a, b), n in collections.Counter(climbs).most_common():
        print(f"  up: {a} -> {b} ({n})")
    # Issue 45: what a cycle learns leaves it through its ledger; the rest of cycle/ only reads.
    out = collections.Counter(
        (a, b) for a, b in moves if a.startswith("cycle.") and b.startswith("record.")
    )
    print(
        "cycle/ -> record/: "
        + (", ".join(f"{a} -> {b} {n}" for (a, b), n in out.most_common()) or "none")
    )
    entered = collections.Counter(b for _, b in moves)
    print("modules entered: " + ", ".join(f"{m} {n}" for m, n in entered.most_common()))


if __name__ == "__main__":
    main()
