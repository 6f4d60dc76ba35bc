"""The watchdog's own requests a short-lived command leaves on a server when it exits
(`left-probes.json` in the state folder and in the user's default one): what every check reads
so that such a request is never taken for a client that gave up, nor for a live one."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from mlx_watchdog.config import default_state_dir
from mlx_watchdog.record.private import UnsafeState, check_private, read_private
from mlx_watchdog.sense.findings import Address

LEFT_PROBES_FILE = "left-probes.json"


class LeftProbes:
    """Client addresses of the watchdog's own requests that a short-lived command (`probe`,
    `drill`, `calibrate`) may leave on the server when it exits.

    When such a process exits, its probe's socket turns CLOSE_WAIT on the server: abandoned,
    but a one-token request, not a client's prompt. Each address is written as soon as it
    connects, to the state folder's record and to the user's default one, and every check
    reads both: so a person's `probe` with another config or state folder leaves no trace the
    daemon takes for a departed client, nor for a live one while it runs. Entries expire on the
    wall clock: they outlive the process that wrote them.
    """

    def __init__(
        self, paths: Path | list[Path] | None, wall: Callable[[], float] = time.time
    ) -> None:
        given = [] if paths is None else [paths] if isinstance(paths, Path) else paths
        self.paths = list(dict.fromkeys(given))
        self.wall = wall
        self._lock = threading.Lock()
        self._later: dict[Address, float] = {}  # shortened expiries, written with the next add
        self._cache: dict[Path, tuple[str, list[tuple[str, int, float]]]] = {}

    def load(self) -> list[Address]:
        found = ((ip, port) for path in self.paths for ip, port, _ in self._entries(path))
        return list(dict.fromkeys(found))

    def add(self, address: Address, keep_for: float) -> None:
        until = self.wall() + keep_for
        key = (address[0], int(address[1]))
        with self._lock:
            later = dict(self._later)
            self._later.clear()
            for path in self.paths:
                # Read, changed and replaced under a lock other processes honour too: a
                # person's `probe` beside the daemon must not lose the daemon's entry, nor its own.
                with _locked(path):
                    kept = [
                        (ip, port, min(until_, later.get((ip, port), until_)))
                        for ip, port, until_ in self._entries(path)
                        if (ip, port) != key
                    ]
                    self._write(path, [*kept, (*key, until)])

    def shorten(self, address: Address, keep_for: float) -> None:
        """An answered request needs its entry only a little longer: said with the next `add`,
        not by a write of its own (a daemon probing every second wrote twice a probe)."""
        with self._lock:
            self._later[(address[0], int(address[1]))] = self.wall() + keep_for

    def _write(self, path: Path, entries: list[tuple[str, int, float]]) -> None:
        try:
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            check_private(path.parent)
            # A fresh file of our own (O_EXCL, 0600), renamed over the record: a planted
            # symlink is replaced, never written through.
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".left-probes-")
            with os.fdopen(fd, "w") as fh:
                fh.write(json.dumps(entries))
            os.replace(tmp, path)
        except (OSError, UnsafeState):
            pass  # losing this only makes a later check count one tiny request as abandoned

    def _entries(self, path: Path) -> list[tuple[str, int, float]]:
        try:
            # Only a record in a folder of this user's that no one else writes: a forged entry
            # would hide a live client, whose request a cancel could then end.
            check_private(path.parent)
            now = self.wall()
            return [e for e in self._parsed(path) if e[2] > now]
        except (OSError, UnsafeState, ValueError, TypeError, OverflowError, RecursionError):
            return []

    def _parsed(self, path: Path) -> list[tuple[str, int, float]]:
        """The record's entries, parsed again only when its text changed (every check reads
        it; most find it as the last look left it)."""
        text = read_private(path)
        cached = self._cache.get(path)
        if cached is not None and cached[0] == text:
            return cached[1]
        raw = json.loads(text)
        entries = [(str(ip), int(port), float(until)) for ip, port, until in raw[-1000:]]
        self._cache[path] = (text, entries)
        return entries


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on the record's lock file beside it (0600, never through a link).
    Without one (a folder not ours, not writable) the update goes on unlocked: losing an entry
    only makes a later check count one tiny request as abandoned."""
    fd = -1
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        check_private(path.parent)
        lock = path.with_name(f".{path.name}.lock")
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
    except (OSError, UnsafeState):
        if fd >= 0:
            os.close(fd)
            fd = -1
    try:
        yield
    finally:
        if fd >= 0:
            os.close(fd)  # closing releases the lock


def left_probes(state_dir: Path) -> LeftProbes:
    """The leftover-probe records every check of this watchdog's servers reads and writes."""
    return LeftProbes([state_dir / LEFT_PROBES_FILE, default_state_dir() / LEFT_PROBES_FILE])
