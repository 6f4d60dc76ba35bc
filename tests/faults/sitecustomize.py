"""Faults put into a real `mlx-watchdog` process from outside, for the tests only: this folder
on PYTHONPATH makes Python import it at start-up. Nothing in the package knows of it.

MLXWD_FAULT_HANG_TICK=PATH: once PATH exists, every tick of the daemon blocks forever (a
deadlock in a tick, as a bug or a stuck library call would cause)."""

import os
import threading

_hang = os.environ.get("MLXWD_FAULT_HANG_TICK")
if _hang:
    from mlx_watchdog.serve import daemon as _daemon

    _tick = _daemon.Daemon.tick

    def _hanging_tick(self, name):  # type: ignore[no-untyped-def]
        if os.path.exists(_hang):
            threading.Event().wait()
        return _tick(self, name)

    _daemon.Daemon.tick = _hanging_tick  # type: ignore[method-assign]
