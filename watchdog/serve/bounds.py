"""How long the watchdog's own stop may take. The service managers that run it must wait
longer (launchd's ExitTimeOut, systemd's TimeoutStopSec), so `service` reads these too."""

STOP_TIMEOUT = 20.0  # for a restart in progress to finish by itself
INTERRUPT_TIMEOUT = 5.0  # then for its interrupted command to end
