"""What a bug report to a server's project needs, from one incident: ready to paste.

mlx-lm #1834 and #1493 were reported without a stack or the server's last words, and the first
answer asked for the version. This puts the version, the cause and what decided it, the stack
taken before the restart and the log's last lines in one block.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mlx_watchdog.config.profiles import PROFILES
from mlx_watchdog.judge.cause import WORDS, Cause
from mlx_watchdog.record.rows import Incident
from mlx_watchdog.sense.text import printable

PROJECTS = {
    "mlx_lm": "ml-explore/mlx-lm",
    "llama.cpp": "ggml-org/llama.cpp",
    "vllm-mlx": "waybarrios/vllm-mlx",
    "ollama": "ollama/ollama",
}
STACK_LINES = 80
LOG_LINES = 40


def upstream_report(incident: Incident, dumps: Sequence[Mapping[str, Any]]) -> str:
    """A Markdown block for an issue upstream; what could not be had is said, not left out."""
    e = incident.evidence
    dump = dumps[-1] if dumps else {}
    kind = str(dump.get("kind") or "")
    profile = PROFILES.get(kind)  # type: ignore[call-overload]
    title = profile.title if profile is not None else (kind or "the server")
    where = PROJECTS.get(kind)
    cause = _cause(e.get("cause"))
    versions = dump.get("versions") or []
    lines = [
        f"A bug report to {where or title}" + (f" (github.com/{where}/issues)" if where else ""),
        "",
        f"**Server**: {title}, "
        + (", ".join(map(str, versions)) if versions else "version unknown (pip show it)"),
        f"**What happened**: {printable(incident.reason)}",
        f"**Cause, as mlx-watchdog named it**: {WORDS[cause]}"
        + (f" ({printable(str(e['cause_because']))})" if e.get("cause_because") else ""),
    ]
    shown = [
        f"{k}={e[k]}"
        for k in ("waited_s", "cpu_percent", "rss_bytes", "abandoned_connections", "health_status")
        if e.get(k) not in (None, "")
    ]
    if shown:
        lines.append(f"**Evidence**: {', '.join(shown)}")
    stack = dump.get("stack")
    lines += ["", "**Stacks** (taken just before the restart):", "```"]
    if isinstance(stack, str) and stack.strip():
        lines += [printable(x) for x in stack.rstrip().splitlines()[:STACK_LINES]]
    else:
        lines.append(f"(none: {printable(str(dump.get('stack_problem') or 'no restart dump'))})")
    lines.append("```")
    tail = dump.get("log_tail")
    lines += ["", "**The server's log, its last lines**:", "```"]
    if isinstance(tail, str) and tail.strip():
        lines += [printable(x) for x in tail.rstrip().splitlines()[-LOG_LINES:]]
    else:
        lines.append(f"(none: {printable(str(dump.get('log_problem') or 'no log named'))})")
    lines.append("```")
    # Versions come from folder names, the title from the config: shown, never acted on.
    return printable("\n".join(lines), lines=True)


def _cause(value: object) -> Cause:
    try:
        return Cause(str(value))
    except ValueError:
        return Cause.UNKNOWN
