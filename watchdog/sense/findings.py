"""What a probe, the /v1/models check and a look at the server's process found, as plain data:
judging them needs no HTTP library and no psutil (the verdict, `status` and the endpoint import
this, not the probe nor the process table)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

Clock = Callable[[], float]
Address = tuple[str, int]

REPORT_TIMEOUT = 5.0  # a load report or health route read, at most
# mlx_lm.server answers /v1/models with headers and no body when the Hugging Face cache folder
# it scans is missing (huggingface_hub's scan_cache_dir raises after the 200 is sent).
EMPTY_MODELS_FIX = (
    "create the Hugging Face cache folder the server reads (mkdir -p ~/.cache/huggingface/hub), "
    "or point HF_HUB_CACHE in its environment at one that exists"
)


@dataclass(frozen=True)
class WorkSign:
    """One look's reading of the work sign."""

    on: str  # "cpu" or "gpu": where the server's work runs, so where it is read
    percent: float | None  # busy share since the last reading (of a core, of the GPU's time)
    unknown: str = ""  # why `percent` is None ("" when read, or when it is a first reading)
    source: str = "psutil"  # what read it

    def describe(self) -> str:
        what = self.on.upper()
        if self.percent is not None:
            return f"{what} {self.percent:.1f}%"
        return f"{what} unknown ({self.unknown})" if self.unknown else f"{what} not read yet"


@dataclass(frozen=True)
class Client:
    """One client connection to the server, live or left, and since when."""

    address: Address
    status: str  # "live" or "abandoned"
    first_seen: float
    abandoned_since: float | None
    received: int | None = None  # bytes it sent (its request); None where it cannot be read
    sent_at: float | None = None  # when its last byte came, on the span clock; None: unknown
    answered: int | None = None  # bytes the server sent it (acknowledged); None: unknown
    answered_at: float | None = None  # when the server last sent it data, on the span clock
    # Its connection is gone, unanswered: reset, as HAProxy's `option abortonclose` does when
    # its client leaves. The server still has its request; nothing of it is left to read.
    departed: bool = False

    @property
    def sent(self) -> float:
        """When it sent its request, as well as it is known (else when it was first seen)."""
        return self.sent_at if self.sent_at is not None else self.first_seen


@dataclass(frozen=True)
class ProcessSample:
    """What the operating system shows of the server process: identity, CPU, memory and
    its clients."""

    pid: int | None
    local: bool = True  # False: the server is on another machine; nothing to inspect
    create_time: float | None = None  # on the span clock (`mono`)
    cmdline: tuple[str, ...] = ()
    matches: bool | None = None  # does the command line match the configured pattern
    cpu_percent: float | None = None
    rss_bytes: int | None = None
    abandoned: int | None = None
    live: int | None = None
    clients: tuple[Client, ...] = field(default=())
    error: str = ""

    def age(self, now: float) -> float | None:
        return None if self.create_time is None else now - self.create_time

    def gave_up_after(self) -> list[float]:
        """How long each abandoned client had waited when it left, where both ends were seen.

        Both ends are sampled once a tick, so each figure is good to about one interval.
        """
        return sorted(
            round(c.abandoned_since - c.first_seen, 1)
            for c in self.clients
            if c.abandoned_since is not None and c.abandoned_since > c.first_seen
        )

    def oldest_live(self, now: float) -> float | None:
        ages = [now - c.first_seen for c in self.clients if c.status == "live"]
        return max(ages) if ages else None

    def oldest_abandoned(self, now: float) -> float | None:
        ages = [now - c.abandoned_since for c in self.clients if c.abandoned_since is not None]
        return max(ages) if ages else None


@dataclass(frozen=True)
class Prefill:
    """A prefill the server says it is doing (its own log): `done` of `total` prompt tokens."""

    done: int
    total: int
    rate_tps: float | None  # over this prefill's logged steps; None after one step
    age_s: float  # since its last logged step
    step_s: float | None = None  # the mean time between its logged steps; None after one
    slowing: float | None = None  # growth of a token's time with its position (s/token/token)

    @property
    def finished(self) -> bool:
        return self.done >= self.total

    @property
    def left_s(self) -> float | None:
        """The seconds the rest takes: at its rate now, each further token slower by what its
        steps show (a cost linear in position: the integral over what is left)."""
        if self.finished:
            return 0.0
        if not self.rate_tps:
            return None
        left = self.total - self.done
        return left / self.rate_tps + (self.slowing or 0.0) * left * left / 2

    def describe(self) -> str:
        if self.finished:
            text = f"prefilled {self.total:,} prompt tokens"
        else:
            text = f"prefilling {self.done:,}/{self.total:,} prompt tokens"
            if self.rate_tps:
                text += f" at {self.rate_tps:,.0f} tok/s, about {self.left_s:,.0f} s left"
        return f"{text} (its last step {self.age_s:,.0f} s ago)"


class ProbeFinding(StrEnum):
    """How a probe ended. OK served a token; the rest name what was wrong."""

    OK = "ok"
    AUTH_FAILED = "auth_failed"
    HTTP_ERROR = "http_error"
    HTML_ERROR = "html_error"
    INVALID_JSON = "invalid_json"
    NO_DATA_EVENTS = "no_data_events"
    DONE_WITHOUT_TOKEN = "done_without_token"
    ZERO_TOKENS = "zero_tokens"
    FINISH_ERROR = "finish_error"
    STREAM_ERROR = "stream_error"
    BODY_TOO_LARGE = "body_too_large"
    TRICKLE = "trickle"
    RESET = "reset"
    NO_MODEL = "no_model"  # the server needs a model named and lists none
    REFUSED = "refused"
    CONNECT_TIMEOUT = "connect_timeout"
    CONNECT_ERROR = "connect_error"
    LOADING = "loading"  # 503 "Loading model" (llama-server while it loads)
    NO_RESPONSE = "no_response"  # nothing by the hard timeout
    ABORTED = "aborted"  # the watchdog closed it itself: says nothing about the server
    KEY_UNREADABLE = "key_unreadable"  # the watchdog cannot read its api_key_file: its fault
    PROBE_FAILED = "probe_failed"  # the watchdog's own reading of the answer failed: its fault


class OwnFault(Exception):
    """The watchdog cannot look (its API key file is unreadable, say): never the server's
    fault, so never a verdict on it; the daemon is blind until it is fixed, and says so."""


OK = ProbeFinding.OK
DEAD_FINDINGS: dict[ProbeFinding, str] = {
    ProbeFinding.AUTH_FAILED: "the server refused the API key",
    ProbeFinding.HTTP_ERROR: "the server answered with an HTTP error",
    ProbeFinding.HTML_ERROR: "the server answered with an HTML page instead of JSON",
    ProbeFinding.INVALID_JSON: "the server sent a body that is not valid JSON",
    ProbeFinding.NO_DATA_EVENTS: "the stream ended without any data: event",
    ProbeFinding.DONE_WITHOUT_TOKEN: "the stream ended with [DONE] before any token",
    ProbeFinding.ZERO_TOKENS: "the server answered 200 with zero tokens",
    ProbeFinding.FINISH_ERROR: 'the server finished with finish_reason "error"',
    ProbeFinding.STREAM_ERROR: "the stream carried an error object",
    ProbeFinding.BODY_TOO_LARGE: "the answer is larger than a 1-token probe can be",
    ProbeFinding.TRICKLE: "bytes kept trickling in without a token",
    ProbeFinding.RESET: "the server closed or reset the connection mid-answer",
    ProbeFinding.NO_MODEL: "the server needs a model named and lists none",
}
DOWN_FINDINGS: dict[ProbeFinding, str] = {
    ProbeFinding.REFUSED: "connection refused: nothing is listening",
    ProbeFinding.CONNECT_TIMEOUT: "could not connect in time",
    ProbeFinding.CONNECT_ERROR: "could not connect",
}


@dataclass(frozen=True)
class ProbeSnapshot:
    """What one probe has seen so far; times are readings of the span clock (`mono`), None until they happen."""

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
    finding: ProbeFinding | None = None  # None while the probe still waits
    detail: str = ""
    model: str | None = None  # the model it named (None: the server's default)

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
    """What `/v1/models` answered, read under a deadline and a cap."""

    status: int | None
    ok: bool
    finding: str  # "ok", "refused", "timeout", "error", "empty_body", "invalid_json", "http_error", "not_listed"
    detail: str
    ids: tuple[str, ...]
    elapsed: float


@dataclass(frozen=True)
class LoadReport:
    """What the server said about itself this tick: its health route's status and its own load
    report. `since`: when the progress counter last moved (or was first read)."""

    route: str
    finding: str  # "ok", "http_error", "invalid", "timeout", "error"
    detail: str
    status: int | None = None
    running: int | None = None
    waiting: int | None = None
    progress: float | None = None
    loaded: int | None = None
    delivered: float | None = None  # its counter of tokens generated for clients
    delivered_since: float | None = None  # how much that counter grew since the last answer
    since: float | None = None  # the first answer that showed the progress counter's value
    read_at: float | None = None  # when this answer came
    health_status: int | None = None
    health_body: str = ""

    @property
    def ok(self) -> bool:
        return self.finding == "ok"

    @property
    def queued(self) -> int | None:
        """Requests the server holds: running and waiting."""
        if self.running is None and self.waiting is None:
            return None
        return (self.running or 0) + (self.waiting or 0)

    def stalled(self) -> float | None:
        """How long the progress counter has not moved, between answers that showed it (a
        read that failed proves nothing either way)."""
        if self.since is None or self.read_at is None or self.progress is None:
            return None
        return self.read_at - self.since

    def describe(self) -> str:
        if not self.ok:
            return f"{self.route}: {self.finding} ({self.detail})"
        parts = []
        if self.running is not None:
            parts.append(f"{self.running} running")
        if self.waiting is not None:
            parts.append(f"{self.waiting} waiting")
        if self.loaded is not None:
            parts.append(f"{self.loaded} model{'s' if self.loaded != 1 else ''} loaded")
        return f"{self.route} reports " + (", ".join(parts) or "nothing")
