"""What a bug report upstream needs, taken just before a restart throws it away.

mlx-lm #1834 (a deadlock, `/v1/models` 200 for 12 days) and #1493 (a hang at 0% CPU after the
prefill) were reported without a stack or the server's last words. Before a restart the watchdog
keeps the server's Python stacks (`py-spy dump` where it is installed and the OS permits it;
macOS `sample`), the last lines of its log and its socket table, all within BUDGET seconds: the
restart waits that long at most. Each part that cannot be had says why instead.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import psutil

from mlx_watchdog.sense import platform, selfdump
from mlx_watchdog.sense.files import open_regular

BUDGET = 2.0  # seconds the whole dump may delay a restart
STACK_MAX = 64 * 1024  # characters of stacks kept
LOG_TAIL_MAX = 32 * 1024  # bytes of the log's end kept (whole lines)
SOCKETS_MAX = 200


@dataclass(frozen=True)
class Dump:
    """A server's last words before a restart: its stacks, its log's tail, its sockets."""

    at: float  # wall time it was taken
    pid: int | None
    stack: str | None = None
    stack_problem: str | None = None
    log_tail: str | None = None
    log_problem: str | None = None
    sockets: tuple[str, ...] = field(default_factory=tuple)
    took_s: float = 0.0
    versions: tuple[str, ...] = field(default_factory=tuple)  # "mlx_lm 0.32.2", beside its Python

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["sockets"] = list(self.sockets)
        doc["versions"] = list(self.versions)
        return doc


RunCommand = Callable[..., "subprocess.CompletedProcess[str]"]


def take(
    pid: int | None,
    log_file: Path | None,
    *,
    budget: float = BUDGET,
    run: RunCommand = subprocess.run,
    mono: Callable[[], float] = time.monotonic,
    wall: Callable[[], float] = time.time,
) -> Dump:
    """The server's stacks, log tail and sockets, within `budget` seconds."""
    start = mono()
    tail, log_problem = _log_tail(log_file)
    sockets = _sockets(pid)
    stack, stack_problem = None, None
    if pid is not None and log_file is not None and own_first(pid):
        stack, stack_problem = selfdump.dump(pid, log_file)  # its own, where no tool serves
    if stack is None:
        stack, stack_problem = stack_text(pid, max(0.1, budget - (mono() - start)), run)
    return Dump(
        at=wall(),
        pid=pid,
        stack=stack,
        stack_problem=stack_problem,
        log_tail=tail,
        log_problem=log_problem,
        sockets=sockets,
        took_s=round(mono() - start, 3),
        versions=versions(pid),
    )


def stack_command(pid: int) -> list[str] | None:
    """How this OS dumps a process's stacks: py-spy (beside this Python, or on PATH); on macOS,
    where py-spy needs root, `sample` for a user."""
    beside = Path(sys.executable).parent / "py-spy"
    spy = str(beside) if beside.exists() else shutil.which("py-spy")
    mac = platform.is_mac()
    if mac and os.geteuid() != 0 and shutil.which("sample"):
        return ["sample", str(pid), "1", "-file", "/dev/stdout"]
    return None if spy is None else [spy, "dump", "--pid", str(pid)]


def own_first(pid: int, command: Callable[[int], list[str] | None] = stack_command) -> bool:
    """The server's own dump (sense/selfdump.py) before a tool: on a Mac (py-spy needs root
    there, `sample` has no Python frames), or where no tool is installed."""
    return platform.is_mac() or command(pid) is None


def stack_text(
    pid: int | None,
    timeout: float,
    run: RunCommand,
    *,
    command: Callable[[int], list[str] | None] | None = None,
) -> tuple[str | None, str | None]:
    """The stack tool's output, or why there is none."""
    if pid is None:
        return None, "no server process to dump"
    argv = (command or stack_command)(pid)
    if argv is None:
        return None, "py-spy is not installed (pip install py-spy)"
    try:
        done = run(
            argv,
            capture_output=True,
            text=True,
            encoding="utf-8",
            errors="replace",  # a tool's stray bytes are its output still, never a failure
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return None, f"{Path(argv[0]).name} took longer than {timeout:.1f} s"
    except OSError as exc:
        return None, f"{Path(argv[0]).name} could not run: {exc.strerror or exc}"
    if done.returncode != 0:
        said = (done.stderr or done.stdout or "").strip().splitlines()
        why = said[-1][:300] if said else f"exit {done.returncode}"
        return None, f"{Path(argv[0]).name} failed: {why}"
    return done.stdout[:STACK_MAX], None


def _log_tail(path: Path | None) -> tuple[str | None, str | None]:
    if path is None:
        return None, None
    try:
        with open_regular(path, follow=False) as fh:
            fh.seek(max(0, os.fstat(fh.fileno()).st_size - LOG_TAIL_MAX))
            data = fh.read(LOG_TAIL_MAX)
    except OSError as exc:
        return None, f"cannot read the server's log {path}: {exc.strerror or exc}"
    if len(data) == LOG_TAIL_MAX and b"\n" in data:
        data = data[data.index(b"\n") + 1 :]  # from the first whole line
    return data.decode("utf-8", errors="replace"), None


def _sockets(pid: int | None) -> tuple[str, ...]:
    if pid is None:
        return ()
    try:
        conns = psutil.Process(pid).net_connections("tcp")
    except (psutil.Error, OSError) as exc:
        return (f"cannot list its sockets: {exc}",)
    lines = [
        f"{_addr(c.laddr)} <- {_addr(c.raddr)} {c.status}"
        if c.raddr
        else f"{_addr(c.laddr)} {c.status}"
        for c in conns[:SOCKETS_MAX]
    ]
    if len(conns) > SOCKETS_MAX:
        lines.append(f"... and {len(conns) - SOCKETS_MAX} more")
    return tuple(lines)


PACKAGES = ("mlx_lm", "mlx", "mlx_metal", "vllm_mlx", "mlx_vlm", "omlx")
VERSIONS_MAX = 64  # site-packages folders looked in


def versions(pid: int | None) -> tuple[str, ...]:
    """The server's packages and their versions, from the dist-info folders beside its Python
    (a venv's or a framework's site-packages): what a bug report upstream asks first. Nothing
    is run; a server that is not Python, or not readable, gives none."""
    if pid is None:
        return ()
    try:
        proc = psutil.Process(pid)
        argv0 = Path(proc.cwd()) / proc.cmdline()[0]  # a venv's python: a link, not followed
        exes = (argv0, Path(proc.exe()))
    except (psutil.Error, OSError, ValueError, IndexError):
        return ()
    found: dict[str, str] = {}
    sites = itertools.chain.from_iterable(
        e.parent.parent.glob("lib/python3*/site-packages") for e in exes
    )
    for site in itertools.islice(sites, 4):
        try:
            names = [p.name for p in itertools.islice(site.iterdir(), 20000)]
        except OSError:
            continue
        for name in names:
            if not name.endswith(".dist-info") or "-" not in name:
                continue
            package, version = name[: -len(".dist-info")].split("-", 1)
            if package.lower() in PACKAGES:
                found.setdefault(package.lower(), version)
    return tuple(f"{p} {found[p]}" for p in PACKAGES if p in found)


def _addr(a: Any) -> str:
    return f"{a.ip}:{a.port}" if a else "-"
