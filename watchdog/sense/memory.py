"""The machine's memory and swap, for naming memory pressure as a wedge's cause.

psutil reads both on macOS too (`host_statistics64` and `sysctl vm.swapusage`, what `vm_stat`
and `sysctl` print), so no command is run. Swap is followed from the first look of a wait: its
growth during the wait is the sign, a swap file left from yesterday is not.
"""

from __future__ import annotations

from collections.abc import Callable

import psutil

from mlx_watchdog.sense.signs import Machine, gib

TOO_MUCH = 0.75  # of the machine's memory, held by its servers together


def resident(pid: int | None) -> int:
    """A process's resident memory in bytes; 0 when it cannot be read."""
    if pid is None:
        return 0
    try:
        return int(psutil.Process(pid).memory_info().rss)
    except (OSError, psutil.Error):
        return 0


def memory_holders(held: list[tuple[str, int]], total: int) -> str:
    """Which servers hold the machine's memory, largest first; said plainly when together
    they hold more than the machine can give (mlx-lm #1252: each wiring ~75% of it)."""
    running = sorted(((n, b) for n, b in held if b > 0), key=lambda nb: -nb[1])
    if not running:
        return ""
    whole = sum(b for _, b in running)
    each = ", ".join(f"{n} {gib(b)}" for n, b in running)
    said = f"resident in servers: {gib(whole)} of the machine's {gib(total)} ({each})"
    if len(running) > 1 and total > 0 and whole > total * TOO_MUCH:
        said += "; together more than the machine can give them: run fewer or smaller at once"
    return said


def read_machine() -> Machine | None:
    try:
        vm, swap = psutil.virtual_memory(), psutil.swap_memory()
    except (OSError, RuntimeError, psutil.Error):
        return None
    return Machine(vm.total, vm.available, swap.total, swap.used)


class MemoryWatch:
    """The machine's memory at each look of one wait, with its swap's growth since the first."""

    def __init__(self, read: Callable[[], Machine | None] = read_machine) -> None:
        self.read = read
        self._swap_at_start: int | None = None

    def look(self) -> Machine | None:
        m = self.read()
        if m is None:
            return None
        if self._swap_at_start is None:
            self._swap_at_start = m.swap_used
        return Machine(
            m.total,
            m.available,
            m.swap_total,
            m.swap_used,
            max(0, m.swap_used - self._swap_at_start),
        )

    def reset(self) -> None:
        self._swap_at_start = None


SETTLE_MAX = 30.0  # seconds to wait for a stopped server's memory before starting anyway
SETTLE_SHARE = 0.8  # of its resident memory back: the rest may be cache the system keeps


class Settle:
    """Between a memory-pressure stop and the start: wait (bounded) until the memory the
    stopped server held is available again, and say how it went.

    A SIGKILLed MLX process may leave its wired memory unreturned until a reboot (oMLX #2184),
    and a server started before the old one's memory is back starts into the same pressure."""

    def __init__(
        self,
        freed: int,
        *,
        read: Callable[[], Machine | None] = read_machine,
        sleep: Callable[[float], None],
        mono: Callable[[], float],
        limit: float = SETTLE_MAX,
        stopping: Callable[[], bool] = lambda: False,
    ) -> None:
        self.freed = max(0, freed)
        self.read = read
        self.sleep = sleep
        self.mono = mono
        self.limit = limit
        self.stopping = stopping
        self.before = read()  # taken before the stop

    def __call__(self) -> str:
        start = self.mono()
        if self.before is None:
            return "memory could not be read: started without waiting for it"
        goal = self.before.available + int(self.freed * SETTLE_SHARE)
        now = self.before
        while True:
            m = self.read()
            if m is None:  # no reading now: no figure to say, and nothing to wait on
                waited = self.mono() - start
                return (
                    f"memory could not be read after the stop ({waited:.1f} s): "
                    "started without waiting for it"
                )
            now = m
            waited = self.mono() - start
            if now.available >= goal:
                return (
                    f"memory back after {waited:.1f} s: {gib(now.available)} available "
                    f"(+{gib(now.available - self.before.available)})"
                )
            if self.stopping():
                return (
                    f"the watchdog is stopping: started after {waited:.1f} s, "
                    f"{gib(now.available)} available"
                )
            if waited >= self.limit:
                return (
                    f"memory not back after {self.limit:g} s: {gib(now.available)} available "
                    f"(+{gib(max(0, now.available - self.before.available))} of the "
                    f"{gib(self.freed)} the server held); started anyway"
                )
            self.sleep(0.5)
