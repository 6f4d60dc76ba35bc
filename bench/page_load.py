"""The status page under load: does asking for it delay the probing?

    python bench/page_load.py [--quick] [--servers 20] [--clients 8] [--seconds 60]

A watchdog (its own process, as installed) watches `--servers` servers at a 1 s interval (one
misbehaving server process of the tests answers them all, each under its own name), with a
history of a flapping day for each (a probe every 10 s for 24 hours, healthy and slow in turn,
a wedge among them). `--clients` clients reload its page as fast as it answers, for
`--seconds`. Measured: the gaps between each server's successive probes while they do (the
interval is 1 s: a gap is the probing delayed), the page's size and answer times, and the
watchdog's CPU per probe. `--quick` (CI's smoke run): 10 s.
"""

from __future__ import annotations

import argparse
import collections
import json
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.harness import free_port, python  # noqa: E402
from mlx_watchdog.record.store import Store  # noqa: E402

FLAP_EVERY = 10.0  # s between two probes of the seeded day


def seed(db: Path, names: list[str], now: float) -> None:
    """A flapping day for each server, written as the watchdog writes its history."""
    Store(db).close()  # the schema, made by the watchdog's own code
    con = sqlite3.connect(db)
    rows = []
    for name in names:
        for k in range(int(86400 / FLAP_EVERY)):
            at = now - 86400 + k * FLAP_EVERY
            state = "wedged" if k == 4000 else ("healthy", "slow")[k % 2]
            ttft = None if state == "wedged" else 0.1 + (k % 5)
            rows.append((name, at, state, f"{state}: seeded", ttft, None, "{}"))
    with con:
        con.executemany(
            "INSERT INTO probes (server, at, state, reason, ttft_s, waited_s, evidence) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            rows,
        )
    con.close()


def gaps(db: Path, since: float, until: float) -> list[float]:
    con = sqlite3.connect(db, timeout=10)
    try:
        rows = con.execute(
            "SELECT server, at FROM probes WHERE at >= ? AND at <= ? ORDER BY server, at",
            (since, until),
        ).fetchall()
    finally:
        con.close()
    out, last = [], {}
    for server, at in rows:
        if server in last:
            out.append(at - last[server])
        last[server] = at
    return out


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(servers: int, clients: int, seconds: float) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="page-load-"))
    port = free_port()
    bad = subprocess.Popen(
        [python(), str(ROOT / "tests" / "badserver.py"), "--port", str(port), "--mode", "ok"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    assert bad.stdout is not None and bad.stdout.readline().strip() == b"ready"
    names = [f"s{i:02d}" for i in range(servers)]
    state = work / "state"
    state.mkdir(mode=0o700)
    seed(state / "history.db", names, time.time())
    listen = free_port()
    config = work / "w.toml"
    config.write_text(
        f'[watchdog]\ninterval = "1s"\nlisten = "127.0.0.1:{listen}"\nstate_dir = "{state}"\n'
        + "".join(
            f'[[server]]\nname = "{n}"\nurl = "http://127.0.0.1:{port}"\nmatch = "badserver"\n'
            for n in names
        )
    )
    err = (work / "daemon.err").open("wb")
    daemon = subprocess.Popen(
        [python(), "-m", "mlx_watchdog", "run", "--config", str(config)],
        stdout=subprocess.DEVNULL,
        stderr=err,
        cwd=ROOT,
    )
    url = f"http://127.0.0.1:{listen}/"
    try:
        deadline = time.monotonic() + 60
        while True:
            if daemon.poll() is not None:
                raise SystemExit(f"the watchdog exited {daemon.returncode}")
            try:
                if httpx.get(url, timeout=30).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("the watchdog's page never answered")
            time.sleep(0.5)
        time.sleep(3.0)  # every server probed a few times
        proc = psutil.Process(daemon.pid)
        cpu0 = sum(proc.cpu_times()[:2])
        began = time.time()
        stop = time.monotonic() + seconds
        answers: list[float] = []
        sizes: list[int] = []
        failed: list[str] = []

        def reload() -> None:
            with httpx.Client(timeout=60) as client:
                while time.monotonic() < stop:
                    t = time.perf_counter()
                    try:
                        r = client.get(url)
                    except httpx.HTTPError as exc:
                        failed.append(type(exc).__name__)
                        continue
                    answers.append(time.perf_counter() - t)
                    sizes.append(len(r.content))

        askers = [threading.Thread(target=reload) for _ in range(clients)]
        for a in askers:
            a.start()
        for a in askers:
            a.join()
        time.sleep(max(0.0, stop - time.monotonic()))  # with no clients: the probing alone
        ended = time.time()
        cpu = sum(proc.cpu_times()[:2]) - cpu0
        if daemon.poll() is not None:
            raise SystemExit(f"the watchdog exited {daemon.returncode} under the load")
        time.sleep(1.5)  # the last probes written
        seen = gaps(state / "history.db", began, ended)
    finally:
        daemon.terminate()
        daemon.wait(30)
        bad.kill()
        bad.wait()
    probes = len(seen) + servers
    return {
        "servers": servers,
        "clients": clients,
        "seconds": seconds,
        "pages": len(answers),
        "pages_failed": len(failed),
        "pages_failed_by": dict(collections.Counter(failed)),
        "page_kb": round(statistics.median(sizes) / 1000) if sizes else None,
        "page_s_p50": round(statistics.median(answers), 3) if answers else None,
        "page_s_p99": round(pct(answers, 0.99), 3) if answers else None,
        "probes": probes,
        "probe_gap_s_p50": round(statistics.median(seen), 3),
        "probe_gap_s_p99": round(pct(seen, 0.99), 3),
        "probe_gap_s_max": round(max(seen), 3),
        "cpu_ms_per_probe": round(1000 * cpu / max(1, probes), 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="10 s of reloading (CI)")
    parser.add_argument("--servers", type=int, default=20)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=60.0)
    args = parser.parse_args()
    seconds = 10.0 if args.quick else args.seconds
    print(json.dumps(run(args.servers, args.clients, seconds)))


if __name__ == "__main__":
    main()
