"""What the watchdog knows about each local server: the defaults a user would otherwise look
up (`match`, whether the probe must name a model), the health route and what it means, and
where the server reports its own load. Read from each project's source; see docs/servers.md's
"Supported servers" table. Plain data: reading the routes is `sense.load`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal[
    "mlx_lm",
    "llama.cpp",
    "vllm-mlx",
    "rapid-mlx",
    "omlx",
    "mlx-openai-server",
    "lmstudio",
    "ollama",
    "vllm",
    "sglang",
    "openai",
]
Format = Literal["prometheus", "json"]
# How a server cancels a request on demand: all at once (SGLang), or each by the id its own
# status route lists (vllm-mlx, Rapid-MLX). See act/cancel.py.
Cancel = Literal["abort_all", "by_id"]


@dataclass(frozen=True)
class LoadRoute:
    """A route where the server says what it is doing.

    `running`, `waiting`, `progress`: Prometheus family names (summed over their samples) or
    dotted JSON paths (a number, a bool, or a list's length). `progress` is a counter that
    moves as the server computes (decode steps, engine steps). It is evidence to show, never
    a reason to restart: it moves once per step, and one prefill step can take minutes
    (measured by bench/llama_abandon.py: llama-server's n_decode_total moved every 1-5 s
    through a 12k-token prompt on the tests' tiny model, while its /metrics answered at once).
    """

    path: str
    format: Format
    running: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    progress: tuple[str, ...] = ()
    loaded: str = ""  # models in memory: none while the probe waits means one is loading
    # A counter of tokens generated for clients: grown since the last look, with live clients
    # and none that left, real traffic proves the server and the probe may be skipped.
    delivered: tuple[str, ...] = ()
    enable: str = ""  # what turns the route on, when it is off by default


@dataclass(frozen=True)
class InMemory:
    """Where a server that loads models on demand lists the ones it holds now, so the probe
    names one of those instead of making it load (or evict) another every interval.

    `items`: the JSON key of the list; `name`: each entry's model name, or, with `instances`,
    the name of each entry's first loaded instance (entries with none are not in memory).
    """

    path: str
    items: str
    name: str
    instances: str = ""


@dataclass(frozen=True)
class Profile:
    """What one kind of server is: how it is recognised, probed and asked about its load."""

    kind: Kind
    title: str
    match: str  # a substring of the server's command line
    needs_model: bool = False  # the probe must name a model: one in memory, else /v1/models' first
    in_memory: InMemory | None = None
    fans_out: bool = False  # a request with n > 1 reports as n running requests
    health: str | None = None
    load: LoadRoute | None = None
    cancel: Cancel | None = None
    failure_modes: tuple[tuple[str, str], ...] = ()  # (what goes wrong, what avoids it)


PROFILES: dict[Kind, Profile] = {
    p.kind: p
    for p in (
        Profile(
            "mlx_lm",
            "mlx_lm.server",
            match="mlx_lm",
            health="/health",
            failure_modes=(
                (
                    "serves one request at a time: a client that gives up mid-prefill leaves "
                    "the server computing for nobody while everyone waits",
                    "client timeouts longer than a long prompt's prefill "
                    "(`mlx-watchdog calibrate` says how long)",
                ),
                (
                    "/health answers 503 when the generation thread has died; /v1/models "
                    "still answers 200",
                    "a restart: the watchdog makes it when no token comes, where a manager is set",
                ),
            ),
        ),
        Profile(
            "llama.cpp",
            "llama.cpp llama-server",
            match="llama-server",
            health="/health",
            load=LoadRoute(
                "/metrics",
                "prometheus",
                running=("llamacpp:requests_processing",),
                waiting=("llamacpp:requests_deferred",),
                progress=("llamacpp:n_decode_total",),
                delivered=("llamacpp:tokens_predicted_total",),
                enable="start llama-server with --metrics",
            ),
            failure_modes=(
                (
                    'every route answers 503 "Loading model" until the model is loaded',
                    "probe.startup_grace at least the model's load time",
                ),
                (
                    "/metrics is off by default, so the watchdog cannot read the slots' load",
                    "start llama-server with --metrics",
                ),
                (
                    "aborting one stream during another's prefill can hang the server "
                    "(llama.cpp #27604)",
                    "client timeouts longer than the prefill; the watchdog restarts a hung one",
                ),
            ),
        ),
        Profile(
            "vllm-mlx",
            "vllm-mlx",
            match="vllm-mlx",
            health="/health",
            # /health has active_requests only with the lifecycle manager; /v1/status always
            # counts (waybarrios/vllm-mlx 4b654c0, server.py `status`: num_running,
            # num_waiting, steps_executed from the engine's get_stats).
            load=LoadRoute(
                "/v1/status",
                "json",
                running=("num_running",),
                waiting=("num_waiting",),
                progress=("steps_executed",),
            ),
            cancel="by_id",
            failure_modes=(
                (
                    '/health says "healthy" while requests queue behind a stuck one',
                    "--continuous-batching, and client timeouts longer than the prefill",
                ),
            ),
        ),
        Profile(
            "rapid-mlx",
            "Rapid-MLX",
            match="rapid-mlx",
            health="/health",
            load=LoadRoute(
                "/metrics",
                "prometheus",
                running=("rapid_mlx_requests_running",),
                waiting=("rapid_mlx_requests_waiting",),
                progress=("rapid_mlx_steps_executed_total",),
                delivered=("rapid_mlx_completion_tokens_total",),
            ),
            cancel="by_id",
            failure_modes=(
                (
                    "aborted requests can leak running slots until nothing is served, while "
                    "/v1/models and /metrics answer 200 (Rapid-MLX #1759)",
                    "nothing in the server: the watchdog reads the leaked slots from /metrics "
                    "and restarts it",
                ),
            ),
        ),
        Profile(
            "omlx",
            "oMLX",
            match="omlx",
            health="/health",
            failure_modes=(
                (
                    "/health answers 200 during a wedge (oMLX #1883, #1884, #2852)",
                    "nothing in the server: only a generation probe tells",
                ),
            ),
        ),
        Profile(
            "mlx-openai-server",
            "mlx-openai-server",
            match="mlx-openai-server",
            health="/health",
            load=LoadRoute(
                "/v1/queue/stats",
                "json",
                running=(
                    "queue_stats.queue_stats.active_requests",
                    "queue_stats.batch_stats.active_requests",
                ),
                waiting=(
                    "queue_stats.queue_stats.queue_size",
                    "queue_stats.batch_stats.queue_size",
                ),
            ),
            failure_modes=(
                (
                    "non-streaming requests are not cancelled when the client leaves and "
                    "starve the serial worker (mlx-openai-server #321)",
                    "clients that stream, or timeouts longer than the longest answer",
                ),
            ),
        ),
        Profile(
            "lmstudio",
            "LM Studio",
            match="LM Studio",
            needs_model=True,
            in_memory=InMemory("/api/v1/models", "models", "id", instances="loaded_instances"),
            failure_modes=(
                (
                    "prompt processing runs to the end after the client aborts",
                    "client timeouts longer than the prefill",
                ),
                (
                    "the probe must name a model; an unloaded one is loaded first (JIT)",
                    "set model to one that stays loaded",
                ),
            ),
        ),
        Profile(
            "ollama",
            "Ollama",
            match="ollama",
            needs_model=True,
            in_memory=InMemory("/api/ps", "models", "model"),
            load=LoadRoute("/api/ps", "json", loaded="models"),
            failure_modes=(
                (
                    "a client's disconnect is noticed only at the first token, so an "
                    "abandoned prefill runs to the end (Ollama #11889)",
                    "client timeouts longer than the prefill",
                ),
                (
                    "the model is unloaded after OLLAMA_KEEP_ALIVE (5 min): the next "
                    "request pays the load time",
                    "OLLAMA_KEEP_ALIVE=-1, or probe.startup_grace above the load time",
                ),
            ),
        ),
        Profile(
            "vllm",
            "vLLM",
            match="vllm",
            health="/health",
            fans_out=True,
            load=LoadRoute(
                "/metrics",
                "prometheus",
                running=("vllm:num_requests_running",),
                waiting=("vllm:num_requests_waiting",),
                progress=("vllm:iteration_tokens_total_count",),
                delivered=("vllm:generation_tokens_total",),
            ),
        ),
        Profile(
            "sglang",
            "SGLang",
            match="sglang",
            # Not /health_generate: it generates a token per call, waits 1 s at least and up
            # to 20 s, and a call the watchdog gives up on is one more abandoned request.
            load=LoadRoute(
                "/metrics",
                "prometheus",
                running=("sglang:num_running_reqs",),
                waiting=("sglang:num_queue_reqs",),
                progress=("sglang:generation_tokens_total",),
                delivered=("sglang:generation_tokens_total",),
                enable="start SGLang with --enable-metrics",
            ),
            cancel="abort_all",
        ),
        Profile("openai", "any OpenAI-compatible server", match=""),
    )
}
KINDS: tuple[Kind, ...] = tuple(PROFILES)
