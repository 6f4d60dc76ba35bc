"""The work an abandoned request has left, where the server's log says nothing of it. Pure.

Under --draft-model mlx_lm.server logs no prefill progress. What is left can still be bounded
from signs no client writes of itself: the abandoned request's size, as the kernel counted it on
the server's socket, read as tokens at the bytes per token the server's last calibration measured
(`mlx-watchdog calibrate` records its prompts' sizes), and its prefill time from the curve that
calibration fitted. A real prompt is not the calibration's filler (code and JSON take more tokens
a byte, prose in other scripts fewer), so the tokens are a range (`BAND`), and so is the time.
The time the server has had the request counts as done: the range is low when it waited in a
queue first, which only makes a restart chosen on it rarer.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mlx_watchdog.judge.retry import size_label

BAND = (0.5, 2.0)  # a real prompt's tokens, against what the filler's bytes per token say


@dataclass(frozen=True)
class WorkLeft:
    """What an abandoned request has left to prefill, in seconds, as a range."""

    lo: float
    hi: float
    why: str  # how it was estimated, in words


@dataclass(frozen=True)
class Curve:
    """A calibration, as far as an estimate needs it: prefill_s(n) = a + b*n + c*n^2, and how
    many bytes of a request its prompts took per token."""

    a: float
    b: float
    c: float
    bytes_per_token: float

    def prefill_s(self, tokens: float) -> float:
        return max(0.0, self.a + self.b * tokens + self.c * tokens * tokens)

    def rate_at(self, tokens: int) -> float | None:
        """The prefill rate (tokens a second) `tokens` into a prompt: the curve's slope there."""
        return _rate(self.b, self.c, tokens)


def curve(doc: Mapping[str, Any] | None) -> Curve | None:
    """From a stored calibration document; None where it lacks what is needed (one made before
    calibrations recorded their prompts' sizes) or holds nonsense."""
    if not doc:
        return None
    try:
        fit = doc["fit"]
        a, b, c = (float(fit[k]) for k in ("a", "b", "c"))
        ratios = [
            float(p["prompt_bytes"]) / float(p["prompt_tokens"])
            for p in doc["points"]
            if p.get("prompt_bytes") and p.get("prompt_tokens")
        ]
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError):
        return None
    ratios = sorted(r for r in ratios if 0.1 < r < 100.0)
    numbers = (a, b, c)
    if not ratios or any(x != x or abs(x) == float("inf") for x in numbers) or b < 0 or c < 0:
        return None
    return Curve(a, b, c, ratios[len(ratios) // 2])


def work_left(size: int | None, held_s: float | None, found: Curve | None) -> WorkLeft | None:
    """The prefill left of an abandoned request of `size` bytes the server has had for
    `held_s`, on the calibrated curve; None without either."""
    if size is None or held_s is None or found is None:
        return None
    tokens = size / found.bytes_per_token
    few, many = tokens * BAND[0], tokens * BAND[1]
    short, long = found.prefill_s(few), found.prefill_s(many)
    lo, hi = max(0.0, short - held_s), max(0.0, long - held_s)
    why = (
        f"its ~{size_label(size)} request is {few:,.0f}-{many:,.0f} tokens, a prefill of "
        f"{short:.0f}-{long:.0f} s on this server's calibrated curve; had for {held_s:.0f} s, "
        f"{lo:.0f}-{hi:.0f} s of it is left"
    )
    return WorkLeft(lo, hi, why)


def calibrated_rate(doc: Mapping[str, Any] | None, tokens: int) -> float | None:
    """The prefill rate (tokens a second) a calibration measured `tokens` into a prompt: its
    fitted curve's slope there. None without a usable fit."""
    try:
        fit = doc["fit"] if doc else None
        b, c = float(fit["b"]), float(fit["c"])  # type: ignore[index]
    except (KeyError, TypeError, ValueError):
        return None
    return _rate(b, c, tokens)


def _rate(b: float, c: float, tokens: int) -> float | None:
    slope = b + 2 * c * max(0, tokens)
    if not (0 < slope < float("inf")):
        return None
    return 1.0 / slope
