"""The record of the watchdog's own leftover requests, shared by processes: none loses
another's entry."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from mlx_watchdog.record.left_probes import LeftProbes

ADDER = """
import sys
from pathlib import Path
from mlx_watchdog.record.left_probes import LeftProbes
left = LeftProbes(Path(sys.argv[1]))
base = int(sys.argv[2])
for n in range(int(sys.argv[3])):
    left.add(("127.0.0.1", base + n), keep_for=600)
"""


def test_processes_adding_at_once_lose_no_entry(tmp_path: Path) -> None:
    """Four processes add 60 entries each, all at once, to one record: every entry is there
    (read, changed and replaced under a lock each honours)."""
    record = tmp_path / "state" / "left-probes.json"
    each, writers = 60, 4
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", ADDER, str(record), str(10_000 * (w + 1)), str(each)]
        )
        for w in range(writers)
    ]
    for p in procs:
        assert p.wait(120) == 0
    found = set(LeftProbes(record).load())
    wanted = {("127.0.0.1", 10_000 * (w + 1) + n) for w in range(writers) for n in range(each)}
    assert found == wanted, f"{len(wanted - found)} entries lost"
    lock = record.with_name(".left-probes.json.lock")
    assert lock.exists() and lock.stat().st_mode & 0o777 == 0o600
