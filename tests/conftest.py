from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlx_watchdog.demo.run import long_prompt, send

TESTS = Path(__file__).parent
START_TIMEOUT = 180.0


def mlx_watchdog(
    *args: str, timeout: float = 120.0, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """The command as a person runs it: a new process, no stdin, 120 columns."""
    return subprocess.run(
        [sys.executable, "-m", "mlx_watchdog", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "COLUMNS": "120", **(env or {})},
    )


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Running:
    """A server process this test run started; stopped by its own PID only."""

    proc: subprocess.Popen[bytes]
    url: str
    port: int
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def spawn(cmd: list[str], port: int, log: Path, env: dict[str, str] | None = None) -> Running:
    """A server process with its output in `log`, no stdin."""
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, stdin=subprocess.DEVNULL
        )
    return Running(proc, f"http://127.0.0.1:{port}", port, log)


def llama_argv(binary: Path, gguf: Path, port: int, *, metrics: bool = True) -> list[str]:
    """llama-server on the tiny GGUF: one slot (serial, as a single-user Mac runs it)."""
    return [
        *(str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
        *(["--metrics"] if metrics else []),
        *("-np", "1", "-c", "16384"),
    ]


def server_argv(model: Path, port: int) -> list[str]:
    """The real mlx_lm.server on the tiny model, batched; add --draft-model for serial."""
    from mlx_watchdog.demo.run import server_command

    return server_command(model, port, serial=False)


def _tiny_request(url: str, timeout: float) -> bool:
    body = {"messages": [{"role": "user", "content": "ping"}], "max_tokens": 1}
    try:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)
    except httpx.HTTPError:
        return False
    return r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def wait_until_serving(server: Running, timeout: float = START_TIMEOUT) -> None:
    """Block until a tiny request is served: start-up done, or an earlier wedge drained."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise RuntimeError(f"server exited:\n{server.log.read_text()[-3000:]}")
        if _tiny_request(server.url, timeout=max(1.0, deadline - time.monotonic())):
            return
        time.sleep(0.2)
    raise RuntimeError(f"server at {server.url} did not serve within {timeout:g}s")


def wait_until_idle(server: Running) -> None:
    """Serving, and no client connection left over from an earlier test."""
    import psutil

    wait_until_serving(server)
    proc = psutil.Process(server.proc.pid)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        busy = [
            c
            for c in proc.net_connections("tcp")
            if c.laddr.port == server.port and c.raddr and c.status != "TIME_WAIT"
        ]
        if not busy:
            return
        time.sleep(0.2)
    raise RuntimeError(f"connections never drained from {server.url}")


# The tests' own build cache (llama-server: minutes to build) stays where the run began with it.
TESTS_CACHE = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reads or writes the real user's home, config or state."""
    home = tmp_path / "isolated-home"
    home.mkdir(exist_ok=True)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("XDG_CACHE_HOME", TESTS_CACHE)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("MLX_WATCHDOG_CONFIG", raising=False)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-model")
    subprocess.run(
        [sys.executable, "-m", "mlx_watchdog.demo.tinymodel", str(out)],
        check=True,
        capture_output=True,
    )
    return out


@pytest.fixture(scope="session")
def hf_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf-hub-cache")


@contextlib.contextmanager
def stopped_at_end() -> Iterator[list[Running]]:
    """The servers a fixture starts, each stopped when the fixture ends."""
    started: list[Running] = []
    try:
        yield started
    finally:
        for server in started:
            server.stop()


StartServer = Callable[..., Running]


@pytest.fixture(scope="session")
def start_real_server(
    tiny_model: Path, hf_cache: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StartServer]:
    def start(*extra: str, hub_cache: Path | None = None) -> Running:
        port = free_port()
        log = tmp_path_factory.mktemp("server-log") / "server.log"
        env = {
            **os.environ,
            "HF_HUB_CACHE": str(hub_cache or hf_cache),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
        }
        server = spawn([*server_argv(tiny_model, port), *extra], port, log, env)
        started.append(server)
        wait_until_serving(server)
        return server

    with stopped_at_end() as started:
        yield start


@pytest.fixture(scope="session")
def _serial_server(start_real_server: StartServer, tiny_model: Path) -> Running:
    # Speculative decoding disables batching: strictly one request at a time, as in the field.
    return start_real_server("--draft-model", str(tiny_model))


@pytest.fixture
def serial_server(_serial_server: Running) -> Running:
    wait_until_idle(_serial_server)
    return _serial_server


@pytest.fixture
def patient_client(serial_server: Running) -> Iterator[Callable[..., None]]:
    threads: list[threading.Thread] = []
    outcome: list[str] = []

    def start(words: int = 3000) -> None:
        """A client with a prompt of about 3 tokens a word, waiting as long as it takes."""
        prompt = long_prompt(random.randrange(10**9), words=words)
        t = threading.Thread(
            target=lambda: outcome.append(send(serial_server.url, prompt, timeout=300))
        )
        t.start()
        threads.append(t)

    yield start
    for t in threads:
        t.join(300)
    assert outcome == ["served"] * len(threads), "the patient client was not served"


@pytest.fixture
def uploading_client() -> Iterator[Callable[[Running], socket.socket]]:
    """A client still sending its request (headers sent, the body half): a live connection the
    server is serving, which costs it no prefill, so the test ends without waiting for one."""
    held: list[socket.socket] = []

    def connect(server: Running) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
        )
        sock.sendall(head.encode() + b'{"messages": [')
        held.append(sock)
        return sock

    yield connect
    for sock in held:
        sock.close()


@pytest.fixture(scope="session")
def _batched_server(start_real_server: StartServer) -> Running:
    return start_real_server()


@pytest.fixture
def batched_server(_batched_server: Running) -> Running:
    wait_until_idle(_batched_server)
    return _batched_server


@contextlib.contextmanager
def bad_servers(folder: Path) -> Iterator[Callable[..., Running]]:
    """Start misbehaving servers (tests/badserver.py) on demand; all end with the block."""

    def start(
        mode: str,
        delay: float = 1.5,
        kind: str = "mlx_lm",
        ok_requests: int | None = None,
        port: int | None = None,
        extra: tuple[str, ...] = (),
        under: tuple[str, ...] = (),  # a command it runs under, that execs it: ("nice", ...)
    ) -> Running:
        port = port or free_port()
        log = folder / f"bad-{mode}-{port}-{len(started)}.log"
        fh = log.open("wb")
        proc = subprocess.Popen(
            [
                *under,
                sys.executable,
                str(TESTS / "badserver.py"),
                "--port",
                str(port),
                "--mode",
                mode,
                "--delay",
                str(delay),
                # only when asked: "--kind mlx_lm" in its command line would match "mlx_lm"
                *(["--kind", kind] if kind != "mlx_lm" else []),
                *(["--ok-requests", str(ok_requests)] if ok_requests is not None else []),
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=fh,
            stdin=subprocess.DEVNULL,
        )
        fh.close()
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"ready", log.read_text()
        server = Running(proc, f"http://127.0.0.1:{port}", port, log)
        started.append(server)
        return server

    with stopped_at_end() as started:
        yield start


@pytest.fixture
def bad_server(tmp_path: Path) -> Iterator[Callable[..., Running]]:
    with bad_servers(tmp_path) as start:
        yield start


@pytest.fixture(scope="module")
def module_bad_server(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., Running]]:
    """Servers shared by a module's tests (each test file gets its own)."""
    with bad_servers(tmp_path_factory.mktemp("bad")) as start:
        yield start


# -- the daemon's surroundings -------------------------------------------------------------


def system_tool(name: str, package: str | None = None) -> str:
    """A Debian package's program: skipped where missing, a fault under CI (.ci/run installs
    it)."""
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")
    if found is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing (apt-get install {package or name})")
        pytest.skip(f"needs {name} (Debian's package {package or name})")
    return found


def gone(pid: int) -> bool:
    """Not running (a zombie counts as gone: nothing here reaps orphans)."""
    import psutil

    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def until(check: Callable[[], object], timeout: float, what: str, step: float = 0.1) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(step)
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")


def ttft(url: str, prompt: str) -> float:
    """Seconds to the first streamed token of `prompt` (a patient client)."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 4, "stream": True}
    started = time.monotonic()
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content"' in line:
                return time.monotonic() - started
    raise RuntimeError("no token")


class Receiver:
    """A local webhook that Apprise's json:// URLs post to."""

    def __init__(self) -> None:
        import http.server
        import json
        import threading

        received: list[dict[str, object]] = []
        self.received = received

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                received.append({"path": self.path, **json.loads(body)})
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str = "hook") -> str:
        return f"json://127.0.0.1:{self.port}/{path}"

    def titles(self) -> list[str]:
        return [str(r["title"]) for r in self.received]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def hook(tmp_path: Path) -> tuple[list[str], Path]:
    """An on_event command that appends each event's JSON (from stdin) to a file."""
    out = tmp_path / "hook-events.jsonl"
    script = tmp_path / "hook.py"
    script.write_text(
        "import sys\n"
        f"with open({str(out)!r}, 'a') as fh:\n"
        "    fh.write(sys.stdin.read().replace('\\n', ' ') + '\\n')\n"
    )
    return [sys.executable, str(script)], out


class DaemonThread:
    def __init__(self, daemon: object) -> None:
        import threading

        from mlx_watchdog.daemon import Daemon

        assert isinstance(daemon, Daemon)
        self.daemon = daemon
        self.thread = threading.Thread(
            target=lambda: daemon.run(install_signals=False), daemon=True
        )
        self.thread.start()

    def stop(self) -> None:
        self.daemon.stop()
        self.thread.join(60)
        assert not self.thread.is_alive(), "the daemon did not stop"


@pytest.fixture
def run_daemon() -> Iterator[Callable[[object], DaemonThread]]:
    running: list[DaemonThread] = []

    def start(daemon: object) -> DaemonThread:
        t = DaemonThread(daemon)
        running.append(t)
        return t

    yield start
    for t in running:
        if t.thread.is_alive():
            t.stop()


RESTART_BAD = [sys.executable, str(TESTS / "fakes" / "restart_bad.py")]


class BadByPidfile:
    """A bad server started (and replaced) through restart_bad.py, tracked by its pid file."""

    def __init__(self, tmp_path: Path, mode: str) -> None:
        self.port = free_port()
        self.pidfile = tmp_path / "bad.pid"
        self.url = f"http://127.0.0.1:{self.port}"
        self.replace(mode)

    def replace(self, mode: str) -> None:
        subprocess.run([*RESTART_BAD, str(self.pidfile), str(self.port), mode], check=True)
        until(lambda: listens(self.port), 10, "the bad server to listen")

    def pid(self) -> int:
        return int(self.pidfile.read_text())

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, FileNotFoundError):
            os.kill(self.pid(), signal.SIGKILL)


def listens(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@pytest.fixture
def hanging(tmp_path: Path) -> Iterator[BadByPidfile]:
    bad = BadByPidfile(tmp_path, "hang")
    yield bad
    bad.kill()


class FakeServices:
    """The fake launchctl (fakes/fakelaunchd.py), systemctl and journalctl (fakes/fakesvc.py) on PATH,
    and their state: the machine (who has a GUI login, whose user manager runs, the
    LaunchDaemons and system units folders) and the jobs."""

    def __init__(self, root: Path, gui: list[int] | None = None) -> None:
        import json

        self.json = json
        self.bin = root / "bin"
        self.bin.mkdir(parents=True)
        self.state = root / "svc-state.json"
        self.log = root / "svc-calls.jsonl"
        launchctl = self.bin / "launchctl"
        launchctl.write_text(
            f'#!/bin/sh\nexec {sys.executable} {TESTS / "fakes" / "fakelaunchd.py"} "$@"\n'
        )
        systemctl = self.bin / "systemctl"
        systemctl.write_text(
            f'#!/bin/sh\nexec {sys.executable} {TESTS / "fakes" / "fakesvc.py"} "$@"\n'
        )
        journalctl = self.bin / "journalctl"
        journalctl.write_text(
            f'#!/bin/sh\nexec {sys.executable} {TESTS / "fakes" / "fakesvc.py"} journalctl "$@"\n'
        )
        for exe in (launchctl, systemctl, journalctl):
            exe.chmod(0o755)
        self.machine(gui=[os.getuid()] if gui is None else gui)

    def env(self) -> dict[str, str]:
        return {
            "PATH": f"{self.bin}{os.pathsep}{os.environ['PATH']}",
            "FAKE_SVC_STATE": str(self.state),
            "FAKE_SVC_LOG": str(self.log),
        }

    def kill_all(self) -> None:
        for _ in range(2):  # supervisors first; then any job they left
            for pid in self.pids():  # only the processes these fakes started
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)

    def machine(self, **settings: object) -> None:
        """Who has a GUI login (uids), where the LaunchDaemons folder is."""
        table = self.table()
        table.setdefault("machine", {}).update(settings)
        self.save(table)

    def table(self) -> dict[str, Any]:
        return self.json.loads(self.state.read_text()) if self.state.exists() else {}

    def save(self, table: dict[str, Any]) -> None:
        self.state.write_text(self.json.dumps(table))

    def calls(self) -> list[list[str]]:
        if not self.log.exists():
            return []
        return [self.json.loads(line) for line in self.log.read_text().splitlines()]

    def systemd_unit(self, scope: str, unit: str) -> dict[str, Any] | None:
        found: dict[str, Any] | None = self.table().get("systemd", {}).get(scope, {}).get(unit)
        return found

    def launchd_job(self, domain: str, label: str) -> dict[str, Any] | None:
        job: dict[str, Any] | None = self.table().get("launchd", {}).get(domain, {}).get(label)
        return job

    def pids(self) -> list[int]:
        table = self.table()
        jobs = [j for d in table.get("launchd", {}).values() for j in d.values()]
        jobs += [j for s in table.get("systemd", {}).values() for j in s.values()]
        return [int(j[k]) for j in jobs for k in ("pid", "supervisor") if j.get(k)]


@dataclass(frozen=True)
class User:
    """An ordinary user that commands run as, with a HOME of its own (as root, the tests make
    one: what an ordinary user may and may not do is the point of the service tests)."""

    name: str
    uid: int
    gid: int
    home: Path

    def env(self, **extra: str) -> dict[str, str]:
        return {
            "PATH": os.environ["PATH"],
            "HOME": str(self.home),
            "USER": self.name,
            "LOGNAME": self.name,
            "XDG_CONFIG_HOME": str(self.home / ".config"),
            "XDG_STATE_HOME": str(self.home / ".local" / "state"),
            "PYTHONDONTWRITEBYTECODE": "1",
            "COLUMNS": "120",
            **extra,
        }

    def run(
        self, argv: list[str], env: dict[str, str], timeout: float = 180.0
    ) -> subprocess.CompletedProcess[str]:
        prefix: list[str] = []
        if os.getuid() != self.uid:
            # The interpreter may live under root's home, which an ordinary user cannot enter:
            # the user keeps one capability of root's, to read and search anywhere. Everything
            # launchd and the installer decide by uid and file ownership stays as for any user.
            prefix = [
                "setpriv",
                f"--reuid={self.uid}",
                f"--regid={self.gid}",
                "--clear-groups",
                "--inh-caps=+dac_read_search",
                "--ambient-caps=+dac_read_search",
            ]
        return subprocess.run(
            [*prefix, *argv],
            env=env,
            cwd=self.home,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
        )

    def own(self, *paths: Path) -> None:
        if os.getuid() == 0:
            for path in paths:
                for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
                    os.chown(p, self.uid, self.gid)


TEST_USER = "mlxwd-test"


USER_WAIT = 900.0  # seconds another run of the suite may hold the tests' user


@contextlib.contextmanager
def _the_test_user() -> Iterator[None]:
    """The tests' user is one per machine, its home in the user database: a run of the suite
    beside this one (CI and a person, say) would empty that home under this test. Held by
    one test at a time, across processes."""
    import fcntl
    import tempfile

    with open(Path(tempfile.gettempdir()) / f"{TEST_USER}.lock", "a") as lock:
        deadline = time.monotonic() + USER_WAIT
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    pytest.fail(f"another run held the user {TEST_USER} for {USER_WAIT:.0f} s")
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.fixture
def user(tmp_path: Path) -> Iterator[User]:
    """An ordinary user with an empty HOME. As root, the tests' own user (made once), whose home
    is the one in the user database, emptied for each test: --system installs read it there."""
    if os.getuid() == 0:
        with _the_test_user():
            yield from _user()
    else:
        yield from _user()


def _user() -> Iterator[User]:
    import pwd
    import shutil
    import tempfile

    if os.getuid() == 0:
        try:
            entry = pwd.getpwnam(TEST_USER)
        except KeyError:
            subprocess.run(
                ["useradd", "--home-dir", f"/home/{TEST_USER}", "--no-create-home",
                 "--shell", "/usr/sbin/nologin", TEST_USER],
                check=True,
            )  # fmt: skip
            entry = pwd.getpwnam(TEST_USER)
        home = Path(entry.pw_dir)
        shutil.rmtree(home, ignore_errors=True)
        home.mkdir(parents=True)
        home.parent.chmod(home.parent.stat().st_mode | 0o055)
        cleanup = home
    else:
        entry = pwd.getpwuid(os.getuid())
        root = Path(tempfile.mkdtemp(prefix="mlxwd-user-", dir="/tmp"))
        home = root / "home"
        home.mkdir()
        cleanup = root
    u = User(entry.pw_name, entry.pw_uid, entry.pw_gid, home)
    u.own(home)
    yield u
    shutil.rmtree(cleanup, ignore_errors=True)


@pytest.fixture
def fake_services(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeServices]:
    fakes = FakeServices(tmp_path)
    monkeypatch.setenv("PATH", f"{fakes.bin}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SVC_STATE", str(fakes.state))
    monkeypatch.setenv("FAKE_SVC_LOG", str(fakes.log))
    yield fakes
    fakes.kill_all()


@pytest.fixture
def user_services(user: User) -> Iterator[FakeServices]:
    """The fakes for `user`, their state writable by that user; nobody at the screen yet."""
    fakes = FakeServices(user.home / ".fake-svc", gui=[])
    user.own(user.home / ".fake-svc")
    yield fakes
    fakes.kill_all()


# -- the real llama.cpp llama-server ---------------------------------------------------------


LLAMA_MARK = "llama_server"


# What makes a test slow: a real server, a daemon, a service user, a browser, mypy and a wheel.
# `pytest -m "not slow"` leaves them out: the everyday loop (CONTRIBUTING.md).
SLOW_FIXTURES = {
    "tiny_model",
    "llama_binary",
    "run_daemon",
    "hanging",
    "user",
    "fake_services",
    "bad_server",
    "module_bad_server",
    "two_servers",  # test_balancer.py: two servers, a daemon and HAProxy
}
SLOW_FILES = {"test_quality.py", "test_page_browser.py", "test_demo.py", "test_prometheus.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        if "llama_binary" in used:
            item.add_marker(LLAMA_MARK)
        if used & SLOW_FIXTURES or item.path.name in SLOW_FILES:
            item.add_marker("slow")


def pytest_sessionfinish(session: pytest.Session) -> None:
    from tests import background

    background.stop()


def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the quality tools in the background (tests/background.py). Build llama-server here, once, before the first test: a build of about 10 minutes must
    not run inside a test's time limit (its fixture would error, and every later test with it)."""
    from tests import background, llamacpp

    config = session.config
    if not config.option.collectonly and any(
        i.path.name == "test_quality.py" for i in session.items
    ):
        background.start()
    wanted = any(LLAMA_MARK in (m.name for m in item.iter_markers()) for item in session.items)
    if not wanted or config.option.collectonly or llamacpp.find():
        return
    reporter = config.pluginmanager.getplugin("terminalreporter")
    capture = config.pluginmanager.getplugin("capturemanager")

    def say(line: str) -> None:
        if reporter is None or capture is None:
            print(line, file=sys.stderr, flush=True)
            return
        with capture.global_and_fixture_disabled():
            reporter.write_line(line)

    try:
        llamacpp.build(say=say)
    except llamacpp.BuildError as e:
        pytest.exit(str(e), returncode=pytest.ExitCode.USAGE_ERROR)


@pytest.fixture(scope="session")
def llama_binary() -> Path:
    """Built before the first test by `pytest_collection_finish`."""
    from tests import llamacpp

    found = llamacpp.find()
    if found is None:
        raise RuntimeError("llama-server is missing from the cache after the session's build")
    return found


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.tinygguf import build

    return build(tmp_path_factory.mktemp("tiny-gguf") / "tiny.gguf")


StartLlama = Callable[..., Running]


@pytest.fixture(scope="session")
def start_llama(
    llama_binary: Path, tiny_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StartLlama]:
    """llama-server on the tiny GGUF (`llama_argv`). `wait=False` returns while it loads."""

    def start(*extra: str, wait: bool = True, metrics: bool = True) -> Running:
        port = free_port()
        log = tmp_path_factory.mktemp("llama-log") / "llama.log"
        cmd = [*llama_argv(llama_binary, tiny_gguf, port, metrics=metrics), *extra]
        server = spawn(cmd, port, log)
        started.append(server)
        if wait:
            wait_until_serving(server)
        return server

    with stopped_at_end() as started:
        yield start


@pytest.fixture(scope="session")
def _llama_server(start_llama: StartLlama) -> Running:
    return start_llama()


@pytest.fixture
def llama_server(_llama_server: Running) -> Running:
    wait_until_idle(_llama_server)
    return _llama_server


def send_chat(port: int) -> socket.socket:
    """A chat request sent on a raw socket, its answer left unread (the caller leaves or waits)."""
    s = socket.create_connection(("127.0.0.1", port))
    body = b'{"messages":[{"role":"user","content":"hi"}]}'
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    return s


def daemon_process(config_path: Path, stderr: Path) -> subprocess.Popen[bytes]:
    """`mlx-watchdog run` as its own process (the caller ends it by its PID)."""
    with stderr.open("ab") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "mlx_watchdog", "run", "--config", str(config_path)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
        )


def restarts_in(db: Path) -> list[tuple[str, str | None]]:
    """(trigger, outcome) of each restart in a history file, oldest first."""
    if not db.exists():
        return []
    con = sqlite3.connect(db)
    try:
        return con.execute("SELECT trigger, outcome FROM restarts ORDER BY id").fetchall()
    except sqlite3.OperationalError:
        return []
    finally:
        con.close()
