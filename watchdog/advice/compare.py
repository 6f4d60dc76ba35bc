"""Two servers side by side, measured the same way: measure the alternative before switching.

For each: the first token of a tiny prompt, the prefill and decode rates, what the prompt cache
saves when the same long prompt comes twice, and the aggregate decode rate with 1, 2 and 4
streams at once (what batching gives, and whether the server batches at all).
"""

from __future__ import annotations

import secrets
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from mlx_watchdog.advice.calibrate import (
    CalibrationError,
    decode_rate,
    filler,
    measure,
    tokens_per_word,
)
from mlx_watchdog.config import ServerConfig
from mlx_watchdog.sense.probe import ProbeSnapshot

STREAMS = (1, 2, 4)
STREAM_TOKENS = 256
TINY_RUNS = 3
SLACK = 0.005  # answers of one batch sent in bursts arrive within a few ms of each other


@dataclass(frozen=True)
class Side:
    """One server's numbers in a comparison: time to first token, prefill and decode rates."""

    name: str
    url: str
    ttft_s: float  # a tiny prompt, median of TINY_RUNS
    prompt_tokens: int
    prefill_s: float
    prefill_tps: float
    decode_tps: float | None
    decode_note: str | None
    again_s: float  # the same long prompt a second time
    again_cached_tokens: int | None  # as the server reports it (None: not reported)
    streams_tps: dict[int, float]  # concurrent streams -> aggregate tokens per second
    together: dict[int, int]  # of n streams sent at once, the most answered side by side

    @property
    def cache_speedup(self) -> float:
        return self.prefill_s / self.again_s if self.again_s > 0 else 0.0

    @property
    def batches(self) -> bool:
        """Serves streams side by side: a serial server answers the next only after one ends."""
        return max(self.together.values(), default=1) > 1

    @property
    def batching(self) -> float:
        one, most = self.streams_tps.get(1), self.streams_tps.get(max(self.streams_tps))
        return most / one if one and most else 0.0

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["streams_tps"] = {str(k): v for k, v in self.streams_tps.items()}
        doc["together"] = {str(k): v for k, v in self.together.items()}
        doc["batches"] = self.batches
        doc["cache_speedup"] = round(self.cache_speedup, 2)
        doc["batching"] = round(self.batching, 2)
        return doc


def measure_side(
    server: ServerConfig,
    prompt_tokens: int,
    *,
    say: Callable[[str], None] = lambda _: None,
    timeout: float = 1800.0,
    mono: Callable[[], float] = time.monotonic,
) -> Side:
    """Every request of the side within `timeout` seconds in all: each gets what is left, so a
    server that never answers ends the comparison at the limit, not after a request's own."""
    deadline = mono() + timeout

    def left() -> float:
        remaining = deadline - mono()
        if remaining <= 0:
            raise CalibrationError(f"{server.name}: not measured within the limit of {timeout:g}s")
        return remaining

    say(f"{server.name}: a tiny prompt, {TINY_RUNS} times ...")
    tiny = [
        _ttft(measure(server, filler(5, secrets.token_hex(8)), 1, left())) for _ in range(TINY_RUNS)
    ]
    words = max(1, int(prompt_tokens / tokens_per_word(server, left())[0]))
    text = filler(words, secrets.token_hex(8))
    say(f"{server.name}: prefilling about {prompt_tokens} tokens, then the same prompt again ...")
    first = measure(server, text, 1, left())
    again = measure(server, text, 1, left())
    say(f"{server.name}: decoding ...")
    decode_tps, decode_note = decode_rate(server, left())
    streams, together = {}, {}
    for n in STREAMS:
        say(f"{server.name}: {n} stream{'s' if n > 1 else ''} at once ...")
        streams[n], together[n] = _streams(server, n, left())
    tokens = first.prompt_tokens or prompt_tokens
    return Side(
        name=server.name,
        url=server.url,
        ttft_s=round(statistics.median(tiny), 4),
        prompt_tokens=tokens,
        prefill_s=round(_ttft(first), 4),
        prefill_tps=round(tokens / _ttft(first), 1),
        decode_tps=decode_tps,
        decode_note=decode_note,
        again_s=round(_ttft(again), 4),
        again_cached_tokens=again.cached_tokens,
        streams_tps=streams,
        together=together,
    )


def _ttft(snap: ProbeSnapshot) -> float:
    assert snap.ttft is not None  # measure() raises when no token came
    return max(snap.ttft, 1e-6)


def _streams(server: ServerConfig, n: int, timeout: float) -> tuple[float, int]:
    """Aggregate completion tokens per second of `n` streams started together, and the most
    of them answered side by side: that tells batching from serial serving whatever the
    machine's speed."""
    results: list[ProbeSnapshot] = []
    errors: list[Exception] = []
    lock = threading.Lock()

    def one() -> None:
        try:
            snap = measure(server, filler(20, secrets.token_hex(8)), STREAM_TOKENS, timeout)
        except CalibrationError as exc:
            with lock:
                errors.append(exc)
            return
        with lock:
            results.append(snap)

    threads = [threading.Thread(target=one) for _ in range(n)]
    start = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.monotonic() - start
    if errors:
        raise errors[0]
    together = side_by_side(
        [(s.first_token_at, s.done_at) for s in results if s.first_token_at and s.done_at]
    )
    tps = round(sum(s.tokens for s in results) / wall, 1) if wall > 0 else 0.0
    return tps, together


def side_by_side(answers: list[tuple[float, float]]) -> int:
    """The most answers in progress at one moment, each from its first token to its end.

    A serial server's answers follow one another, however fast; a batching one's overlap, and
    when it sends each answer in one burst, the bursts of a batch come at the same moment.
    """
    edges = sorted(
        [(first - SLACK, 1) for first, _ in answers] + [(done + SLACK, -1) for _, done in answers],
        key=lambda e: (e[0], -e[1]),
    )
    most = now = 0
    for _, step in edges:
        now += step
        most = max(most, now)
    return max(most, 1)


@dataclass(frozen=True)
class Comparison:
    """Two servers measured alike, and what the difference means."""

    a: Side
    b: Side

    def to_json(self) -> dict[str, Any]:
        return {"a": self.a.to_json(), "b": self.b.to_json(), "findings": findings(self)}


def findings(c: Comparison) -> list[str]:
    """What a person would take from the table, in sentences."""
    a, b = c.a, c.b
    out = [
        _faster("first token of a tiny prompt", a.name, a.ttft_s, b.name, b.ttft_s, lower=True),
        _faster("prefill", a.name, a.prefill_tps, b.name, b.prefill_tps),
    ]
    if a.decode_tps and b.decode_tps:
        out.append(_faster("decode", a.name, a.decode_tps, b.name, b.decode_tps))
    for side in (a, b):
        n = max(side.together)
        if side.batches:
            best = max(side.together.values())
            out.append(
                f"{side.name} batches: up to {best} streams were answered side by side; "
                f"{n} streams decode {side.batching:.1f}x as fast as one"
            )
        else:
            out.append(
                f"{side.name} serves one stream at a time ({n} streams: "
                f"{side.batching:.1f}x the decode rate of one); batching needs a setting: "
                "mlx_lm.server batches without --draft-model, llama-server with -np N"
            )
        if side.cache_speedup >= 2:
            out.append(
                f"{side.name} reuses the prompt cache: the same prompt again came "
                f"{side.cache_speedup:.0f}x sooner"
            )
        else:
            out.append(f"{side.name} gains little from sending the same prompt again")
    return out


def _faster(what: str, an: str, av: float, bn: str, bv: float, lower: bool = False) -> str:
    if av <= 0 or bv <= 0:
        return f"{what}: not measured on both"
    ratio = av / bv
    a_wins = ratio < 1 if lower else ratio > 1
    factor = max(ratio, 1 / ratio)
    if factor < 1.1:
        return f"{what}: about the same on both"
    return f"{what}: {an if a_wins else bn} is {factor:.1f}x faster"


def table(c: Comparison) -> list[tuple[str, str, str]]:
    """Rows of (measure, A, B) for a terminal table."""
    a, b = c.a, c.b

    def tps(v: float | None) -> str:
        return f"{v:,.0f} tok/s" if v else "not measured"

    rows = [
        ("first token, tiny prompt", _ms(a.ttft_s), _ms(b.ttft_s)),
        (
            "prefill",
            f"{tps(a.prefill_tps)} ({a.prompt_tokens} in {a.prefill_s:.2f} s)",
            f"{tps(b.prefill_tps)} ({b.prompt_tokens} in {b.prefill_s:.2f} s)",
        ),
        ("decode", tps(a.decode_tps), tps(b.decode_tps)),
        ("same prompt again", _again(a), _again(b)),
    ]
    for n in STREAMS:
        rows.append(
            (
                f"{n} stream{'s' if n > 1 else ''} at once",
                _streams_cell(a, n),
                _streams_cell(b, n),
            )
        )
    return rows


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _again(side: Side) -> str:
    cached = f", {side.again_cached_tokens} cached" if side.again_cached_tokens is not None else ""
    x = side.cache_speedup
    return (
        f"{_ms(side.again_s)} ({x:.0f}x sooner{cached})"
        if x >= 10
        else (f"{_ms(side.again_s)} ({x:.1f}x sooner{cached})")
    )


def _streams_cell(side: Side, n: int) -> str:
    v = side.streams_tps.get(n, 0.0)
    one = side.streams_tps.get(1) or 0.0
    gain = f" (x{v / one:.1f}, {side.together.get(n, 1)} side by side)" if n > 1 and one else ""
    return f"{v:,.0f} tok/s{gain}"


def compare(
    a: ServerConfig,
    b: ServerConfig,
    prompt_tokens: int,
    *,
    say: Callable[[str], None] = lambda _: None,
    timeout: float = 600.0,
) -> Comparison:
    """`timeout`: for each side, in all."""
    return Comparison(
        measure_side(a, prompt_tokens, say=say, timeout=timeout),
        measure_side(b, prompt_tokens, say=say, timeout=timeout),
    )
