"""A process's GPU time on macOS, without root: the sign of work for a server that computes on
the GPU, where its thread waits in Metal and its CPU says nothing (MLX's `mx.eval` blocks on a
Metal event; a healthy 100 s prefill used about 1.3 s of CPU, Rapid-MLX #1363).

Each Metal client of a process is an `AGXDeviceUserClient` in the IORegistry, a child of the
GPU's `IOAccelerator`; its `IOUserClientCreator` is `"pid N, name"` (the name cut at 16
characters: the PID is matched, never the name), and `AppUsage` is an array of dicts whose
`accumulatedGPUTime` (ns) summed over the PID's clients is its GPU time, Activity Monitor's
"GPU Time" (mactop `internal/app/native_stats.go`; wieslawsoltes/ActivityMonitor's
GPU_VALIDATION.md; on an Intel GPU the key sits on the client itself). `ioreg -a` prints them
as an XML plist. Read under a deadline and a byte cap; anything else is `Unreadable`, an
unknown sign with its reason, never a verdict.
"""

from __future__ import annotations

import plistlib
import re
from collections.abc import Iterator
from typing import Any

from mlx_watchdog.sense.tool import ToolRun, Unreadable, answer, bounded

IOREG = ("ioreg", "-r", "-c", "AGXDeviceUserClient", "-d", "1", "-a")
IOREG_TIMEOUT = 2.0  # s an ioreg may take
IOREG_CAP = 4 << 20  # bytes of its answer: a few hundred clients' properties are well under
DEPTH = 6  # nesting read at most: the entries sit at the top, or one level under a parent
CREATOR = re.compile(r"^\s*pid\s+(\d+)\s*,")


def gpu_time_ns(pid: int, run: ToolRun | None = None) -> int:
    """The GPU time of `pid` so far, in ns (Unreadable: why it cannot be told)."""
    out = answer(list(IOREG), run or bounded(IOREG_CAP, IOREG_TIMEOUT), IOREG_CAP)
    return parse(out, pid)


def parse(data: bytes, pid: int) -> int:
    """The summed `accumulatedGPUTime` of `pid`'s clients in ioreg's XML plist."""
    if not data.strip():
        raise Unreadable("ioreg printed nothing (no GPU client on this machine)")
    try:
        doc = plistlib.loads(data, fmt=plistlib.FMT_XML)
    except Exception as exc:  # expat's, binascii's, ValueError: each means garbage
        raise Unreadable(f"ioreg's answer is not a property list ({type(exc).__name__})") from None
    total, clients = 0, 0
    for entry in _entries(doc, DEPTH):
        if _creator(entry.get("IOUserClientCreator")) != pid:
            continue
        ns = _gpu_ns(entry)
        if ns is not None:
            total, clients = total + ns, clients + 1
    if not clients:
        raise Unreadable(f"PID {pid} has no GPU client with a GPU time in the IORegistry")
    return total


def _entries(node: Any, depth: int) -> Iterator[dict[str, Any]]:
    if depth <= 0:
        return
    if isinstance(node, dict):
        if "IOUserClientCreator" in node:
            yield node
        for child in node.get("IORegistryEntryChildren", ()) or ():
            yield from _entries(child, depth - 1)
    elif isinstance(node, list):
        for item in node:
            yield from _entries(item, depth - 1)


def _creator(value: object) -> int | None:
    if not isinstance(value, str):
        return None
    found = CREATOR.match(value)
    return int(found.group(1)) if found else None


def _gpu_ns(entry: dict[str, Any]) -> int | None:
    """One client's GPU time: its AppUsage entries' sum (Apple silicon), or the key on the
    client itself (an Intel GPU's driver); None where it has neither."""
    usage = entry.get("AppUsage")
    if isinstance(usage, list):
        times = [u.get("accumulatedGPUTime") for u in usage if isinstance(u, dict)]
        counted = [t for t in times if isinstance(t, int) and _counter(t)]
        if counted:
            return sum(counted)
    own = entry.get("accumulatedGPUTime")
    return own if isinstance(own, int) and _counter(own) else None


def _counter(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 63
