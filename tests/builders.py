"""What the tests build their configs from: the probe presets and config builders, in one place.

Spans are short so that a wedge shows within seconds, and ordered as the config requires
(slow_after <= wedge_after <= max_busy <= hard_timeout).
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlx_watchdog.config import ProbeSettings, ServerConfig
from mlx_watchdog.config.profiles import Kind

if TYPE_CHECKING:
    from tests.conftest import BadByPidfile

# A misbehaving server of our own, judged in process: a wedge within a second or two.
QUICK = ProbeSettings(
    slow_after=0.5,
    wedge_after=1.0,
    max_busy=1.5,
    hard_timeout=2.0,
    startup_grace=0.01,
    models_timeout=2.0,
)
# Every kind of server, every route answering badly at once: tighter still.
HOSTILE = replace(
    QUICK, slow_after=0.3, wedge_after=0.6, max_busy=0.8, hard_timeout=3.0, models_timeout=1.0
)
# A real server on a tiny model (CPU): its first token can take a second or two.
REAL = ProbeSettings(
    slow_after=2.0, wedge_after=4.0, max_busy=60.0, hard_timeout=300.0, startup_grace=0.01
)
# The same spans as a config file writes them, for a daemon's config.
QUICK_TOML = {
    "slow_after": "300ms",
    "wedge_after": "1s",
    "max_busy": "2s",
    "startup_grace": "5s",
    "hard_timeout": "1m",
}


def watched(
    url: str,
    *,
    name: str = "bad",
    kind: Kind = "mlx_lm",
    match: str = "badserver",
    probe: ProbeSettings = QUICK,
    **spans: float,
) -> ServerConfig:
    """A server to judge in process, with `probe`'s spans and any of them changed."""
    return ServerConfig(name=name, url=url, kind=kind, match=match, probe=replace(probe, **spans))


def watchdog_config(
    state: Path,
    servers: list[dict[str, Any]],
    *,
    interval: str = "200ms",
    listen: str = "127.0.0.1:0",
    **settings: Any,
) -> dict[str, Any]:
    """A daemon's config as a parsed TOML document: ticks every `interval`, state in `state`."""
    section = {"interval": interval, "listen": listen, "state_dir": str(state), **settings}
    return {"watchdog": section, "server": servers}


def badserver_argv(port: int, mode: str = "ok", *extra: str) -> list[str]:
    """The command line of a misbehaving server of our own (tests/badserver.py)."""
    script = Path(__file__).parent / "badserver.py"
    return [sys.executable, str(script), "--port", str(port), "--mode", mode, *extra]


def mac_like_server(
    port: int, gpu_dir: Path, *, rate: int, wedge_after: str, max_busy: str
) -> dict[str, Any]:
    """tests/badserver.py as MLX is on a Mac (`--mode gpu`: serial, its prefill waits while its
    GPU time climbs in `gpu_dir`), run by the watchdog (`manager = "process"`)."""
    argv = badserver_argv(port, "gpu", "--gpu-dir", str(gpu_dir), "--rate", str(rate))
    return {
        "name": "mac",
        "url": f"http://127.0.0.1:{port}",
        "manager": "process",
        "match": "badserver",
        "command": argv,
        "probe": {
            "slow_after": "500ms",
            "wedge_after": wedge_after,
            "max_busy": max_busy,
            "startup_grace": "10s",
            "hard_timeout": "10m",
        },
        "restart": {"max_restarts": 2, "window": "1h", "backoff": "1s"},
    }


def command_server(
    url: str, pidfile: Path, port: int, *, delay: float = 0.0, probe: dict[str, str] = QUICK_TOML
) -> dict[str, Any]:
    """A misbehaving server restarted through the `command` manager: tests/fakes/restart_bad.py
    starts a fresh one that serves ("ok") after `delay` seconds."""
    restart = [sys.executable, str(Path(__file__).parent / "fakes" / "restart_bad.py")]
    return {
        "name": "bad",
        "url": url,
        "manager": "command",
        "match": "badserver",
        "restart_command": [*restart, str(pidfile), str(port), "ok", str(delay)],
        "probe": probe,
        "restart": {"max_restarts": 3, "backoff": "1s", "command_timeout": "1m"},
    }


def restarts_took(state: Path, server: str, seconds: float) -> None:
    """A history in which `server`'s restarts took `seconds` to the first token (two hours ago:
    outside any budget's window), as for a large model: waiting can then be the cheaper cure."""
    import time

    from mlx_watchdog.record.store import open_history

    store = open_history(state)
    try:
        at = time.time() - 7200
        store.finish_restart(
            store.start_restart(server, at, "wedged"), at + seconds, "recovered", seconds
        )
    finally:
        store.close()


def calibrated_at(state: Path, server: str, rate_tps: float, bytes_per_token: float) -> None:
    """A calibration in the history: `server` prefills `rate_tps` tokens a second, its prompts
    `bytes_per_token` bytes of a request a token (what progress lines are held against)."""
    import time

    from mlx_watchdog.advice.calibrate import Calibration, Fit, Point
    from mlx_watchdog.record.store import open_history

    points = tuple(
        Point(n, n / rate_tps, None, int(n * bytes_per_token)) for n in (1024, 4096, 16384)
    )
    doc = Calibration(server, 0.0, points, Fit(0.0, 1 / rate_tps, 0.0), 50.0).to_json()
    store = open_history(state)
    try:
        store.save_calibration(server, time.time() - 3600, doc)
    finally:
        store.close()


def one_incident(
    tmp_path: Path, reason: str, evidence: dict[str, Any], dump: dict[str, Any]
) -> tuple[Path, int]:
    """A config file for one server "m" and, in its history, one incident with a restart's
    dump: what `history --show N` reads. Returns the config's path and the incident's number."""
    from mlx_watchdog.config import effective, parse_config, to_toml
    from mlx_watchdog.record.rows import Row
    from mlx_watchdog.record.store import Store

    state = tmp_path / "state"
    config = parse_config(
        {
            "watchdog": {"state_dir": str(state)},
            "server": [{"name": "m", "url": "http://127.0.0.1:9"}],
        }
    )
    (tmp_path / "w.toml").write_text(to_toml(effective(config)))
    state.mkdir(parents=True, exist_ok=True)
    store = Store(state / "history.db")
    ref = store.open_incident("m", 1.0, "wedged", reason, evidence, began_at=1.0)
    store.add_dump("m", ref, 2.0, dump)
    store.close()
    number = ref.id if isinstance(ref, Row) else ref
    assert isinstance(number, int)
    return tmp_path / "w.toml", number


def command_config(
    tmp_path: Path,
    bad: BadByPidfile,
    *,
    delay: float = 0.0,
    alerts: list[str] | None = None,
    hook: list[str] | None = None,
) -> dict[str, object]:
    server = command_server(bad.url, bad.pidfile, bad.port, delay=delay)
    return watchdog_config(tmp_path / "state", [server], alerts=alerts or [], on_event=hook or [])


def toml(data: dict[str, object]) -> str:
    from mlx_watchdog.config import to_toml

    return to_toml(data)


# A history's every column edited by hand: what each holds where a person or a tool wrote it.
BAD_VALUES = ("text", b"\x00\xff\xfe", -1e308, 2**62)
EDITED = {
    "probes": ("at", "state", "reason", "ttft_s", "waited_s", "evidence"),
    "incidents": (
        "opened_at",
        "closed_at",
        "began_at",
        "state",
        "reason",
        "evidence",
        "actions",
        "outage_s",
        "recover_s",
        "outcome",
        "advice",
    ),
    "events": ("at", "kind", "message", "data"),
    "restarts": ("at", "trigger", "finished_at", "outcome", "served_s"),
    "calibrations": ("at", "doc"),
    "dumps": ("at", "doc", "incident"),
    "holds": ("since", "reason"),
}


def a_history(db: Path, server: str, now: float) -> None:
    """A history with a row of every kind, several of each, to edit."""
    from mlx_watchdog.record.store import Store

    store = Store(db)
    for n in range(len(BAD_VALUES) + 1):
        at = now - 600 + n
        store.record_probe(server, at, "healthy", "first token in 10 ms", {"ttft_s": 0.01})
        ref = store.open_incident(server, at, "wedged", "wedged: no token", {"cause": "deadlock"})
        store.add_action(ref, {"at": at, "action": "restart (command)", "outcome": "recovered"})
        store.close_incident(ref, at + 5, "restarted", 3.0)
        store.add_event(server, at, "detected", "wedged", {"cause": "deadlock"})
        store.finish_restart(store.start_restart(server, at, "wedged"), at + 3, "recovered", 3.0)
        store.save_calibration(server, at, {"fit": {"a": 0, "b": 0.001, "c": 0}})
        store.add_dump(server, ref, at, {"stack": "x", "kind": "mlx_lm"})
    store.hold(server, now - 60, "3 restarts did not help")
    store.close()
