"""Behind a real HAProxy (Debian's), run with the configuration docs/endpoint.md shows: the
watchdog answers HAProxy's agent check per server, and a client stream through HAProxy loses
no request while one of two servers wedges and is restarted."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from mlx_watchdog.advice.balancer import findings
from mlx_watchdog.advice.calibrate import Advice
from mlx_watchdog.config import Config, parse_config
from mlx_watchdog.daemon import Daemon
from mlx_watchdog.serve.agent import answer
from tests.balancing import (
    Stream,
    docs_block,
    haproxy_config,
    nginx_config,
    server_states,
    watching,
)
from tests.builders import QUICK_TOML, badserver_argv, command_server
from tests.conftest import DaemonThread, free_port, listens, system_tool, until
from tests.pageday import NOW, changed, status_doc

ROOT = Path(__file__).parent.parent


def test_the_agent_answers_each_server_as_healthz_does() -> None:
    doc = status_doc(NOW, ("healthy", "wedged", "busy"))
    assert answer(doc, "srv-healthy") == "up ready"
    assert answer(doc, "srv-busy") == "up ready"  # busy with live clients: it still serves
    assert answer(doc, "srv-wedged") == "down #wedged"
    assert answer(doc, "nobody").startswith("down #no server named nobody")
    assert answer(doc, "").startswith("down #agent-send names no server")  # several watched
    drained = changed(doc, 0, draining=True, serving=False)
    assert answer(drained, "srv-healthy") == "drain"
    restarting = changed(doc, 0, restarting=True, serving=False)
    assert answer(restarting, "srv-healthy") == "down #restarting"
    held = changed(doc, 2, held_behind=True, serving=False)
    assert answer(held, "srv-busy") == "down #busy: holding requests behind abandoned work"
    one = changed(status_doc(NOW, ("healthy",)), 0)
    assert answer(one, "") == "up ready"  # no agent-send, one server: that one
    hostile = changed(doc, 1, state="wedged\n\x1b[2Jup ready")
    assert "\n" not in answer(hostile, "srv-wedged")


def test_the_last_server_in_stays_in_so_requests_queue_instead_of_failing() -> None:
    """Issue 55: two long prompts given up through HAProxy wedged both servers; both drained
    and restarted at once left HAProxy no server, and every request got a 503. The last of a
    watchdog's servers not out answers up (its requests wait in HAProxy's queue), and the
    restarts take turns (cycle/crew.py Turns)."""
    from mlx_watchdog.cycle.crew import Turns

    both = changed(status_doc(NOW, ("wedged", "wedged")), 1, name="srv-b")
    assert answer(both, "srv-wedged") == "up ready"
    one_out = changed(both, 0, restarting=True, serving=False)
    assert answer(one_out, "srv-wedged") == "down #restarting"  # the one restarting is out
    other = changed(status_doc(NOW, ("healthy", "wedged")), 0, serving=True)
    assert answer(other, "srv-wedged") == "down #wedged"  # another serves: this one goes
    turns = Turns(settle_s=3.0)
    assert turns.take("a", 0.0) == [] and turns.take("b", 1.0) == ["a"]
    assert turns.take("a", 1.0) == []  # its own turn goes on
    turns.give_back("a", 2.0)
    assert turns.take("b", 4.0) == ["a"]  # the balancer has not taken "a" back yet
    assert turns.take("b", 5.0) == []


def test_a_restart_waits_until_the_agent_has_told_the_balancer_its_server_is_out() -> None:
    """Issue 55: with both servers wedged the agent kept the first in (the last server in
    stays up) and the watchdog restarted it before HAProxy's next agent check: 33 requests it
    had queued went to the closed port and got a 503 within 0.25 s. A drain now waits until
    the agent has told the balancer the server is out, for two of its check intervals at
    most; where no balancer asks, not at all."""
    import threading

    from mlx_watchdog.act.rotation import Rotation
    from mlx_watchdog.serve.agent import start

    clock = [0.0]
    rotation = Rotation(mono=lambda: clock[0])
    assert rotation.wait_out("srv-wedged")  # no balancer asks of it: no wait
    docs = {"now": changed(status_doc(NOW, ("wedged", "wedged")), 1, name="srv-b")}
    agent = start("127.0.0.1", 0, lambda name: docs["now"], rotation)
    port = agent.server_address[1]

    def check(name: bytes) -> bytes:
        before = rotation.said(name.decode())
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(name + b"\n")
            got = s.recv(4096)
        if name != b"no-such-server":  # recorded once sent: wait for it
            asked = before[1] if before else 0
            until(lambda: (rotation.said(name.decode()) or (0, 0))[1] > asked, 5, "recorded")
        return got

    def waiting() -> tuple[threading.Thread, list[bool]]:
        result: list[bool] = []
        waiter = threading.Thread(target=lambda: result.append(rotation.wait_out("srv-wedged")))
        waiter.start()
        return waiter, result

    try:
        assert check(b"srv-wedged") == b"up ready\n"  # kept in: the last server in
        clock[0] += 1.0
        assert check(b"srv-wedged") == b"up ready\n"  # checked every second: waits 2.5 s
        waiter, result = waiting()
        waiter.join(0.3)
        assert waiter.is_alive(), "out before the balancer was told"
        docs["now"] = changed(docs["now"], 0, draining=True, serving=False)
        clock[0] += 1.0
        assert check(b"srv-wedged") == b"drain\n"
        waiter.join(5)
        assert result == [True], "the restart still waits after the balancer was told"
        assert rotation.wait_out("srv-wedged")  # told out already: at once
        check(b"no-such-server")  # names it does not watch are not kept
        assert rotation.said("no-such-server") is None
        # Told in again, and no check comes: the wait ends at its bound, saying not out.
        docs["now"] = changed(docs["now"], 0, draining=False, serving=True)
        clock[0] += 1.0
        assert check(b"srv-wedged") == b"up ready\n"
        waiter, result = waiting()
        clock[0] += 2.0
        waiter.join(0.3)
        assert waiter.is_alive(), "gave up before two check intervals"
        clock[0] += 1.0
        waiter.join(5)
        assert result == [False]
    finally:
        agent.shutdown()
        agent.server_close()


def test_the_agent_reads_what_it_is_sent_within_bounds_and_answers_one_line() -> None:
    """Whatever connects to the agent port: a name line too long, one with control
    characters, or nothing at all; each gets one line, within the read's bound."""
    from mlx_watchdog.serve.agent import NAME_WAIT, start

    doc = status_doc(NOW, ("healthy",))
    agent = start("127.0.0.1", 0, lambda name: doc)
    port = agent.server_address[1]

    def ask(sent: bytes, *, close: bool = False) -> tuple[bytes, float]:
        began = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(sent)
            if close:
                s.shutdown(socket.SHUT_WR)
            got = b""
            # Closed with unread bytes of ours, the agent's socket resets after its line.
            with contextlib.suppress(ConnectionResetError):
                while chunk := s.recv(4096):
                    got += chunk
        return got, time.monotonic() - began

    try:
        assert ask(b"srv-healthy\n")[0] == b"up ready\n"
        long, took = ask(b"x" * 100_000)  # no newline: read to the cap, then answered
        assert long.startswith(b"down #no server named ") and long.count(b"\n") == 1
        assert len(long) < 200 and took < NAME_WAIT + 2
        nothing, took = ask(b"")  # no agent-send, one server: that one, after the wait
        assert nothing == b"up ready\n" and took < NAME_WAIT + 2
        hostile = ask(b"srv\x1b[2J\rup ready\x00\n")[0]
        assert hostile.startswith(b"down #no server named ") and hostile.count(b"\n") == 1
        assert b"\x1b" not in hostile and b"\r" not in hostile
        assert ask(b"", close=True)[0] == b"up ready\n"  # a client that closed its side
    finally:
        agent.shutdown()
        agent.server_close()


def test_a_flood_of_idle_connections_to_the_agent_costs_a_bounded_number_of_threads() -> None:
    """Issue 54: a thread a connection, uncapped, behind a backlog of 5. Two hundred idle
    connections at once: at most MAX_OPEN handlers run, the rest are closed unanswered, and
    a check after the flood is answered as before."""
    import threading

    from mlx_watchdog.serve.agent import MAX_OPEN, start

    doc = status_doc(NOW, ("healthy",))
    agent = start("127.0.0.1", 0, lambda name: doc)
    port = agent.server_address[1]
    before = threading.active_count()
    flood: list[socket.socket] = []
    try:
        for _ in range(200):
            flood.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        until(lambda: threading.active_count() > before + MAX_OPEN // 2, 10, "the handlers")
        most = max(threading.active_count() for _ in range(50))
        assert most <= before + MAX_OPEN + 1, most
    finally:
        for s in flood:
            s.close()
    try:
        until(lambda: threading.active_count() <= before + 1, 10, "the handlers done")
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"srv-healthy\n")
            assert s.recv(100) == b"up ready\n"
    finally:
        agent.shutdown()
        agent.server_close()


def test_an_early_sign_moves_traffic_only_where_the_balancer_drains() -> None:
    """Abandoned connections and the probe past slow_after with no token: /healthz and the
    agent say so at once where `restart.drain` says another server takes the traffic."""
    from mlx_watchdog.config import ServerConfig
    from mlx_watchdog.judge.evidence import Evidence
    from mlx_watchdog.record.tally import Figures
    from mlx_watchdog.serve.status import describe

    lone = ServerConfig("s", "http://127.0.0.1:1")
    e = Evidence(waited_s=lone.probe.slow_after + 1, abandoned_connections=1, tokens=0)
    kept = describe(lone, NOW, Figures(), state="slow", reason="r", at=NOW, evidence=e)
    assert kept.held_behind and kept.serving  # no other server: nothing is drained
    paired = parse_config(
        {"server": [{"name": "s", "url": "http://127.0.0.1:1", "restart": {"drain": True}}]}
    ).servers[0]
    moved = describe(paired, NOW, Figures(), state="slow", reason="r", at=NOW, evidence=e)
    assert moved.held_behind and not moved.serving
    young = Evidence(waited_s=0.1, abandoned_connections=1, tokens=0)
    early = describe(paired, NOW, Figures(), state="slow", reason="r", at=NOW, evidence=young)
    assert not early.held_behind and early.serving  # not yet past slow_after


NEED = Advice(32768, 1024, 95.0, 2.0, 150, 180, 210)  # a calibration: 210 s at the balancer


def trap_findings(text: str, tmp_path: Path, serial: bool = True) -> list[tuple[str, str]]:
    path = tmp_path / "balancer.cfg"
    path.write_text(text)
    serial_names = {NAME} if serial else set()
    return [(lvl, d) for lvl, d, _ in findings(path, docs_watchdog(), {NAME: NEED}, serial_names)]


NAME = "mlx-8080"  # the docs' name for the server, in the watchdog and in agent-send


def docs_watchdog(agent: str = "10.0.0.11:9465") -> Config:
    """The watchdog docs/endpoint.md sets up on the machine 10.0.0.11."""
    return parse_config(
        {"watchdog": {"agent": agent}, "server": [{"name": NAME, "url": "http://10.0.0.11:8080"}]}
    )


def test_doctor_reads_the_agent_check_against_the_watchdogs_agent(tmp_path: Path) -> None:
    """Issue 55: an agent-send naming HAProxy's own server name (the docs use different names in
    the two places) made every server DOWN and every request 503 while doctor said ok; a wrong
    agent-port and an agent-send without a newline passed too."""
    docs = docs_block("haproxy")
    assert [lvl for lvl, _ in trap_findings(docs, tmp_path)] == ["ok"]

    def said(text: str, config: Config | None = None) -> str:
        path = tmp_path / "agent.cfg"
        path.write_text(text)
        found = findings(path, config or docs_watchdog(), {NAME: NEED}, {NAME})
        return "\n".join(f"{lvl}: {d}" for lvl, d, _ in found)

    own = said(docs.replace('agent-send "mlx-8080\\n"', 'agent-send "mac1\\n"', 1))
    assert (
        "problem: haproxy mlx mac1 (mlx-8080): agent-send names 'mac1' (HAProxy's own name" in own
    )
    assert "a server this watchdog does not watch" in own and "answers down" in own
    port = said(docs.replace("agent-port 9465", "agent-port 9464", 1))
    assert (
        "problem: haproxy mlx mac1 (mlx-8080): agent-port 9464, but this watchdog's agent" in port
    )
    bare = said(docs.replace('agent-send "mlx-8080\\n"', 'agent-send "mlx-8080"', 1))
    assert "warning: haproxy mlx mac1 (mlx-8080): agent-send 'mlx-8080' has no newline" in bare
    slow = said(docs.replace("agent-inter 1s", "agent-inter 30s", 1))
    assert "agent-inter 30 s: traffic moves that late" in slow
    off = said(docs, docs_watchdog("off"))
    assert "this watchdog serves no agent check (watchdog.agent is off)" in off
    elsewhere = said(docs, docs_watchdog("127.0.0.1:9465"))
    assert (
        "HAProxy asks the agent at 10.0.0.11, but this watchdog's agent listens on 127.0.0.1"
        in (elsewhere)
    )
    # A default-server line carries the agent check to each server line under it.
    shared = docs.replace(" agent-check agent-addr 10.0.0.11 agent-port 9465", "", 1).replace(
        "\nbackend mlx\n", "\nbackend mlx\n    default-server agent-check agent-port 9466\n", 1
    )
    assert "agent-port 9466, but this watchdog's agent check listens on port 9465" in said(shared)


def test_doctor_finds_the_seeds_traps_in_an_haproxy_config(tmp_path: Path) -> None:
    docs = trap_findings(docs_block("haproxy"), tmp_path)
    assert [lvl for lvl, _ in docs] == ["ok"], docs  # what the docs show passes
    assert "1 of its servers watched here" in docs[0][1]
    trap = (
        "defaults\n    mode http\n    timeout connect 5s\n    timeout server 60s\n"
        "    retry-on all-retryable-errors\n"
        "backend mlx\n    server mac1 10.0.0.11:8080 check\n"
        "    server mac2 10.0.0.12:8080 maxconn 1 check\n"
    )
    said = trap_findings(trap, tmp_path)
    text = "\n".join(d for _, d in said)
    assert "timeout server 60 s, below the 210 s" in text
    assert "retries 3 without option redispatch" in text  # HAProxy's default 3 retries
    assert "retry-on all-retryable-errors resends a prompt" in text
    assert "no queue in front of a server that serves one request at a time" in text
    assert "no option abortonclose: a client that gives up at the balancer leaves" in text
    queued = trap.replace(
        "server mac1 10.0.0.11:8080 check", "server mac1 10.0.0.11:8080 maxconn 1"
    )
    text = "\n".join(d for _, d in trap_findings(queued, tmp_path))
    assert "requests wait 5 s in the queue (timeout queue, or timeout connect when unset)" in text
    batched = "\n".join(d for _, d in trap_findings(trap, tmp_path, serial=False))
    assert "no queue in front" not in batched  # a batched server takes them together


def test_doctor_finds_the_seeds_traps_in_an_nginx_config(tmp_path: Path) -> None:
    docs = trap_findings(docs_block("nginx"), tmp_path)
    levels = [lvl for lvl, _ in docs]
    assert "problem" not in levels, docs
    assert any("open-source nginx has no queue" in d for _, d in docs)  # said plainly
    trap = (
        "upstream mlx { server 10.0.0.11:8080; }\n"
        "server { location /v1/ { proxy_pass http://mlx; proxy_next_upstream error timeout; } }\n"
    )
    text = "\n".join(d for _, d in trap_findings(trap, tmp_path))
    assert "proxy_read_timeout 60 s, below the 210 s" in text  # nginx's default when unset
    assert "proxy_next_upstream includes timeout" in text
    garbage = trap_findings("this is no balancer", tmp_path)
    assert garbage[0][0] == "problem" and "neither an HAProxy config" in garbage[0][1]
    binary = tmp_path / "binary.cfg"
    binary.write_bytes(b"upstream \xff\xfe {\x00 server 10.0.0.11:8080 max_conns=x; }" * 50_000)
    from mlx_watchdog.advice.balancer import findings

    config = parse_config({"server": [{"name": "mac1", "url": "http://10.0.0.11:8080"}]})
    said = list(findings(binary, config, {"mac1": NEED}, {"mac1"}))  # read to a cap, no crash
    assert said[0][0] == "ok"
    missing = list(findings(tmp_path / "none.cfg", config, {}, set()))
    assert missing[0][0] == "problem" and "cannot read" in missing[0][1]


def test_a_balancer_file_is_read_within_bounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 54: a FIFO hung doctor; 180,000 open `upstream` blocks (a regular expression that
    looked for each one's end) and 3,000 names (a DNS query each) ran past a minute; `maxconn
    ³` raised. Each is answered now, and no name is looked up."""
    from mlx_watchdog.advice.balancer import findings

    looked_up: list[str] = []
    monkeypatch.setattr(socket, "gethostbyname", lambda name: looked_up.append(name) or "")
    config = parse_config({"server": [{"name": "mac1", "url": "http://127.0.0.1:8080"}]})
    fifo = tmp_path / "fifo.cfg"
    os.mkfifo(fifo)
    said = list(findings(fifo, config, {}, set()))
    assert said[0][0] == "problem" and "cannot read" in said[0][1]
    blocks = tmp_path / "blocks.cfg"
    blocks.write_text("upstream a {\n" * 180_000)
    assert list(findings(blocks, config, {"mac1": NEED}, {"mac1"}))  # answered
    names = tmp_path / "names.cfg"
    lines = "".join(f"    server n{i}.invalid:8080;\n" for i in range(3000))
    names.write_text(f"upstream many {{\n{lines}}}\n")
    assert list(findings(names, config, {"mac1": NEED}, {"mac1"}))
    assert looked_up == []
    odd = tmp_path / "odd.cfg"
    odd.write_text("backend mlx\n    retries ³\n    server a 127.0.0.1:8080 maxconn ³\n")
    assert list(findings(odd, config, {"mac1": NEED}, {"mac1"}))  # no traceback


@pytest.fixture
def haproxy() -> str:
    return system_tool("haproxy")


@pytest.fixture
def two_servers(tmp_path: Path) -> Iterator[list[tuple[str, int, Path]]]:
    """Servers "a" (serves until its hang file exists, then holds every request) and "b"
    (serves), each restarted by restart_bad.py through its pid file."""
    made, procs = [], []
    for name, mode in (("a", "hang_later"), ("b", "ok")):
        folder = tmp_path / name
        folder.mkdir()
        port = free_port()
        argv = badserver_argv(port, mode, "--hang-file", str(folder / "hang"))
        proc = subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL)
        procs.append(proc)
        (folder / "bad.pid").write_text(str(proc.pid))
        made.append((name, port, folder))
        until(lambda p=port: listens(p), 10, f"server {name} to listen")
    yield made
    for _, _, folder in made:  # the one running now: a restart replaced the first
        with contextlib.suppress(ProcessLookupError, ValueError, FileNotFoundError):
            os.kill(int((folder / "bad.pid").read_text()), 9)
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def test_a_wedge_behind_haproxy_loses_no_request_and_the_server_comes_back(
    tmp_path: Path, two_servers: list[tuple[str, int, Path]], haproxy: str
) -> None:
    """HAProxy as the docs configure it, one watchdog answering its agent check for both
    servers: "a" wedges (it holds every request) under a steady client stream. The agent marks
    it down at the verdict, the watchdog restarts it, the request it held is sent again to "b",
    and "a" is back in the farm once it serves: no request fails, none waits much longer than
    the detection and the restart."""
    agent, front = free_port(), free_port()
    servers = []
    for name, port, folder in two_servers:
        # A restart that takes 3 s, as a real one takes seconds: HAProxy's agent (every 1 s)
        # sees it, a loaded machine's late checks too.
        url = f"http://127.0.0.1:{port}"
        s = command_server(url, folder / "bad.pid", port, delay=3.0, probe=QUICK_TOML)
        servers.append({**s, "name": name})
    daemon = watching(servers, tmp_path / "state", agent, "200ms")
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(haproxy_config(tmp_path, front, [(n, p) for n, p, _ in two_servers], agent))
    checked = subprocess.run([haproxy, "-c", "-f", str(cfg)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    log = (tmp_path / "haproxy.log").open("w")
    proxy = subprocess.Popen(
        [haproxy, "-db", "-f", str(cfg)], stdin=subprocess.DEVNULL, stdout=log, stderr=log
    )
    stats = tmp_path / "admin.sock"
    try:
        until(lambda: stats.exists() and server_states(stats) == {"a": "UP", "b": "UP"}, 20, "UP")
        stream = Stream(f"http://127.0.0.1:{front}")
        until(lambda: len(stream.results) >= 10, 20, "the stream to flow through both")
        (two_servers[0][2] / "hang").write_text("")  # "a" now holds what it is sent
        seen: set[str] = set()

        def back_up() -> bool:
            seen.add(server_states(stats)["a"])
            restarted = [r for r in daemon.daemon.store.restarts("a", 0.0) if r.outcome]
            return bool(restarted) and server_states(stats)["a"] == "UP"

        until(back_up, 60, "a wedged, restarted and back UP")
        until(lambda: len(stream.results) >= 10 + 30, 30, "requests after the cure")
        results = stream.end()
        restarts = daemon.daemon.store.restarts("a", 0.0)
    finally:
        proxy.terminate()
        proxy.wait(10)
        log.close()
        daemon.stop()
    assert "DOWN (agent)" in seen, seen  # the agent took it out, not a failed connect
    failed = [r for r in results if r[0] != 200]
    assert results and not failed, failed
    # Detection: max_busy (2 s: HAProxy's request on it is a live client), a tick, the agent's
    # next check (1 s); then the restart (3 s) frees the request it held for a resend.
    longest = max(wait for _, wait in results)
    assert longest < 2.0 + 0.4 + 1.0 + 3.0 + 4.0, sorted(w for _, w in results)[-5:]
    assert [r.outcome for r in restarts] == ["recovered"]


def test_a_server_that_serves_again_during_the_drain_is_not_restarted(
    tmp_path: Path, run_daemon: Callable[[object], DaemonThread]
) -> None:
    """A restart with a drain waits for the clients on the server; when the server answers
    the probe meanwhile (what held it ended by itself), it is not restarted: the incident ends
    "served again during the drain", and no restart is spent."""
    port = free_port()
    raw = {
        "watchdog": {"interval": "200ms", "listen": "off", "state_dir": str(tmp_path / "s")},
        "server": [
            {
                "name": "slow",
                "url": f"http://127.0.0.1:{port}",
                "manager": "command",
                "match": "badserver",
                "restart_command": ["false"],  # never reached
                "probe": QUICK_TOML,
                "restart": {"drain": True, "drain_timeout": "30s", "least_cost": False},
            }
        ],
    }
    server = subprocess.Popen(badserver_argv(port, "slow", "--delay", "5"), start_new_session=True)
    client = None
    try:
        until(lambda: listens(port), 10, "the server to listen")
        # A client still sending its request: live, and never done (the drain waits for it).
        client = socket.create_connection(("127.0.0.1", port), timeout=10)
        client.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nContent-Length: 999\r\n\r\n{")
        t = run_daemon(Daemon(parse_config(raw)))
        cycles = t.daemon.cycles
        until(lambda: "slow" in cycles and cycles["slow"].draining, 30, "the drain to begin")
        until(lambda: not cycles["slow"].draining, 30, "the drain to end")
        until(lambda: cycles["slow"].incident is None, 10, "the incident to close")
        t.daemon.store.flush(5.0)
        (incident,) = t.daemon.store.incidents(0.0)
        assert incident.outcome == "served again during the drain, not restarted"
        assert t.daemon.store.restarts("slow", 0.0) == []
        assert [a["action"] for a in incident.actions] == ["drain"]
    finally:
        if client is not None:
            client.close()
        server.kill()
        server.wait(10)


@pytest.fixture
def nginx() -> str:
    return system_tool("nginx")


def test_the_docs_nginx_config_runs_and_a_wedge_strands_what_it_sent(
    tmp_path: Path, two_servers: list[tuple[str, int, Path]], nginx: str
) -> None:
    """Debian's nginx with the docs' block: it serves through both servers; with one holding
    every request, what nginx already sent it waits (nginx has no queue to keep it in, and
    never resends a POST), which is what the docs say of it."""
    front = free_port()
    conf = tmp_path / "nginx.conf"
    conf.write_text(nginx_config(tmp_path, front, [p for _, p, _ in two_servers]))
    checked = subprocess.run([nginx, "-t", "-c", str(conf)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr
    proxy = subprocess.Popen(
        [nginx, "-c", str(conf), "-g", "daemon off;"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        until(lambda: listens(front), 10, "nginx to listen")
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
        url = f"http://127.0.0.1:{front}/v1/chat/completions"
        assert [httpx.post(url, json=body, timeout=10).status_code for _ in range(4)] == [200] * 4
        (two_servers[0][2] / "hang").write_text("")  # "a" holds what it is sent from now on
        held = 0
        for _ in range(4):  # round robin: half of them go to "a"
            try:
                httpx.post(url, json=body, timeout=2).raise_for_status()
            except httpx.TimeoutException:
                held += 1
        assert held >= 1  # stranded on the wedged server: no queue, no resend
    finally:
        proxy.terminate()
        proxy.wait(10)


def test_the_seeds_wedge_behind_haproxy_loses_no_request(
    tmp_path: Path, tiny_model: Path, haproxy: str
) -> None:
    """The seed's setup: two real serial mlx_lm.servers behind HAProxy as the docs configure
    it, one watchdog (agent check, restart.drain), a client stream, and server "a" wedged by
    two long prompts its clients give up on after 1 s. No request fails, and none waits longer
    than the detection (wedge_after 4 s), one agent check (1 s) and 4 s."""
    from tests.balancing import run_real

    row = run_real("agent", 20, haproxy, tmp_path, tiny_model)
    assert row["failed"] == 0, row
    assert float(str(row["max_wait_s"])) < 4.0 + 1.0 + 4.0, row
    assert row["incident_outcomes"] == ["restarted"], row


@pytest.mark.parametrize("prompts", [1, 2])
def test_long_prompts_given_up_at_haproxy_are_seen_and_cured(
    tmp_path: Path, tiny_model: Path, haproxy: str, prompts: int
) -> None:
    """Issue 55: the field sends the long prompts through the balancer, and gives up there;
    HAProxy kept its connection to the server open, and the watchdog saw "1 live client being
    served" for 477 s. With the docs' `option abortonclose`, HAProxy 2.6 resets the server's
    connection when its client leaves: the request vanishes unanswered, and counts as the
    abandoned work it is. No request fails, none waits past the detection, a check and 4 s.
    Two such prompts wedge both servers: they restart in turns, the second once the balancer
    has the first back (its restart and SETTLE_S more), and neither before the agent has told
    HAProxy it is out (33 requests got a 503 when the first was restarted before)."""
    from mlx_watchdog.cycle.crew import SETTLE_S
    from tests.balancing import run_real

    row = run_real("agent", 20, haproxy, tmp_path, tiny_model, through=True, prompts=prompts)
    assert row["failed"] == 0, row
    outcomes, recover = row["incident_outcomes"], row["recover_s"]
    assert isinstance(outcomes, list) and isinstance(recover, list)
    assert len(outcomes) == prompts and all(o == "restarted" for o in outcomes), row
    turn = SETTLE_S + float(recover[0] or 0.0) if prompts == 2 else 0.0
    assert float(str(row["max_wait_s"])) < 4.0 + 1.0 + 4.0 + turn, row


def test_a_balancer_timeout_shorter_than_the_prefill_is_a_wedge_in_disguise(
    tmp_path: Path, tiny_model: Path, haproxy: str
) -> None:
    """Issue 55: with `timeout server 5s` (a mistake doctor flags) and patient clients, HAProxy
    cuts each long prompt off at 5 s and sends the next request in its place; each counted as
    a live client being served, and both servers were "busy" for ~290 s. A request cut off
    unanswered is abandoned work, so each server is judged wedged within wedge_after (4 s)
    and one check of the cut, and cured."""
    from tests.balancing import run_real

    row = run_real("agent", 10, haproxy, tmp_path, tiny_model, through=True, timeout_server="5s")
    opened = row["opened_after_s"]
    assert isinstance(opened, list) and opened, row
    assert all(o < 5.0 + 4.0 + 1.0 for o in opened), row
    assert row["incident_outcomes"] and all(o == "restarted" for o in row["incident_outcomes"])


@pytest.fixture
def litellm_python() -> Path:
    from tests import litellm_env
    from tests.conftest import TESTS_CACHE

    try:
        return litellm_env.python(TESTS_CACHE)
    except (subprocess.SubprocessError, OSError) as exc:
        if os.environ.get("CI"):
            raise
        pytest.skip(f"LiteLLM could not be installed into the tests' cache: {exc}")


def test_a_wedge_behind_litellms_router_with_a_fallback_loses_no_request(
    tmp_path: Path, two_servers: list[tuple[str, int, Path]], litellm_python: Path
) -> None:
    """LiteLLM's Router (its own venv) configured as the docs show, one deployment per
    server with a fallback to the other: server "a" holds every request it is sent until the
    watchdog restarts it; the requests it held fail over to "b" and no client sees an error."""
    import json

    import yaml

    ports = {name: port for name, port, _ in two_servers}
    config = yaml.safe_load(docs_block("yaml"))
    for deployment, name in zip(config["model_list"], ("a", "b"), strict=True):
        base = f"http://127.0.0.1:{ports[name]}/v1"
        deployment["litellm_params"]["api_base"] = base
    (tmp_path / "router.json").write_text(json.dumps(config))
    servers = []
    for name, port, folder in two_servers:
        url = f"http://127.0.0.1:{port}"
        s = command_server(url, folder / "bad.pid", port, delay=3.0, probe=QUICK_TOML)
        servers.append({**s, "name": name})
    raw = {
        "watchdog": {"interval": "200ms", "listen": "off", "state_dir": str(tmp_path / "s")},
        "server": servers,
    }
    daemon = DaemonThread(Daemon(parse_config(raw)))
    stop, progress = tmp_path / "stop", tmp_path / "progress"
    progress.write_text("")
    first = config["model_list"][0]["model_name"]
    script = Path(__file__).parent / "litellm_stream.py"
    args = [str(tmp_path / "router.json"), first, str(stop), str(progress)]
    log = (tmp_path / "client.log").open("w")
    client = subprocess.Popen(
        [str(litellm_python), str(script), *args, str(tmp_path / "results.json")],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    try:
        until(lambda: len(progress.read_text().split()) >= 10, 60, "the stream to flow")
        (two_servers[0][2] / "hang").write_text("")  # "a" now holds what it is sent
        store = daemon.daemon.store

        def cured() -> bool:
            return any(r.outcome == "recovered" for r in store.restarts("a", 0.0))

        until(cured, 60, "a restarted")
        answered = len(progress.read_text().split())
        until(lambda: len(progress.read_text().split()) >= answered + 20, 60, "more answers")
        stop.write_text("")
        assert client.wait(180) == 0, (tmp_path / "client.log").read_text()[-2000:]
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(10)
        log.close()
        daemon.stop()
    results = json.loads((tmp_path / "results.json").read_text())
    failed = [r for r in results if r[0] != "ok"]
    assert len(results) > 30 and not failed, failed
