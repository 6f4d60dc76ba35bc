"""A client behind a wedge that resends the abandoned prompt, told from the sizes and times the
kernel gives of the server's sockets (judge/retry.py)."""

from __future__ import annotations

import pytest

from mlx_watchdog.judge.retry import MIN_BYTES, WITHIN_S, retry_of
from mlx_watchdog.sense.findings import Client


def client(
    port: int,
    status: str,
    received: int | None,
    sent_at: float | None,
    left_at: float | None = None,
) -> Client:
    first = sent_at if sent_at is not None else 0.0
    return Client(("127.0.0.1", port), status, first, left_at, received, sent_at)


def test_the_same_prompt_sent_again_after_its_client_left_is_a_retry() -> None:
    gone = client(1, "abandoned", 65_537, sent_at=100.0, left_at=110.0)
    again = client(2, "live", 65_620, sent_at=110.2)
    found = retry_of([gone, again], now=115.0)
    assert found is not None
    assert (found.bytes, found.after_s, found.held_s) == (65_537, pytest.approx(0.2), 15.0)
    assert "resends the abandoned ~64 KiB request 0 s after giving up" in found.describe()


@pytest.mark.parametrize(
    ("again", "why"),
    [
        (client(2, "live", 80_000, sent_at=110.2), "another size: another prompt"),
        (client(2, "live", 65_537, sent_at=99.0), "sent before the abandoned one"),
        (client(2, "live", 65_537, sent_at=110.0 + WITHIN_S + 1), "long after it was left"),
        (client(2, "live", None, sent_at=110.2), "its size cannot be read"),
        (client(2, "abandoned", 65_537, sent_at=110.2, left_at=114.0), "it left too"),
    ],
)
def test_other_requests_are_not_a_retry(again: Client, why: str) -> None:
    gone = client(1, "abandoned", 65_537, sent_at=100.0, left_at=110.0)
    assert retry_of([gone, again], now=115.0) is None, why


def test_small_requests_are_no_prompt_whose_work_matters() -> None:
    gone = client(1, "abandoned", MIN_BYTES - 1, sent_at=100.0, left_at=110.0)
    again = client(2, "live", MIN_BYTES - 1, sent_at=110.2)
    assert retry_of([gone, again], now=115.0) is None


def test_the_oldest_abandoned_request_resent_is_the_one_told() -> None:
    """Two attempts left before the third came: the work held longest is what a restart
    destroys (the second waits behind it and is answered from its cache)."""
    first = client(1, "abandoned", 65_537, sent_at=100.0, left_at=110.0)
    second = client(2, "abandoned", 65_540, sent_at=110.1, left_at=120.0)
    third = client(3, "live", 65_541, sent_at=120.1)
    found = retry_of([third, second, first], now=125.0)
    assert found is not None and found.held_s == 25.0
