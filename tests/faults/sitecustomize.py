"""Faults put into a real `mlx-watchdog` process from outside, for the tests and bench/faults.py
only: this folder on PYTHONPATH makes Python import it at start-up. The package knows nothing
of it.

MLXWD_FAULT_CLOCK_FILE=PATH: the wall clock (time.time) is stepped by the seconds written in
PATH (read every 0.1 s), as a person or NTP stepping the system clock would; the span clock
(time.monotonic) goes on untouched, as the kernel keeps it.

MLXWD_FAULT_HANG_TICK=PATH: once PATH exists, every tick of the daemon blocks forever (a
deadlock in a tick, as a bug or a stuck library call would cause).
"""

import os
import threading
import time

_clock = os.environ.get("MLXWD_FAULT_CLOCK_FILE")
if _clock:  # first: the package's default arguments take time.time as it is when imported
    _real_time = time.time
    _offset = [0.0]

    def _follow(path: str) -> None:
        while True:
            try:
                with open(path) as fh:
                    _offset[0] = float(fh.read().strip() or 0)
            except (OSError, ValueError):
                pass
            time.sleep(0.1)

    threading.Thread(target=_follow, args=(_clock,), daemon=True).start()
    time.time = lambda: _real_time() + _offset[0]

_hang = os.environ.get("MLXWD_FAULT_HANG_TICK")
if _hang:
    from mlx_watchdog.daemon import run as _daemon

    _tick = _daemon.Daemon.tick

    def _hanging_tick(self, name):  # type: ignore[no-untyped-def]
        if os.path.exists(_hang):
            threading.Event().wait()
        return _tick(self, name)

    _daemon.Daemon.tick = _hanging_tick  # type: ignore[method-assign]
