"""How long the watchdog's own stop may take. The service managers that run it must wait
longer (launchd's ExitTimeOut, systemd's TimeoutStopSec), so `service` reads these too."""

STOP_TIMEOUT = 20.0  # for a restart in progress to finish by itself
INTERRUPT_TIMEOUT = 5.0  # then for its interrupted command to end


def fresh_for(interval: float, slow_after: float, models_timeout: float) -> float:
    """How old a verdict may be and still be served as current: a few intervals, plus what one
    tick may take by its own deadlines (the wait for a quick token, /v1/models, the health
    route and load report, the process). Older, the watchdog is blind and says so."""
    from mlx_watchdog.sense.load import REPORT_TIMEOUT

    tick = min(slow_after, interval / 2) + models_timeout + 2 * min(models_timeout, REPORT_TIMEOUT)
    return 3 * interval + slow_after + tick + 2.0
