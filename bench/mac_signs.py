"""The macOS signs, measured on Linux through the stand-ins of tests/fakes/mac/ (no Mac here).

    python bench/mac_signs.py [--quick] [--json out.json]

1. What a reading costs the watchdog: one GPU-time reading (`ioreg -a`, parsed) and one
   netstat reading (`netstat -anv -p tcp`, parsed), CPU and wall per reading, the command's
   process included (its children's CPU), with 1 and 20 processes holding the GPU.
2. A Mac-like server (tests/badserver.py --mode gpu: its prefill waits, near 0 % CPU, while its
   GPU time climbs) under the daemon with MLX_WATCHDOG_PLATFORM=darwin:
   - a live client's long prefill (30 s; 10 s with --quick): restarts, and the verdicts said;
   - an abandoned long prompt, waited for while the GPU works on it, then the GPU hangs:
     seconds and looks from the hang to the restart (the unknown-work bound alone would wait
     out the restart's cost: 60 s here, as for a large model);
   - the same, the GPU hanging as the client leaves: from its leaving to the restart, against
     wedge_after.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_watchdog.config import parse_config
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.sense import gpu, netstat, platform
from tests.badserver import uptime_ns
from tests.builders import mac_like_server, restarts_took, watchdog_config
from tests.conftest import free_port

FAKES = Path(__file__).resolve().parent.parent / "tests" / "fakes" / "mac"
RATE = 1000
INTERVAL = 0.25
WEDGE_AFTER = 2.0


def cpu_now() -> tuple[float, float]:
    """CPU seconds so far: the watchdog's own, and the commands' it ran (the stand-ins')."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def cost(read: Any, n: int) -> dict[str, float]:
    own, kids, walls = [], [], []
    for _ in range(n):
        (o0, k0), w0 = cpu_now(), time.perf_counter()
        read()
        (o1, k1), w1 = cpu_now(), time.perf_counter()
        own.append(o1 - o0)
        kids.append(k1 - k0)
        walls.append(w1 - w0)
    return {
        "watchdog_cpu_ms_median": round(statistics.median(own) * 1000, 2),
        "watchdog_cpu_ms_max": round(max(own) * 1000, 2),
        "command_cpu_ms_median": round(statistics.median(kids) * 1000, 2),
        "wall_ms_median": round(statistics.median(walls) * 1000, 2),
    }


def costs(folder: Path, n: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for holders in (1, 20):
        for f in folder.glob("*.gpu"):
            f.unlink()
        for i in range(holders):
            since = uptime_ns()
            (folder / f"{100000 + i}.gpu").write_text(f"{i * 1000} {since}\n")
        out[f"gpu, {holders} process(es) on the GPU"] = cost(lambda: gpu.gpu_time_ns(100000), n)
    out["netstat, this machine's connections"] = cost(netstat.read, max(5, n // 4))
    return out


def server(port: int, folder: Path) -> dict[str, Any]:
    return mac_like_server(port, folder, rate=RATE, wedge_after=f"{WEDGE_AFTER:g}s", max_busy="5m")


def ask(port: int, seconds: float, leave_after: float | None = None) -> str:
    body = json.dumps({"messages": [{"role": "user", "content": "x" * int(seconds * RATE * 4)}]})
    try:
        with httpx.Client(timeout=httpx.Timeout(leave_after or seconds * 3 + 30)) as c:
            r = c.post(f"http://127.0.0.1:{port}/v1/chat/completions", content=body)
            return f"served ({r.status_code})"
    except httpx.HTTPError as exc:
        return type(exc).__name__


def until(check: Any, timeout: float, what: str) -> None:
    ends = time.monotonic() + timeout
    while not check():
        if time.monotonic() > ends:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


RESTART_S = 60.0  # what a restart costs here, as for a large model (the wait's bound)


class Running:
    def __init__(self, folder: Path) -> None:
        self.port = free_port()
        restarts_took(folder / "state", "mac", RESTART_S)
        doc = watchdog_config(
            folder / "state", [server(self.port, folder)], interval=f"{INTERVAL * 1000:g}ms"
        )
        self.daemon = Daemon(parse_config(doc)).open()
        self.thread = threading.Thread(
            target=lambda: self.daemon.run(install_signals=False), daemon=True
        )
        self.thread.start()
        self.store = self.daemon.store
        until(self.serving, 60, "the first healthy probe")
        self.pid = int(next(folder.glob("*.gpu")).stem)

    def serving(self) -> bool:
        if not self.thread.is_alive():
            raise SystemExit("the watchdog died")
        return any(p.state == "healthy" for p in self.store.probes("mac", 0.0))

    def stop(self) -> None:
        self.daemon.stop()
        self.thread.join(60)


def live_client(folder: Path, seconds: float) -> dict[str, Any]:
    run = Running(folder)
    try:
        started, since = time.monotonic(), time.time()
        got = ask(run.port, seconds)
        said = [p.reason for p in run.store.probes("mac", 0.0) if p.state in ("busy", "wedged")]
        return {
            "prefill_s": seconds,
            "client": got,
            "took_s": round(time.monotonic() - started, 1),
            "restarts": len(run.store.restarts("mac", since)),
            "wedged_verdicts": sum("wedged" in s for s in said),
            "last_said": said[-1] if said else "",
        }
    finally:
        run.stop()


def hung_gpu(folder: Path) -> dict[str, Any]:
    run = Running(folder)
    try:
        ask(run.port, 120.0, leave_after=0.5)
        until(lambda: run.store.events("mac", kind="clearing"), 60, "the wait")
        os.kill(run.pid, signal.SIGUSR1)
        hung = time.time()
        until(lambda: len(run.store.restarts("mac", 0.0)) > 1, 120, "the restart")
        after = run.store.restarts("mac", 0.0)[-1].at - hung
        until(lambda: run.store.restarts("mac", 0.0)[-1].finished_at, 60, "the restart's end")
        (incident,) = run.store.incidents(0.0)
        said = next((a["detail"] for a in incident.actions if a.get("action") == "wait"), "")
        return {
            "hang_to_restart_s": round(after, 2),
            "looks": round(after / INTERVAL, 1),
            "said": said,
        }
    finally:
        run.stop()


def hung_at_once(folder: Path) -> dict[str, Any]:
    """A client leaves a long prompt and the GPU hangs on it at once: from the client's leaving
    to the restart, against wedge_after (the goal: within wedge_after and 2 looks)."""
    run = Running(folder)
    try:
        left = time.time()
        ask(run.port, 120.0, leave_after=0.3)
        os.kill(run.pid, signal.SIGUSR1)
        until(lambda: len(run.store.restarts("mac", 0.0)) > 1, 120, "the restart")
        after = run.store.restarts("mac", 0.0)[-1].at - left
        until(lambda: run.store.restarts("mac", 0.0)[-1].finished_at, 60, "the restart's end")
        return {
            "leave_to_restart_s": round(after, 2),
            "looks_past_wedge_after": round((after - WEDGE_AFTER) / INTERVAL, 1),
        }
    finally:
        run.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    os.environ[platform.VARIABLE] = "darwin"
    os.environ["PATH"] = f"{FAKES}{os.pathsep}{os.environ.get('PATH', '')}"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        os.environ["FAKE_GPU_DIR"] = str(folder / "costs")
        (folder / "costs").mkdir()
        doc: dict[str, Any] = {"costs": costs(folder / "costs", 20 if args.quick else 200)}
        for what, c in doc["costs"].items():
            print(
                f"{what}: the watchdog {c['watchdog_cpu_ms_median']} ms CPU a reading (max "
                f"{c['watchdog_cpu_ms_max']}), the stand-in command "
                f"{c['command_cpu_ms_median']} ms, {c['wall_ms_median']} ms wall",
                flush=True,
            )
        seconds = 10.0 if args.quick else 30.0
        cases: list[tuple[str, Any, str]] = [
            (
                "live_client",
                lambda at: live_client(at, seconds),
                "a live client's {prefill_s:g} s GPU prefill: {client} in {took_s} s, "
                "{restarts} restarts, {wedged_verdicts} wedged verdicts; last: {last_said}",
            ),
            (
                "hung_gpu",
                hung_gpu,
                "the GPU hangs under abandoned work: restarted {hang_to_restart_s} s "
                f"({{looks}} looks of {INTERVAL:g} s) after; {{said}}",
            ),
            (
                "hung_at_once",
                hung_at_once,
                "the GPU hangs as its client leaves: restarted {leave_to_restart_s} s after "
                f"(wedge_after {WEDGE_AFTER:g} s + {{looks_past_wedge_after}} looks)",
            ),
        ]
        for name, run, said in cases:
            at = folder / name
            at.mkdir()
            os.environ["FAKE_GPU_DIR"] = str(at)
            doc[name] = run(at)
            print(said.format(**doc[name]), flush=True)
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
