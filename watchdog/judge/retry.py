"""A client behind a wedge that resends the abandoned prompt. Pure.

An agent that gives up sends the same prompt again. mlx-lm keeps the work of an abandoned prompt
(its prompt cache is stored when the request ends, client or not), so the retry is answered from
it once the abandoned work is done; a restart throws that work away, the retry prefills from
zero, gives up again, and the loop never ends. So a restart's cost counts that work.

The sign is what the kernel says of the server's sockets, not what any client says of itself:
a live connection whose request is about the size of an abandoned one's (the same prompt, a
few header bytes apart) and came after it, within `WITHIN_S` of its client leaving. The least
work a restart would destroy is how long the server has had the abandoned request: it has been
on it since (the request is the oldest left, and the process is busy), and the retry needs all
of it again.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from mlx_watchdog.sense.findings import Client

MIN_BYTES = 4096  # smaller requests are not prompts whose prefill matters
SLACK_SHARE = 0.02  # the same prompt resent: its size within 2%...
SLACK_BYTES = 512  # ...or half a KiB (other headers, a request id)
WITHIN_S = 30.0  # after its client left: an agent's retry, not a stranger's prompt


@dataclass(frozen=True)
class Retry:
    """A live request resending an abandoned one."""

    bytes: int  # the abandoned request's size, as received
    after_s: float  # how soon after the abandoned client left (or was seen gone) it came
    held_s: float  # how long the server has had the abandoned request: work a restart redoes

    def describe(self) -> str:
        return (
            f"a client resends the abandoned ~{size_label(self.bytes)} request "
            f"{self.after_s:.0f} s after giving up; the {self.held_s:.0f} s of work already "
            "done on it will answer it, where a restart would start it again from zero"
        )


def retry_of(clients: Iterable[Client], now: float) -> Retry | None:
    """The oldest abandoned request that a live one resends, if any."""
    clients = tuple(clients)
    left = sorted(
        (c for c in clients if c.status == "abandoned" and (c.received or 0) >= MIN_BYTES),
        key=lambda c: c.sent,
    )
    live = [c for c in clients if c.status == "live" and c.received is not None]
    for gone in left:
        size = gone.received or 0
        slack = max(SLACK_BYTES, SLACK_SHARE * size)
        quit_at = gone.abandoned_since if gone.abandoned_since is not None else now
        for again in live:
            came = again.sent
            if abs((again.received or 0) - size) > slack or came < gone.sent:
                continue
            if came - quit_at > WITHIN_S:
                continue
            return Retry(size, max(0.0, came - quit_at), max(0.0, now - gone.sent))
    return None


def size_label(n: int) -> str:
    return f"{n / 1024:,.0f} KiB" if n >= 10 * 1024 else f"{n / 1024:.1f} KiB"
