"""A GPU-style hang on Linux: the thread that does the model's arithmetic held stopped.

On a Mac a hung GPU leaves the server's process idle: its generation thread waits in
`mx.eval` for a command buffer that never completes, while the HTTP threads answer
`/v1/models` and `/health`. On Linux, MLX's CPU stream runs the arithmetic on a thread of its
own; stopping that one thread (ptrace's PTRACE_SEIZE then PTRACE_INTERRUPT: the thread alone,
not its process) makes the same server: no token ever, near 0 % CPU, every other thread
answering. It lasts until the process ends.

The arithmetic thread is found as the one that works hardest once the server computes
(`working_thread`): Python's generation thread waits on it and uses a tenth of its CPU, and a
fresh server's has done less than the threads that loaded the model.
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from pathlib import Path

_PTRACE_SEIZE = 0x4206
_PTRACE_INTERRUPT = 0x4207
_WALL = 0x40000000  # waitpid's __WALL: a thread of another process is waited on as a tracee


def _ticks(pid: int) -> dict[int, int]:
    """Each thread's CPU time so far (clock ticks), the main one left out."""
    out = {}
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task") if int(t) != pid]
    except OSError:
        return {}
    for tid in tids:
        try:
            stat = Path(f"/proc/{pid}/task/{tid}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[tid] = int(fields[11]) + int(fields[12])  # utime + stime
    return out


def working_thread(pid: int, timeout: float, *, ticks: int = 20, poll: float = 0.05) -> int | None:
    """The thread that works hardest from now until one has used `ticks` of CPU (200 ms,
    more than the generation thread spends tokenizing a long prompt): the arithmetic thread
    once the server computes. A fresh server's has done less than the threads that loaded the
    model, so the total so far is no guide; None if nothing worked."""
    before = _ticks(pid)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = _ticks(pid)
        if not now:
            return None
        grown = {t: n - before.get(t, 0) for t, n in now.items()}
        tid = max(grown, key=lambda t: grown[t])
        if grown[tid] >= ticks:
            return tid
        time.sleep(poll)
    return None


class Hang:
    """Holds one thread stopped until its process ends. ptrace binds a tracee to the thread
    that seized it, so one thread of ours seizes, interrupts, and then waits for the end."""

    def __init__(self, tid: int) -> None:
        self.tid = tid
        self.error: str | None = None
        self._held = threading.Event()
        self._thread = threading.Thread(target=self._hold, name=f"hang-{tid}", daemon=True)

    def start(self, timeout: float = 5.0) -> bool:
        """True once the thread is stopped; False (and `error` says why) if it could not be."""
        self._thread.start()
        self._held.wait(timeout)
        return self.error is None and self._held.is_set()

    def ended(self, timeout: float) -> bool:
        """True once the held thread's process has ended and the hold let go."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def _hold(self) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        libc.ptrace.restype = ctypes.c_long
        for request in (_PTRACE_SEIZE, _PTRACE_INTERRUPT):
            if libc.ptrace(request, self.tid, None, None) != 0:
                self.error = f"ptrace: {os.strerror(ctypes.get_errno())}"
                self._held.set()
                return
        stopped = False
        while True:  # each stop is left stopped; only the thread's end lets go
            try:
                _, status = os.waitpid(self.tid, _WALL)
            except ChildProcessError:
                break
            if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                break
            if os.WIFSTOPPED(status) and not stopped:
                stopped = True
                self._held.set()  # stopped now, not only asked to stop
        if not stopped:
            self.error = "the thread ended before it stopped"
            self._held.set()
