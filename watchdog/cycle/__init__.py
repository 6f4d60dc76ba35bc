"""One owner for each server's cycle: verdicts, phase, incident, advice, events."""

from mlx_watchdog.cycle.crew import Conflict, Crew, NoSink, Sink
from mlx_watchdog.cycle.cycle import Cycle
from mlx_watchdog.cycle.phases import TRANSITIONS, OpenIncident, Phase

__all__ = ["TRANSITIONS", "Conflict", "Crew", "Cycle", "NoSink", "OpenIncident", "Phase", "Sink"]
