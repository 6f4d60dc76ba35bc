"""A load balancer's own config, read for the seed's traps: a timeout below the prefill (the
balancer gives up mid-prefill and the server computes for nobody), a retry or fallback onto the
same server, and no queue in front of a server that serves one request at a time (a wedge then
strands every request the balancer sent it). HAProxy and nginx, told apart by their syntax.

Only what this module parses is judged: directives in `defaults`/`backend`/`listen` sections
(HAProxy) and in `upstream`, `server` and `location` blocks (nginx); includes are not followed.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from mlx_watchdog.advice.calibrate import Advice
from mlx_watchdog.advice.finding import Level
from mlx_watchdog.config import Config, ServerConfig
from mlx_watchdog.config.values import is_loopback
from mlx_watchdog.sense.files import open_regular
from mlx_watchdog.sense.process import is_local_address
from mlx_watchdog.serve.agent import NAME_WAIT

MAX_BALANCER_CONFIG = 2 * 2**20  # bytes of a balancer config read at most


class BalancerConfigError(ValueError):
    """A file that is not a balancer config this module reads; the message says why."""


@dataclass(frozen=True)
class AgentCheck:
    """A server line's `agent-check` (HAProxy), as its parameters say."""

    send: str | None  # agent-send, its escapes read (None: none)
    port: int | None  # agent-port
    addr: str | None  # agent-addr (None: the server's own address)
    inter_s: float | None  # agent-inter (None: `inter`, 2 s by default)


@dataclass
class Upstream:
    """One server line of a backend (HAProxy) or upstream (nginx), with what governs it."""

    kind: str  # haproxy, nginx
    section: str
    address: str  # host:port
    maxconn: int | None = None
    timeout_s: float | None = None  # how long the balancer waits for the answer
    queue_s: float | None = None  # how long a request may wait for a free slot (HAProxy)
    retries: int = 0
    redispatch: bool = False
    retry_on: str = ""
    name: str = ""  # the balancer's name for the server (HAProxy's `server NAME`)
    abortonclose: bool = True  # a client's departure ends its server connection (HAProxy)
    agent: AgentCheck | None = None


def load(path: Path) -> list[Upstream]:
    try:
        with open_regular(path) as f:  # a FIFO or a device is no config: never waited on
            text = f.read(MAX_BALANCER_CONFIG).decode("utf-8", "replace")
    except OSError as exc:
        raise BalancerConfigError(f"cannot read {path}: {exc.strerror or exc}") from None
    text = "\n".join(line.split("#", 1)[0].rstrip() for line in text.splitlines())
    if re.search(r"\bupstream\s+\S+\s*\{", text):
        return _nginx(text)
    if re.search(r"^(backend|listen)\s+\S+", text, re.M):  # a section starts a line
        return _haproxy(text)
    raise BalancerConfigError(
        f"{path} is neither an HAProxy config (no backend or listen section) nor an nginx one "
        "(no upstream block)"
    )


def _seconds(value: str, default_unit: str = "ms") -> float | None:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(us|ms|s|m|h|d)?", value.strip())
    if m is None:
        return None
    unit = m.group(2) or default_unit
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}[unit]
    return float(m.group(1)) * scale


def _haproxy(text: str) -> list[Upstream]:
    defaults: dict[str, str] = {}
    sections: list[tuple[str, dict[str, str], list[list[str]]]] = []
    current: dict[str, str] | None = None
    for line in text.splitlines():
        words = line.split()
        if not words:
            continue
        if not line[0].isspace():
            head = words[0]
            if head == "defaults":
                current = defaults = {}
            elif head in ("backend", "listen"):
                current = {}
                sections.append((words[1] if len(words) > 1 else "?", current, []))
            else:
                current = None
            continue
        if current is None:
            continue
        key = " ".join(words[:2]) if words[0] in ("timeout", "option") else words[0]
        if words[0] == "server" and sections and current is sections[-1][1]:
            sections[-1][2].append(words)
        else:
            current[key] = " ".join(words[len(key.split()) :])
    found = []
    for name, own, servers in sections:
        settings = {**defaults, **own}
        connect = _seconds(settings.get("timeout connect", ""))
        queue = (
            _seconds(settings.get("timeout queue", "")) if "timeout queue" in settings else connect
        )
        for words in servers:
            args = [*settings.get("default-server", "").split(), *words[3:]]
            maxconn = next((args[i + 1] for i, w in enumerate(args[:-1]) if w == "maxconn"), None)
            retries = settings.get("retries", "3")
            found.append(
                Upstream(
                    "haproxy",
                    name,
                    words[2] if len(words) > 2 else "?",
                    maxconn=_number(maxconn),
                    timeout_s=_seconds(settings.get("timeout server", "")),
                    queue_s=queue,
                    retries=_number(retries) or 3,
                    redispatch="option redispatch" in settings,
                    retry_on=settings.get("retry-on", "conn-failure"),
                    name=words[1] if len(words) > 1 else "?",
                    abortonclose="option abortonclose" in settings,
                    agent=_agent(args),
                )
            )
    return found


def _agent(args: list[str]) -> AgentCheck | None:
    """The agent check a server line's parameters (after its default-server's) set up."""
    if "agent-check" not in args:
        return None
    value = {w: args[i + 1] for i, w in enumerate(args[:-1]) if w.startswith("agent-")}
    send = value.get("agent-send")
    inter = value.get("agent-inter")
    return AgentCheck(
        send=None if send is None else _unquote(send),
        port=_number(value.get("agent-port")),
        addr=value.get("agent-addr"),
        inter_s=None if inter is None else _seconds(inter),
    )


def _unquote(word: str) -> str:
    r"""A word as HAProxy reads it: quotes dropped, and within double quotes or bare, the
    escapes \n, \r, \t and \\ read (configuration.txt, 2.2 "Quoting and escaping")."""
    if len(word) >= 2 and word[0] == word[-1] == "'":
        return word[1:-1]
    if len(word) >= 2 and word[0] == word[-1] == '"':
        word = word[1:-1]
    escapes = {"n": "\n", "r": "\r", "t": "\t", "\\": "\\", '"': '"', "'": "'", " ": " "}
    return re.sub(r"\\(.)", lambda m: escapes.get(m.group(1), m.group(0)), word)


def _number(text: str | None) -> int | None:
    """Digits as ASCII only ("³" is a digit to str.isdigit, not to int)."""
    return int(text) if text and text.isascii() and text.isdigit() else None


def _blocks(text: str) -> dict[str, str]:
    """Each `upstream NAME { ... }` block's body, in one pass: a regular expression that looks
    for each block's closing brace from every opening one took time with the square of the
    blocks left open (180,000 of them ran past a minute)."""
    found: dict[str, str] = {}
    name, start = None, 0
    for m in re.finditer(r"\bupstream\s+(\S+)\s*\{|\}", text):
        if m.group(1) is not None:
            name, start = m.group(1), m.end()
        elif name is not None:
            found.setdefault(name, text[start : m.start()])
            name = None
    return found


def _nginx(text: str) -> list[Upstream]:
    upstreams = _blocks(text)
    read = re.search(r"\bproxy_read_timeout\s+([^;]+);", text)
    nxt = re.search(r"\bproxy_next_upstream\s+([^;]+);", text)
    ignores = re.search(r"\bproxy_ignore_client_abort\s+on\s*;", text) is not None
    timeout = _seconds(read.group(1), "s") if read else 60.0  # nginx's default
    found = []
    for name, body in upstreams.items():
        for line in body.split(";")[:-1]:  # each ends with its ";"
            server = re.match(r"\s*server\s+(\S+)(.*)", line, re.S)
            if server is None:
                continue
            address, params = server.group(1), server.group(2)
            conns = re.search(r"\bmax_conns=(\d+)", params)
            found.append(
                Upstream(
                    "nginx",
                    name,
                    address,
                    maxconn=int(conns.group(1)) if conns else None,
                    timeout_s=timeout,
                    retries=0 if nxt is not None and nxt.group(1).strip() == "off" else 1,
                    redispatch=True,  # nginx's next upstream is another server
                    retry_on=nxt.group(1).strip() if nxt else "error timeout",
                    abortonclose=not ignores,
                )
            )
    return found


def findings(
    path: Path, config: Config, advice: dict[str, Advice], serial: set[str]
) -> Iterator[tuple[Level, str, str]]:
    """(level, detail, fix) for each trap found; `serial`: the servers known to serve one
    request at a time."""
    try:
        upstreams = load(path)
    except BalancerConfigError as exc:
        yield "problem", str(exc), "name an HAProxy or nginx config"
        return
    watched = [(u, s) for u in upstreams if (s := _served(u.address, config)) is not None]
    kinds = sorted({u.kind for u in upstreams})
    yield "ok", f"{path}: {', '.join(kinds)}, {len(watched)} of its servers watched here", ""
    for u, server in watched:
        yield from _one(u, server, advice.get(server.name), server.name in serial)
        if u.agent is not None:
            yield from _agent_findings(u, u.agent, server, config)


AGENT_INTER_MAX = 10.0  # s: past this, traffic moves that late after the watchdog's first sign


def _agent_findings(
    u: Upstream, agent: AgentCheck, server: ServerConfig, config: Config
) -> Iterator[tuple[Level, str, str]]:
    """HAProxy's agent check of a watched server, against this watchdog's agent: the port it
    asks, an address the agent listens on, a name it watches, a newline, a sane interval."""
    where = f"haproxy {u.section} {u.name} ({server.name})"
    mine = config.watchdog.agent
    if mine is None:
        yield (
            "problem",
            f"{where}: agent-check asks port {agent.port or '(none)'}, but this watchdog serves "
            "no agent check (watchdog.agent is off): HAProxy's agent check fails",
            f'agent = "{server.host}:{agent.port or 9465}" under [watchdog]',
        )
        return
    host, port = mine
    if agent.port != port:
        yield (
            "problem",
            f"{where}: agent-port {agent.port if agent.port is not None else '(none)'}, but "
            f"this watchdog's agent check listens on port {port}",
            f"agent-port {port}",
        )
    asked = agent.addr or server.host
    if not _reaches(asked, host):
        yield (
            "problem",
            f"{where}: HAProxy asks the agent at {asked}, but this watchdog's agent listens on "
            f"{host} only",
            f'agent = "{asked}:{port}" under [watchdog] (or agent-addr {host})',
        )
    names = [s.name for s in config.servers]
    if agent.send is None:
        if len(names) > 1:
            yield (
                "problem",
                f"{where}: no agent-send, and this watchdog watches {len(names)} servers: the "
                "agent cannot tell which is asked and answers down",
                f'agent-send "{server.name}\\n"',
            )
        return
    name = agent.send.rstrip("\r\n")
    if name != server.name:
        own = " (HAProxy's own name for it)" if name == u.name else ""
        known = "a server this watchdog does not watch" if name not in names else "another server"
        yield (
            "problem",
            f"{where}: agent-send names {name!r}{own}, {known}; the watchdog calls the server at "
            f"{u.address} {server.name!r}: the agent answers "
            + (
                "down and HAProxy takes the server out"
                if name not in names
                else "for the wrong one"
            ),
            f'agent-send "{server.name}\\n"',
        )
    if not agent.send.endswith("\n"):
        yield (
            "warning",
            f"{where}: agent-send {agent.send!r} has no newline: the agent waits {NAME_WAIT:g} s "
            "for one at each check before it answers",
            f'agent-send "{name}\\n"',
        )
    if agent.inter_s is not None and agent.inter_s > AGENT_INTER_MAX:
        yield (
            "warning",
            f"{where}: agent-inter {agent.inter_s:g} s: traffic moves that late after the "
            "watchdog's first sign of a wedge",
            "agent-inter 1s",
        )


def _reaches(asked: str, bound: str) -> bool:
    """Whether a connection to `asked` reaches an agent bound to `bound` on this machine."""
    if bound in ("0.0.0.0", "::", ""):
        return True
    if asked == bound:
        return True
    return is_loopback(asked) and is_loopback(bound)


def _one(
    u: Upstream, server: ServerConfig, need: Advice | None, serial: bool
) -> Iterator[tuple[Level, str, str]]:
    where = f"{u.kind} {u.section} {u.address} ({server.name})"
    if need is None:
        yield (
            "warning",
            f"{where} waits {_said(u.timeout_s)}; whether that outlasts the prefill is unknown",
            f"mlx-watchdog calibrate --server {server.name}",
        )
    elif u.timeout_s is not None and u.timeout_s < need.load_balancer_s:
        what = "timeout server" if u.kind == "haproxy" else "proxy_read_timeout"
        yield (
            "problem",
            f"{where}: {what} {u.timeout_s:g} s, below the {need.load_balancer_s} s a "
            f"{need.prompt_tokens}-token prompt needs: it gives up mid-prefill and the server "
            "computes for nobody",
            f"set {what} to at least {need.load_balancer_s}s",
        )
    if u.kind == "nginx" and "timeout" in u.retry_on.split():
        yield (
            "problem",
            f"{where}: proxy_next_upstream includes timeout: a prompt that timed out is sent "
            "again, one more abandoned request",
            "proxy_next_upstream error; (connection errors only)",
        )
    if not u.abortonclose:
        what = "no option abortonclose" if u.kind == "haproxy" else "proxy_ignore_client_abort on"
        yield (
            "warning",
            f"{where}: {what}: a client that gives up at the balancer leaves "
            "its request on the server, whose connection stays open, so the server (and the "
            "watchdog) sees a live client being served while it computes for nobody",
            "option abortonclose (in defaults or the backend)"
            if u.kind == "haproxy"
            else "proxy_ignore_client_abort off (nginx's default)",
        )
    if u.kind == "haproxy" and u.retries and not u.redispatch:
        yield (
            "warning",
            f"{where}: retries {u.retries} without option redispatch: a retry goes to the same "
            "server",
            "option redispatch 1",
        )
    resends = {"response-timeout", "all-retryable-errors"} & set(u.retry_on.split())
    if u.kind == "haproxy" and resends:
        yield (
            "problem",
            f"{where}: retry-on {min(resends)} resends a prompt the server is still computing "
            "when the balancer's timeout strikes: one more abandoned request",
            "retry-on conn-failure empty-response",
        )
    if not serial:
        return
    if u.maxconn is None:
        fix = "maxconn 1 on its server line" if u.kind == "haproxy" else "see docs/endpoint.md"
        plain = (
            ""
            if u.kind == "haproxy"
            else "; open-source nginx has no queue (max_conns without NGINX Plus's queue "
            "refuses the excess with 502)"
        )
        yield (
            "warning",
            f"{where}: no queue in front of a server that serves one request at a time: the "
            f"balancer sends it every request, and a wedge strands them all{plain}",
            fix,
        )
    elif u.kind == "haproxy" and need is not None and (u.queue_s or 0) < need.load_balancer_s:
        yield (
            "problem",
            f"{where}: requests wait {_said(u.queue_s)} in the queue (timeout queue, or timeout "
            f"connect when unset), below the {need.load_balancer_s} s one request may hold it",
            f"timeout queue {need.load_balancer_s}s",
        )


def _said(seconds: float | None) -> str:
    return "without a limit" if seconds is None else f"{seconds:g} s"


def _served(address: str, config: Config) -> ServerConfig | None:
    host, _, port = address.rpartition(":")
    number = _number(port)
    return served_at(host, number, config) if number is not None else None


def served_at(host: str, port: int | None, config: Config) -> ServerConfig | None:
    """The watched server a balancer or proxy sends to at host:port (loopback names alike).
    No name is looked up: a file naming thousands of hosts costs no DNS query (each could wait
    seconds); a name matches a watched server's as written, or as this machine's own."""
    for server in config.servers:
        if port != server.port:
            continue
        if host == server.host or (is_local_address(host) and is_local_address(server.host)):
            return server
    return None
