"""What a bug report to a server's project needs, from one incident: ready to paste.

mlx-lm #1834 and #1493 were reported without a stack or the server's last words, and the first
answer asked for the version. This puts the version, the cause and what decided it, the stack
taken before the restart and the log's last lines in one block.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from mlx_watchdog.config.profiles import PROFILES
from mlx_watchdog.judge.cause import NEXT_STEP, WORDS, Cause
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
# The server's own bugs, worth a report upstream; the rest (clients that time out, a machine out
# of memory, a process gone for no reason shown) are fixed here, not there.
UPSTREAM = frozenset({Cause.THREAD_GONE, Cause.DEADLOCK, Cause.METAL_ERROR, Cause.LEAKED_REQUEST})
_HOME = re.compile(r"/(?:Users|home)/[^/\s]+")


def report_offered(incident: Incident) -> str | None:
    """None when the incident's cause is the server's bug; else why no report goes upstream,
    and the fix that is the user's."""
    cause = _cause(incident.evidence.get("cause"))
    if cause in UPSTREAM:
        return None
    return (
        f"no report upstream: the cause ({WORDS[cause]}) is not a bug of the server's; "
        f"next: {NEXT_STEP[cause]}"
    )


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
        + (", ".join(map(str, versions)) if versions else "version unknown (pip show it)")
        + f' (watched as "{incident.server}")',
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
    # Versions come from folder names, the title from the config: shown, never acted on. A
    # report is pasted in public: no one's home folder in it.
    return printable(_no_home("\n".join(lines)), lines=True)


def _no_home(text: str) -> str:
    home = str(Path.home())
    if len(home) > 1:
        text = text.replace(home, "~")
    return _HOME.sub("~", text)


def _cause(value: object) -> Cause:
    try:
        return Cause(str(value))
    except ValueError:
        return Cause.UNKNOWN
