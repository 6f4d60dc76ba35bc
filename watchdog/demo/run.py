"""`mlx-watchdog demo`: the whole story on a real mlx_lm.server, in about a minute.

It builds the tiny model, runs the real server (serial, as in the field) under the `process`
manager, and plays a client whose timeout is shorter than a long prefill: the server is wedged
by abandoned work, the daemon sees it, restarts it once and verifies a token comes back.
Everything lives in a temporary folder; the user's config and history are never touched.
"""

from __future__ import annotations

import importlib
import logging
import random
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx

from mlx_watchdog.config import Config, parse_config
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.judge.states import State
from mlx_watchdog.record.store import Incident

SERVER_EXTRA = 'pip install "mlx-watchdog[server]"'
_WORDS = (
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "lazy",
    "dog",
    "watchdog",
    "probes",
    "server",
    "tiny",
    "prompt",
)


def missing_server_extra(needs: str = "the demo runs") -> str | None:
    """What to install for `needs` (what runs the real server) to work, or None when
    everything is there."""
    for module in ("mlx.core", "mlx_lm", "tokenizers"):
        try:
            importlib.import_module(module)
        except ImportError as exc:
            return (
                f"{needs} the real mlx_lm.server, and {module} cannot be imported ({exc}); "
                f"install the server extra into this environment: {SERVER_EXTRA}"
            )
    return None


def long_prompt(seed: int, words: int = 3000) -> str:
    """About 3 tokens a word for the tiny tokenizer, unique per seed so no prompt cache helps."""
    rnd = random.Random(seed)
    return " ".join(rnd.choice(_WORDS) + str(rnd.randint(0, 99)) for _ in range(words))


def send(url: str, prompt: str, timeout: float) -> str:
    """A non-streaming chat request: "served", "gave up" when the client timeout hit, or
    "error" (refused, reset: the server went away)."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
    try:
        httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
    except httpx.TimeoutException:
        return "gave up"
    except httpx.HTTPError:
        return "error"
    return "served"


def server_command(model: Path, port: int, *, serial: bool = True) -> list[str]:
    """The real mlx_lm.server on the tiny model, as the demo and the tests start it.

    serial: --draft-model, which makes the server strictly serial (speculative decoding
    disables batching), as in the field.
    """
    argv = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), "--port", str(port)]
    return [*argv, "--max-tokens", "16", *(["--draft-model", str(model)] if serial else [])]


def demo_config(workdir: Path, model: Path, port: int) -> Config:
    hub_cache = workdir / "hf-hub-cache"
    hub_cache.mkdir(parents=True, exist_ok=True)  # an absent cache makes /v1/models answer empty
    return parse_config(
        {
            "watchdog": {
                "interval": "1s",
                "listen": "127.0.0.1:0",
                "state_dir": str(workdir / "state"),
            },
            "server": [
                {
                    "name": "demo",
                    "url": f"http://127.0.0.1:{port}",
                    "manager": "process",
                    "command": server_command(model, port),
                    "env": {"HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1"},
                    "log_file": str(workdir / "server.log"),
                    "probe": {
                        "slow_after": "2s",
                        "wedge_after": "5s",
                        "startup_grace": "2m",
                    },
                    "restart": {"max_restarts": 2, "window": "1h", "backoff": "5s"},
                }
            ],
        }
    )


@dataclass(frozen=True)
class DemoResult:
    """How the demo went: recovered or not, the incident, and how soon it was seen."""

    recovered: bool
    incident: Incident | None
    restarts: int
    detected_after_s: float | None  # from the moment the clients gave up to the verdict
    message: str


def run_demo(
    workdir: Path,
    port: int,
    *,
    say: Callable[[str], None],
    clients: int = 2,
    give_up_after: float = 2.0,
    timeout: float = 300.0,
) -> DemoResult:
    from mlx_watchdog.demo.tinymodel import build_model

    say(f"building a tiny random-weight model in {workdir / 'model'}")
    model = build_model(workdir / "model")
    config = demo_config(workdir, model, port)
    server = config.servers[0]
    say(
        f"starting the real mlx_lm.server (serial: --draft-model) on {server.url} under the "
        f"watchdog; probing every {config.watchdog.interval:g}s, wedge_after "
        f"{server.probe.wedge_after:g}s"
    )
    daemon = Daemon(config).open()
    runner = threading.Thread(target=lambda: daemon.run(install_signals=False), daemon=True)
    runner.start()
    deadline = time.monotonic() + timeout
    try:
        if not _until(lambda: _state(daemon) == State.HEALTHY, deadline):
            return _result(daemon, None, f"the server did not serve within {timeout:g}s")
        say(
            f"{clients} clients send long unique prompts (~9k tokens each) and give up after "
            f"{give_up_after:g}s, like a load balancer with a timeout shorter than the prefill"
        )
        abandoned_at = time.time()
        senders = [
            threading.Thread(
                target=send,
                args=(server.url, long_prompt(int(abandoned_at) + i), give_up_after),
                daemon=True,
            )
            for i in range(clients)
        ]
        for s in senders:
            s.start()
        closed = _until(
            lambda: any(i.closed_at for i in daemon.store.incidents(abandoned_at)), deadline
        )
        gave_up_at = abandoned_at + give_up_after
        if not closed:
            return _result(daemon, gave_up_at, f"no recovery within {timeout:g}s")
        return _result(daemon, gave_up_at, "recovered")
    finally:
        daemon.stop()
        runner.join(60)


def _state(daemon: Daemon) -> str | None:
    v = daemon.cycles["demo"].verdict
    return v.state if v else None


def _until(check: Callable[[], object], deadline: float) -> bool:
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.2)
    return False


def _result(daemon: Daemon, since: float | None, message: str) -> DemoResult:
    incidents = daemon.store.incidents(since) if since is not None else []
    incident = incidents[0] if incidents else None
    restarts = daemon.store.restarts("demo", since) if since is not None else []
    return DemoResult(
        recovered=incident is not None and incident.closed_at is not None,
        incident=incident,
        restarts=len(restarts),
        detected_after_s=None if incident is None or since is None else incident.opened_at - since,
        message=message,
    )


class SayHandler(logging.Handler):
    """Passes the watchdog's log lines to the demo's narration."""

    def __init__(self, say: Callable[[str], None]) -> None:
        super().__init__(logging.INFO)
        self.say = say

    def emit(self, record: logging.LogRecord) -> None:
        self.say(record.getMessage())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
