"""What the balancer tests and bench/balancer.py share: the docs' configurations, a real
HAProxy's view of its servers, and a client stream through it."""

from __future__ import annotations

import re
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from mlx_watchdog.config import parse_config
from mlx_watchdog.daemon import Daemon
from tests.conftest import DaemonThread, free_port, until

ROOT = Path(__file__).parent.parent


def docs_block(language: str) -> str:
    """The one ```language block of docs/endpoint.md: what the tests run is what it shows."""
    text = (ROOT / "docs" / "endpoint.md").read_text()
    (block,) = re.findall(rf"```{language}\n(.*?)```", text, re.S)
    return block


def haproxy_config(folder: Path, front: int, servers: list[tuple[str, int]], agent: int) -> str:
    """The docs' configuration, its addresses, ports, socket and names changed only."""
    text = docs_block("haproxy")
    text = text.replace("/run/haproxy/admin.sock", str(folder / "admin.sock"))
    text = text.replace("127.0.0.1:8000", f"127.0.0.1:{front}")
    lines = text.splitlines()
    at = [i for i, line in enumerate(lines) if line.strip().startswith("server ")]
    assert len(at) == len(servers) == 2
    for i, (name, port) in zip(at, servers, strict=True):
        line = re.sub(r"10\.0\.0\.\d+:8080", f"127.0.0.1:{port}", lines[i])
        line = re.sub(r"agent-addr 10\.0\.0\.\d+", "agent-addr 127.0.0.1", line)
        line = line.replace("agent-port 9465", f"agent-port {agent}")
        line = re.sub(r"server mac\d ", f"server {name} ", line)
        lines[i] = line.replace('agent-send "mlx-8080\\n"', f'agent-send "{name}\\n"')
    return "\n".join(lines) + "\n"


def server_states(sock: Path) -> dict[str, str]:
    """Each server's status as HAProxy's stats socket says (UP, DOWN, DRAIN, ...)."""
    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(5)
        s.connect(str(sock))
        s.sendall(b"show stat\n")
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    rows = got.decode().splitlines()
    header = rows[0].lstrip("# ").split(",")
    out = {}
    for row in rows[1:]:
        cells = dict(zip(header, row.split(","), strict=False))
        if cells.get("svname") not in (None, "FRONTEND", "BACKEND"):
            out[cells["svname"]] = cells["status"]
    return out


class Stream:
    """A client sending a small request through the balancer every 0.1 s, each waiting as
    long as it takes (a minute at most)."""

    def __init__(self, url: str) -> None:
        self.url, self.results = url, []
        self.stop = threading.Event()
        self.threads: list[threading.Thread] = []
        self.sender = threading.Thread(target=self._send_all)
        self.sender.start()

    def _send_all(self) -> None:
        while not self.stop.wait(0.1):
            t = threading.Thread(target=self._one)
            t.start()
            self.threads.append(t)

    def _one(self) -> None:
        began = time.monotonic()
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        try:
            r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=60)
            outcome: object = r.status_code
        except httpx.HTTPError as exc:
            outcome = type(exc).__name__
        self.results.append((outcome, time.monotonic() - began))

    def end(self) -> list[tuple[object, float]]:
        self.stop.set()
        self.sender.join()
        for t in self.threads:
            t.join(90)
        return list(self.results)


def nginx_config(folder: Path, front: int, ports: list[int]) -> str:
    """The docs' nginx block inside the least an nginx.conf needs to run unprivileged here
    (its own pid file, logs and temporary folders); addresses and ports changed only."""
    block = docs_block("nginx").replace("127.0.0.1:8000", f"127.0.0.1:{front}")
    for docs_address, port in zip(("10.0.0.11:8080", "10.0.0.12:8080"), ports, strict=True):
        block = block.replace(docs_address, f"127.0.0.1:{port}")
    temp = "\n".join(
        f"    {kind}_temp_path {folder / kind};"
        for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return (
        f"pid {folder / 'nginx.pid'};\nerror_log {folder / 'error.log'};\n"
        "events {}\nhttp {\n"
        f"    access_log {folder / 'access.log'};\n{temp}\n"
        + "\n".join("    " + line for line in block.splitlines())
        + "\n}\n"
    )


def watching(
    servers: list[dict[str, object]], state: Path, agent: int, interval: str
) -> DaemonThread:
    """One watchdog watching `servers`, answering HAProxy's agent check on port `agent`."""
    raw = {
        "watchdog": {
            "interval": interval,
            "listen": "off",
            "agent": f"127.0.0.1:{agent}",
            "state_dir": str(state),
        },
        "server": servers,
    }
    return DaemonThread(Daemon(parse_config(raw)))


def configured(text: str, setup: str) -> str:
    if setup == "agent":
        return text
    if setup == "agent, no queue, no resend":  # the docs' config before issue 47
        text = text.replace(" maxconn 1", "")
        text = re.sub(
            r"^    (retry-on|option redispatch|option http-buffer).*\n", "", text, flags=re.M
        )
        return text
    text = re.sub(r" agent-check.*$", "", text, flags=re.M)
    if setup == "no check":
        return re.sub(r" check inter 1s fall 1 rise 2", "", text)
    return text.replace(
        "    balance leastconn\n",
        "    balance leastconn\n    option httpchk GET /v1/models\n    http-check expect status 200\n",
    )


def run_real(
    setup: str,
    after: int,
    haproxy: str,
    work: Path,
    model: Path,
    *,
    through: bool = False,
    prompts: int = 2,
    timeout_server: str | None = None,
) -> dict[str, object]:
    """The seed's setup behind HAProxy (configured for `setup`): two real serial servers
    (`model`, `--draft-model`) started and restarted by one watchdog, a client stream, and a
    wedge from two long prompts sent by clients that give up after 1 s: to server "a"
    directly, or (`through`) through HAProxy, as the field sends them. With `timeout_server`
    (HAProxy's, a mistake when shorter than the prefill), the clients are patient and the
    balancer cuts them off."""
    from mlx_watchdog.demo.run import long_prompt
    from tests.conftest import ttft

    folder = work / setup.replace("/", "").replace(" ", "-")
    folder.mkdir()
    (work / "hub").mkdir(exist_ok=True)
    ports = {"a": free_port(), "b": free_port()}
    probe = {
        "slow_after": "2s",
        "wedge_after": "4s",
        "max_busy": "5m",
        "startup_grace": "3m",
        "hard_timeout": "10m",
    }
    serve = ("-m", "mlx_lm", "server", "--model", str(model), "--draft-model", str(model))
    servers = [
        {
            "name": name,
            "url": f"http://127.0.0.1:{port}",
            "manager": "process",
            "command": [sys.executable, *serve, "--port", str(port), "--max-tokens", "8"],
            "env": {"HF_HUB_CACHE": str(work / "hub"), "HF_HUB_OFFLINE": "1"},
            "probe": probe,
            "restart": {"drain": True, "drain_timeout": "1m", "max_restarts": 5, "backoff": "1s"},
        }
        for name, port in ports.items()
    ]
    agent, front = free_port(), free_port()
    daemon = watching(servers, folder / "state", agent, "1s")
    text = haproxy_config(folder, front, list(ports.items()), agent)
    text = configured(text, setup)
    if timeout_server is not None:
        text = re.sub(r"timeout server \S+", f"timeout server {timeout_server}", text)
    if through:  # each long prompt to its own server, whatever leastconn's tie would pick
        text = _placed(text, list(ports))
    (folder / "haproxy.cfg").write_text(text)
    proxy = subprocess.Popen(
        [haproxy, "-db", "-f", str(folder / "haproxy.cfg")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    stats = folder / "admin.sock"
    try:
        cycles = daemon.daemon.cycles

        def serving() -> bool:
            shown = [c.shown for c in list(cycles.values())]
            return len(shown) == 2 and all(s.state == "healthy" for s in shown)

        until(serving, 240, "both servers to serve")
        until(lambda: set(server_states(stats).values()) == {"UP"}, 30, "both UP")
        a = f"http://127.0.0.1:{ports['a']}"
        rate = 1500 * 3 / ttft(a, long_prompt(1, words=1500))  # tokens a second, about
        words = int(rate * 20 / 3)  # each abandoned prompt about 20 s of prefill
        stream = Stream(f"http://127.0.0.1:{front}")
        until(lambda: len(stream.results) >= 10, 30, "the stream")
        to = f"http://127.0.0.1:{front}" if through else a
        sent_at, patient = time.time(), []
        for seed, name in zip((11, 12)[:prompts], ports, strict=False):
            # The seed's wedge: clients that give up after 1 s.
            asked = long_prompt(seed, words=words)
            if timeout_server is None:
                _send(to, asked, 1.0, name)
                continue
            patient.append(threading.Thread(target=_send, args=(to, asked, 120.0, name)))
            patient[-1].start()
        store = daemon.daemon.store

        def cured() -> bool:
            incidents = store.incidents(0.0, None if through else "a")
            return bool(incidents) and all(i.closed_at is not None for i in incidents)

        until(cured, 300, "the wedge on a to end")
        ended_at = len(stream.results)
        until(lambda: len(stream.results) >= ended_at + after, 120, "requests after it")
        results = stream.end()
        incidents = store.incidents(0.0, None if through else "a")
        how = [i.outcome for i in incidents]
        recover = [i.recover_s for i in incidents]
        opened = sorted(round(i.opened_at - sent_at, 1) for i in incidents)
        for t in patient:
            t.join(150)
    finally:
        proxy.terminate()
        proxy.wait(10)
        daemon.stop()
    row = summary(setup, results)
    return {
        **row,
        "abandoned_prefill_s_each": 20,
        "incident_outcomes": how,
        "recover_s": recover,
        "opened_after_s": opened,
    }


PLACE = "x-to"  # a request header naming the server HAProxy must send it to (tests only)


def _placed(text: str, names: list[str]) -> str:
    """The config with a `use-server` rule per server, before the first `server` line: a
    request carrying PLACE goes to that server (queued there at its maxconn), as the field's
    long prompts each reach one server; the rest are balanced as the docs say."""
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.strip().startswith("server "))
    rules = [f"    use-server {n} if {{ req.hdr({PLACE}) -m str {n} }}" for n in names]
    return "\n".join(lines[:first] + rules + lines[first:]) + "\n"


def _send(url: str, prompt: str, timeout: float, to: str) -> str:
    """demo.run.send's request, placed on server `to` when it goes through HAProxy."""
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 8}
    try:
        httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout, headers={PLACE: to})
    except httpx.TimeoutException:
        return "gave up"
    except httpx.HTTPError:
        return "error"
    return "served"


def summary(setup: str, results: list[tuple[object, float]]) -> dict[str, object]:
    waits = sorted(w for _, w in results)
    failed = [o for o, _ in results if o != 200]
    return {
        "setup": setup,
        "served": len(results) - len(failed),
        "failed": len(failed),
        "p99_wait_s": round(waits[max(0, int(0.99 * len(waits)) - 1)], 2),
        "max_wait_s": round(waits[-1], 2),
        "median_wait_s": round(statistics.median(waits), 3),
    }
