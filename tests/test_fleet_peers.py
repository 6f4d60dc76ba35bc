"""`fleet` against peers that lie: each crafted /status is that machine's row ("unknown" or
unreachable, exit 3 at least), never a crash that hides the healthy machines, never an escape
sequence on the terminal, never a wait longer than the per-machine deadline."""

from __future__ import annotations

import http.server
import json
import os
import socket
import ssl
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import Running, mlx_watchdog

GOOD = {
    "watchdog": {"running": True},
    "servers": [
        {"name": "fine", "state": "healthy", "exit_code": 0, "reason": "healthy: first token"}
    ],
}
HOSTILE = {
    "exit code 256": {
        "watchdog": {"running": True},
        "servers": [{"name": "x", "state": "healthy", "exit_code": 256}],
    },
    "exit code -1": {
        "watchdog": {"running": True},
        "servers": [{"name": "x", "state": "healthy", "exit_code": -1}],
    },
    "exit code as text": {
        "watchdog": {"running": True},
        "servers": [{"name": "x", "exit_code": "0"}],
    },
    "markup": {
        "watchdog": {"running": True},
        "servers": [{"name": "[/]", "state": "[/]", "exit_code": 0, "reason": "[bold]x[/]"}],
    },
    "no servers key": {"watchdog": {"running": True}},
    "servers a string": {"watchdog": {"running": True}, "servers": "all fine"},
    "server not an object": {"watchdog": {"running": True}, "servers": [1]},
    "watchdog a list": {"watchdog": [], "servers": []},
    "no name or state": {"watchdog": {"running": True}, "servers": [{}]},
    "numbers that are not": {
        "watchdog": {"running": True},
        "servers": [
            {
                "name": "x",
                "state": "healthy",
                "exit_code": 0,
                "restarts_24h": "many",
                "gave_up_24h": 1e308,
                "budget_left": -5,
            }
        ],
    },
    "escapes": {
        "watchdog": {"running": True},
        "servers": [
            {
                "name": "\x1b[2Jwiped",
                "state": "healthy",
                "exit_code": 0,
                "reason": "\x1b]8;;http://evil\x1b\\click\x1b]8;;\x1b\\",
            }
        ],
    },
}
SERVING = ("numbers that are not", "escapes")
RAW = {
    "nested": "[" * 100_000,
    "not json": "<html>",
    "trickle": {"body": json.dumps(GOOD) * 3, "trickle": 0.5},
    "endless": {"body": "x" * 65536, "endless": True},
}


@pytest.fixture
def peers(bad_server: Callable[..., Running]) -> tuple[Running, Running]:
    good, bad = bad_server("ok"), bad_server("ok")
    httpx.put(good.url + "/_hostile", json={"/status": {"body": json.dumps(GOOD)}}, timeout=5)
    return good, bad


def _answer(bad: Running, answer: object) -> None:
    if isinstance(answer, dict) and ("body" in answer):
        route = answer
    else:
        route = {"body": answer if isinstance(answer, str) else json.dumps(answer)}
    r = httpx.put(bad.url + "/_hostile", json={"/status": route}, timeout=5)
    assert r.status_code == 204


@pytest.mark.parametrize("name", [*HOSTILE, *RAW])
def test_a_lying_peer_is_its_own_row_and_never_hides_the_others(
    name: str, peers: tuple[Running, Running]
) -> None:
    good, bad = peers
    _answer(bad, HOSTILE.get(name, RAW.get(name)))
    for args in (["--json"], []):
        run = mlx_watchdog("fleet", good.url, bad.url, *args, timeout=60)
        assert "Traceback" not in run.stderr, run.stderr
        wanted = 0 if name in SERVING else 3  # a serving peer with odd fields is still serving
        assert run.returncode == wanted, (name, run.stdout[-400:], run.stderr[-400:])
        assert not any(c in run.stdout for c in ("\x1b", "\x9b", "u001b", "u009b"))
        if args:
            rows = json.loads(run.stdout)["rows"]
            assert rows[0]["machine"] == good.url and rows[0]["state"] == "healthy"
            theirs = [r for r in rows if r["machine"] == bad.url]
            assert theirs and all(
                r["state"] in ("unknown", "unreachable", "healthy") for r in theirs
            )
        else:
            assert "fine" in run.stdout and "healthy" in run.stdout


@pytest.mark.parametrize(
    "url",
    [
        "http://u:secret-pw@mac-1:9464",
        "ftp://mac-1:9464",
        "http://mac-1:99999",
        "http://mac-1:9464/?x=1",
        "mac-1:9464",
    ],
)
def test_a_peer_url_it_cannot_read_as_given_is_refused(url: str) -> None:
    run = mlx_watchdog("fleet", url)
    assert run.returncode == 3 and "Invalid value for URLS" in run.stderr, run.stderr
    assert "Traceback" not in run.stderr and "secret-pw" not in run.stderr.replace(url, "")


def _tls_files(folder: Path) -> tuple[Path, Path, Path]:
    """A CA of our own and a certificate it signed for 127.0.0.1, made by openssl."""

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
            "ca.pem", "-days", "2", "-subj", "/CN=test CA")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "peer.key", "-out", "peer.csr",
            "-subj", "/CN=127.0.0.1")  # fmt: skip
    (folder / "san.ext").write_text("subjectAltName = IP:127.0.0.1\n")
    openssl("x509", "-req", "-in", "peer.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
            "-CAcreateserial", "-out", "peer.pem", "-days", "2", "-extfile", "san.ext")  # fmt: skip
    return folder / "ca.pem", folder / "peer.pem", folder / "peer.key"


@pytest.fixture
def tls_peer(tmp_path: Path) -> Iterator[tuple[str, Path, list[str]]]:
    """A watchdog behind a TLS proxy at /wd/, wanting its token: its URL, the CA, the paths
    asked for."""
    ca, cert, key = _tls_files(tmp_path)
    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            asked.append(self.path)
            ok = self.headers.get("Authorization") == "Bearer s3cret"
            body = json.dumps(GOOD).encode() if ok else b'{"error": "token"}'
            self.send_response(200 if ok and self.path == "/wd/status" else 401 if not ok else 404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"https://127.0.0.1:{server.server_address[1]}/wd/", ca, asked
    server.shutdown()
    server.server_close()


def test_fleet_reads_https_with_the_path_the_token_and_verified_certificates(
    tls_peer: tuple[str, Path, list[str]], tmp_path: Path
) -> None:
    url, ca, asked = tls_peer
    token = tmp_path / "token"
    token.write_text("s3cret\n")

    run = mlx_watchdog("fleet", url, "--json", "--token-file", str(token), "--cacert", str(ca))
    assert run.returncode == 0, run.stdout + run.stderr
    rows = json.loads(run.stdout)["rows"]
    assert [(r["server"], r["state"]) for r in rows] == [("fine", "healthy")]
    assert asked == ["/wd/status"]  # the endpoint's path kept
    assert "s3cret" not in run.stdout + run.stderr

    # Without our CA the certificate is not trusted: that machine's row says so, exit 3.
    run = mlx_watchdog("fleet", url, "--json", "--token-file", str(token))
    assert run.returncode == 3
    why = json.loads(run.stdout)["rows"][0]["why"]
    assert "CERTIFICATE_VERIFY_FAILED" in why, why
    assert len(asked) == 1  # no request went out over the unverified connection

    # Without the token: the row says what is wanted.
    run = mlx_watchdog("fleet", url, "--json", "--cacert", str(ca))
    assert run.returncode == 3 and "--token-file" in json.loads(run.stdout)["rows"][0]["why"]

    # A --cacert that holds no certificate is the caller's mistake: exit 3, named.
    run = mlx_watchdog("fleet", url, "--cacert", str(token))
    assert run.returncode == 3 and "Invalid value for --cacert" in run.stderr, run.stderr


@pytest.mark.parametrize(
    ("url", "clear"),
    [
        ("http://127.0.0.1:9464", False),
        ("http://127.8.0.1:9464", False),
        ("http://[::1]:9464", False),
        ("http://localhost:9464", False),
        ("https://mac-1.lan:9464", False),
        ("http://mac-1.lan:9464", True),
        ("http://192.0.2.7:9464", True),
        ("http://[::ffff:127.0.0.1]:9464", False),
    ],
)
def test_a_token_crosses_the_network_only_encrypted(url: str, clear: bool) -> None:
    from mlx_watchdog.fleet.peers import in_clear

    assert in_clear(url) is clear


def _lan_address() -> str | None:
    import psutil

    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return str(a.address)
    return None


def test_the_token_is_not_sent_to_a_plain_http_peer_beyond_loopback(tmp_path: Path) -> None:
    address = _lan_address()
    if address is None:
        pytest.skip("this machine has no address beyond loopback")
    seen: list[str | None] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            self.send_response(401)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer((address, 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        token = tmp_path / "token"
        token.write_text("s3cret\n")
        url = f"http://{address}:{server.server_address[1]}"
        run = mlx_watchdog("fleet", url, "--json", "--token-file", str(token))
        assert run.returncode == 3 and seen == [None], (seen, run.stdout)
        assert "--token-in-clear" in json.loads(run.stdout)["rows"][0]["why"]
        run = mlx_watchdog("fleet", url, "--json", "--token-file", str(token), "--token-in-clear")
        assert seen[-1] == "Bearer s3cret"
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        run = mlx_watchdog("fleet", url, "--token-file", str(fifo), timeout=20)
        assert run.returncode == 3 and "not a regular file" in run.stderr, run.stderr
    finally:
        server.shutdown()
        server.server_close()


def test_rows_into_a_pipe_are_whole(bad_server: Callable[..., Running]) -> None:
    """As kubectl's and docker's: piped, no column is cut to a terminal's width."""
    peer = bad_server("ok")
    reason = "wedged: no token for 61.0 s while /v1/models answers 200; " + "evidence " * 8
    doc = {
        "watchdog": {"running": True},
        "servers": [{"name": "m", "state": "wedged", "exit_code": 2, "reason": reason}],
    }
    _answer(peer, doc)
    piped = mlx_watchdog("fleet", peer.url, env={"COLUMNS": ""})
    assert reason.strip() in piped.stdout, piped.stdout
    narrow = mlx_watchdog("fleet", peer.url, env={"COLUMNS": "100"})
    assert reason.strip() not in narrow.stdout  # a terminal of 100 columns: cut to fit
