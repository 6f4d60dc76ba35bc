"""What a client sends counts only where signs no client writes agree with it. Pure.

Three things a cure could be sized on are a client's to write. A prefill's progress is a line
in the server's log, and mlx_lm.server 0.32.2 logs a malformed body raw, newlines and all
(server.py `do_POST`), so any client can write one with any total and time. A request's size
is what its client chose to send (2 MiB of a field the server ignores reads as 500k tokens).
A resend is a connection that sent about as many bytes as the abandoned request.

Each may explain a wait; none decides alone. The wait for unknown work is bounded by the restart
it avoids (judge/clearing.py), and only what agrees with the kernel, the calibration and the
process may move that bound: the log's prefill may end a wait early (a restart before the
bound, because the prefill would outlast it) only where the abandoned request's bytes, read
as tokens at the calibrated bytes per token, can be that prompt, its steps come at about the
calibrated pace, and the process works. A resend may stretch the wait only until the
abandoned request's prefill must have ended, read from its bytes (a token is a byte at the
least) on the calibrated curve. A request's size alone ends no wait.
"""

from __future__ import annotations

from mlx_watchdog.judge.estimate import Curve
from mlx_watchdog.judge.evidence import Evidence
from mlx_watchdog.judge.retry import size_label
from mlx_watchdog.sense.progress import TEMPLATE_TOKENS

PACE = 4.0  # a prefill's logged rate within this factor of the calibrated one at its length
TOKENS_BAND = (0.25, 4.0)  # a real prompt's tokens against what the filler's bytes per token say


def progress_doubt(e: Evidence, found: Curve | None, works: bool | None) -> str | None:
    """Why the log's prefill cannot end a wait before its bound (None: it agrees with what no
    client writes). `works`: whether the process works, where its work runs (None: unread)."""
    total, done = e.prefill_total, e.prefill_done
    if total is None or done is None:
        return "the server's log tells of no prefill"
    if found is None:
        return (
            "no calibration of this server to hold its pace against (`mlx-watchdog calibrate` "
            "records one)"
        )
    if e.abandoned_bytes is None:
        return "the abandoned request's size cannot be read"
    tokens = e.abandoned_bytes / found.bytes_per_token
    lo = tokens * TOKENS_BAND[0]
    hi = min(tokens * TOKENS_BAND[1], float(e.abandoned_bytes)) + TEMPLATE_TOKENS
    if not lo <= total <= hi:
        return (
            f"its {total:,}-token prompt is not the abandoned ~{size_label(e.abandoned_bytes)} "
            f"request ({lo:,.0f}-{hi:,.0f} tokens at this server's calibrated bytes per token)"
        )
    rate, expected = e.prefill_rate_tps, found.rate_at(done)
    if rate is None or expected is None:
        return "its pace is not known yet"
    if not expected / PACE <= rate <= expected * PACE:
        return (
            f"its steps come at {rate:,.0f} tok/s where this server prefills about "
            f"{expected:,.0f} tok/s at that length (calibrated)"
        )
    if works is not True:
        return "the process's work cannot be read" if works is None else "the process is idle"
    return None


def resend_end(e: Evidence, found: Curve | None, now: float) -> float | None:
    """When the abandoned request's prefill must have ended, at the latest (on the span clock
    of `now`): its bytes as tokens at a byte each, on the calibrated curve, from when the
    server had it. None without a calibration or the request's size."""
    if found is None or e.abandoned_bytes is None or e.abandoned_held_s is None:
        return None
    most = found.prefill_s(e.abandoned_bytes + TEMPLATE_TOKENS)
    return now - e.abandoned_held_s + most
