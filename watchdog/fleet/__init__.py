"""For many machines: Prometheus rules and a Grafana dashboard over every watchdog's /metrics,
and `fleet`: several watchdogs' /status side by side.

Both ship in the package and are printed by `mlx-watchdog prometheus rules|dashboard`; the
rules are checked and unit-tested with the real `promtool`, and a real Prometheus scraping a
real watchdog fires the wedge alert in the tests.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from mlx_watchdog.judge.states import SHOWN_STATES, UNKNOWN

HERE = Path(__file__).parent
RUNBOOK = "docs/runbook.md"  # a section an alert; --runbook-base points them at your copy


def rules(runbook_base: str = RUNBOOK) -> str:
    """The rules file, each runbook_url its alert's section of the runbook at `runbook_base`."""
    base = runbook_base.rstrip("/")
    if _ESCAPES.search(base):
        raise ValueError(f"--runbook-base {base!r} holds a control character")
    # It lands in an annotation, a Go template: "{{" would open an action (promtool refuses
    # the file), so it is written as one that prints it. Then inside YAML double quotes:
    # escaped as YAML reads them, the file stays valid.
    templated = base.replace("{{", '{{ "{{" }}')
    quoted = templated.replace("\\", "\\\\").replace('"', '\\"')
    return (HERE / "rules.yml").read_text().replace("@RUNBOOK@", quoted)


def dashboard() -> str:
    return (HERE / "dashboard.json").read_text()


NUMBERS = ("restarts_24h", "incidents_24h", "gave_up_24h", "budget_left")
_ESCAPES = re.compile(r"[\x00-\x1f\x7f-\x9f]")  # ANSI and OSC escapes start with these


def clean(value: object, limit: int = 200) -> str:
    """Text from another machine, made safe to print: no control characters (no escape
    sequence reaches the terminal), at most `limit` characters."""
    return _ESCAPES.sub("", str(value))[:limit]


class Malformed(ValueError):
    """A status document that is not one; the message says what is wrong."""


def normalize(doc: object) -> dict[str, Any]:
    """A peer's /status as `fleet` uses it, every field checked: a state it does not know is
    "unknown", an exit code outside 0-3 is 3, a count that is not one is left out."""
    if not isinstance(doc, dict) or not isinstance(doc.get("watchdog"), dict):
        raise Malformed('no "watchdog" object')
    servers = doc.get("servers")
    if not isinstance(servers, list):
        raise Malformed('no "servers" list')
    watchdog = doc["watchdog"]
    out: list[dict[str, Any]] = []
    for s in servers[:1000]:
        if not isinstance(s, dict):
            raise Malformed("a server entry is not an object")
        state = s.get("state") if s.get("state") in SHOWN_STATES else UNKNOWN
        code = s.get("exit_code")
        valid = isinstance(code, int) and not isinstance(code, bool) and 0 <= code <= 3
        entry: dict[str, Any] = {
            "name": clean(s.get("name", "?"), 64),
            "state": state,
            "exit_code": code if valid and state != UNKNOWN else 3,
            "reason": clean(s.get("reason", "")),
        }
        for key in NUMBERS:
            entry[key] = _count(s.get(key))
        out.append(entry)
    return {
        "watchdog": {
            "running": watchdog.get("running") is True,
            "why": clean(watchdog.get("why", "")),
        },
        "servers": out,
    }


def _count(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    number = float(value) if abs(value) < 1e18 else math.inf
    return value if math.isfinite(number) and 0 <= number < 1e9 else None


def gather(urls: Sequence[str], fetch: Callable[[str], dict[str, Any]]) -> list[dict[str, Any]]:
    """Each watchdog's status document (its /status, checked), or why it could not be had."""
    docs = []
    for url in urls:
        try:
            doc = normalize(fetch(url))
        except Malformed as exc:
            why = f"answered with a malformed status document ({exc})"
            doc = {"watchdog": {"running": False, "why": why}, "servers": []}
        except Exception as exc:  # one machine that does not answer must not hide the others
            doc = {"watchdog": {"running": False, "why": clean(exc)}, "servers": []}
        docs.append({"url": clean(url), **doc})
    return docs


def worst_exit(docs: Sequence[dict[str, Any]]) -> int:
    """The monitoring-plugin exit code of the fleet: its worst server, 3 for a silent watchdog."""
    codes = [3 if not d["watchdog"].get("running") else 0 for d in docs]
    codes += [int(s["exit_code"]) for d in docs for s in d["servers"]]
    return max(codes, default=3)


def rows(docs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row a server, machines side by side; provocations per hour over the last day, so
    that a correlation across machines is not taken for a cause: one may just be provoked more."""
    out = []
    for d in docs:
        if not d["watchdog"].get("running"):
            out.append(
                {
                    "machine": d["url"],
                    "server": "-",
                    "state": "unreachable",
                    "why": d["watchdog"].get("why", ""),
                }
            )
            continue
        for s in d["servers"]:
            out.append(
                {
                    "machine": d["url"],
                    "server": s["name"],
                    "state": s["state"],
                    "exit_code": s["exit_code"],
                    "restarts_24h": s.get("restarts_24h"),
                    "incidents_24h": s.get("incidents_24h"),
                    "gave_up_per_hour": round(float(s.get("gave_up_24h") or 0) / 24, 2),
                    "budget_left": s.get("budget_left"),
                    "reason": s["reason"],
                }
            )
    return out
