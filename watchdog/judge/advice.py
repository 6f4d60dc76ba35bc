"""What people need to hear when clients gave up: how long they waited, and the timeouts the
server's measured speed calls for. The daemon says it in incidents; `calibrate` and `doctor` too.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

MARGIN = 1.5  # on the predicted time: a busier machine, a longer answer, a slower model load
LOOP_SEEN = 3  # the same prompt abandoned at the same point this often is a retry loop
ALIKE = 0.15  # prompt sizes and waits within this share of each other are "the same"
LOOP_MARGIN = 1.2  # the timeout it needs: the prefill at the rate seen, and a fifth more


def tokens_label(tokens: int) -> str:
    """4096 -> "4k", 1500 -> "1500"."""
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def article(label: str) -> str:
    """ "a" or "an" before a number as it is said: an 8k-token prompt, an 11,000-token one, a
    110k-token one."""
    digits = "".join(ch for ch in label.split("k")[0] if ch.isdigit())
    lead = digits[: len(digits) % 3 or 3]  # the group said first: 11 of 11,000
    return "an" if digits.startswith("8") or lead in ("11", "18") else "a"


def round_up(seconds: float, step: int) -> int:
    return max(step, int(math.ceil(seconds / step) * step))


def incident_advice(
    waits: Sequence[float], last: dict[str, Any] | None, gone: int = 0
) -> str | None:
    """What to tell people when clients gave up: how long they waited and what they need.

    `last` is the stored document of the server's last calibration (with its "advice");
    `gone`: how many clients left in all, some of them maybe before any look saw them wait.
    """
    if not waits:
        return None
    lo, hi = min(waits), max(waits)
    span = f"{lo:.0f} s" if round(lo) == round(hi) else f"{lo:.0f}-{hi:.0f} s"
    n = max(len(waits), gone)
    who = f"{n} client{'s' if n > 1 else ''} gave up after {span} of waiting"
    if n > len(waits):  # came and went between two looks: how long they waited is not known
        unseen = n - len(waits)
        who = f"{who} ({unseen} of them left before a look saw how long they waited)"
    need = last.get("advice") if last else None
    if not need:
        return (
            f"{who}, while their requests were still being prefilled or queued; raise their "
            f"timeouts well above {hi:.0f} s (`mlx-watchdog calibrate` measures by how much)"
        )
    at_least = max(int(need["client_s"]), round_up(hi * MARGIN, 30))
    size = tokens_label(int(need["prompt_tokens"]))
    return (
        f"{who}; {article(size)} {size}-token prompt needs about {float(need['prefill_s']):.0f} s here "
        f"(last calibration); raise their timeouts to at least {at_least} s"
    )


@dataclass(frozen=True)
class Abandoned:
    """A wedge as its incident saw it: the prompt the server's log showed in flight, how long
    the client that left had waited, and the prefill rate the log showed."""

    prompt_tokens: int
    waited_s: float
    rate_tps: float | None

    @classmethod
    def of(cls, evidence: Mapping[str, Any]) -> Abandoned | None:
        total, waits = evidence.get("prefill_total"), evidence.get("gave_up_after_s") or ()
        rate = evidence.get("prefill_rate_tps")
        if not isinstance(total, int) or total <= 0 or not waits:
            return None
        if not all(isinstance(w, (int, float)) for w in waits):
            return None
        return cls(
            total, float(max(waits)), float(rate) if isinstance(rate, (int, float)) else None
        )


def retry_loop(seen: Sequence[Abandoned]) -> str | None:
    """A client that resends the same prompt and gives up at the same point, in numbers; or
    None. `seen` is oldest first, the wedge at hand last."""
    if not seen:
        return None
    last = seen[-1]
    alike = [
        a
        for a in seen
        if abs(a.prompt_tokens - last.prompt_tokens) <= ALIKE * last.prompt_tokens
        and abs(a.waited_s - last.waited_s) <= max(2.0, ALIKE * last.waited_s)
    ]
    if len(alike) < LOOP_SEEN:
        return None
    tokens = statistics.median(a.prompt_tokens for a in alike)
    waited = statistics.median(a.waited_s for a in alike)
    text = (
        f"a client resends a ~{_k(tokens)}-token prompt and gives up after ~{waited:.0f} s "
        f"each time ({len(alike)} times)"
    )
    rates = [a.rate_tps for a in alike if a.rate_tps]
    if not rates:
        return f"{text}; it will never succeed until its timeout is well above {waited:.0f} s"
    rate = statistics.median(rates)
    need = tokens / rate
    return (
        f"{text}; at {rate:,.0f} tok/s it needs ~{need:.0f} s; it will never succeed until its "
        f"timeout is above {round_up(need * LOOP_MARGIN, 10)} s"
    )


def _k(tokens: float) -> str:
    return f"{tokens / 1000:.0f}k" if tokens >= 1000 else f"{tokens:.0f}"


def resend_advice(size: str, answered_s: float, gave_up_s: float | None) -> str:
    """The deadline a resent prompt needs, from what this incident measured: the time from its
    first send to the server serving again (its prefill, and whatever was decoded for nobody)."""
    gave = f" (its client gave up after {gave_up_s:.0f} s)" if gave_up_s else ""
    return (
        f"a client resent an abandoned ~{size} prompt{gave}; the server had it done "
        f"{answered_s:.0f} s after it was first sent: a client deadline above "
        f"{round_up(answered_s * MARGIN, 10)} s (that and half again) is served at the first "
        "attempt, which ends this loop at its source"
    )


def unattended(name: str) -> tuple[str, str]:
    """What a failing server with `manager = "none"` needs said wherever it is shown: that
    nobody restarts it, and what to do."""
    return (
        f'manager = "none": the watchdog only watches {name}, so nobody will restart it',
        "restart it yourself with what runs it, or set `manager` in the config so that the "
        "watchdog can",
    )


def nobody_restarts(name: str) -> str:
    return "; ".join(unattended(name))
