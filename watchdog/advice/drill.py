"""`mlx-watchdog drill`: reproduce the abandoned-request wedge on purpose, on this server.

One long unique prompt is sent and abandoned mid-prefill, as a client with a short timeout
would; then a tiny request measures how long the server stops answering, while its process and
`/v1/models` are watched. The drill ends only when the server answers again (or, past
`max_wait`, after a restart through the running watchdog), so it leaves the server healthy.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from mlx_watchdog.advice.calibrate import WORDS_PROBE, filler, measure
from mlx_watchdog.config import ServerConfig
from mlx_watchdog.judge.advice import article
from mlx_watchdog.record.left_probes import LeftProbes
from mlx_watchdog.sense.probe import OK, Probe
from mlx_watchdog.sense.process import Inspector
from mlx_watchdog.sense.request import auth_headers
from mlx_watchdog.sense.round import Checker


def plan(server: ServerConfig, prompt_tokens: int, give_up_after: float) -> str:
    return (
        f"The drill sends one unique prompt of about {prompt_tokens} tokens to {server.name} "
        f"({server.url}) and gives up on it after {give_up_after:g} s, like a client whose "
        "timeout is shorter than the prefill. Then it sends a tiny request and measures how "
        "long the server stops answering. Other clients of this server wait meanwhile. It "
        "ends when the server answers again."
    )


@dataclass(frozen=True)
class DrillResult:
    """What a drill measured: how long the wedge it made lasted, and how it ended."""

    server: str
    prompt_tokens: int  # of the abandoned prompt, estimated from the server's count for a probe
    give_up_after_s: float
    baseline_ttft_s: float | None
    stall_s: float | None  # from giving up to the tiny request's first token; None: no answer
    tiny_waited_s: float
    abandoned_seen: int
    cpu_percent_max: float | None
    models_status: int | None  # what /v1/models answered during the stall
    restarted: bool  # the drill asked the watchdog for a restart
    finding: str
    replaced_after_s: float | None = None  # someone else (the daemon) replaced the server then
    served_after_s: float | None = None  # and the replacement served a token this long after

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    def summary(self) -> str:
        if self.replaced_after_s is not None:
            back = (
                f"; it served again {self.served_after_s:.1f} s after the drill gave up"
                if self.served_after_s is not None
                else "; it has not served again yet"
            )
            return (
                f"{self.server} did not answer a tiny request after one client gave up "
                f"mid-prefill, and was restarted (by the watchdog, not the drill) "
                f"{self.replaced_after_s:.1f} s later{back}. The drill asked for no restart."
            )
        if self.stall_s is None:
            return (
                f"{self.server} did not answer a tiny request for {self.tiny_waited_s:.0f} s "
                "after one client gave up mid-prefill"
                + (": the drill restarted it through the watchdog" if self.restarted else "")
            )
        models = (
            f"/v1/models answered {self.models_status} meanwhile; " if self.models_status else ""
        )
        base = f" (it takes {self.baseline_ttft_s:.2f} s when idle)" if self.baseline_ttft_s else ""
        head = (
            f"after one client gave up mid-prefill, {self.server} answered a tiny request "
            f"{self.stall_s:.1f} s later{base}; {models}{self.abandoned_seen} abandoned "
            "connection(s) seen."
        )
        if not self.stalled:
            return f"{head} The abandoned work barely held other requests back here."
        return (
            f"{head} The server finishes the work of a client that left before it serves "
            "others: every client and proxy in front of it needs a timeout longer than its "
            "longest prefill (`mlx-watchdog calibrate` measures it)."
        )

    @property
    def stalled(self) -> bool:
        """Did other requests wait noticeably for the departed client's work?"""
        if self.stall_s is None:
            return True
        return self.stall_s > 2 * max(self.baseline_ttft_s or 0.0, 0.25) + 1.0


def run_drill(
    server: ServerConfig,
    *,
    prompt_tokens: int,
    give_up_after: float,
    max_wait: float,
    restart: Callable[[str], bool] = lambda _: False,
    say: Callable[[str], None] = lambda _: None,
    left: LeftProbes | None = None,
    mono: Callable[[], float] = time.monotonic,
) -> DrillResult:
    baseline = Probe(server, mono=mono).run()  # the watchdog's own tiny probe, idle
    warm = measure(server, filler(WORDS_PROBE, secrets.token_hex(8)), 1, 120.0)
    per_word = (warm.prompt_tokens or WORDS_PROBE) / WORDS_PROBE
    words = max(1, int(prompt_tokens / per_word))
    text = filler(words, secrets.token_hex(8))
    say(
        f"sending {article(str(prompt_tokens))} {prompt_tokens}-token prompt and giving up after {give_up_after:g} s"
    )
    _abandon(server, text, give_up_after)
    gave_up = mono()
    settings = replace(server.probe, hard_timeout=max_wait, max_busy=max(max_wait, 1.0))
    checker = Checker(
        replace(server, probe=settings), left=left, mono=mono, short_lived=left is not None
    )
    before = checker.inspector.sample().pid
    tiny = checker.start()
    models_status = checker.models.status if checker.models else None
    say("a tiny request waits for its first token ...")
    abandoned, cpu_max = _watch(checker, tiny, gave_up + max_wait, mono)
    snap = tiny.snapshot()
    answered = snap.finding == OK and snap.first_token_at is not None
    restarted = False
    replaced_after = served_after = None
    now_pid = Inspector(server, mono=mono).sample().pid  # a fresh look: the listener now
    if not answered and before is not None and now_pid != before:
        # A running daemon restarted it meanwhile: say so, and never ask for a second one.
        replaced_after = mono() - gave_up
        became = f"PID {before} -> {now_pid}" if now_pid is not None else f"PID {before} is gone"
        say(f"the server was restarted meanwhile ({became}); waiting for it")
        served_after = _served_again(server, settings, gave_up + max_wait, mono)
        served_after = None if served_after is None else served_after - gave_up
    elif not answered and mono() - gave_up >= max_wait:
        tiny.abort()
        say(f"no answer within {max_wait:g} s; asking the watchdog to restart the server")
        restarted = restart(server.name)
    return DrillResult(
        server=server.name,
        prompt_tokens=int(words * per_word),
        give_up_after_s=give_up_after,
        baseline_ttft_s=round(baseline.ttft, 3) if baseline.ttft else None,
        stall_s=round(snap.first_token_at - gave_up, 2)
        if answered and snap.first_token_at
        else None,
        tiny_waited_s=round(mono() - gave_up, 2),
        abandoned_seen=abandoned,
        cpu_percent_max=cpu_max,
        models_status=models_status,
        restarted=restarted,
        finding=snap.finding or "waiting",
        replaced_after_s=None if replaced_after is None else round(replaced_after, 2),
        served_after_s=None if served_after is None else round(served_after, 2),
    )


def _watch(
    checker: Checker, tiny: Probe, until: float, mono: Callable[[], float]
) -> tuple[int, float | None]:
    """While the tiny request waits: the most abandoned connections and CPU seen."""
    abandoned, cpu_max = 0, None
    while not tiny.wait(0.5):
        ev = checker.observe(None).process
        abandoned = max(abandoned, ev.abandoned or 0)
        if ev.cpu_percent is not None:
            cpu_max = max(cpu_max or 0.0, ev.cpu_percent)
        if mono() > until:
            break
    return abandoned, cpu_max


def _served_again(
    server: ServerConfig, settings: Any, until: float, mono: Callable[[], float]
) -> float | None:
    """When a tiny request to a server being restarted gets its first token; None by `until`.
    Refused or reset while the new process starts: asked again."""
    while mono() < until:
        left = until - mono()
        snap = Probe(replace(server, probe=replace(settings, hard_timeout=left)), mono=mono).run()
        if snap.finding == OK and snap.first_token_at is not None:
            return snap.first_token_at
        time.sleep(0.5)
    return None


def _abandon(server: ServerConfig, text: str, timeout: float) -> None:
    body: dict[str, Any] = {"messages": [{"role": "user", "content": text}], "max_tokens": 8}
    if server.model:
        body["model"] = server.model
    try:
        httpx.post(
            server.url + "/v1/chat/completions",
            json=body,
            headers=auth_headers(server),
            timeout=timeout,
        )
    except httpx.HTTPError:
        return  # giving up is the point; a refused or reset request abandons nothing more


def restart_through_daemon(state_dir: Path) -> Callable[[str], bool]:
    def restart(name: str) -> bool:
        from mlx_watchdog.serve.client import ActionRefused, DaemonNotRunning, act

        try:
            act(state_dir, name, "restart")
        except (DaemonNotRunning, ActionRefused):
            return False
        return True

    return restart
