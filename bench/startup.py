"""Start-up and footprint of mlx-watchdog as a user installs it (a wheel in a fresh venv).

    python bench/startup.py                 # --help, status --json, daemon RSS, 10,000 probes
    python bench/startup.py --probes 2000   # a shorter footprint run
    python bench/startup.py --quick         # CI's smoke run: 3 runs, 300 probes

Targets (issue 10): `--help` under 120 ms median, `status --json` against a running daemon under
150 ms median (issue 45: without a daemon, within 6x the bare interpreter's start), the daemon's RSS at most 36 MiB after start, and flat (within 1 MiB) from 1,000
to 10,000 probes. It prints one JSON document; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).parent.parent
BADSERVER = ROOT / "tests" / "badserver.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def install(venv: Path) -> Path:
    """A fresh venv with mlx-watchdog from a wheel (no editable finder, bytecode compiled)."""
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    wheels = venv / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(wheels), str(ROOT)],
        check=True,
    )
    (wheel,) = wheels.glob("*.whl")
    py = venv / "bin" / "python"
    subprocess.run([py, "-m", "pip", "install", "-q", str(wheel)], check=True)
    return py


def median_ms(argv: list[str], env: dict[str, str], runs: int) -> float:
    subprocess.run(argv, capture_output=True, env=env)  # warm the page cache
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        subprocess.run(argv, capture_output=True, env=env)
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1000, 1)


def rss_mib(pid: int) -> float:
    import psutil

    return round(psutil.Process(pid).memory_info().rss / 2**20, 2)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--probes", type=int, default=10_000)
    parser.add_argument("--quick", action="store_true", help="3 runs, 300 probes (CI's smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.runs, args.probes = 3, 300
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    result: dict[str, object] = {"machine": f"{os.cpu_count()} cores", "runs": args.runs}
    with tempfile.TemporaryDirectory(prefix="mlx-watchdog-bench-") as tmp:
        work = Path(tmp)
        py = install(work / "venv")
        port = free_port()
        server = subprocess.Popen(
            [py, str(BADSERVER), "--port", str(port), "--mode", "ok"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:
            state = work / "state"
            config = work / "config.toml"
            config.write_text(
                f'[watchdog]\ninterval = "1s"\nlisten = "127.0.0.1:0"\nstate_dir = "{state}"\n\n'
                f'[[server]]\nname = "bad"\nurl = "http://127.0.0.1:{port}"\nmatch = "badserver"\n'
            )
            run_env = {**env, "MLX_WATCHDOG_CONFIG": str(config)}
            result["python_startup_ms"] = median_ms([str(py), "-c", "pass"], env, args.runs)
            result["help_ms"] = median_ms([str(py), "-m", "mlx_watchdog", "--help"], env, args.runs)
            # No daemon yet: status from the history, without importing the daemon's stack.
            result["status_json_no_daemon_ms"] = median_ms(
                [str(py), "-m", "mlx_watchdog", "status", "--json"], run_env, args.runs
            )
            said = work / "daemon.err"
            with said.open("w") as err:
                daemon = subprocess.Popen(
                    [py, "-m", "mlx_watchdog", "run"],
                    env=run_env,
                    stdout=subprocess.DEVNULL,
                    stderr=err,
                )
            try:
                deadline = time.monotonic() + 30
                while not (state / "daemon.json").exists() and time.monotonic() < deadline:
                    if daemon.poll() is not None:
                        raise SystemExit(
                            f"the watchdog exited with {daemon.returncode} at start: "
                            + said.read_text()[-2000:]
                        )
                    time.sleep(0.1)
                time.sleep(5)  # a few ticks: the probe, the inspector and the store have run
                if daemon.poll() is not None or not (state / "daemon.json").exists():
                    raise SystemExit("the watchdog is not running: nothing to measure")
                result["daemon_rss_after_start_mib"] = rss_mib(daemon.pid)
                result["status_json_ms"] = median_ms(
                    [str(py), "-m", "mlx_watchdog", "status", "--json"], run_env, args.runs
                )
            finally:
                daemon.terminate()
                daemon.wait(30)
            footprint = subprocess.run(
                [py, "-c", FOOTPRINT, str(config), str(args.probes)],
                env=run_env,
                capture_output=True,
                text=True,
                check=True,
            )
            result["probes"] = json.loads(footprint.stdout)
        finally:
            server.terminate()
            server.wait(10)
    print(json.dumps(result, indent=2))


# The daemon's own tick, driven as fast as the server answers, in a process of its own; RSS
# sampled at 1,000 probes (a tenth of a shorter run) and at the end.
FOOTPRINT = """
import json, sys
sys.modules.setdefault("httpx._main", None)  # as `mlx-watchdog run` does
import psutil
from pathlib import Path
from mlx_watchdog.config import load_config
from mlx_watchdog.daemon import Daemon

config = load_config(Path(sys.argv[1]))
total = int(sys.argv[2])
# The clocks advance one interval a tick, as in a real run: what is kept for an hour (TTFTs
# for status) fills as it would, not with 10,000 probes crammed into a few minutes.
clock = [1.8e9, 1e6]
daemon = Daemon(config, wall=lambda: clock[0], mono=lambda: clock[1]).open()
proc = psutil.Process()
first = min(1000, max(1, total // 10))
marks = {}
for i in range(1, total + 1):
    clock[0] += config.watchdog.interval
    clock[1] += config.watchdog.interval
    daemon.tick("bad")
    if i in (first, total):
        marks[i] = round(proc.memory_info().rss / 2**20, 2)
daemon.close()
print(json.dumps({"rss_mib_at": marks, "growth_mib": round(marks[total] - marks[first], 2)}))
"""


if __name__ == "__main__":
    main()
