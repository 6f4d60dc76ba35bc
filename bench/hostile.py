"""The whole hostile-answer matrix of tests/hostile.py, every kind, every route it is read on:
prints, per kind, how many answers were tried and how many were judged as they must be (a
serving server left alone, one serving nobody found), the crashes and the longest check. The
table in docs/servers.md comes from this; the suite runs a share of it (tests/test_hostile.py).

    python bench/hostile.py
    python bench/hostile.py --against 7b583d6   # the same answers against an older package
    python bench/hostile.py --quick             # every fifth answer of each kind (CI)

`--against REV` checks out REV's watchdog/ in a detached worktree and judges with it (the
answers, the misbehaving server and the rule stay this tree's): that table's "before" column.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import free_port  # noqa: E402
from mlx_watchdog.config.profiles import KINDS, Kind  # noqa: E402
from mlx_watchdog.record.left_probes import LeftProbes  # noqa: E402
from tests.hostile import Outcome, cases, run_case  # noqa: E402


def run_kind(kind: Kind, folder: Path, every: int = 1) -> list[Outcome]:
    port = free_port()
    argv = [
        sys.executable,
        str(ROOT / "tests" / "badserver.py"),
        "--port",
        str(port),
        "--mode",
        "ok",
    ]
    if kind != "mlx_lm":
        argv += ["--kind", kind]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        left = LeftProbes(folder / f"left-{kind}.json")
        tried = list(cases((kind,)))[::every]
        return [run_case(c, f"http://127.0.0.1:{port}", left) for c in tried]
    finally:
        proc.terminate()
        proc.wait(10)


def against(rev: str) -> int:
    """Run this script again with REV's package first on the path."""
    with tempfile.TemporaryDirectory() as tmp:
        tree, pkg = Path(tmp) / "tree", Path(tmp) / "pkg"
        git = ["git", "-C", str(ROOT), "worktree"]
        subprocess.run([*git, "add", "-q", "--detach", str(tree), rev], check=True)
        try:
            pkg.mkdir()
            (pkg / "mlx_watchdog").symlink_to(tree / "watchdog")
            env = {**os.environ, "PYTHONPATH": str(pkg)}
            return subprocess.run([sys.executable, __file__], env=env).returncode
        finally:
            subprocess.run([*git, "remove", "--force", str(tree)], check=False)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--against":
        return against(sys.argv[2])
    every = 5 if sys.argv[1:] == ["--quick"] else 1
    if sys.argv[1:] not in ([], ["--quick"]):
        print("usage: bench/hostile.py [--quick | --against REV]", file=sys.stderr)
        return 3
    import mlx_watchdog

    print(f"(judged by the package in {Path(mlx_watchdog.__file__).parent})", file=sys.stderr)
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(len(KINDS)) as pool:
        results = dict(
            zip(KINDS, pool.map(lambda k: run_kind(k, Path(tmp), every), KINDS), strict=True)
        )
    print("| kind | answers tried | judged as they must be | crashes | longest check |")
    print("|---|---:|---:|---:|---:|")
    total = collections.Counter[str]()
    for kind, outcomes in results.items():
        kept = sum(o.kept for o in outcomes)
        crashes = sum(bool(o.error) for o in outcomes)
        longest = max(o.seconds for o in outcomes)
        total.update(tried=len(outcomes), kept=kept, crashes=crashes)
        print(f"| `{kind}` | {len(outcomes)} | {kept} | {crashes} | {longest:.1f} s |")
    print(f"| all | {total['tried']} | {total['kept']} | {total['crashes']} | |")
    for outcomes in results.values():
        for o in outcomes:
            if not o.kept:
                print(f"WRONG {o.case.label}: {o.error or o.state} ({o.reason[:160]})")
    print(f"({time.monotonic() - started:.0f} s in all)", file=sys.stderr)
    return 0 if total["tried"] == total["kept"] else 1


if __name__ == "__main__":
    sys.exit(main())
