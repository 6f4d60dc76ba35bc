"""Side-by-side benchmark: detection, recovery, false restarts, probe cost and footprint.

    python bench/run.py [--quick] [--json OUT] [--only SCENARIO,...] [--watchers NAME,...]

For each scenario and each watcher: a fresh server (the real mlx_lm.server on the tiny model,
serial with --draft-model; the tests' misbehaving server for the permanent wedge), one watcher
attached, the fault injected at a known moment, and everything measured from outside by the
timestamps of real requests. Watchers' intervals and thresholds are divided by the compression
factor k; the servers' own speed is not (prefill takes what it takes).
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import ROOT, Box, Prober, free_port, python
from bench.watchers import WATCHERS, make
from mlx_watchdog.demo.run import long_prompt, send, server_command

SCENARIOS = ("abandoned", "permanent", "patient", "crash", "steady")
GIVE_UP_AFTER = 2.0  # the abandoning clients' timeout; their prompts take ~15 s to prefill


@dataclass
class Result:
    scenario: str
    watcher: str
    detected: bool
    detection_s: float | None  # from the fault to the watcher's verdict (or first restart)
    back_s: float | None  # from the fault until a real tiny request was served again
    restarts: int
    false_restarts: int  # restarts where nothing was wrong (patient, steady)
    cut_off: int  # real client requests that failed (reset/refused) after the fault
    own_abandoned: int  # generation requests the watcher itself gave up on
    observed_s: float


def run_one(
    scenario: str, watcher: str, k: float, observe: float, work: Path, model: Path
) -> Result:
    if scenario == "permanent" and watcher == "timeout-busy":
        # Long enough for its 15 min of busy, counted from its first timed-out probe.
        observe = max(observe, (900 + 30 + 120) / k + 10)
    port = free_port()
    hang_file = work / f"hang-{port}"
    if scenario == "permanent":
        argv = [python(), str(ROOT / "tests" / "badserver.py"), "--port", str(port)]
        argv += ["--mode", "hang_later", "--hang-file", str(hang_file)]
        match = "badserver"
    else:
        argv, match = server_command(model, port), "mlx_lm"
    hub = work / "hub"
    hub.mkdir(exist_ok=True)
    box = Box(
        argv, port, work / f"server-{port}.log", {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    )
    restart = box.restart

    def restart_and_heal(by: str) -> None:
        hang_file.unlink(missing_ok=True)  # a new process has a free slot again
        restart(by)

    box.restart = restart_and_heal  # type: ignore[method-assign]
    box.start()
    prober = Prober(box.url, period=0.5)
    prober.start()
    w = make(watcher, box, k, str(work / f"state-{port}"))
    if hasattr(w, "match"):
        w.match = match  # type: ignore[attr-defined]
    w.start()
    time.sleep(max(2.0, 35 / k))  # let it see a healthy server first
    outcomes: list[str] = []
    clients: list[threading.Thread] = []
    t0 = time.time()
    if scenario == "abandoned":
        for i in range(3):  # a client, then two load-balancer retries of it
            t = threading.Thread(
                target=lambda i=i: outcomes.append(
                    send(box.url, long_prompt(random.randrange(10**9)), GIVE_UP_AFTER)
                ),
                daemon=True,
            )
            t.start()
            clients.append(t)
            time.sleep(0.5)
    elif scenario == "permanent":
        hang_file.touch()
    elif scenario == "patient":
        t = threading.Thread(target=lambda: outcomes.append(_patient(box.url)), daemon=True)
        t.start()
        clients.append(t)
    elif scenario == "crash":
        box.kill()
    elif scenario == "steady":
        t = threading.Thread(target=lambda: outcomes.extend(_steady(box.url, observe)), daemon=True)
        t.start()
        clients.append(t)
    time.sleep(observe)
    w.stop()
    prober.stopped.set()
    for t in clients:
        t.join(120)
    prober.join(30)
    box.close()
    restarts = [t for t, by in box.restarts if by == watcher]
    first_restart = min(restarts) if restarts else None
    detected_at = w.detected_at or first_restart
    wrong = scenario in ("patient", "steady")
    return Result(
        scenario=scenario,
        watcher=watcher,
        detected=detected_at is not None and not wrong,
        detection_s=None if detected_at is None or wrong else round(detected_at - t0, 1),
        back_s=None if (b := prober.back_after(t0)) is None else round(b, 1),
        restarts=len(restarts),
        false_restarts=len(restarts) if wrong else 0,
        # The abandoning clients gave up anyway; only live clients (patient, steady) count.
        cut_off=prober.cut_off(restarts) + (sum(o == "error" for o in outcomes) if wrong else 0),
        own_abandoned=w.own_abandoned,
        observed_s=observe,
    )


def _patient(url: str) -> str:
    try:
        import httpx

        body = {
            "messages": [{"role": "user", "content": long_prompt(random.randrange(10**9))}],
            "max_tokens": 8,
        }
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
        return "served" if r.status_code == 200 else "error"
    except Exception:
        return "error"


def _steady(url: str, duration: float) -> list[str]:
    import httpx

    out = []
    end = time.time() + duration - 1
    while time.time() < end:
        body = {
            "messages": [{"role": "user", "content": f"hello {random.random()}"}],
            "max_tokens": 4,
        }
        try:
            r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
            out.append("served" if r.status_code == 200 else "error")
        except httpx.HTTPError:
            out.append("error")
        time.sleep(0.3)
    return out


# -- mlx-watchdog's own cost ---------------------------------------------------------------


def probe_cost(model: Path, work: Path, probes: int) -> dict[str, Any]:
    """Prompt tokens computed (not cached) and completion tokens per probe, on the real server."""
    from mlx_watchdog.config import ServerConfig
    from mlx_watchdog.sense.probe import Probe

    port = free_port()
    hub = work / "hub"
    hub.mkdir(exist_ok=True)
    box = Box(server_command(model, port), port, work / "cost.log", {"HF_HUB_CACHE": str(hub)})
    box.start()
    try:
        server = ServerConfig("cost", box.url)
        snaps = [Probe(server).run() for _ in range(probes)]
    finally:
        box.stop()
    later = snaps[1:]
    computed = [(s.prompt_tokens or 0) - (s.cached_tokens or 0) for s in later]
    return {
        "probes": probes,
        "first_probe_prompt_tokens_computed": (snaps[0].prompt_tokens or 0)
        - (snaps[0].cached_tokens or 0),
        "prompt_tokens_computed_max": max(computed),
        "prompt_tokens_computed_median": statistics.median(computed),
        "completion_tokens_max": max(s.tokens for s in later),
    }


def footprint(work: Path, probes: int) -> dict[str, Any]:
    """The daemon as a process of its own: RSS at start and after `probes` probes, CPU per
    probe; and `mlx-watchdog status` wall time against it."""
    import subprocess

    import psutil

    port = free_port()
    bad = subprocess.Popen(
        [python(), str(ROOT / "tests" / "badserver.py"), "--port", str(port), "--mode", "ok"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert bad.stdout is not None and bad.stdout.readline().strip() == b"ready"
    config = work / "footprint.toml"
    state = work / "footprint-state"
    config.write_text(
        f'[watchdog]\ninterval = "100ms"\nlisten = "127.0.0.1:0"\nstate_dir = "{state}"\n'
        f'[[server]]\nname = "fp"\nurl = "http://127.0.0.1:{port}"\nmatch = "badserver"\n'
    )
    daemon = subprocess.Popen(
        [python(), "-m", "mlx_watchdog", "run", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=(work / "footprint.err").open("wb"),  # a file: a pipe nobody reads fills up
        cwd=ROOT,
    )

    def alive() -> None:
        """A daemon that exited (a config it refuses, say) is said, never waited for."""
        if daemon.poll() is not None:
            err = (work / "footprint.err").read_text(errors="replace")
            raise SystemExit(f"the footprint daemon exited {daemon.returncode}: {err[-500:]}")

    proc = psutil.Process(daemon.pid)
    db = state / "history.db"
    try:
        import sqlite3

        def count() -> int:
            try:
                con = sqlite3.connect(db, timeout=5)
                try:
                    return int(con.execute("SELECT COUNT(*) FROM probes").fetchone()[0])
                finally:
                    con.close()
            except sqlite3.Error:
                return 0

        while count() < 20:
            alive()
            time.sleep(0.2)
        rss_start = proc.memory_info().rss
        cpu_start = sum(proc.cpu_times()[:2])
        n_start = count()
        samples = []
        for _ in range(5):
            t = time.perf_counter()
            subprocess.run(
                [python(), "-m", "mlx_watchdog", "status", "--config", str(config), "--json"],
                capture_output=True,
                check=False,
                cwd=ROOT,
            )
            samples.append(time.perf_counter() - t)
        while count() < n_start + probes:
            alive()
            time.sleep(1.0)
        n_end = count()
        rss_end = proc.memory_info().rss
        cpu = sum(proc.cpu_times()[:2]) - cpu_start
    finally:
        daemon.terminate()
        daemon.wait(30)
        bad.kill()
        bad.wait()
    return {
        "probes": n_end - n_start,
        "rss_start_mib": round(rss_start / 2**20, 1),
        "rss_end_mib": round(rss_end / 2**20, 1),
        "cpu_ms_per_probe": round(1000 * cpu / max(1, n_end - n_start), 2),
        "status_wall_ms_median": round(1000 * statistics.median(samples)),
    }


def table(results: list[Result]) -> str:
    head = (
        "scenario",
        "watcher",
        "detected",
        "detect s",
        "back s",
        "restarts",
        "false",
        "cut off",
        "own abandoned",
    )
    rows = [head]
    for r in results:
        rows.append(
            (
                r.scenario,
                r.watcher,
                "yes" if r.detected else "no",
                "-" if r.detection_s is None else f"{r.detection_s:g}",
                f"> {r.observed_s:g}" if r.back_s is None else f"{r.back_s:g}",
                str(r.restarts),
                str(r.false_restarts),
                str(r.cut_off),
                str(r.own_abandoned),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
        for row in rows
    ]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


OBSERVE = {"abandoned": 30.0, "permanent": 25.0, "patient": 30.0, "crash": 25.0, "steady": 25.0}
# Quick: long enough for mlx-watchdog at k = 20 (a crash waits startup_grace, 6 s, to restart).
QUICK = {"abandoned": 10.0, "permanent": 8.0, "patient": 10.0, "crash": 11.0, "steady": 8.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="k = 20, shorter windows, 300 probes")
    parser.add_argument("--json", help="write every figure to this file")
    parser.add_argument("--only", help="scenarios, comma-separated")
    parser.add_argument("--watchers", help="watchers, comma-separated")
    args = parser.parse_args()
    k = 20.0 if args.quick else 10.0
    windows = QUICK if args.quick else OBSERVE
    scenarios = args.only.split(",") if args.only else list(SCENARIOS)
    watchers = args.watchers.split(",") if args.watchers else list(WATCHERS)
    started = time.time()
    print(f"# mlx-watchdog bench: k = {k:g} (watchers' intervals and thresholds divided by k)")
    print(
        f"# {platform.platform()}, {platform.processor() or platform.machine()}, Python {platform.python_version()}"
    )
    with tempfile.TemporaryDirectory(prefix="mlx-watchdog-bench-") as tmp:
        work = Path(tmp)
        from mlx_watchdog.demo.tinymodel import build_model

        model = build_model(work / "model")
        results = []
        for scenario in scenarios:
            for watcher in watchers:
                r = run_one(scenario, watcher, k, windows[scenario], work, model)
                print(
                    f"  {scenario:9} {watcher:13} {json.dumps(asdict(r))}",
                    file=sys.stderr,
                    flush=True,
                )
                results.append(r)
        cost = probe_cost(model, work, 50)
        fp = footprint(work, 300 if args.quick else 3000)
    print(table(results))
    print(f"\nprobe cost on the real server: {json.dumps(cost)}")
    print(f"daemon footprint: {json.dumps(fp)}")
    print(f"\nran in {time.time() - started:.0f} s")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "k": k,
                    "machine": platform.platform(),
                    "results": [asdict(r) for r in results],
                    "probe_cost": cost,
                    "footprint": fp,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
