"""A LiteLLM proxy config, read for what makes a local server wedge: timeouts shorter than the
prefill, retries of long prompts, and fallbacks that send the retry to the same machine."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from mlx_watchdog.advice.balancer import MAX_BALANCER_CONFIG
from mlx_watchdog.sense.files import open_regular


class LiteLLMConfigError(Exception):
    """The file cannot be read as a LiteLLM config; the message says where and why."""


@dataclass(frozen=True)
class Deployment:
    """One LiteLLM deployment: its group, the server it sends to, and its timeouts."""

    group: str  # model_name: what clients and fallbacks name
    api_base: str
    timeout: float | None
    stream_timeout: float | None

    @property
    def machine(self) -> str:
        return (urlsplit(self.api_base).hostname or self.api_base).lower()

    @property
    def endpoint(self) -> tuple[str, int | None]:
        parts = urlsplit(self.api_base)
        return self.machine, parts.port


@dataclass(frozen=True)
class LiteLLMConfig:
    """What of a LiteLLM proxy config decides whether clients outlast a prefill: its
    deployments, fallbacks, retries and timeouts."""

    path: Path
    deployments: tuple[Deployment, ...]
    fallbacks: tuple[tuple[str, tuple[str, ...]], ...]
    num_retries: int | None
    router_timeout: float | None
    # general_settings.cancel_on_disconnect: the proxy ends its upstream request when its client
    # leaves (off by default; without it the server's connection stays open to the end).
    cancel_on_disconnect: bool = False

    def group(self, name: str) -> list[Deployment]:
        return [d for d in self.deployments if d.group == name]


def load(path: Path) -> LiteLLMConfig:
    try:
        with open_regular(path) as f:  # a FIFO or a device is no config: never waited on
            doc = yaml.safe_load(f.read(MAX_BALANCER_CONFIG).decode("utf-8", "replace"))
    except OSError as exc:
        raise LiteLLMConfigError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except yaml.YAMLError as exc:
        where = ""
        mark = getattr(exc, "problem_mark", None)
        if mark is not None:
            where = f" at line {mark.line + 1}, column {mark.column + 1}"
        problem = getattr(exc, "problem", None) or str(exc)
        raise LiteLLMConfigError(f"{path}: not valid YAML{where}: {problem}") from None
    if not isinstance(doc, dict):
        raise LiteLLMConfigError(f"{path}: a LiteLLM config is a mapping with a model_list")
    models = doc.get("model_list")
    if not isinstance(models, list):
        raise LiteLLMConfigError(f"{path}: model_list is missing or not a list")
    router = _mapping(doc.get("router_settings"))
    settings = _mapping(doc.get("litellm_settings"))
    deployments = []
    for i, entry in enumerate(models):
        entry = _mapping(entry)
        params = _mapping(entry.get("litellm_params"))
        name = entry.get("model_name")
        if not isinstance(name, str):
            raise LiteLLMConfigError(f"{path}: model_list[{i}] has no model_name")
        deployments.append(
            Deployment(
                group=name,
                api_base=str(params.get("api_base") or ""),
                timeout=_seconds(params.get("timeout"), f"{name}.timeout", path),
                stream_timeout=_seconds(
                    params.get("stream_timeout"), f"{name}.stream_timeout", path
                ),
            )
        )
    fallbacks = []
    for item in router.get("fallbacks") or settings.get("fallbacks") or []:
        for src, dsts in _mapping(item).items():
            targets = dsts if isinstance(dsts, list) else [dsts]
            fallbacks.append((str(src), tuple(str(t) for t in targets)))
    general = _mapping(doc.get("general_settings"))
    retries = router.get("num_retries", settings.get("num_retries"))
    timeout = router.get("timeout", settings.get("request_timeout"))
    return LiteLLMConfig(
        path=path,
        deployments=tuple(deployments),
        fallbacks=tuple(fallbacks),
        num_retries=int(retries) if isinstance(retries, (int, float)) else None,
        router_timeout=_seconds(timeout, "router timeout", path),
        cancel_on_disconnect=general.get("cancel_on_disconnect") is True,
    )


def _mapping(value: object) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _seconds(value: object, where: str, path: Path) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise LiteLLMConfigError(f"{path}: {where} = {value!r} is not a number of seconds")
    return float(value)


def fallback_problems(cfg: LiteLLMConfig) -> list[str]:
    """Fallbacks that retry on the deployment that just failed, or on its machine first."""
    problems = []
    for src, targets in cfg.fallbacks:
        sources = cfg.group(src)
        if not targets or not sources:
            continue
        bases = {d.api_base for d in sources}
        machines = {d.machine for d in sources}
        for target in targets:
            if any(d.api_base in bases for d in cfg.group(target)):
                problems.append(
                    f'fallback "{src}" -> "{target}" retries on the deployment that just failed '
                    f"({', '.join(sorted(bases))})"
                )
        first = cfg.group(targets[0])
        if (
            first
            and all(d.machine in machines for d in first)
            and not any(d.api_base in bases for d in first)
        ):
            problems.append(
                f'fallback "{src}" goes to the same machine first ({first[0].machine}): a wedged '
                "machine gets the retry too; name another machine first"
            )
    return problems
