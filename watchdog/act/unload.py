"""Unloading one wedged model of a server that holds several, instead of restarting the server
(and every model it holds).

Ollama: `keep_alive: 0` asks it to unload the model, which it does only once the model's
requests end, so a wedged one stays; then the model's runner is ended (a child process of the
verified server, `ollama runner` with the model's own blob as its `--model`), and Ollama starts
a new one at the next request (ollama #7606: served again in 1.2 s; ollama #17428). LM Studio:
`lms unload KEY`. Each step bounded; a model still held is a failed unload, and the ladder then
restarts the server (act/ladder.py).
"""

from __future__ import annotations

import json
import shutil
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
import psutil

from mlx_watchdog.act.managers import Outcome, System
from mlx_watchdog.config import ServerConfig
from mlx_watchdog.sense.bounded import send
from mlx_watchdog.sense.models import models_in_memory
from mlx_watchdog.sense.request import MAX_BODY, auth_headers, tls
from mlx_watchdog.sense.text import BadJson, load_json

CALL_TIMEOUT = 5.0
GONE_WAIT = 5.0  # for the model to leave the in-memory list
GONE_POLL = 0.25


@dataclass
class Unloader:
    """Unloads `model` from `server` (its process `pid`, already verified as the server)."""

    server: ServerConfig
    model: str
    pid: int | None
    system: System
    mono: Callable[[], float] = time.monotonic

    def __call__(self) -> Outcome:
        steps: list[str] = []
        if self.server.kind == "ollama":
            return self._ollama(steps)
        if self.server.kind == "lmstudio":
            return self._lmstudio(steps)
        return Outcome(False, f"{self.server.profile.title} has no way to unload one model")

    def _ollama(self, steps: list[str]) -> Outcome:
        said = self._post("/api/generate", {"model": self.model, "keep_alive": 0})
        steps.append(f"asked Ollama to unload {self.model} (keep_alive 0): {said}")
        if self._gone():
            return Outcome(True, f"unloaded {self.model}", tuple(steps))
        steps.append(f"{self.model} still held after {GONE_WAIT:g} s: its request never ends")
        runner, why = self._runner()
        if runner is None:
            return Outcome(False, f"{self.model} stays loaded and {why}", tuple(steps))
        steps.append(self._end(runner))
        if self._gone():
            done = f"ended the runner of {self.model} (PID {runner.pid}); Ollama starts a new one"
            return Outcome(True, done, tuple(steps))
        return Outcome(False, f"{self.model} is still held after its runner ended", tuple(steps))

    def _lmstudio(self, steps: list[str]) -> Outcome:
        lms = shutil.which("lms")
        if lms is None:
            return Outcome(False, "LM Studio's `lms` command is not on the PATH", tuple(steps))
        code, out = self.system.run([lms, "unload", self.model], CALL_TIMEOUT * 2)
        steps.append(f"lms unload {self.model}: exit {code}{': ' + out[-200:] if out else ''}")
        if code == 0 and self._gone():
            return Outcome(True, f"unloaded {self.model} (lms unload)", tuple(steps))
        return Outcome(False, f"{self.model} is still loaded after lms unload", tuple(steps))

    def _send(self, path: str, doc: dict[str, object]) -> tuple[int, bytes]:
        """One JSON POST to the server, within CALL_TIMEOUT and the body cap."""
        return send(
            "POST",
            self.server.url + path,
            headers={**auth_headers(self.server), "Content-Type": "application/json"},
            deadline=CALL_TIMEOUT,
            cap=MAX_BODY,
            body=json.dumps(doc).encode(),
            verify=tls(),
        )

    def _post(self, path: str, doc: dict[str, object]) -> str:
        try:
            status, _ = self._send(path, doc)
        except (httpx.HTTPError, OSError) as exc:
            return f"no answer ({type(exc).__name__})"
        return f"HTTP {status}"

    def _gone(self) -> bool:
        """The model has left the server's in-memory list (bounded)."""
        ends = self.mono() + GONE_WAIT
        while True:
            held = models_in_memory(self.server)
            if held is not None and self.model not in held:
                return True
            if self.mono() >= ends or self.system.interrupted:
                return False
            self.system.sleep(GONE_POLL)

    def _runner(self) -> tuple[psutil.Process | None, str]:
        """The model's runner: a child of the server process whose command line is a runner of
        this model's own blob (from /api/show); one only, or none at all."""
        if self.pid is None:
            return None, "the server's process is not known"
        blobs = self._blobs()
        if not blobs:
            return None, "its blob could not be read from /api/show"
        try:
            children = psutil.Process(self.pid).children(recursive=True)
        except psutil.Error:
            return None, "the server's processes cannot be listed"
        found = [c for c in children if _runs(c, blobs)]
        if len(found) != 1:
            return None, f"{len(found)} runners of its blob are children of PID {self.pid}"
        return found[0], ""

    def _blobs(self) -> tuple[str, ...]:
        try:
            status, body = self._send("/api/show", {"model": self.model})
            doc = load_json(body) if status == 200 else None
        except (httpx.HTTPError, OSError, BadJson):
            return ()
        text = doc.get("modelfile") if isinstance(doc, dict) else None
        if not isinstance(text, str):
            return ()
        return tuple(
            line.split(None, 1)[1].strip()
            for line in text.splitlines()
            if line.startswith("FROM ") and "/blobs/" in line
        )

    def _end(self, runner: psutil.Process) -> str:
        """SIGTERM, then SIGKILL after the server's stop_grace."""
        try:
            runner.send_signal(signal.SIGTERM)
            runner.wait(self.server.restart.stop_grace)
            return f"ended its runner, PID {runner.pid} (SIGTERM)"
        except psutil.TimeoutExpired:
            runner.kill()
            return f"killed its runner, PID {runner.pid} (SIGKILL after {self.server.restart.stop_grace:g} s)"
        except psutil.Error as exc:
            return f"its runner, PID {runner.pid}: {exc}"


def _runs(process: psutil.Process, blobs: Sequence[str]) -> bool:
    try:
        argv = process.cmdline()
    except psutil.Error:
        return False
    return "runner" in argv and any(b in argv for b in blobs)
