"""The server's stacks as it dumps them itself: a server the watchdog starts runs through
sense/stacks_launcher.py, which registers faulthandler on SIGURG; the watchdog signals that
very process (verified by its PID and its command line naming the launcher, read just before)
and reads the dump from the server's log (sense/stack.py reads its threads). No root and no
debugger: what a Mac needs, where py-spy needs root and `sample` shows no Python frames.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import psutil

from mlx_watchdog.sense.files import open_regular

LAUNCHER = Path(__file__).with_name("stacks_launcher.py")
SIGNAL = signal.SIGURG
WAIT = 1.0  # s for the dump to appear in the log
SETTLE = 0.1  # s with no new bytes after it began: it is whole
DUMP_MAX = 256 * 1024  # bytes of the log read after the signal
PYTHON = re.compile(r"^python(\d+(\.\d+)?)?$")


def launched(cmdline: Sequence[str]) -> bool:
    """The process runs through the launcher: its handler is set (or, starting, SIGURG is still
    ignored by default)."""
    return any(Path(a).name == LAUNCHER.name for a in cmdline[1:4])


def wrap(argv: Sequence[str], env: Mapping[str, str] | None = None) -> tuple[str, ...] | None:
    """`argv` run through the launcher by the same Python, or None where it is not a Python
    server the launcher can run: `python -m module ...`, `python script ...`, or a script whose
    first line names its Python (a console script such as `mlx_lm.server`)."""
    if not argv:
        return None
    if PYTHON.match(Path(argv[0]).name) and len(argv) >= 2:
        if argv[1] == "-m" and len(argv) >= 3:
            return (argv[0], str(LAUNCHER), *argv[1:])
        if not argv[1].startswith("-") and Path(argv[1]).is_file():
            return (argv[0], str(LAUNCHER), *argv[1:])
        return None
    path = (env or {}).get("PATH") or os.environ.get("PATH")
    found = shutil.which(argv[0], path=path)
    if found is None:
        return None
    python = _shebang(Path(found), path)
    if python is None:
        return None
    return (python, str(LAUNCHER), found, *argv[1:])


def _shebang(script: Path, path: str | None) -> str | None:
    try:
        with script.open("rb") as fh:
            first = fh.readline(512)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode("utf-8", "replace").split()
    if len(words) == 2 and Path(words[0]).name == "env":
        words = [shutil.which(words[1], path=path) or ""]
    if len(words) != 1 or not PYTHON.match(Path(words[0]).name):
        return None
    return words[0]


def dump(
    pid: int,
    log: Path,
    *,
    kill: Callable[[int, int], None] = os.kill,
    mono: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> tuple[str | None, str | None]:
    """Ask the server to dump its stacks, and read them from its log; (text, why not)."""
    try:
        cmdline = psutil.Process(pid).cmdline()
    except (psutil.Error, OSError) as exc:
        return None, f"cannot read PID {pid}'s command line: {exc}"
    if not launched(cmdline):
        return None, "it was not started through the watchdog's stack launcher"
    try:
        start = log.stat().st_size
        kill(pid, SIGNAL)
    except OSError as exc:
        return None, f"cannot ask PID {pid} for its stacks: {exc.strerror or exc}"
    ends, size, moved = mono() + WAIT, start, mono()
    while mono() < ends:
        sleep(0.02)
        try:
            now = log.stat().st_size
        except OSError as exc:
            return None, f"cannot read its log {log}: {exc.strerror or exc}"
        if now != size:
            size, moved = now, mono()
        elif size > start and mono() - moved >= SETTLE:
            break
    try:
        with open_regular(log, follow=False) as fh:
            fh.seek(start)
            text = fh.read(DUMP_MAX).decode("utf-8", "replace")
    except OSError as exc:
        return None, f"cannot read its log {log}: {exc.strerror or exc}"
    at = text.find("(most recent call first)")
    if at < 0:
        return None, f"no stack dump in its log within {WAIT:g} s"
    begin = text.rfind("\n", 0, at) + 1
    return text[begin:], None
