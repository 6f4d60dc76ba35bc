"""How fast this server prefills and decodes, and so how long every client layer must wait.

The lasting fix for the abandoned-request wedge is that nobody gives up before a long prefill
can finish. Calibration sends prompts of growing size, each with a unique prefix so the prompt
cache cannot help, measures the time to the first token (the prefill), fits how that time grows
with the prompt (attention makes it grow faster than linearly), and turns the prediction for the
largest prompt the clients send into a timeout for each layer.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from mlx_watchdog.act.check import check_once
from mlx_watchdog.config import ServerConfig
from mlx_watchdog.judge.advice import MARGIN, article, round_up
from mlx_watchdog.judge.states import State
from mlx_watchdog.record.left_probes import LeftProbes
from mlx_watchdog.record.store import Store
from mlx_watchdog.sense.findings import Address
from mlx_watchdog.sense.own_connections import ANSWERED_GRACE
from mlx_watchdog.sense.probe import OK, Probe, ProbeSnapshot

WORDS_PROBE = 300
DECODE_TOKENS = 128
DECODE_PAIRS = 3
_FILLER = ("alpha", "beta", "gamma", "delta", "river", "stone", "light", "window", "paper", "cloud")


class CalibrationError(Exception):
    """Calibration could not measure; the message says what the server answered."""


class CalibrationInterrupted(CalibrationError):
    """A person stopped the run mid-prompt; the message says what the server still does."""


def parse_tokens(value: str, where: str) -> int:
    """`"64k"`, `"4096"`, `"1.5k"` -> a token count."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kK]?)", value.strip())
    if match is None or float(match.group(1)) <= 0:
        raise ValueError(f'{where} = "{value}" is not a token count; write it like "4096" or "64k"')
    return int(float(match.group(1)) * (1024 if match.group(2) else 1))


@dataclass(frozen=True)
class Point:
    """One measured prompt: its size, its prefill time, and what the server took from cache."""

    prompt_tokens: int
    prefill_s: float
    cached_tokens: int | None = None
    prompt_bytes: int | None = None  # the request body's size: how bytes on a socket read as tokens


@dataclass(frozen=True)
class Fit:
    """prefill_s(n) = a + b*n + c*n^2, with b, c >= 0."""

    a: float
    b: float
    c: float

    def prefill_s(self, tokens: int) -> float:
        return max(0.0, self.a + self.b * tokens + self.c * tokens * tokens)


def fit(points: Sequence[Point]) -> Fit:
    """Least squares; a quadratic when the points bend upwards, a line otherwise."""
    if len(points) < 2:
        raise CalibrationError("at least two prompt sizes are needed to fit a curve")
    xs = [float(p.prompt_tokens) for p in points]
    ys = [p.prefill_s for p in points]
    if len(points) >= 3:
        a, b, c = _lstsq([[1.0, x, x * x] for x in xs], ys)
        if c >= 0 and b >= 0:
            return Fit(a, b, c)
    a, b = _lstsq([[1.0, x] for x in xs], ys)
    return Fit(a, max(b, 0.0), 0.0)


def _lstsq(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Solve the normal equations (tiny systems: 2 or 3 unknowns), scaled for stability."""
    k = len(rows[0])
    scale = [max(abs(r[j]) for r in rows) or 1.0 for j in range(k)]
    a = [[r[j] / scale[j] for j in range(k)] for r in rows]
    m = [[sum(r[i] * r[j] for r in a) for j in range(k)] for i in range(k)]
    v = [sum(r[i] * y for r, y in zip(a, ys, strict=True)) for i in range(k)]
    for col in range(k):  # Gaussian elimination with partial pivoting
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        m[col], m[pivot], v[col], v[pivot] = m[pivot], m[col], v[pivot], v[col]
        if abs(m[col][col]) < 1e-12:
            raise CalibrationError("the measured sizes are too alike to fit; give other --sizes")
        for r in range(col + 1, k):
            f = m[r][col] / m[col][col]
            m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
            v[r] -= f * v[col]
    out = [0.0] * k
    for r in range(k - 1, -1, -1):
        out[r] = (v[r] - sum(m[r][j] * out[j] for j in range(r + 1, k))) / m[r][r]
    return [x / s for x, s in zip(out, scale, strict=True)]


@dataclass(frozen=True)
class Calibration:
    """A server's calibration: the measured points, the prefill fitted to them, the decode rate."""

    server: str
    at: float
    points: tuple[Point, ...]
    fit: Fit
    decode_tps: float | None
    decode_note: str | None = None  # why decode_tps could not be measured

    def prefill_tps(self, tokens: int) -> float:
        t = self.fit.prefill_s(tokens)
        return tokens / t if t > 0 else math.inf

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def from_json(doc: dict[str, Any]) -> Calibration:
        return Calibration(
            server=doc["server"],
            at=float(doc["at"]),
            points=tuple(Point(**p) for p in doc["points"]),
            fit=Fit(**doc["fit"]),
            decode_tps=doc.get("decode_tps"),
            decode_note=doc.get("decode_note"),
        )


@dataclass(frozen=True)
class Advice:
    """The timeouts each layer between a client and the server needs for a prompt of a size."""

    prompt_tokens: int
    answer_tokens: int
    prefill_s: float
    answer_s: float | None  # None: the decode rate could not be measured
    client_s: int  # the application's own request timeout
    agent_s: int  # an agent framework between it and the balancer
    load_balancer_s: int  # the proxy nearest the server waits longest

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def advise(cal: Calibration, prompt_tokens: int, answer_tokens: int = 1024) -> Advice:
    """The timeout each layer needs for a prompt of `prompt_tokens` and a long answer.

    Every layer must outwait the prefill; a layer nearer the server waits a little longer than
    the one in front of it, so it is never the one that gives up first and turns the wait into
    an error that the layers in front retry.
    """
    prefill = cal.fit.prefill_s(prompt_tokens)
    answer = answer_tokens / cal.decode_tps if cal.decode_tps else None
    client = round_up((prefill + (answer or 0.0)) * MARGIN, 30)
    return Advice(
        prompt_tokens=prompt_tokens,
        answer_tokens=answer_tokens,
        prefill_s=round(prefill, 2),
        answer_s=None if answer is None else round(answer, 2),
        client_s=client,
        agent_s=client + 30,
        load_balancer_s=client + 60,
    )


# -- measuring -----------------------------------------------------------------------------


def filler(words: int, nonce: str) -> str:
    """`words` words after a unique prefix: no prompt cache holds any of it."""
    body = " ".join(_FILLER[(i * 7 + len(nonce)) % len(_FILLER)] for i in range(words))
    return f"[{nonce}] {body}"


def measure(
    server: ServerConfig,
    text: str,
    max_tokens: int,
    timeout: float,
    on_connect: Callable[[Address], None] | None = None,
) -> ProbeSnapshot:
    settings = replace(
        server.probe.around("hard_timeout", timeout), prompt=text, max_tokens=max_tokens
    )
    snap = Probe(replace(server, probe=settings), on_connect=on_connect).run()
    if snap.finding != OK or snap.first_token_at is None:
        raise CalibrationError(
            f"a {len(text.split())}-word prompt was not answered: {snap.finding} {snap.detail}"
        )
    return snap


def run_calibration(
    server: ServerConfig,
    sizes: Sequence[int],
    *,
    say: Callable[[str], None] = lambda _: None,
    timeout: float = 1800.0,
    wall: Callable[[], float] = time.time,
    left: LeftProbes | None = None,
) -> Calibration:
    """Measure each size, smallest first. From the second point on, each step's time is
    estimated before it is sent (said, and a step estimated past `timeout` is left out); each
    prompt's connection is on record in `left` while it runs, so that one left on the server by
    an interrupted run (a server does not stop a prefill whose client left) is the watchdog's
    own, never blamed on a client."""
    per_word, warm = tokens_per_word(server, timeout)
    points: list[Point] = []
    for size in sorted(sizes):
        known = [warm, *points]
        guess = fit(known).prefill_s(size) if len(known) >= 2 else None
        if guess is not None and guess > timeout:
            say(
                f"not prefilling {size} tokens: about {guess:.0f} s by the sizes so far, past the "
                f"{timeout:.0f} s bound; the fit extrapolates from the smaller ones"
            )
            break
        about = "" if guess is None else f" (about {guess:.0f} s by the sizes so far)"
        say(f"prefilling about {size} tokens{about} ...")
        text = filler(max(1, int(size / per_word)), secrets.token_hex(8))
        point = _point(server, text, size, timeout, left, guess)
        points.append(point)
        say(f"  {point.prompt_tokens} tokens: first token after {point.prefill_s:.2f} s")
    if len(points) < 2:
        points.insert(0, warm)
    say("decoding a longer answer ...")
    decode_tps, decode_note = decode_rate(server, timeout)
    return Calibration(server.name, wall(), tuple(points), fit(points), decode_tps, decode_note)


def _point(
    server: ServerConfig,
    text: str,
    size: int,
    timeout: float,
    left: LeftProbes | None,
    guess: float | None,
) -> Point:
    """One prompt measured, its connection on record while it runs."""
    used: list[Address] = []

    def note(address: Address) -> None:
        used.append(address)
        if left is not None:
            left.add(address, keep_for=timeout)

    try:
        snap = measure(server, text, 1, timeout, on_connect=note)
    except KeyboardInterrupt:
        if not used:  # stopped before it connected: nothing left on the server
            raise
        more = "" if guess is None else f" (about {guess:.0f} s of it in all)"
        raise CalibrationInterrupted(
            f"interrupted: {server.name} goes on prefilling the {size}-token prompt{more}: a "
            "server does not stop a prefill whose client left. A running watchdog knows it as "
            "calibrate's own, not a client's; clients wait behind it until it ends"
        ) from None
    for address in used:
        if left is not None:
            left.shorten(address, keep_for=ANSWERED_GRACE)
    assert snap.ttft is not None
    sent = len(json.dumps({"messages": [{"role": "user", "content": text}]}).encode())
    return Point(snap.prompt_tokens or size, round(snap.ttft, 4), snap.cached_tokens, sent)


def tokens_per_word(server: ServerConfig, timeout: float) -> tuple[float, Point]:
    """How many tokens a filler word costs on this server, to size prompts in tokens; and the
    small prompt's time, the first point an estimate has."""
    text = filler(WORDS_PROBE, secrets.token_hex(8))
    warm = measure(server, text, 1, timeout)
    if not warm.prompt_tokens:
        raise CalibrationError(f"{server.name} reports no usage.prompt_tokens; cannot size prompts")
    assert warm.ttft is not None
    sent = len(json.dumps({"messages": [{"role": "user", "content": text}]}).encode())
    point = Point(warm.prompt_tokens, round(warm.ttft, 4), warm.cached_tokens, sent)
    return warm.prompt_tokens / WORDS_PROBE, point


def decode_rate(server: ServerConfig, timeout: float) -> tuple[float | None, str | None]:
    """Tokens per second after the first, and why not when it cannot be told.

    The difference between a 1-token and a DECODE_TOKENS-token answer to prompts of the same
    length, in whole request times: a stream may arrive in one burst (measured: the batched
    mlx_lm.server sends a 64-token answer within 0.2 ms). One pair is at the mercy of a slow
    first request on a fast model, so the median of a few pairs is taken.
    """
    rates: list[float] = []
    why = None
    for _ in range(DECODE_PAIRS):
        one = measure(server, filler(20, secrets.token_hex(8)), 1, timeout)
        many = measure(server, filler(20, secrets.token_hex(8)), DECODE_TOKENS, timeout)
        if many.tokens < 2 or one.done_at is None or many.done_at is None:
            why = f"the model stopped after {many.tokens} token(s) ({many.finish_reason})"
            continue
        extra = (many.done_at - many.started_at) - (one.done_at - one.started_at)
        if extra <= 0:
            why = f"a {many.tokens}-token answer came no later than a 1-token one"
            continue
        rates.append((many.tokens - one.tokens) / extra)
    if rates:
        return round(statistics.median(rates), 1), None
    return None, why


def context_length(cmdline: Sequence[str]) -> int | None:
    """The served model's context length, when its folder is on this machine."""
    args = list(cmdline)
    if "--model" not in args or args.index("--model") + 1 >= len(args):
        return None
    config = Path(args[args.index("--model") + 1]).expanduser() / "config.json"
    try:
        doc = json.loads(config.read_text())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict):
        return None
    for d in (doc, doc.get("text_config") or {}):
        if not isinstance(d, dict):
            continue
        for key in ("max_position_embeddings", "max_sequence_length", "n_ctx"):
            if isinstance(d.get(key), int):
                return int(d[key])
    return None


def serving_process(server: ServerConfig) -> tuple[int, float] | None:
    """The process listening on the server's port (PID, start time), when this machine has it."""
    import psutil

    from mlx_watchdog.sense.process import ProcessTable

    pid = ProcessTable().listener(server.port, server.host, server.match)
    try:
        return None if pid is None else (pid, psutil.Process(pid).create_time())
    except psutil.Error:
        return None


def replaced(server: ServerConfig, before: tuple[int, float] | None) -> str | None:
    """Why what was measured since `before` is not this server's: it was restarted meanwhile
    (by a running watchdog, its service manager or a person), so the timings mix two
    processes, one of them starting with a cold cache. None when the same process serves."""
    if before is None:
        return None
    now = serving_process(server)
    if now == before:
        return None
    after = "nothing listens now" if now is None else f"now PID {now[0]}"
    return (
        f"{server.name} was restarted while being measured (PID {before[0]}, {after}: a "
        "watchdog, its service manager or a person restarted it)"
    )


def refusal(
    server: ServerConfig, left: LeftProbes | None = None
) -> tuple[str | None, Sequence[str]]:
    """Why calibrating now would hurt (None: the server is idle and serving), and its cmdline.

    Calibration sends long prompts; on a busy serial server every client behind it would wait.
    """
    quick = replace(
        server, probe=server.probe.around("wedge_after", min(server.probe.slow_after, 10))
    )
    result = check_once(quick, left=left)
    verdict, process = result.verdict, result.observation.process
    if verdict.state not in (State.HEALTHY, State.SLOW):
        return f"the server is {verdict.reason}", process.cmdline
    if process.live:
        return f"{process.live} client(s) are being served right now", process.cmdline
    return None, process.cmdline


MAINTENANCE_SIZES = (1024, 4096, 16384)


def maintenance_calibration(server: ServerConfig, store: Store) -> str:
    """The maintenance window's calibration: measured, kept in the history like `calibrate`'s
    (unless another process served meanwhile), and said in a line."""
    before = serving_process(server)
    cal = run_calibration(server, MAINTENANCE_SIZES, timeout=600.0)
    moved = replaced(server, before)
    if moved is not None:
        return f"calibration not kept: {moved}"
    prompt = context_length(_cmdline(before)) or 32 * 1024
    advice = advise(cal, prompt)
    store.save_calibration(server.name, cal.at, {**cal.to_json(), "advice": advice.to_json()})
    return (
        f"calibrated: {article(f'{prompt:,}')} {prompt:,}-token prompt needs about {advice.prefill_s:.0f} s here; "
        f"clients need a timeout of at least {advice.client_s} s"
    )


def _cmdline(process: tuple[int, float] | None) -> list[str]:
    import psutil

    try:
        return psutil.Process(process[0]).cmdline() if process is not None else []
    except psutil.Error:
        return []
