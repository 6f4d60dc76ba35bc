"""What the balancer tests and bench/balancer.py share: the docs' configurations, a real
HAProxy's view of its servers, and a client stream through it."""

from __future__ import annotations

import re
import socket
import threading
import time
from pathlib import Path

import httpx

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
