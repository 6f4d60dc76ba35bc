"""The whole hostile-answer matrix of tests/hostile.py, every kind, every route it is read on:
prints, per kind, how many answers were tried and how many were judged as they must be (a
serving server left alone, one serving nobody found), the crashes and the longest check. The
table in docs/servers.md comes from this; the suite runs a share of it (tests/test_hostile.py).

    python bench/hostile.py
    python bench/hostile.py --against 7b583d6   # the same answers against an older package
    python bench/hostile.py --quick             # every fifth answer of each kind (CI)

Then the same for what the watchdog reads back from its own history: every column of every
table holding text, bytes, a huge and a negative number, one edit at a time (the history a person
or a tool edited by hand); the daemon must start, judge and answer /status, /metrics and the page,
and `status`, `history`, `history --show` and `doctor` answer without a traceback.

`--against REV` checks out REV's watchdog/ in a detached worktree and judges with it (the
answers, the misbehaving server and the rule stay this tree's): that table's "before" column.
"""

from __future__ import annotations

import collections
import logging
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
from tests.builders import BAD_VALUES, EDITED, a_history  # noqa: E402
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


READERS = (
    ("status",),
    ("status", "--json"),
    ("history",),
    ("history", "--show", "1"),
    ("doctor",),
)


class Failures(logging.Handler):
    """What the daemon logged failing with a traceback: a tick that raised is a reader that
    failed, though the daemon goes on probing."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info:
            self.seen.append(f"{record.getMessage()}: {record.exc_info[1]!r}"[:300])


def read_edited(folder: Path, table: str, column: str, value: object) -> str:
    """One history with `column` of one `table` row set to `value`; what failed reading it
    ("" when nothing did)."""
    import sqlite3
    import threading

    from click.testing import CliRunner

    from mlx_watchdog.cli.app import cli
    from mlx_watchdog.config import load_config
    from mlx_watchdog.daemon import Daemon

    state = folder / "state"
    state.mkdir(mode=0o700)
    a_history(state / "history.db", "bad", time.time())
    con = sqlite3.connect(state / "history.db")
    with con:
        con.execute(f"UPDATE {table} SET {column} = ? WHERE rowid = 1", (value,))
    con.close()
    cfg = folder / "config.toml"
    cfg.write_text(
        f'[watchdog]\nstate_dir = "{state}"\nlisten = "127.0.0.1:0"\ninterval = "200ms"\n'
        f'[[server]]\nname = "bad"\nurl = "http://127.0.0.1:{free_port()}"\n'
    )
    try:
        daemon = Daemon(load_config(cfg), config_path=cfg).open()
    except Exception as exc:  # the finding: what `run` would exit with
        return f"run: {type(exc).__name__}: {exc}"
    failed = Failures()
    logging.getLogger().addHandler(failed)
    loop = threading.Thread(target=lambda: daemon.run(install_signals=False), daemon=True)
    loop.start()
    try:
        deadline = time.monotonic() + 30
        while daemon.cycles["bad"].verdict is None and loop.is_alive():
            if time.monotonic() > deadline:
                return "run: no verdict in 30 s"
            time.sleep(0.05)
        if not loop.is_alive():
            return "run: the daemon ended"
        for route, answer in (("/status", daemon.status), ("/metrics", daemon.prometheus)):
            try:
                answer()
            except Exception as exc:
                return f"{route}: {type(exc).__name__}: {exc}"
        try:
            daemon.page()
        except Exception as exc:
            return f"/: {type(exc).__name__}: {exc}"
    finally:
        daemon.stop()
        loop.join(60)
        logging.getLogger().removeHandler(failed)
    if failed.seen:
        return f"a tick: {failed.seen[0]}"
    runner = CliRunner()
    for args in READERS:
        done = runner.invoke(cli, [*args, "--config", str(cfg)])
        if not isinstance(done.exception, (SystemExit, type(None))) or "Traceback" in done.output:
            return f"{' '.join(args)}: {done.exception!r}"
    return ""


def edited_histories(every: int) -> int:
    """The hand-edited history's table; 0 when every edit was read."""
    logging.getLogger().handlers[:] = [logging.NullHandler()]  # findings are the table's
    edits = [
        (t, c, v) for t, columns in sorted(EDITED.items()) for c in columns for v in BAD_VALUES
    ]
    edits = edits[::every]
    failed: dict[str, list[str]] = collections.defaultdict(list)
    tried = collections.Counter[str]()
    with tempfile.TemporaryDirectory() as tmp:
        for n, (table, column, value) in enumerate(edits):
            folder = Path(tmp) / str(n)
            folder.mkdir()
            tried[table] += 1
            if problem := read_edited(folder, table, column, value):
                failed[table].append(f"{column} = {value!r:.20}: {problem[:200]}")
    print()
    print("| history table | hand edits tried | read by every reader |")
    print("|---|---:|---:|")
    for table in sorted(tried):
        print(f"| `{table}` | {tried[table]} | {tried[table] - len(failed[table])} |")
    print(
        f"| all | {sum(tried.values())} | {sum(tried.values()) - sum(map(len, failed.values()))} |"
    )
    for table, problems in failed.items():
        for problem in problems:
            print(f"UNREAD {table}.{problem}")
    return 1 if any(failed.values()) else 0


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
    code = 0 if total["tried"] == total["kept"] else 1
    code |= edited_histories(every)
    print(f"({time.monotonic() - started:.0f} s in all)", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
