"""Reading a generation's answer: a JSON completion, one SSE event, an error body.

Pure: bytes and parsed JSON in, a finding and the snapshot fields it changes out.
"""

from __future__ import annotations

import json
from typing import Any

from mlx_watchdog.sense.findings import OK, ProbeFinding
from mlx_watchdog.sense.text import BadJson, load_json, printable

Changes = dict[str, Any]


def json_answer(body: bytes, now: float) -> tuple[ProbeFinding, str, Changes]:
    """A 200 answer that is not a stream: accept a proper non-streaming completion."""
    if body.lstrip()[:1] == b"<":
        return ProbeFinding.HTML_ERROR, "200 with an HTML page", {}
    try:
        data = load_json(body)
    except BadJson as exc:
        return ProbeFinding.INVALID_JSON, f"{exc}: {excerpt(body)}", {}
    if not isinstance(data, dict):
        return ProbeFinding.INVALID_JSON, excerpt(body), {}
    if "error" in data:
        said = excerpt(json.dumps(data["error"]).encode())
        return ProbeFinding.HTTP_ERROR, f"200 with error: {said}", {}
    usage = as_dict(data.get("usage"))
    text, finish = "", None
    for ch in as_list(data.get("choices")):
        if isinstance(ch, dict):
            msg = as_dict(ch.get("message"))
            text += str(msg.get("content") or "") + str(msg.get("reasoning_content") or "")
            finish = ch.get("finish_reason") or finish
    tokens = count(usage.get("completion_tokens")) or (1 if text else 0)
    changes: Changes = {
        "tokens": tokens,
        "finish_reason": finish,
        "first_data_at": now,
        "first_token_at": now if tokens else None,
        **usage_fields(usage),
    }
    if finish == "error":
        return ProbeFinding.FINISH_ERROR, "non-streaming answer", changes
    found = OK if tokens else ProbeFinding.ZERO_TOKENS
    return found, "non-streaming answer", changes


def stream_event(
    payload: bytes, tokens: int, finish: str | None
) -> tuple[ProbeFinding | None, str, Changes]:
    """One SSE `data:` event (not [DONE]) after `tokens` tokens: (a finding that ends the
    probe, or None to go on; its detail; the fields it changes)."""
    try:
        event = load_json(payload)
    except BadJson:
        return ProbeFinding.INVALID_JSON, excerpt(payload), {}
    if not isinstance(event, dict):
        return ProbeFinding.INVALID_JSON, excerpt(payload), {}
    if "error" in event:
        return ProbeFinding.STREAM_ERROR, excerpt(json.dumps(event["error"]).encode()), {}
    for ch in as_list(event.get("choices")):
        if not isinstance(ch, dict):
            continue
        delta = as_dict(ch.get("delta"))
        # Count tokens, not text: a reasoning model's first token can be empty content.
        if (
            delta.get("content")
            or delta.get("reasoning_content")
            or delta.get("reasoning")
            or delta.get("tool_calls")
        ):
            tokens += 1
        finish = ch.get("finish_reason") or finish
    usage = event.get("usage") if isinstance(event.get("usage"), dict) else None
    if usage is not None:
        tokens = max(tokens, count(usage.get("completion_tokens")))
    changes: Changes = {"tokens": tokens, "finish_reason": finish}
    if usage is not None:
        changes.update(usage_fields(usage))
    if finish == "error":
        return ProbeFinding.FINISH_ERROR, 'finish_reason "error"', changes
    return None, "", changes


def classify_error(status: int, ctype: str, body: bytes | None) -> tuple[ProbeFinding, str]:
    if body is None:
        return ProbeFinding.BODY_TOO_LARGE, f"HTTP {status} with a huge body"
    if status in (401, 403):
        return ProbeFinding.AUTH_FAILED, f"HTTP {status}: check api_key_file"
    if "text/html" in ctype or body.lstrip()[:1] == b"<":
        return ProbeFinding.HTML_ERROR, f"HTTP {status} with an HTML page"
    try:
        data = load_json(body)
    except BadJson:
        return ProbeFinding.HTTP_ERROR, f"HTTP {status}: {excerpt(body)}"
    if isinstance(data, dict) and "error" in data:
        err = data["error"]
        msg = err.get("message", err) if isinstance(err, dict) else err
        if status == 503 and "loading" in str(msg).lower():
            return ProbeFinding.LOADING, f"HTTP 503: {excerpt(str(msg).encode())}"
        return ProbeFinding.HTTP_ERROR, f"HTTP {status}: {excerpt(str(msg).encode())}"
    return ProbeFinding.HTTP_ERROR, f"HTTP {status}: {excerpt(body)}"


def usage_fields(usage: dict[str, Any]) -> dict[str, Any]:
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return {
        "prompt_tokens": count(usage.get("prompt_tokens")) if "prompt_tokens" in usage else None,
        "cached_tokens": count(cached) if cached is not None else None,
    }


def as_dict(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def as_list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def count(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


def excerpt(body: bytes, limit: int = 120) -> str:
    text = printable(body.decode(errors="replace").strip().replace("\n", " "))
    return text if len(text) <= limit else text[:limit] + "..."
