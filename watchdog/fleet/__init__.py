"""For many machines: Prometheus rules and a Grafana dashboard over every watchdog's /metrics,
and `fleet`: several watchdogs' /status side by side.

Both ship in the package and are printed by `mlx-watchdog prometheus rules|dashboard`; the
rules are checked and unit-tested with the real `promtool`, and a real Prometheus scraping a
real watchdog fires the wedge alert in the tests.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HERE = Path(__file__).parent
RUNBOOK = "README.md"  # the README's sections; --runbook-base points them at your copy


def rules(runbook_base: str = RUNBOOK) -> str:
    """The rules file, each runbook_url a section of the README at `runbook_base`."""
    return (HERE / "rules.yml").read_text().replace("@RUNBOOK@", runbook_base.rstrip("/"))


def dashboard() -> str:
    return (HERE / "dashboard.json").read_text()


def gather(urls: Sequence[str], fetch: Callable[[str], dict[str, Any]]) -> list[dict[str, Any]]:
    """Each watchdog's status document (its /status), or why it could not be had."""
    docs = []
    for url in urls:
        try:
            doc = fetch(url)
        except Exception as exc:  # one machine that does not answer must not hide the others
            doc = {"watchdog": {"running": False, "why": str(exc)}, "servers": []}
        docs.append({"url": url, **doc})
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
