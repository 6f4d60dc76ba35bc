"""Hostile answers per server kind, for `tests/test_hostile.py` and `bench/hostile.py`: each
route a kind is read on (/v1/models, its health route, its load report, generation) made to
lie, overflow, nest, trickle or hang, next to a generation that works or that never answers.

The rule each must keep: a server that serves is left alone (healthy), one that serves nobody
is found (wedged, dead or down), and every check ends with a verdict, never an exception.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import httpx

from mlx_watchdog.act.check import check_once
from mlx_watchdog.config import ServerConfig
from mlx_watchdog.config.profiles import KINDS, PROFILES, Kind
from mlx_watchdog.record.left_probes import LeftProbes
from tests.builders import HOSTILE

GEN = "/v1/chat/completions"
PROBE = HOSTILE
NESTED = "[" * 500_000
CUT = {"body": '{"data": [{"id": "m"'}
SURROGATE_ERROR = '{"error": {"message": "bad \\ud800"}}'
# Every list a kind names its models in, each with one name that cannot be sent back.
SURROGATE_NAMES = json.dumps(
    {
        "data": [{"id": "\udcff"}, {"id": "bad-model"}],
        "models": [{"model": "\ud800", "name": "\ud800", "id": "\udcff"}],
    }
)
# Terminal escapes (OSC title, CSI clear, BEL), NUL and a right-to-left override: text that
# reaches a terminal, a log or the history only as printable text (sense/text.py).
ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x00\u202egnp.exe"
ESCAPE_ERROR = json.dumps({"error": {"message": ESCAPES}})
ESCAPE_NAMES = json.dumps(
    {"data": [{"id": ESCAPES}], "models": [{"model": ESCAPES, "name": ESCAPES, "id": ESCAPES}]}
)


@dataclass(frozen=True)
class Case:
    kind: Kind
    route: str
    name: str
    answer: dict[str, object]
    generation: str  # "ok" (the server serves) or "hang" (it serves nobody)

    @property
    def wanted(self) -> tuple[str, ...]:
        if self.route == GEN:
            return ("dead", "wedged", "down")
        return ("healthy", "slow") if self.generation == "ok" else ("wedged",)

    @property
    def label(self) -> str:
        return f"{self.kind} {self.route} {self.name} gen={self.generation}"


def _anywhere() -> dict[str, dict[str, object]]:
    """Answers any route can be made to give."""
    return {
        "empty": {"body": ""},
        "html": {"ctype": "text/html", "body": "<html><body>oops</body></html>"},
        "not-utf8": {"body": "\xff\xfe\x00{"},
        "cut-json": CUT,
        "nested": {"body": NESTED},
        "2-MiB": {"body": "x" * (2 << 20)},
        "http-500": {"status": 500, "body": "Internal Server Error"},
        "loading-503": {"status": 503, "body": '{"error": {"message": "Loading model"}}'},
        # A JSON escape of a lone surrogate: text no encoder, database or terminal accepts.
        "surrogate-500": {"status": 500, "body": SURROGATE_ERROR},
        "surrogate-names": {"body": SURROGATE_NAMES},
        "escapes-500": {"status": 500, "body": ESCAPE_ERROR},
        "escape-names": {"body": ESCAPE_NAMES},
        "trickle": {"body": '{"data": []}' * 4, "trickle": 0.4},
        "trickled-headers": {"body": '{"data": []}', "trickle": 0.2, "whole": True},
        "endless": {"body": '{"data": [' * 64, "endless": True},
        "hang": {"hang": True},
    }


def _numbers() -> dict[str, str]:
    """Values a count can be made to take, as the text a server would write."""
    return {
        "+Inf": "+Inf",
        "NaN": "NaN",
        "-1": "-1",
        "1e400": "1e400",
        "huge-int": "9" * 400,
    }


def _report(kind: Kind, value: str) -> dict[str, object]:
    """The kind's load report with every count it reads set to `value`."""
    route = PROFILES[kind].load
    assert route is not None
    names = [*route.running, *route.waiting, *route.progress]
    if route.format == "prometheus":
        prom = {"+Inf": "+Inf", "NaN": "NaN", "-1": "-1", "1e400": "1e9999", "huge-int": "1e308"}
        text = "".join(f'{n}{{x="{i}"}} {prom[value]}\n' for n in names for i in range(3))
        return {"ctype": "text/plain", "body": text}
    json_text = {"+Inf": "Infinity", "NaN": "NaN", "-1": "-1", "1e400": "1e400"}.get(value, value)
    doc: object = "@"
    paths = names or [route.loaded]
    for path in paths[:1]:
        for key in reversed(path.split(".")):
            doc = {key: doc}
    return {"body": json.dumps(doc).replace('"@"', json_text)}


def routes(kind: Kind) -> list[str]:
    profile = PROFILES[kind]
    found = ["/v1/models"]
    if profile.health:
        found.append(profile.health)
    if profile.load and profile.load.path not in found:
        found.append(profile.load.path)
    return found


QUICK_KINDS: tuple[Kind, ...] = ("mlx_lm", "llama.cpp", "vllm-mlx", "mlx-openai-server", "ollama")
QUICK_ANSWERS = (
    "nested",
    "not-utf8",
    "trickle",
    "trickled-headers",
    "endless",
    "hang",
    "loading-503",
    "surrogate-500",
    "surrogate-names",
    "escapes-500",
)


QUICK_OK = ("trickle", "count=+Inf", "surrogate-names")  # also tried next to a serving generation


def cases(kinds: tuple[Kind, ...] = KINDS, quick: bool = False) -> Iterator[Case]:
    """Every hostile answer for every route of each kind. `quick` (the test suite's share):
    the routes every kind shares (/v1/models, health, generation) for mlx_lm only, a few of
    the answers that once broke a check, and every count on each kind's own load report."""
    for kind in kinds:
        profile = PROFILES[kind]
        common = not quick or kind == "mlx_lm"
        for route in routes(kind):
            is_load = profile.load is not None and route == profile.load.path
            if not is_load and not common:
                continue
            answers = dict(_anywhere())
            if quick:
                answers = {k: v for k, v in answers.items() if k in QUICK_ANSWERS}
            if is_load:
                answers |= {f"count={v}": _report(kind, v) for v in _numbers()}
            for name, answer in answers.items():
                for generation in ("ok", "hang"):
                    if quick and generation == "ok" and name not in QUICK_OK:
                        continue
                    yield Case(kind, route, name, answer, generation)
        if common:
            for name, answer in _anywhere().items():
                yield Case(kind, GEN, name, answer, "ok")


def server_for(kind: Kind, url: str) -> ServerConfig:
    profile = PROFILES[kind]
    return ServerConfig(
        name="hostile",
        url=url,
        kind=kind,
        match="badserver",
        model="bad-model" if profile.needs_model else None,
        probe=PROBE,
    )


def set_answers(url: str, answers: dict[str, object]) -> None:
    r = httpx.put(url + "/_hostile", content=json.dumps(answers), timeout=10)
    assert r.status_code == 204, r.text


@dataclass(frozen=True)
class Outcome:
    case: Case
    state: str
    reason: str
    seconds: float
    error: str = ""

    @property
    def kept(self) -> bool:
        return not self.error and self.state in self.case.wanted


def run_case(case: Case, url: str, left: LeftProbes) -> Outcome:
    """Set the case's answers on the misbehaving server at `url`, check once as `probe` does
    (its leftover probes recorded in `left`, so one case's traces are not the next one's
    clients), reset."""
    answers: dict[str, object] = {case.route: case.answer}
    if case.generation == "hang" and case.route != GEN:
        answers[GEN] = {"hang": True}
    set_answers(url, answers)
    started = time.monotonic()
    try:
        result = check_once(server_for(case.kind, url), left=left)
    except Exception as exc:  # what the test counts: a crash is the failure looked for
        return Outcome(
            case, "crash", "", time.monotonic() - started, f"{type(exc).__name__}: {exc}"
        )
    finally:
        set_answers(url, {path: None for path in answers})
    v = result.verdict
    return Outcome(case, v.state, v.reason, time.monotonic() - started)


def with_kind(case: Case, kind: Kind) -> Case:
    return replace(case, kind=kind)
