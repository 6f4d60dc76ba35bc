"""mlx-watchdog: a liveness watchdog for local LLM inference servers."""

__version__ = "0.1.0"
