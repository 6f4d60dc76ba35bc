"""What people need to hear when clients gave up: how long they waited, and the timeouts the
server's measured speed calls for. The daemon says it in incidents; `calibrate` and `doctor` too.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

MARGIN = 1.5  # on the predicted time: a busier machine, a longer answer, a slower model load


def tokens_label(tokens: int) -> str:
    """4096 -> "4k", 1500 -> "1500"."""
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


def round_up(seconds: float, step: int) -> int:
    return max(step, int(math.ceil(seconds / step) * step))


def incident_advice(waits: Sequence[float], last: dict[str, Any] | None) -> str | None:
    """What to tell people when clients gave up: how long they waited and what they need.

    `last` is the stored document of the server's last calibration (with its "advice").
    """
    if not waits:
        return None
    lo, hi = min(waits), max(waits)
    span = f"{lo:.0f} s" if round(lo) == round(hi) else f"{lo:.0f}-{hi:.0f} s"
    who = f"{len(waits)} client{'s' if len(waits) > 1 else ''} gave up after {span} of waiting"
    need = last.get("advice") if last else None
    if not need:
        return (
            f"{who}, while their requests were still being prefilled or queued; raise their "
            f"timeouts well above {hi:.0f} s (`mlx-watchdog calibrate` measures by how much)"
        )
    at_least = max(int(need["client_s"]), round_up(hi * MARGIN, 30))
    return (
        f"{who}; a {tokens_label(int(need['prompt_tokens']))}-token prompt needs about {float(need['prefill_s']):.0f} s here "
        f"(last calibration); raise their timeouts to at least {at_least} s"
    )
