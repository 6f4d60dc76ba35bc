"""For many machines: Prometheus rules and a Grafana dashboard over every watchdog's /metrics.

Both ship in the package and are printed by `mlx-watchdog prometheus rules|dashboard`; the
rules are checked and unit-tested with the real `promtool`, and a real Prometheus scraping a
real watchdog fires the wedge alert in the tests.
"""

from __future__ import annotations

from pathlib import Path

HERE = Path(__file__).parent
RUNBOOK = "README.md"  # the README's sections; --runbook-base points them at your copy


def rules(runbook_base: str = RUNBOOK) -> str:
    """The rules file, each runbook_url a section of the README at `runbook_base`."""
    return (HERE / "rules.yml").read_text().replace("@RUNBOOK@", runbook_base.rstrip("/"))


def dashboard() -> str:
    return (HERE / "dashboard.json").read_text()
