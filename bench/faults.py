"""Fault injection: every fault of "one watchdog, one truth" and more, each tried on a real
daemon (`mlx-watchdog run`) watching the tests' misbehaving server through the `command`
manager, and a table: what the watchdog did, restarts expected and made, alerts expected and
sent, and what the history lost. The README quotes a run.

    python bench/faults.py [--only NAME,NAME] [--quick]   # --quick: four faults (CI)

Restarts made and alerts sent are counted from the `on_event` hook (it is independent of the
history); "lost" is the hook's events the history file lacks afterwards. Faults from outside the
process use tests/faults/ (a stepped wall clock, a hung tick). As root, "disk full" puts the
state folder on a 256 KiB tmpfs.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import signal
import sqlite3
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from mlx_watchdog.config import to_toml  # noqa: E402
from tests.builders import badserver_argv, command_server, watchdog_config  # noqa: E402
from tests.conftest import RESTART_BAD, TESTS, free_port, listens  # noqa: E402

PROBE = {"slow_after": "300ms", "wedge_after": "1s", "max_busy": "2s", "startup_grace": "5s"}
HEALED = ["detected", "restarting", "recovered"]


class Timeout(Exception):
    pass


@dataclass
class Row:
    fault: str
    did: str
    restarts_expected: int
    restarts_made: int
    alerts_expected: list[str]
    alerts_sent: list[str]
    lost: int


class Run:
    """One fault's folder: the misbehaving server, the config, the daemons, the hook's file."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.pidfile = folder / "bad.pid"
        self.state = folder / "state"
        self.events_file = folder / "events.jsonl"
        self.log = folder / "daemon.log"
        self.cfg = folder / "config.toml"
        self.clock_file = folder / "clock"
        self.hang_file = folder / "hang"
        self.daemons: list[subprocess.Popen[bytes]] = []
        self.lost_override: collections.Counter[str] | None = None
        self.others: list[subprocess.Popen[bytes]] = []
        hook = folder / "hook.py"
        hook.write_text(
            "import sys\n"
            f"with open({str(self.events_file)!r}, 'a') as fh:\n"
            "    fh.write(sys.stdin.read().replace('\\n', ' ') + '\\n')\n"
        )
        self.hook = [sys.executable, str(hook)]
        self.server("ok")

    def server(self, mode: str) -> None:
        subprocess.run([*RESTART_BAD, str(self.pidfile), str(self.port), mode], check=True)
        wait(lambda: listens(self.port), 10, "the server to listen")

    def server_pid(self) -> int:
        return int(self.pidfile.read_text())

    def config(self, *, delay: float = 0.0, **server: object) -> None:
        entry = command_server(self.url, self.pidfile, self.port, delay=delay, probe=PROBE)
        entry.update(server)
        self.cfg.write_text(to_toml(watchdog_config(self.state, [entry], on_event=self.hook)))

    def daemon(self, *, wait_up: bool = True) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(TESTS / "faults"), os.environ.get("PYTHONPATH", "")]
            ),
            "MLXWD_FAULT_CLOCK_FILE": str(self.clock_file),
            "MLXWD_FAULT_HANG_TICK": str(self.hang_file),
        }
        seen = self.logged().count("watching bad")
        with self.log.open("ab") as err:
            proc = subprocess.Popen(
                [sys.executable, "-m", "mlx_watchdog", "run", "--config", str(self.cfg)],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env=env,
                cwd=ROOT,
            )
        self.daemons.append(proc)
        if wait_up:
            wait(lambda: self.logged().count("watching bad") > seen, 30, "the daemon to watch")
        return proc

    def logged(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def events(self) -> list[str]:
        if not self.events_file.exists():
            return []
        kinds = []
        for line in self.events_file.read_text().splitlines():
            with contextlib.suppress(ValueError, KeyError):
                kinds.append(json.loads(line)["kind"])
        return kinds

    def settle(self, quiet: float = 1.5, bound: float = 30.0) -> None:
        """Until the hook's file has stopped growing (alerts are sent on their own thread)."""
        deadline, last, since = time.monotonic() + bound, -1, time.monotonic()
        while time.monotonic() < deadline:
            size = self.events_file.stat().st_size if self.events_file.exists() else 0
            if size != last:
                last, since = size, time.monotonic()
            elif time.monotonic() - since >= quiet:
                return
            time.sleep(0.1)

    def history_kinds(self) -> list[str]:
        db = self.state / "history.db"
        if not db.exists():
            return []
        con = sqlite3.connect(f"file:{db}?mode=ro", uri=True, timeout=10)
        try:
            return [r[0] for r in con.execute("SELECT kind FROM events ORDER BY id")]
        except sqlite3.Error:
            return []
        finally:
            con.close()

    def stop(self) -> None:
        for proc in self.daemons:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(40)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for proc in self.others:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        with contextlib.suppress(OSError, ValueError):
            os.kill(self.server_pid(), signal.SIGKILL)


def wait(check: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise Timeout(f"{what}: not within {timeout:g} s")
        time.sleep(0.05)


def threads(pid: int) -> int:
    import psutil

    return psutil.Process(pid).num_threads()


# -- the faults: each sets up, injects, waits, and says what it saw -------------------------


def baseline(run: Run) -> tuple[str, int, list[str]]:
    run.config()
    run.daemon()
    began = time.monotonic()
    run.server("hang")
    wait(lambda: "recovered" in run.events(), 30, "recovered")
    return f"healed in {time.monotonic() - began:.1f} s", 1, HEALED


def second_daemon(run: Run) -> tuple[str, int, list[str]]:
    run.config()
    first = run.daemon()
    began = time.monotonic()
    second = run.daemon(wait_up=False)
    code = second.wait(30)
    took = time.monotonic() - began
    run.server("hang")
    wait(lambda: "recovered" in run.events(), 30, "recovered")
    named = f"PID {first.pid}" in run.logged()
    return f"second `run` exit {code} in {took:.1f} s{', naming the first' * named}", 1, HEALED


def sighup_storm(run: Run) -> tuple[str, int, list[str]]:
    run.config(delay=2.0)
    proc = run.daemon()
    before = threads(proc.pid)
    run.server("hang")
    wait(lambda: "restarting" in run.events(), 30, "a restart")
    for _ in range(100):
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.02)
    wait(lambda: "recovered" in run.events(), 30, "recovered")
    time.sleep(1.0)
    return f"100 SIGHUPs mid-restart; threads {before} -> {threads(proc.pid)}", 1, HEALED


def reload_setting(run: Run) -> tuple[str, int, list[str]]:
    argv = badserver_argv(run.port, "ok")
    os.kill(run.server_pid(), signal.SIGKILL)
    wait(lambda: not listens(run.port), 10, "the port to free")
    run.config(manager="process", command=argv)
    proc = run.daemon()
    wait(lambda: listens(run.port), 10, "the process server")
    time.sleep(1.0)
    from mlx_watchdog.sense.process import ProcessTable

    pid = ProcessTable().listener(run.port)
    run.config(manager="process", command=argv, probe={**PROBE, "wedge_after": "1500ms"})
    proc.send_signal(signal.SIGHUP)
    wait(lambda: "config reloaded" in run.logged(), 10, "the reload")
    time.sleep(2.0)
    after = ProcessTable().listener(run.port)
    return f"wedge_after changed: server PID {'kept' if after == pid else 'changed'}", 0, []


def _kill9_and_relaunch(run: Run, first: subprocess.Popen[bytes], until: str) -> bool:
    """kill -9 the daemon with its commands running, start the next one, wait for `until`:
    whether the commands the first left were ended."""
    import psutil

    helpers = psutil.Process(first.pid).children(recursive=True)
    first.kill()
    first.wait()
    run.daemon()
    wait(lambda: until in run.events(), 60, until)
    return not any(h.is_running() and h.status() != "zombie" for h in helpers)


def kill9_mid_restart(run: Run) -> tuple[str, int, list[str]]:
    run.config(delay=3.0)
    first = run.daemon()
    run.server("hang")
    wait(lambda: "restarting" in run.events(), 30, "a restart")
    time.sleep(0.3)
    said = "ended" if _kill9_and_relaunch(run, first, "recovered") else "LEFT RUNNING"
    return (
        f"orphaned restart command {said} by the next daemon; the wedge restarted once more",
        2,
        ["detected", "restarting", "interrupted", "restarting", "recovered"],
    )


def kill9_mid_drain(run: Run) -> tuple[str, int, list[str]]:
    import psutil

    drain = {"drain": True, "drain_timeout": "1s", "drain_command": ["sleep", "30"]}
    run.config(restart={"max_restarts": 3, "backoff": "1s", **drain})
    first = run.daemon()
    run.server("hang")
    wait(lambda: "detected" in run.events(), 30, "detection")
    wait(lambda: any("sleep" in " ".join(c.cmdline()) for c in psutil.Process(first.pid)
                     .children(recursive=True)), 10, "the drain command")  # fmt: skip
    ended = _kill9_and_relaunch(run, first, "recovered")
    return f"orphaned drain command {'ended' if ended else 'LEFT RUNNING'}", 1, HEALED


def sigterm_mid_restart(run: Run) -> tuple[str, int, list[str]]:
    run.config(delay=600.0)
    proc = run.daemon()
    run.server("hang")
    wait(lambda: "restarting" in run.events(), 30, "a restart")
    began = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(60)
    return (
        f"stopped in {time.monotonic() - began:.1f} s (exit {code}), restart interrupted",
        1,
        ["detected", "restarting", "interrupted"],
    )


def history_locked(run: Run) -> tuple[str, int, list[str]]:
    run.config(restart={"max_restarts": 1, "backoff": "1s"})
    run.daemon()
    time.sleep(1.0)
    locker = subprocess.Popen(
        [sys.executable, "-c", "import sqlite3, sys, time\n"
         "db = sqlite3.connect(sys.argv[1], isolation_level=None)\n"
         "db.execute('BEGIN EXCLUSIVE'); print('locked', flush=True); time.sleep(10)",
         str(run.state / "history.db")], stdout=subprocess.PIPE)  # fmt: skip
    assert locker.stdout is not None and locker.stdout.readline().strip() == b"locked"
    run.others.append(locker)
    began = time.monotonic()
    run.server("hang")
    wait(lambda: "recovered" in run.events(), 30, "recovered")
    healed = time.monotonic() - began
    locker.wait(30)
    time.sleep(2.0)
    return f"healed in {healed:.1f} s under a 10 s lock; rows written after it", 1, HEALED


def shm_truncated(run: Run) -> tuple[str, int, list[str]]:
    run.config()
    proc = run.daemon()
    shm = run.state / "history.db-shm"
    shm.write_bytes(b"\xff" * 32768)
    shm.write_bytes(b"")
    time.sleep(3.0)
    alive = proc.poll() is None
    return f"{'still running' if alive else f'died (exit {proc.returncode})'}", 0, []


def malformed_row(run: Run) -> tuple[str, int, list[str]]:
    run.config()
    proc = run.daemon()
    proc.send_signal(signal.SIGTERM)
    proc.wait(30)
    con = sqlite3.connect(run.state / "history.db", isolation_level=None)
    con.execute(
        "INSERT INTO incidents (server, opened_at, closed_at, state, reason, evidence, actions)"
        " VALUES ('bad', 1, 2, 'wedged', 'x', '[[[', 'nope')"
    )
    con.execute(
        "INSERT INTO events (server, at, kind, message, data) VALUES ('bad', 1, 'x', 'x', '{')"
    )
    con.close()
    run.daemon()
    status = subprocess.run(
        [sys.executable, "-m", "mlx_watchdog", "status", "--config", str(run.cfg)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    history = subprocess.run(
        [sys.executable, "-m", "mlx_watchdog", "history", "--config", str(run.cfg)],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    return f"started; status exit {status.returncode}, history exit {history.returncode}", 0, []


def lock_a_fifo(run: Run) -> tuple[str, int, list[str]]:
    run.config()
    run.state.mkdir(mode=0o700, parents=True, exist_ok=True)
    lock = run.state / "daemon.lock"
    os.mkfifo(lock)
    refused = run.daemon(wait_up=False)
    code = refused.wait(30)
    named = "daemon.lock is not a regular file" in run.logged()
    lock.unlink()
    run.daemon()
    run.server("hang")
    wait(lambda: "recovered" in run.events(), 30, "recovered")
    return f"`run` exit {code}{', naming the FIFO' * named}; removed: healed", 1, HEALED


def text_for_numbers(run: Run) -> tuple[str, int, list[str]]:
    from mlx_watchdog.record.store import Store

    run.config()
    run.state.mkdir(mode=0o700, parents=True, exist_ok=True)
    Store(run.state / "history.db").close()  # the schema, by the watchdog's own code
    con = sqlite3.connect(run.state / "history.db", isolation_level=None)
    now = time.time()
    con.execute(
        "INSERT INTO probes (server, at, state, reason, ttft_s, waited_s, evidence)"
        " VALUES ('bad', ?, 'healthy', 'x', 'fast', NULL, '{}')",
        (now - 30,),
    )
    con.execute(
        "INSERT INTO restarts (server, at, trigger, finished_at, outcome, served_s)"
        " VALUES ('bad', ?, 'wedged', ?, 'recovered', 'soon')",
        (now - 7200, now - 7190),
    )
    con.close()
    run.daemon()
    run.server("hang")
    wait(lambda: "recovered" in run.events(), 30, "recovered")
    return "started over text in ttft_s and served_s; healed", 1, HEALED


def clock_forward(run: Run) -> tuple[str, int, list[str]]:
    run.config()
    run.daemon()
    time.sleep(1.0)
    run.clock_file.write_text("3600")
    time.sleep(3.0)
    afresh = "judging afresh" in run.logged()
    return f"+1 h while serving: {'noticed, judged afresh' if afresh else 'not noticed'}", 0, []


def clock_backward(run: Run) -> tuple[str, int, list[str]]:
    run.config()
    run.daemon()
    run.server("hang")
    wait(lambda: "recovered" in run.events(), 30, "the first recovery")
    run.clock_file.write_text("-3600")
    time.sleep(2.5)  # past the 1 s backoff
    began = time.monotonic()
    run.server("hang")
    wait(lambda: run.events().count("recovered") == 2, 60, "the second recovery")
    return f"-1 h, then a wedge: healed in {time.monotonic() - began:.1f} s", 2, HEALED * 2


def server_stopped(run: Run) -> tuple[str, int, list[str]]:
    run.config()
    run.daemon()
    began = time.monotonic()
    os.kill(run.server_pid(), signal.SIGSTOP)
    wait(lambda: "recovered" in run.events(), 30, "recovered")
    return f"SIGSTOPped server healed in {time.monotonic() - began:.1f} s", 1, HEALED


def port_taken(run: Run) -> tuple[str, int, list[str]]:
    run.config()
    run.daemon()
    os.kill(run.server_pid(), signal.SIGKILL)
    wait(lambda: not listens(run.port), 10, "the port to free")
    stranger = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(run.port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=run.folder,
    )  # fmt: skip
    run.others.append(stranger)
    wait(lambda: listens(run.port), 10, "the stranger to listen")
    wait(lambda: "refused" in run.events(), 30, "the identity refusal")
    time.sleep(2.0)
    alive = stranger.poll() is None
    return (
        f"another program on the port: {'left alone' if alive else 'SIGNALLED'}",
        0,
        [
            "detected",
            "refused",
        ],
    )


def listener_beside(run: Run) -> tuple[str, int, list[str]]:
    """Another program listens on the same port at another address (as an `ssh -L` forward
    binds [::1]:P beside a server on 127.0.0.1:P); the server then wedges: the server is the
    one restarted, the other left alone."""
    listen = (
        "import socket, sys, time; s = socket.socket(); s.bind(('127.0.0.2', int(sys.argv[1])));"
        " s.listen(); time.sleep(600)"
    )
    stranger = subprocess.Popen([sys.executable, "-c", listen, str(run.port)])
    run.others.append(stranger)
    run.config()
    run.daemon()
    began = time.monotonic()
    run.server("hang")
    wait(lambda: "recovered" in run.events(), 30, "recovered")
    alive = stranger.poll() is None
    return (
        f"the server healed in {time.monotonic() - began:.1f} s; the program beside it "
        f"{'left alone' if alive else 'SIGNALLED'}",
        1,
        HEALED,
    )


def disk_full(run: Run) -> tuple[str, int, list[str]]:
    if os.getuid() != 0:
        raise Timeout("needs root for a tmpfs")
    run.state.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k,mode=0700", "tmpfs", str(run.state)],
                   check=True)  # fmt: skip
    try:
        run.config()
        run.daemon()
        time.sleep(1.0)
        with contextlib.suppress(OSError), (run.state / "filler").open("wb") as fh:
            while True:
                fh.write(b"\0" * 4096)
                fh.flush()
        began = time.monotonic()
        run.server("hang")
        wait(lambda: "recovered" in run.events(), 30, "recovered")
        healed = time.monotonic() - began
        run.settle()
        full = sum(
            (collections.Counter(run.events()) - collections.Counter(run.history_kinds())).values()
        )
        (run.state / "filler").unlink()  # space again: what waited is written now
        time.sleep(2.0)
        # Read while the tmpfs is still there: unmounted, the folder under it is empty.
        run.lost_override = collections.Counter(run.events()) - collections.Counter(
            run.history_kinds()
        )
        return f"healed in {healed:.1f} s with the disk full ({full} events waiting)", 1, HEALED
    finally:
        run.stop()
        subprocess.run(["umount", str(run.state)], check=False)


def ticks_hang(run: Run) -> tuple[str, int, list[str]]:
    run.config()
    proc = run.daemon()
    run.hang_file.touch()
    began = time.monotonic()
    code = proc.wait(120)
    took = time.monotonic() - began
    return f"ticks hung: said blind, exited {code} after {took:.0f} s", 0, ["blind"]


FAULTS: dict[str, Callable[[Run], tuple[str, int, list[str]]]] = {
    "wedge (no fault)": baseline,
    "second daemon": second_daemon,
    "SIGHUP storm": sighup_storm,
    "reload of a setting": reload_setting,
    "kill -9 mid-restart": kill9_mid_restart,
    "kill -9 mid-drain": kill9_mid_drain,
    "SIGTERM mid-restart": sigterm_mid_restart,
    "history locked": history_locked,
    "-shm truncated": shm_truncated,
    "malformed row": malformed_row,
    "text where numbers are": text_for_numbers,
    "daemon.lock a FIFO": lock_a_fifo,
    "clock +1 h": clock_forward,
    "clock -1 h": clock_backward,
    "server SIGSTOP": server_stopped,
    "port taken": port_taken,
    "a listener beside": listener_beside,
    "disk full": disk_full,
    "ticks hang": ticks_hang,
}

# CI's smoke run: a wedge healed, and the faults of the daemon's own files, a few seconds each.
QUICK = ("wedge (no fault)", "second daemon", "malformed row", "daemon.lock a FIFO")


def try_fault(name: str, fault: Callable[[Run], tuple[str, int, list[str]]]) -> Row:
    with tempfile.TemporaryDirectory(prefix="mlxwd-fault-") as tmp:
        run = Run(Path(tmp))
        try:
            did, expected, alerts = fault(run)
        except Timeout as exc:
            did, expected, alerts = f"NOT AS EXPECTED: {exc}", -1, []
        finally:
            run.stop()
        run.settle()
        sent = run.events()
        lost = run.lost_override
        if lost is None:
            lost = collections.Counter(sent) - collections.Counter(run.history_kinds())
        return Row(name, did, expected, sent.count("restarting"), alerts, sent, sum(lost.values()))


def table(rows: list[Row]) -> Iterator[str]:
    yield "| fault | what the watchdog did | restarts expected / made | alerts expected / sent | lost |"
    yield "|---|---|---|---|---|"
    for r in rows:
        same = collections.Counter(r.alerts_expected) == collections.Counter(r.alerts_sent)
        alerts = f"{len(r.alerts_expected)} / {len(r.alerts_sent)}"
        if not same:
            alerts += f" ({', '.join(r.alerts_sent) or 'none'})"
        yield (
            f"| {r.fault} | {r.did} | {r.restarts_expected} / {r.restarts_made} | {alerts} "
            f"| {r.lost} |"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated fault names (see FAULTS)")
    parser.add_argument("--quick", action="store_true", help=f"only {', '.join(QUICK)} (CI)")
    args = parser.parse_args()
    names = [n.strip() for n in args.only.split(",")] if args.only else list(FAULTS)
    if args.quick:
        names = [n for n in names if n in QUICK]
    unknown = [n for n in names if n not in FAULTS]
    if unknown:
        parser.error(f"no fault named {unknown}; the faults: {', '.join(FAULTS)}")
    rows = []
    for name in names:
        began = time.monotonic()
        rows.append(try_fault(name, FAULTS[name]))
        print(f"{name}: {time.monotonic() - began:.0f} s", file=sys.stderr, flush=True)
    print("\n".join(table(rows)))
    bad = [r for r in rows if r.restarts_made != r.restarts_expected or
           collections.Counter(r.alerts_expected) != collections.Counter(r.alerts_sent)]  # fmt: skip
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
