"""The machine's memory and swap, for naming memory pressure as a wedge's cause.

psutil reads both on macOS too (`host_statistics64` and `sysctl vm.swapusage`, what `vm_stat`
and `sysctl` print), so no command is run. Swap is followed from the first look of a wait: its
growth during the wait is the sign, a swap file left from yesterday is not.
"""

from __future__ import annotations

from collections.abc import Callable

import psutil

from mlx_watchdog.sense.signs import Machine


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
