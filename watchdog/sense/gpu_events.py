"""The GPU resets macOS recorded: its `gpuEvent-*.ips` reports (ollama #18213), kept under
/Library/Logs/DiagnosticReports (later moved to its Retired folder) and the user's own. Only
their names and times are read, each folder's listing bounded: a report is evidence that
corroborates, never a cause alone (judge/cause.py).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

from mlx_watchdog.sense import platform

LISTED_MAX = 2000  # entries a folder listing reads at most
KEPT = 3  # report names kept, newest first

GpuEvents = Callable[[float], tuple[str, ...]]  # since (wall time) -> report names


def report_folders(home: Path | None = None) -> tuple[Path, ...]:
    """Where macOS writes them; none elsewhere (Linux records a reset in the kernel's log)."""
    if not platform.is_mac():
        return ()
    system = Path("/Library/Logs/DiagnosticReports")
    user = (home or Path.home()) / "Library/Logs/DiagnosticReports"
    return (system, system / "Retired", user, user / "Retired")


def gpu_events(since: float, folders: Iterable[Path] | None = None) -> tuple[str, ...]:
    """The names of the GPU event reports written at or after `since`, newest first."""
    found: list[tuple[float, str]] = []
    for folder in report_folders() if folders is None else folders:
        try:
            with os.scandir(folder) as entries:
                for n, entry in enumerate(entries):
                    if n >= LISTED_MAX:
                        break
                    if not (entry.name.startswith("gpuEvent") and entry.name.endswith(".ips")):
                        continue
                    try:
                        written = entry.stat(follow_symlinks=False).st_mtime
                    except OSError:
                        continue
                    if written >= since:
                        found.append((written, entry.name))
        except OSError:
            continue  # absent or not readable: nothing recorded that we can see
    return tuple(name for _, name in sorted(found, reverse=True)[:KEPT])
