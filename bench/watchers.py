"""The watchers compared, each a faithful small model of what people run today.

Every time is divided by the run's compression factor `k` (the ratios stay). Each watcher
restarts the server only through `box.restart(name)`, and counts the generation requests of its
own that it gave up on while the server was still working on them: abandoned requests it made.
"""

from __future__ import annotations

import contextlib
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from bench.harness import TINY, Box
from mlx_watchdog.judge import clearing


class Watcher(Protocol):
    name: str
    detected_at: float | None
    own_abandoned: int

    def start(self) -> None: ...

    def stop(self) -> None: ...


class Loop:
    """A watcher thread: `_loop` runs until `stop()`; a restart after stop is dropped (what it
    sees then is the bench taking the server down)."""

    name = ""
    box: Box
    longest_wait = 5.0  # its longest request: stop() waits that long for the thread

    def __init__(self) -> None:
        self.detected_at: float | None = None
        self.own_abandoned = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.longest_wait + 5)

    def _restart(self) -> None:
        if self._stop.is_set():
            return
        self.detected_at = self.detected_at or time.time()
        self.box.restart(self.name)

    def _loop(self) -> None:
        raise NotImplementedError


class Polling(Loop):
    """A loop that checks every `period`, with a `timeout`, and restarts after `threshold`
    failures in a row. The shape of the common scripts and of a Kubernetes liveness probe."""

    def __init__(
        self, name: str, box: Box, period: float, timeout: float, threshold: int, method: str
    ) -> None:
        super().__init__()
        self.name, self.box, self.method = name, box, method  # "models", "health", "generate"
        self.period, self.timeout, self.threshold = period, timeout, threshold
        self.longest_wait = timeout

    def check(self) -> bool:
        url = self.box.url
        try:
            if self.method == "models":
                return httpx.get(url + "/v1/models", timeout=self.timeout).status_code == 200
            if self.method == "health":
                return httpx.get(url + "/health", timeout=self.timeout).status_code == 200
            r = httpx.post(url + "/v1/chat/completions", json=TINY, timeout=self.timeout)
            return r.status_code == 200
        except httpx.TimeoutException:
            if self.method == "generate":
                self.own_abandoned += 1  # it hung up; the server still owes that request
            return False
        except httpx.HTTPError:
            return False

    def _loop(self) -> None:
        failures = 0
        while not self._stop.wait(self.period):
            if self.check():
                failures = 0
                continue
            failures += 1
            if failures >= self.threshold:
                self._restart()
                failures = 0


def models_probe(box: Box, k: float) -> Polling:
    # GET /v1/models every 10 s, 5 s timeout, restart after 3 failures in a row.
    return Polling("models-probe", box, 10 / k, 5 / k, 3, "models")


def health_probe(box: Box, k: float) -> Polling:
    # The same loop on mlx_lm.server's own GET /health.
    return Polling("health-probe", box, 10 / k, 5 / k, 3, "health")


def k8s_liveness(box: Box, k: float) -> Polling:
    # A generation request as the liveness probe, with Kubernetes' defaults: periodSeconds 10,
    # timeoutSeconds 1, failureThreshold 3 (the kubelet restarts the container).
    return Polling("k8s-liveness", box, 10 / k, 1 / k, 3, "generate")


def k8s_health(box: Box, k: float) -> Polling:
    # Kubernetes' liveness defaults on the server's /health: period 10 s, timeout 1 s, 3 failures.
    # The timeout is the route's latency, not a prefill's: not divided below 1 s.
    return Polling("k8s-health", box, 10 / k, 1.0, 3, "health")


class TimeoutBusy(Loop):
    """A generation probe with a long timeout; a timeout counts as "busy", not dead, and only
    15 minutes of busy in a row lead to a restart (the careful shell watchdogs for MLX)."""

    name = "timeout-busy"

    def __init__(self, box: Box, k: float) -> None:
        super().__init__()
        self.box, self.k = box, k
        self.longest_wait = 120 / k

    def _loop(self) -> None:
        period, timeout, busy_limit = 30 / self.k, 120 / self.k, 900 / self.k
        busy_since: float | None = None
        while not self._stop.wait(period):
            try:
                r = httpx.post(self.box.url + "/v1/chat/completions", json=TINY, timeout=timeout)
                busy_since = None
                if r.status_code != 200:
                    self._restart()
            except httpx.TimeoutException:
                self.own_abandoned += 1
                busy_since = busy_since or time.time()
                if time.time() - busy_since >= busy_limit:
                    self._restart()
                    busy_since = None
            except httpx.HTTPError:
                self._restart()  # refused: the server is down


class BoxManager:
    """mlx-watchdog's manager interface over the bench's Box: restarts go through the Box."""

    kind = "command"
    spawned = False  # the Box runs the server: its start is not the daemon's to time

    def __init__(self, box: Box, by: str = "mlx-watchdog") -> None:
        self.box, self.by = box, by

    def pid(self) -> int | None:
        return self.box.pid()

    def exited(self) -> str | None:
        """The Box owns the process, as the `process` manager does: an exit is seen at once."""
        proc = self.box.proc
        code = None if proc is None or self.box.closed else proc.poll()
        return None if code is None else f"exited with code {code}"

    def start(self) -> None:
        pass

    def stop(self) -> None:
        pass

    def restart(self) -> object:
        from mlx_watchdog.act.managers import Outcome

        before = self.box.pid()
        self.box.restart(self.by)
        return Outcome(True, f"replaced PID {before} with {self.box.pid()}")

    def stop_then_start(self, between: object) -> None:
        return None  # the Box restarts in one step


@dataclass
class MlxWatchdog:
    """The real daemon, with its defaults divided by k, restarting through the Box."""

    box: Box
    k: float
    state_dir: str
    name: str = "mlx-watchdog"
    match: str = "mlx_lm"
    least_cost: bool = True  # false: every wedge restarted (the "restart-always" row)
    # Its wait's own times (judge/clearing.py: the restart cost it assumes until it has
    # measured one, 30 s, and the margin past a wait's end, 5 s) divided by this, as a replay
    # divides every other time; 1 leaves them as they ship.
    scale_waits: float = 1.0
    _shipped: tuple[float, float] | None = None
    detected_at: float | None = None
    own_abandoned: int = 0
    daemon: object = None
    _thread: threading.Thread | None = None
    _failed: BaseException | None = None

    def start(self) -> None:
        from mlx_watchdog.config import ProbeSettings, RestartSettings, parse_config
        from mlx_watchdog.daemon import Daemon

        p, r = ProbeSettings(), RestartSettings()
        k = self.k
        config = parse_config(
            {
                "watchdog": {
                    "interval": f"{30 / k}s",
                    "listen": "off",
                    "state_dir": self.state_dir,
                },
                "server": [
                    {
                        "name": "bench",
                        "url": self.box.url,
                        "match": self.match,
                        "probe": {
                            "slow_after": f"{p.slow_after / k}s",
                            "wedge_after": f"{p.wedge_after / k}s",
                            "max_busy": f"{p.max_busy / k}s",
                            "startup_grace": f"{p.startup_grace / k}s",
                            "hard_timeout": f"{p.hard_timeout / k}s",
                        },
                        "restart": {
                            "window": f"{r.window / k}s",
                            "backoff": f"{r.backoff / k}s",
                            "max_restarts": r.max_restarts,
                            "least_cost": self.least_cost,
                        },
                    }
                ],
            }
        )
        daemon = Daemon(config).open()
        watch = daemon.cycles["bench"]
        watch.manager = BoxManager(self.box, self.name)  # type: ignore[assignment]
        original = watch.emit

        def emit(kind: str, message: str, **data: object) -> None:
            if kind == "detected":
                self.detected_at = self.detected_at or time.time()
            original(kind, message, **data)  # type: ignore[arg-type]

        watch.emit = emit  # type: ignore[method-assign]
        self.daemon = daemon
        if self.scale_waits != 1.0:  # once the daemon is open: stop() puts them back
            self._shipped = (clearing.DEFAULT_RESTART_S, clearing.MARGIN_S)
            clearing.DEFAULT_RESTART_S /= self.scale_waits
            clearing.MARGIN_S /= self.scale_waits
        self._thread = threading.Thread(target=self._run, args=(daemon,), daemon=True)
        self._thread.start()

    def _run(self, daemon: Any) -> None:
        try:
            daemon.run(install_signals=False)
        except BaseException as exc:  # said at stop: a bench on a dead daemon measures nothing
            self._failed = exc

    def stop(self) -> None:
        from mlx_watchdog.daemon import Daemon

        assert isinstance(self.daemon, Daemon)
        self.daemon.stop()
        if self._thread is not None:
            self._thread.join(60)
        if self._shipped is not None:
            clearing.DEFAULT_RESTART_S, clearing.MARGIN_S = self._shipped
        if self._failed is not None:
            raise RuntimeError(f"the watchdog under test failed: {self._failed!r}")


class Traffic(Protocol):
    """What a watcher inside the serving path sees of the clients' requests."""

    last_byte_at: float  # when any client last got a byte of an answer (wall time)
    active: int  # client requests in flight


class Nobody(Loop):
    """No watcher: what the traffic does to the server alone."""

    name = "none"

    def _loop(self) -> None:
        self._stop.wait()


class Watching(Loop):
    """A watcher in the serving path: it sees the clients' traffic."""

    longest = 0.0  # s on the Mac: its longest request

    def __init__(self, box: Box, k: float, traffic: Traffic) -> None:
        super().__init__()
        self.box, self.k, self.traffic = box, k, traffic
        self.longest_wait = self.longest / k


class GPUStack(Watching):
    """GPUStack's check: a real 1-token request every 300 s (15 s timeout), skipped when
    requests were served within the period; 3 failures in a row restart."""

    name = "gpustack"
    longest = 15.0

    def _loop(self) -> None:
        period, failures = 300 / self.k, 0
        while not self._stop.wait(period):
            if time.time() - self.traffic.last_byte_at < period:
                failures = 0
                continue
            try:
                r = httpx.post(
                    self.box.url + "/v1/chat/completions", json=TINY, timeout=15 / self.k
                )
                failures = 0 if r.status_code == 200 else failures + 1
            except httpx.TimeoutException:
                self.own_abandoned += 1
                failures += 1
            except httpx.HTTPError:
                failures += 1
            if failures >= 3:
                self._restart()
                failures = 0


class Lemonade(Watching):
    """lemonade's rule: while a request is active and no chunk came for 90 s, /health every
    5 s; 3 failures in a row restart."""

    name = "lemonade"
    longest = 5.0

    def _loop(self) -> None:
        failures = 0
        while not self._stop.wait(5 / self.k):
            quiet = time.time() - self.traffic.last_byte_at
            if not self.traffic.active or quiet < 90 / self.k:
                failures = 0
                continue
            try:
                ok = httpx.get(self.box.url + "/health", timeout=5 / self.k).status_code == 200
            except httpx.HTTPError:
                ok = False
            failures = 0 if ok else failures + 1
            if failures >= 3:
                self._restart()
                failures = 0


class SGLang(Watching):
    """SGLang's /health_generate rule: healthy when any output came within 20 s; otherwise
    a 1-token request must answer within 20 s. Polled each second."""

    name = "sglang"
    longest = 20.0

    def _loop(self) -> None:
        window = 20 / self.k
        while not self._stop.wait(1 / self.k):
            if time.time() - self.traffic.last_byte_at < window:
                continue
            try:
                r = httpx.post(self.box.url + "/v1/chat/completions", json=TINY, timeout=window)
                ok = r.status_code == 200
            except httpx.TimeoutException:
                self.own_abandoned += 1
                ok = False
            except httpx.HTTPError:
                ok = False
            if ok:
                self.traffic.last_byte_at = max(self.traffic.last_byte_at, time.time())
                continue
            self._restart()
            # Its orchestrator waits for the new server to start before it probes again.
            started = time.time()
            while time.time() - started < 120 / self.k and not self._stop.wait(0.2):
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(self.box.url + "/health", timeout=1.0).status_code == 200:
                        break
            self.traffic.last_byte_at = time.time()


def make(
    name: str,
    box: Box,
    k: float,
    state_dir: str,
    traffic: Traffic | None = None,
    *,
    scale_waits: bool = False,
) -> Watcher:
    """`scale_waits`: mlx-watchdog's own wait times divided by k too (the replay)."""
    if name in ("mlx-watchdog", "restart-always"):
        return MlxWatchdog(
            box,
            k,
            state_dir,
            name=name,
            least_cost=name == "mlx-watchdog",
            scale_waits=k if scale_waits else 1.0,
        )
    if name == "timeout-busy":
        return TimeoutBusy(box, k)
    if name == "none":
        return Nobody()
    if name in ("gpustack", "lemonade", "sglang"):
        if traffic is None:
            raise ValueError(f"{name} watches the traffic: give it one")
        kind: type[Watching] = {"gpustack": GPUStack, "lemonade": Lemonade, "sglang": SGLang}[name]
        return kind(box, k, traffic)
    return {
        "models-probe": models_probe,
        "health-probe": health_probe,
        "k8s-liveness": k8s_liveness,
        "k8s-health": k8s_health,
    }[name](box, k)


WATCHERS = ("mlx-watchdog", "models-probe", "health-probe", "k8s-liveness", "timeout-busy")
