"""Least-cost recovery against always-restart, side by side, on the real mlx_lm.server.

    python bench/least_cost.py [--restart-delay 20] [--quick] [--json out.json]

The server is serial without a draft model (`--kv-bits 8 --kv-group-size 32`, on the tiny model
built with 2 heads so its KV cache can be quantized), so mlx-lm logs its prefill. Its start is
wrapped to take `--restart-delay` seconds, like a large model loading. An agent's long prompt is
sent once so the server's prompt cache holds it. Then a client abandons a long prompt sized to
be detected at about 80% of its prefill. Each mode runs on a fresh server and daemon:

- least cost (`restart.least_cost = true`): the wedge is waited out when its prefill ends sooner
  than a restart would bring the server back;
- always restart (`least_cost = false`).

Each mode runs three cases, as the field brings them:

- lab: the abandoned prompt alone, the config naming the server's log;
- impatient: a client polls behind it (a tiny request each second, a 5 s timeout, as a load
  balancer's health check): it gives up behind the wedge, one more victim;
- default: the same, with the config a user writes (no `log_file`: the watchdog's own log of
  the server it runs is read).

And a cancel-capable server (the tests' misbehaving server, shaped as vllm-mlx) with a live
client queued behind an abandoned request.

Measured for each: the outage (the incident's, from the first unanswered probe to the first
token after), whether the server was restarted, the polling client's requests served and given
up, the live client's outcome, and the agent's prompt sent again afterwards: its time to first
token (cached: about a tenth of a second; after a restart the cache is gone and the whole
prompt is prefilled again). Last, a retry loop: one client sends the same prompt three times
and gives up each time at the same point; the alert text is printed. `--quick` runs the
impatient case and the cancel case only, with a short restart delay (CI's smoke run).

First, the seed's loop (`seed_case`): an agent whose deadline (10 s; 5 s with `--quick`) is
shorter than its prompt's whole prefill (sized to about 1.8 deadlines on the server alone)
resends the identical prompt each time it gives up, up to six attempts. On each way of serving
(serial `--draft-model`, no progress lines: the seed's; serial `--kv-bits`, which logs its
prefill; batched), with the config a user writes (no `log_file`): the server alone, with the
watchdog, and with `least_cost = false` (always restart) as the peer. Measured: the attempt that
was served and when, and the restarts. `--only-seed` runs these alone (`--quick`: serial
`--draft-model`, alone and with the watchdog).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import free_port, tiny_request
from mlx_watchdog.config import parse_config
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.demo.run import long_prompt, send
from mlx_watchdog.demo.tinymodel import build_model
from tests.conftest import DaemonThread, ttft, until

WEDGE_AFTER = 4.0
CLIENT_TIMEOUT = 1.0


SERVING = {
    "serial --kv-bits": ("--kv-bits", "8", "--kv-group-size", "32"),  # serial, logs its prefill
    "serial --draft-model": ("--draft-model", "{model}"),  # serial, no progress lines (the seed's)
    "batched": (),
}


def server_argv(
    model: Path, port: int, delay: float, serving: str = "serial --kv-bits"
) -> list[str]:
    """mlx_lm.server (serial through a quantized KV cache unless `serving` says otherwise), its
    start delayed by `delay` s."""
    how = [a.format(model=model) for a in SERVING[serving]]
    serve = [
        *("-m", "mlx_lm", "server", "--model", str(model), "--port", str(port)),
        *("--max-tokens", "8", *how),
    ]
    wrapper = (
        "import os, sys, time; time.sleep(float(sys.argv[1])); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
    )
    return [sys.executable, "-c", wrapper, str(delay), *serve]


def config(
    work: Path,
    model: Path,
    port: int,
    delay: float,
    least_cost: bool,
    *,
    log: bool = True,
    serving: str = "serial --kv-bits",
) -> Any:
    hub = work / "hf-hub"
    hub.mkdir(parents=True, exist_ok=True)
    named = {"log_file": str(work / "server.log")} if log else {}
    return parse_config(
        {
            "watchdog": {"interval": "1s", "listen": "127.0.0.1:0", "state_dir": str(work)},
            "server": [
                {
                    "name": "bench",
                    "url": f"http://127.0.0.1:{port}",
                    "manager": "process",
                    "command": server_argv(model, port, delay, serving),
                    "env": {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"},
                    **named,
                    "probe": {
                        "slow_after": "2s",
                        "wedge_after": f"{WEDGE_AFTER:g}s",
                        "max_busy": "5m",
                        "startup_grace": f"{delay + 90:g}s",
                        "hard_timeout": "10m",
                    },
                    "restart": {"max_restarts": 5, "backoff": "1s", "least_cost": least_cost},
                }
            ],
        }
    )


def healthy(t: DaemonThread) -> bool:
    w = t.daemon.cycles["bench"]
    return w.verdict is not None and w.verdict.state == "healthy" and w.incident is None


class Poller:
    """A client that sends a tiny request each second with a 5 s timeout, behind the wedge."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.outcomes: list[str] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.outcomes.append(send(self.url, "ping", timeout=5.0))
            self.stop.wait(1.0)

    def start(self) -> Poller:
        self.thread.start()
        return self

    def end(self) -> dict[str, int]:
        self.stop.set()
        self.thread.join(30)
        return {o: self.outcomes.count(o) for o in ("served", "gave up", "error")}


def one_mode(
    work: Path, model: Path, delay: float, least_cost: bool, case: str = "lab"
) -> dict[str, Any]:
    port = free_port()
    cfg = config(work, model, port, delay, least_cost, log=case != "default")
    url = cfg.servers[0].url
    t = DaemonThread(Daemon(cfg).open())
    try:
        until(lambda: healthy(t), delay + 120, "the server to serve")
        agent = long_prompt(7, words=1500)
        first = ttft(url, agent)  # fills the prompt cache
        cached = ttft(url, agent)
        rate = 1500 * 3 / first  # the tiny tokenizer: about 3 tokens a word
        # Detected about WEDGE_AFTER + half an interval after the send: 80% of its prefill.
        words = int((WEDGE_AFTER + 0.5) / 0.8 * rate / 3)
        sent = time.monotonic()
        assert send(url, long_prompt(99, words=words), timeout=CLIENT_TIMEOUT) == "gave up"
        poller = Poller(url).start() if case != "lab" else None
        until(lambda: t.daemon.store.incidents(0.0), 60, "the wedge to be detected")
        until(lambda: healthy(t), delay + 180, "serving again")
        polled = poller.end() if poller is not None else {}
        (incident,) = t.daemon.store.incidents(0.0)
        after = ttft(url, agent)
        return {
            "case": case,
            "mode": "least cost" if least_cost else "always restart",
            "abandoned_prompt_words": words,
            "outage_s": round(incident.outage_s or 0.0, 1),
            "restarted": bool(t.daemon.store.restarts("bench", 0.0)),
            "restart_s": delay,
            "outcome": incident.outcome,
            "poller": polled,
            "agent_ttft_cached_s": round(cached, 2),
            "agent_ttft_after_s": round(after, 2),
            "lost_cache_s": round(max(0.0, after - cached), 2),
            "until_serving_s": round(time.monotonic() - sent, 1),
        }
    finally:
        t.stop()


def cancel_case(work: Path, least_cost: bool) -> dict[str, Any]:
    """A vllm-mlx-shaped server (cancel by id): an abandoned long request, a poller, and a live
    client queued behind it; its restart takes 5 s (a wrapped start)."""
    port = free_port()
    script = Path(__file__).resolve().parent.parent / "tests" / "badserver.py"
    wrapper = (
        "import os, sys, time; time.sleep(5); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[1:]])"
    )
    server = {
        "name": "bench",
        "url": f"http://127.0.0.1:{port}",
        "kind": "vllm-mlx",
        "match": "badserver",
        "manager": "process",
        "command": [
            sys.executable,
            "-c",
            wrapper,
            str(script),
            "--port",
            str(port),
            "--mode",
            "cancellable",
            "--kind",
            "vllm-mlx",
        ],
        "probe": {"slow_after": "1s", "wedge_after": "3s", "startup_grace": "60s"},
        "restart": {"max_restarts": 5, "backoff": "1s", "least_cost": least_cost},
    }
    doc = {"watchdog": {"interval": "500ms", "listen": "127.0.0.1:0", "state_dir": str(work)}}
    t = DaemonThread(Daemon(parse_config({**doc, "server": [server]})).open())
    url = server["url"]
    try:
        until(lambda: healthy(t), 60, "the server to serve")
        # The client waited 2 s before it gave up (its timeout); those who come after it are
        # younger than its request by that much, as in the field (where it is minutes).
        assert send(str(url), "word " * 8000, timeout=2.0) == "gave up"
        poller = Poller(str(url)).start()
        time.sleep(0.5)  # the live client comes after the abandoned request, and waits
        live: list[str] = []
        client = threading.Thread(target=lambda: live.append(send(str(url), "hi", timeout=120)))
        client.start()
        until(lambda: t.daemon.store.incidents(0.0), 60, "the wedge to be detected")
        until(lambda: healthy(t), 120, "serving again")
        client.join(120)
        polled = poller.end()
        (incident,) = t.daemon.store.incidents(0.0)
        return {
            "case": "cancel, a live client queued",
            "mode": "least cost" if least_cost else "always restart",
            "outage_s": round(incident.outage_s or 0.0, 1),
            "restarted": bool(t.daemon.store.restarts("bench", 0.0)),
            "restart_s": 5.0,
            "outcome": incident.outcome,
            "poller": polled,
            "live_client": live[0] if live else "no answer",
        }
    finally:
        t.stop()


def retry_loop(work: Path, model: Path) -> str:
    """One client resends a prompt three times, giving up at the same point: the alert text."""
    port = free_port()
    cfg = config(work, model, port, 0.0, True)
    url = cfg.servers[0].url
    t = DaemonThread(Daemon(cfg).open())
    try:
        until(lambda: healthy(t), 120, "the server to serve")
        # About 27k tokens: seconds of prefill left when its client gives up at 3 s, on a fast
        # machine too (9k tokens ended within 3.6 s here: no wedge to see).
        for n in (1, 2, 3):
            send(url, long_prompt(5 + n, words=9000), timeout=3.0)
            until(lambda n=n: len(t.daemon.store.incidents(0.0)) >= n, 60, f"wedge {n}")
            until(lambda: healthy(t), 240, "serving again")
        detected = [e for e in t.daemon.store.events() if e.kind == "detected"]
        return detected[-1].message
    finally:
        t.stop()


class Agent:
    """An agent as the seed's: it sends one prompt with a deadline shorter than its prefill and,
    each time it gives up, sends the same prompt again at once, `attempts` times; a refused or
    reset connection (a restart) is tried again a second later, within `patience` s, and is no
    attempt of its own."""

    def __init__(
        self, url: str, prompt: str, deadline: float, attempts: int, patience: float = 180.0
    ) -> None:
        self.url, self.prompt, self.deadline, self.attempts = url, prompt, deadline, attempts
        self.patience = patience
        self.outcomes: list[str] = []
        self.served_after: float | None = None

    def run(self) -> Agent:
        began = time.monotonic()
        while self.outcomes.count("gave up") < self.attempts:
            outcome = send(self.url, self.prompt, timeout=self.deadline)
            self.outcomes.append(outcome)
            if outcome == "served":
                self.served_after = round(time.monotonic() - began, 1)
                break
            if outcome == "error":  # refused or reset: the server is restarting
                if time.monotonic() - began > self.patience:
                    break
                time.sleep(1.0)
        return self


def seed_words(url: str, prefill_s: float) -> int:
    """The words of a prompt whose whole prefill takes about `prefill_s` on this server: the
    rate is read from two prompts, and its fall with length extrapolated."""
    small, large = 1000, 3000
    t_small = ttft(url, long_prompt(3, words=small))
    t_large = ttft(url, long_prompt(4, words=large))
    # Time grows with the square of the length here (attention): t = a*w + b*w^2.
    b = max(0.0, (t_large / large - t_small / small) / (large - small))
    a = max(1e-6, t_small / small - b * small)
    if b == 0.0:
        return int(prefill_s / a)
    return int((-a + (a * a + 4 * b * prefill_s) ** 0.5) / (2 * b))


def seed_case(
    work: Path, model: Path, delay: float, serving: str, mode: str, deadline: float, words: int
) -> dict[str, Any]:
    """The seed's loop: an agent whose deadline is shorter than its prompt's prefill resends
    the identical prompt each time it gives up. `mode`: "alone" (the server and no watchdog),
    "least cost" or "always restart"; the config has no `log_file` (the watchdog's own log of
    the server it runs: nothing to read under --draft-model)."""
    port = free_port()
    cfg = config(work, model, port, delay, mode == "least cost", log=False, serving=serving)
    url = cfg.servers[0].url
    server = cfg.servers[0]
    t: DaemonThread | None = None
    proc: subprocess.Popen[bytes] | None = None
    try:
        if mode == "alone":
            env = {**os.environ, **dict(server.env)}
            proc = subprocess.Popen(
                list(server.command),
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            until(lambda: tiny_request(url, 5.0), delay + 120, "the server to serve")
        else:
            t = DaemonThread(Daemon(cfg).open())
            until(lambda: healthy(t), delay + 120, "the server to serve")
        if words == 0:
            words = seed_words(url, deadline * 1.8)
        agent = Agent(url, long_prompt(42, words=words), deadline, attempts=6).run()
        restarts = len(t.daemon.store.restarts("bench", 0.0)) if t is not None else 0
        said = ""
        if t is not None:
            shown = [e for e in t.daemon.store.events() if e.kind in ("clearing", "restarting")]
            said = shown[0].message if shown else ""
        return {
            "case": f"seed loop, {serving}",
            "mode": mode,
            "words": words,
            "deadline_s": deadline,
            "attempts": agent.outcomes,
            "served_after_s": agent.served_after,
            "restarted": restarts,
            "said": said,
        }
    finally:
        if t is not None:
            t.stop()
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def show_seed(r: dict[str, Any]) -> None:
    tries = r["attempts"].count("gave up") + 1
    errors = r["attempts"].count("error")
    refused = f" ({errors} refused or reset)" if errors else ""
    served = (
        f"served at attempt {tries}{refused}, {r['served_after_s']:.1f} s after the first send"
        if r["served_after_s"] is not None
        else f"never served: gave up {tries - 1} times{refused}"
    )
    print(
        f"{r['case']:>34} {r['mode']:>15}: {served}; restarts {r['restarted']} "
        f"({r['words']} words, deadline {r['deadline_s']:g} s)",
        flush=True,
    )
    if r["said"]:
        print(f"{'':>36}{r['said']}", flush=True)


def show(r: dict[str, Any]) -> None:
    polled = r["poller"]
    print(
        f"{r['case']:>28} {r['mode']:>15}: outage {r['outage_s']:5.1f} s, "
        f"{'restarted' if r['restarted'] else 'not restarted'} (a restart: {r['restart_s']:g} s)"
        + (
            f", the poller: {polled.get('served', 0)} served, {polled.get('gave up', 0)} gave up"
            if polled
            else ""
        )
        + (f", the live client: {r['live_client']}" if "live_client" in r else "")
        + (
            f", the agent's cached prompt again: {r['agent_ttft_after_s']:.2f} s "
            f"(cached {r['agent_ttft_cached_s']:.2f} s)"
            if "agent_ttft_after_s" in r
            else ""
        ),
        flush=True,
    )
    print(f"{'':>30}{r['outcome']}", flush=True)


def seed_loops(
    root: Path, model: Path, delay: float, quick: bool, only: tuple[str, ...] = ()
) -> list[dict[str, Any]]:
    """The seed's loop on each way of serving, with and without the watchdog: the prompt is
    sized once per way (on the server alone), so every mode sends the same prompt."""
    deadline = 5.0 if quick else 10.0
    servings = only or (("serial --draft-model",) if quick else tuple(SERVING))
    modes = ("alone", "least cost") if quick else ("alone", "least cost", "always restart")
    rows: list[dict[str, Any]] = []
    for serving in servings:
        words = 0
        for mode in modes:
            work = root / f"seed-{serving.split()[-1].strip('-')}-{mode.split()[0]}"
            rows.append(seed_case(work, model, delay, serving, mode, deadline, words))
            words = rows[-1]["words"]
            show_seed(rows[-1])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restart-delay", type=float, default=20.0)
    parser.add_argument("--quick", action="store_true", help="few cases, a 5 s restart")
    parser.add_argument("--only-seed", action="store_true", help="the seed's loop cases only")
    parser.add_argument("--no-seed", action="store_true", help="leave the seed's loop out")
    parser.add_argument(
        "--serving", action="append", choices=tuple(SERVING), help="the seed's loop on these"
    )
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    delay = 5.0 if args.quick else args.restart_delay
    cases = ("impatient",) if args.quick else ("lab", "impatient", "default")
    rows: list[dict[str, Any]] = []
    alert = None
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_model(root / "model", heads=2)
        seeds = (
            []
            if args.no_seed
            else seed_loops(root, model, delay, args.quick, tuple(args.serving or ()))
        )
        if not args.only_seed:
            for case in cases:
                for mode, least_cost in (("least", True), ("always", False)):
                    rows.append(one_mode(root / f"{case}-{mode}", model, delay, least_cost, case))
                    show(rows[-1])
            for mode, least_cost in (("least", True), ("always", False)):
                rows.append(cancel_case(root / f"cancel-{mode}", least_cost))
                show(rows[-1])
            if not args.quick:
                alert = retry_loop(root / "loop", model)
    if alert is not None:
        print(f"retry loop, the third alert: {alert}")
    if args.json:
        doc = {"modes": rows, "seed_loops": seeds, "retry_loop_alert": alert}
        args.json.write_text(json.dumps(doc, indent=2))


if __name__ == "__main__":
    main()
