"""Cancelling through a server's own route: the ids read from its status, every answer bounded."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from mlx_watchdog.act import cancel as cancel_module
from mlx_watchdog.act.cancel import abandoned_ids, cancel_abandoned
from mlx_watchdog.config import parse_config
from mlx_watchdog.config.schema import ServerConfig
from tests.conftest import Running


def status(*requests: tuple[object, object]) -> dict[str, object]:
    return {"requests": [{"request_id": r, "elapsed_s": e} for r, e in requests]}


def test_the_probe_and_newer_requests_are_never_cancelled() -> None:
    # The probe has waited 4.0 s: chatcmpl-p is it; chatcmpl-new came after it.
    doc = status(
        ("chatcmpl-a", 9.0), ("chatcmpl-p", 4.05), ("chatcmpl-b", 4.1), ("chatcmpl-new", 0.2)
    )
    assert abandoned_ids(doc, 4.0) == ["chatcmpl-a", "chatcmpl-b"]
    # A client that gave up just before the probe was sent is still told from it.
    assert abandoned_ids(status(("l", 4.06), ("p", 4.01)), 4.0) == ["l"]
    assert abandoned_ids(status(("p", 4.0)), 4.0) == []


def test_with_live_clients_only_requests_older_than_every_live_one_are_cancelled() -> None:
    # The probe has waited 4 s; a live client was first seen 6 s ago (interval included).
    doc = status(("left", 30.0), ("live", 6.2), ("edge", 6.5), ("p", 4.0), ("new", 1.0))
    assert abandoned_ids(doc, 4.0, 6.0) == ["left"]
    assert abandoned_ids(doc, 4.0) == ["left", "live", "edge"]
    # Ids that would name another route once in the path are never sent.
    assert abandoned_ids(status((".", 30.0), ("..", 30.0), ("a/b", 30.0)), 4.0) == []


def test_abort_all_is_never_sent_while_a_live_client_is_connected() -> None:
    def never(*a: object, **kw: object) -> tuple[int, bytes]:
        raise AssertionError("nothing may be sent")

    sglang = server_for("http://127.0.0.1:9", "sglang")
    done = cancel_abandoned(sglang, 4.0, 12.0, call=never)
    assert not done.ok and "a live client is connected" in done.detail


@pytest.mark.parametrize(
    "doc",
    [
        [],
        {"requests": "none"},
        {"status": "idle"},
        "requests",
        None,
    ],
)
def test_a_status_without_a_requests_list_is_a_named_problem(doc: object) -> None:
    with pytest.raises(ValueError, match='no "requests" list'):
        abandoned_ids(doc, 1.0)


def test_odd_entries_are_skipped_not_cancelled() -> None:
    doc = {
        "requests": [
            "chatcmpl-x",
            {"request_id": 7, "elapsed_s": 9.0},
            {"request_id": "", "elapsed_s": 9.0},
            {"request_id": "x" * 201, "elapsed_s": 9.0},
            {"request_id": "flag", "elapsed_s": True},
            {"request_id": "late", "elapsed_s": "9"},
            {"request_id": "ok", "elapsed_s": 9.0},
        ]
    }
    assert abandoned_ids(doc, 1.0) == ["ok"]


def server_for(url: str, kind: str) -> ServerConfig:
    return parse_config({"server": [{"url": url, "kind": kind}]}).servers[0]


def test_a_kind_without_a_cancel_route_says_so_and_sends_nothing() -> None:
    def never(*a: object, **kw: object) -> tuple[int, bytes]:
        raise AssertionError("nothing may be sent")

    done = cancel_abandoned(server_for("http://127.0.0.1:9", "mlx_lm"), 1.0, call=never)
    assert not done.ok and done.detail == "mlx_lm.server has no route to cancel a request"


@pytest.mark.parametrize(
    ("route", "answer", "said"),
    [
        ("/v1/status", {"hang": True}, "did not answer: Overdue"),
        ("/v1/status", {"status": 200, "body": "x" * (2 << 20)}, "did not answer: TooLarge"),
        ("/v1/status", {"status": 200, "body": "{" * 5000}, "GET /v1/status: "),
        ("/v1/status", {"status": 401, "body": "{}"}, "GET /v1/status answered 401"),
    ],
)
def test_a_hostile_status_route_is_a_named_failure_within_its_bound(
    bad_server: Callable[..., Running],
    monkeypatch: pytest.MonkeyPatch,
    route: str,
    answer: dict[str, object],
    said: str,
) -> None:
    monkeypatch.setattr(cancel_module, "CANCEL_TIMEOUT", 1.0)
    srv = bad_server("cancellable", kind="vllm-mlx")
    httpx.post(f"{srv.url}/_hostile", json={route: answer}, timeout=5)
    done = cancel_abandoned(server_for(srv.url, "vllm-mlx"), 1.0)
    assert not done.ok and said in done.detail, done.detail


def test_a_cancel_route_that_refuses_is_said_with_what_was_cancelled(
    bad_server: Callable[..., Running],
) -> None:
    srv = bad_server("cancellable", kind="vllm-mlx")
    listed = {"requests": [{"request_id": "chatcmpl-9", "elapsed_s": 30.0}]}
    httpx.post(
        f"{srv.url}/_hostile",
        json={
            "/v1/status": {"status": 200, "body": json.dumps(listed)},
            "/v1/requests/chatcmpl-9/cancel": {"status": 500, "body": "{}"},
        },
        timeout=5,
    )
    done = cancel_abandoned(server_for(srv.url, "vllm-mlx"), 1.0)
    assert not done.ok and done.detail == "cancelled 0; refused chatcmpl-9: 500"


def test_many_slow_cancels_end_within_the_budget_in_all() -> None:
    """Each call may take its 5 s, but a cancel runs inside a tick: 10 s in all, then stop."""
    now = [0.0]
    deadlines: list[float] = []
    listed = {"requests": [{"request_id": f"r{i}", "elapsed_s": 99.0} for i in range(30)]}

    def slow(method: str, url: str, **kw: object) -> tuple[int, bytes]:
        deadlines.append(float(kw["deadline"]))  # type: ignore[arg-type]
        now[0] += 4.0  # each answer takes 4 s
        return (200, json.dumps(listed).encode()) if method == "GET" else (200, b"{}")

    done = cancel_abandoned(
        server_for("http://127.0.0.1:9", "vllm-mlx"), 1.0, call=slow, mono=lambda: now[0]
    )
    assert not done.ok and "took longer than 10s in all" in done.detail
    assert deadlines == [5.0, 5.0, 2.0] and now[0] == 12.0
