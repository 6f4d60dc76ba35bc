"""What a probe and the /v1/models check found, as plain data: judging them needs no HTTP
library (the verdict, `status` and the endpoint import this, not the probe)."""

from __future__ import annotations

from dataclasses import dataclass

# Findings of a finished probe. "ok" served a token; the rest name what was wrong.
OK = "ok"
DEAD_FINDINGS = {
    "auth_failed": "the server refused the API key",
    "http_error": "the server answered with an HTTP error",
    "html_error": "the server answered with an HTML page instead of JSON",
    "invalid_json": "the server sent a body that is not valid JSON",
    "no_data_events": "the stream ended without any data: event",
    "done_without_token": "the stream ended with [DONE] before any token",
    "zero_tokens": "the server answered 200 with zero tokens",
    "finish_error": 'the server finished with finish_reason "error"',
    "stream_error": "the stream carried an error object",
    "body_too_large": "the answer is larger than a 1-token probe can be",
    "trickle": "bytes kept trickling in without a token",
    "reset": "the server closed or reset the connection mid-answer",
}
DOWN_FINDINGS = {
    "refused": "connection refused: nothing is listening",
    "connect_timeout": "could not connect in time",
    "connect_error": "could not connect",
}


@dataclass(frozen=True)
class ProbeSnapshot:
    """What one probe has seen so far; times are clock readings, None until they happen."""

    started_at: float
    connected_at: float | None = None
    headers_at: float | None = None
    first_data_at: float | None = None
    first_token_at: float | None = None
    done_at: float | None = None
    status: int | None = None
    bytes: int = 0
    keepalives: int = 0
    keepalive_progress: str | None = None
    tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    finding: str | None = None  # None while the probe still waits
    detail: str = ""

    @property
    def done(self) -> bool:
        return self.finding is not None

    def waited(self, now: float) -> float:
        return (self.done_at if self.done_at is not None else now) - self.started_at

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_at is None else self.first_token_at - self.started_at

    def phases(self) -> dict[str, float | None]:
        def since(t: float | None) -> float | None:
            return None if t is None else round(t - self.started_at, 4)

        return {
            "connect_s": since(self.connected_at),
            "headers_s": since(self.headers_at),
            "first_data_s": since(self.first_data_at),
            "first_token_s": since(self.first_token_at),
            "done_s": since(self.done_at),
        }


@dataclass(frozen=True)
class ModelsCheck:
    status: int | None
    ok: bool
    finding: str  # "ok", "refused", "timeout", "error", "empty_body", "invalid_json", "http_error", "not_listed"
    detail: str
    ids: tuple[str, ...]
    elapsed: float
