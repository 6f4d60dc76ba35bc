"""The daemon: wiring around each server's cycle (scheduler, signals, reload, endpoint start)."""

from mlx_watchdog.daemon.run import Daemon

__all__ = ["Daemon"]
