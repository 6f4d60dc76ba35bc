"""A system tool's answer, read as every answer from outside is: under a deadline and a byte cap
(sense/progress.py's `bounded_run`), its failure a reason in words, never an exception that
escapes. The macOS readers (`ioreg`, `netstat`, `log`) run through it; tests inject `ToolRun`."""

from __future__ import annotations

from collections.abc import Callable

from mlx_watchdog.sense.progress import bounded_run

ToolRun = Callable[[list[str]], tuple[int, bytes, bytes]]  # argv -> exit code, stdout, stderr


class Unreadable(Exception):
    """What a tool said could not be had or read: the reason, in words."""


def bounded(cap: int, timeout: float) -> ToolRun:
    """Runs a command with that cap on its output and that deadline in all."""
    return lambda argv: bounded_run(argv, cap=cap, timeout=timeout)


def answer(argv: list[str], run: ToolRun, cap: int) -> bytes:
    """The tool's output; Unreadable when it cannot run, fails, or fills its cap."""
    name = argv[0]
    try:
        code, out, err = run(argv)
    except OSError as exc:
        raise Unreadable(f"{name} could not run: {exc.strerror or exc}") from None
    if code != 0:
        said = err.decode("utf-8", "replace").strip().splitlines()
        raise Unreadable(f"{name} failed: {said[-1][:200] if said else f'exit {code}'}")
    if len(out) >= cap:
        raise Unreadable(f"{name} printed more than {cap >> 10} KiB")
    return out
