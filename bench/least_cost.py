"""Least-cost recovery against always-restart, side by side, on the real mlx_lm.server.

    python bench/least_cost.py [--restart-delay 20] [--json out.json]

The server is serial without a draft model (`--kv-bits 8 --kv-group-size 32`, on the tiny model
built with 2 heads so its KV cache can be quantized), so mlx-lm logs its prefill. Its start is
wrapped to take `--restart-delay` seconds, like a large model loading. An agent's long prompt is
sent once so the server's prompt cache holds it. Then a client abandons a long prompt sized to
be detected at about 80% of its prefill. Each mode runs on a fresh server and daemon:

- least cost (`restart.least_cost = true`): the wedge is waited out when its prefill ends sooner
  than a restart would bring the server back;
- always restart (`least_cost = false`).

Measured for each: the outage (the incident's, from the first unanswered probe to the first
token after), whether the server was restarted, and the agent's prompt sent again afterwards:
its time to first token (cached: about a tenth of a second; after a restart the cache is gone
and the whole prompt is prefilled again). Last, a retry loop: one client sends the same prompt
three times and gives up each time at the same point; the alert text is printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import free_port
from mlx_watchdog.config import parse_config
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.demo.run import long_prompt, send
from mlx_watchdog.demo.tinymodel import build_model
from tests.conftest import DaemonThread, until

WEDGE_AFTER = 4.0
CLIENT_TIMEOUT = 1.0


def server_argv(model: Path, port: int, delay: float) -> list[str]:
    """mlx_lm.server, serial through a quantized KV cache, its start delayed by `delay` s."""
    serve = [
        *("-m", "mlx_lm", "server", "--model", str(model), "--port", str(port)),
        *("--max-tokens", "8", "--kv-bits", "8", "--kv-group-size", "32"),
    ]
    wrapper = (
        "import os, sys, time; time.sleep(float(sys.argv[1])); "
        "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])"
    )
    return [sys.executable, "-c", wrapper, str(delay), *serve]


def config(work: Path, model: Path, port: int, delay: float, least_cost: bool) -> Any:
    hub = work / "hf-hub"
    hub.mkdir(parents=True, exist_ok=True)
    return parse_config(
        {
            "watchdog": {"interval": "1s", "listen": "127.0.0.1:0", "state_dir": str(work)},
            "server": [
                {
                    "name": "bench",
                    "url": f"http://127.0.0.1:{port}",
                    "manager": "process",
                    "command": server_argv(model, port, delay),
                    "env": {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"},
                    "log_file": str(work / "server.log"),
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


def ttft(url: str, prompt: str) -> float:
    """Seconds to the first streamed token of `prompt` (a patient client)."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "stream": True}
    started = time.monotonic()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return time.monotonic() - started
    raise RuntimeError("no token")


def healthy(t: DaemonThread) -> bool:
    w = t.daemon.cycles["bench"]
    return w.verdict is not None and w.verdict.state == "healthy" and w.incident is None


def one_mode(work: Path, model: Path, delay: float, least_cost: bool) -> dict[str, Any]:
    port = free_port()
    cfg = config(work, model, port, delay, least_cost)
    url = cfg.servers[0].url
    t = DaemonThread(Daemon(cfg))
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
        until(lambda: t.daemon.store.incidents(0.0), 60, "the wedge to be detected")
        until(lambda: healthy(t), delay + 180, "serving again")
        (incident,) = t.daemon.store.incidents(0.0)
        after = ttft(url, agent)
        return {
            "mode": "least cost" if least_cost else "always restart",
            "abandoned_prompt_words": words,
            "outage_s": round(incident.outage_s or 0.0, 1),
            "restarted": bool(t.daemon.store.restarts("bench", 0.0)),
            "outcome": incident.outcome,
            "agent_ttft_cached_s": round(cached, 2),
            "agent_ttft_after_s": round(after, 2),
            "lost_cache_s": round(max(0.0, after - cached), 2),
            "until_serving_s": round(time.monotonic() - sent, 1),
        }
    finally:
        t.stop()


def retry_loop(work: Path, model: Path) -> str:
    """One client resends a prompt three times, giving up at the same point: the alert text."""
    port = free_port()
    cfg = config(work, model, port, 0.0, True)
    url = cfg.servers[0].url
    t = DaemonThread(Daemon(cfg))
    try:
        until(lambda: healthy(t), 120, "the server to serve")
        for n in (1, 2, 3):
            send(url, long_prompt(5 + n, words=3000), timeout=3.0)
            until(lambda n=n: len(t.daemon.store.incidents(0.0)) >= n, 60, f"wedge {n}")
            until(lambda: healthy(t), 240, "serving again")
        detected = [e for e in t.daemon.store.events() if e.kind == "detected"]
        return detected[-1].message
    finally:
        t.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restart-delay", type=float, default=20.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = build_model(root / "model", heads=2)
        rows = [
            one_mode(root / mode, model, args.restart_delay, least_cost)
            for mode, least_cost in (("least", True), ("always", False))
        ]
        alert = retry_loop(root / "loop", model)
    for r in rows:
        print(
            f"{r['mode']:>15}: outage {r['outage_s']:5.1f} s, "
            f"{'restarted' if r['restarted'] else 'not restarted'}, "
            f"the agent's cached prompt again: {r['agent_ttft_after_s']:.2f} s "
            f"(cached {r['agent_ttft_cached_s']:.2f} s; lost to the cache {r['lost_cache_s']:.2f} s)"
        )
        print(f"{'':>17}{r['outcome']}")
    print(f"retry loop, the third alert: {alert}")
    if args.json:
        args.json.write_text(json.dumps({"modes": rows, "retry_loop_alert": alert}, indent=2))


if __name__ == "__main__":
    main()
