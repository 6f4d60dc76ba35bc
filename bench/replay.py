"""A day of real traffic: a production request trace replayed through each watcher, scored
from the clients' side.

    python bench/replay.py                      # the shipped hour, every watcher, serial server
    python bench/replay.py --quick              # CI: 10 minutes of it, none and mlx-watchdog
    python bench/replay.py --trace FILE --start MIN --minutes N --seed N \\
        --watchers a,b --servers serial,batched --json OUT

The trace (bench/traces/, derived from shared/traces/ with its attribution, or any of their
formats with --trace) gives arrival times, prompt and answer sizes and prefix ids at a Mac's
scale. They are played against the real mlx_lm.server on the tiny model, one fresh server per
watcher, with time compressed by k and sizes scaled so that a prompt's prefill here, against
its client's deadline, is what it is on a Mac at --mac-rate tokens a second: the tiny model's
rate is measured first, and the scale printed. Prompts whose Mooncake blocks are equal share
their text, so the server's prompt cache serves a conversation's later turns as it does an
agent's.

Clients: each request's deadline is drawn from the published ones (120, 300, 600, 1,200 s);
the turns of a conversation are an agent's, which resends the same prompt up to twice when it
gives up; half the clients stream. Faults at seeded moments on top (a SIGSTOP of 30 s, a
GPU-style hang (bench/hang.py), a kill, and on the batched server a dead generation thread).
All seeded: the same seed, the same day. Watchers' times are divided by k like the traffic's,
mlx-watchdog's own wait times among them (the restart cost it assumes until it has measured
one, 30 s, and a wait's margin, 5 s).

Scores (Mac seconds and minutes): served, failed (deadline passed or error), resent, tokens,
ttft_p50_s, ttft_p99_s, outage_min (minutes in which requests waited and none was served),
restarts, false_restarts (a restart while answers were flowing: a client got a byte within the
last 30 s), cure_s per fault (to the next request served). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import httpx

from bench.hang import Hang, working_thread
from bench.harness import TINY, Box, free_port
from bench.trace import (
    BLOCK,
    Request,
    TraceError,
    derived,
    one_mac,
    read,
    session,
    sliced,
    write_derived,
)
from bench.watchers import make
from mlx_watchdog.demo.run import long_prompt, server_command

HERE = Path(__file__).resolve().parent
SHIPPED = HERE / "traces" / "mooncake_conversation_one_mac.csv"
DEADLINES = (120.0, 300.0, 600.0, 1200.0)  # s: the common client timeouts (shared/traces)
RESENDS = 2  # an agent's resends of a prompt it gave up on
MAX_PROMPT_HERE = 12_000  # tokens: the tiny model's prompts are capped here (and said)
MAX_ANSWER_HERE = 24
WATCHERS = (
    "none",
    "mlx-watchdog",
    "restart-always",
    "k8s-health",
    "models-probe",
    "gpustack",
    "lemonade",
    "sglang",
)


@dataclass(frozen=True)
class Scale:
    k: float  # 1 s here is k s on the Mac
    size: float  # a Mac token is `size` tokens here
    words_per_token: float  # of the tiny tokenizer
    rate_here: float  # prefill tokens a second, measured

    def said(self, mac_rate: float) -> str:
        return (
            f"1 s here = {self.k:g} s on a Mac at {mac_rate:g} tok/s; a Mac token = "
            f"{self.size:.3f} tokens here (the tiny model prefills {self.rate_here:.0f} tok/s)"
        )


@dataclass
class Attempt:
    sent: float
    first_byte: float | None = None
    done: float | None = None
    ok: bool = False
    gave_up: bool = False
    tokens: int = 0
    ended: float = 0.0  # when its client stopped waiting, served or not
    deadline: float = 0.0  # s here


@dataclass
class Client:
    req: Request
    prompt: str
    deadline: float  # s here
    stream: bool
    agent: bool
    answer: int
    attempts: list[Attempt] = field(default_factory=list)

    @property
    def served(self) -> bool:
        return any(a.ok for a in self.attempts)


class Traffic:
    """What the clients have seen, for the watchers that sit in the serving path."""

    def __init__(self) -> None:
        self.last_byte_at = time.time()
        self.active = 0
        self.lock = threading.Lock()

    def byte(self) -> None:
        self.last_byte_at = time.time()


def text_for(req: Request, index: int, scale: Scale) -> str:
    """The prompt's words: one seeded run of words per Mooncake block (so equal blocks are
    equal text and a cache can serve them), cut to the request's size here."""
    tokens = min(MAX_PROMPT_HERE, max(8, round(req.prompt * scale.size)))
    words = max(4, round(tokens * scale.words_per_token))
    per_block = max(1, round(BLOCK * scale.size * scale.words_per_token))
    out: list[str] = []
    for block in req.blocks or (-1 - index,):
        out.extend(long_prompt(block, per_block).split())
        if len(out) >= words:
            break
    if len(out) < words:
        out.extend(long_prompt(10**9 + index, words - len(out)).split())
    return " ".join(out[:words])


def measure(url: str) -> tuple[float, float]:
    """(prefill tokens a second, words a token) of the server, from one long prompt."""
    words = 1500
    prompt = long_prompt(7, words)
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": 1}
    began = time.monotonic()
    r = httpx.post(url + "/v1/chat/completions", json=body, timeout=300)
    took = time.monotonic() - began
    tokens = int(r.json()["usage"]["prompt_tokens"])
    return tokens / took, words / tokens


def clients_for(requests: list[Request], scale: Scale, seed: int) -> list[Client]:
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    out = []
    for i, req in enumerate(requests):
        turn = session(req)
        agent = turn in seen and len(req.blocks) >= 2
        seen.add(turn)
        answer = max(1, min(MAX_ANSWER_HERE, round(req.output * scale.size)))
        out.append(
            Client(
                req,
                text_for(req, i, scale),
                rng.choice(DEADLINES) / scale.k,
                rng.random() < 0.5,
                agent,
                answer,
            )
        )
    return out


def one(url: str, c: Client, traffic: Traffic) -> Attempt:
    a = Attempt(time.time(), deadline=c.deadline)
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": c.prompt}],
        "max_tokens": c.answer,
        "stream": c.stream,
    }
    end = a.sent + c.deadline
    try:
        with (
            httpx.Client(timeout=httpx.Timeout(c.deadline, connect=5.0)) as http,
            http.stream("POST", url + "/v1/chat/completions", json=body) as r,
        ):
            if r.status_code != 200:
                r.read()
                a.done = time.time()
                return a
            got = b""
            for chunk in r.iter_bytes():
                now = time.time()
                if a.first_byte is None:
                    a.first_byte = now
                traffic.byte()
                got += chunk
                if now > end:
                    a.gave_up = True
                    return a  # closed unread: the client leaves, as a timeout does
            a.done = time.time()
            a.ok = a.done <= end
            a.gave_up = not a.ok
            a.tokens = _tokens(got, c.stream)
    except httpx.TimeoutException:
        a.gave_up = True
    except httpx.HTTPError:
        a.done = time.time()
    return a


def _tokens(body: bytes, stream: bool) -> int:
    text = body.decode("utf-8", "replace")
    if stream:
        return text.count('"content"')
    try:
        return int(json.loads(text)["usage"]["completion_tokens"])
    except (ValueError, KeyError, TypeError):
        return 0


def run_client(url: str, c: Client, traffic: Traffic) -> None:
    with traffic.lock:
        traffic.active += 1
    try:
        for _ in range(1 + (RESENDS if c.agent else 0)):  # an agent resends what failed
            a = one(url, c, traffic)
            a.ended = time.time()
            c.attempts.append(a)
            if a.ok:
                return
    finally:
        with traffic.lock:
            traffic.active -= 1


@dataclass
class Fault:
    kind: str
    at: float  # s here, from the replay's start
    began: float | None = None  # wall time it was made
    cured: float | None = None  # wall time a tiny request was first answered after it


def await_cure(f: Fault, box: Box, until: float) -> None:
    """One tiny request at a time after the fault, as a patient user sends it, until one is
    answered: the cure's time (one request in the queue perturbs the day by one request)."""
    while time.time() < until and not box.closed:
        try:
            r = httpx.post(box.url + "/v1/chat/completions", json=TINY, timeout=until - time.time())
            if r.status_code == 200:
                f.cured = time.time()
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)


def faults_for(span: float, serial: bool, seed: int) -> list[Fault]:
    """Apart, so that each one's cure is its own: evenly over the replay, each moved by up to
    4 % of it."""
    rng = random.Random(seed + 1)
    kinds = ["sigstop", "gpu", "kill"] + ([] if serial else ["thread"])
    n = len(kinds) + 1
    return [
        Fault(kind, span * ((i + 1) / n + rng.uniform(-0.04, 0.04))) for i, kind in enumerate(kinds)
    ]


def inject(f: Fault, box: Box, k: float) -> None:
    threading.Thread(target=_fault, args=(f, box, k), daemon=True).start()


def _fault(f: Fault, box: Box, k: float) -> None:
    """Made now; a GPU-style hang once the server computes (a GPU hangs on work), up to five
    Mac minutes later. Its time to cure runs from when it was made."""
    if f.kind == "gpu":
        if not _hang(box, time.time() + 300 / k):
            print("gpu hang: the server did not compute within 300 s", file=sys.stderr)
            return
        f.began = time.time()
    else:
        f.began = time.time()
        proc = box.proc
        if proc is not None and proc.poll() is None:
            _make(f.kind, box, proc, k)
    await_cure(f, box, f.began + 1800 / k)


def _hang(box: Box, until: float) -> bool:
    while time.time() < until and not box.closed:
        proc = box.proc
        if proc is None or proc.poll() is not None:
            time.sleep(0.1)
            continue
        tid = working_thread(proc.pid, until - time.time())
        if tid is None:
            continue
        hang = Hang(tid)
        if hang.start():
            return True
        print(f"gpu hang: {hang.error}", file=sys.stderr)
        return False
    return False


def _make(kind: str, box: Box, proc: subprocess.Popen[bytes], k: float) -> None:
    if kind == "kill":
        box.kill()
    elif kind == "sigstop":
        os.killpg(proc.pid, signal.SIGSTOP)

        def resume() -> None:
            if proc.poll() is None:  # our own process, still there
                os.killpg(proc.pid, signal.SIGCONT)

        threading.Timer(30.0 / k, resume).start()
    elif kind == "thread":  # mlx-lm 0.32's batched server: its generation thread dies
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stop": [["x"]]}
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(box.url + "/v1/chat/completions", json=body, timeout=10)


def replay(
    watcher: str,
    requests: list[Request],
    scale: Scale,
    model: Path,
    work: Path,
    *,
    serial: bool,
    seed: int,
    faults: bool,
) -> dict[str, Any]:
    port = free_port()
    hub = work / "hub"
    hub.mkdir(exist_ok=True)
    env = {"HF_HUB_CACHE": str(hub), "HF_HUB_OFFLINE": "1"}
    box = Box(server_command(model, port, serial=serial), port, work / f"{watcher}-{port}.log", env)
    box.start()
    traffic = Traffic()
    w = make(watcher, box, scale.k, str(work / f"state-{port}"), traffic, scale_waits=True)
    w.start()
    try:
        clients, planned, t0 = _play(
            box, requests, scale, traffic, serial=serial, seed=seed, faults=faults
        )
    finally:
        w.stop()
        box.close()
    restarts = [at for at, by in box.restarts if by == watcher]
    return score(watcher, clients, restarts, planned, scale, t0, prefills(box.log))


def _play(
    box: Box,
    requests: list[Request],
    scale: Scale,
    traffic: Traffic,
    *,
    serial: bool,
    seed: int,
    faults: bool,
) -> tuple[list[Client], list[Fault], float]:
    time.sleep(max(1.0, 35 / scale.k))  # a healthy server seen first
    clients = clients_for(requests, scale, seed)
    span = max((r.at for r in requests), default=0.0) / scale.k
    planned = faults_for(span, serial, seed) if faults else []
    t0 = time.time()
    threads = []
    events = sorted(
        [(c.req.at / scale.k, "client", c) for c in clients]
        + [(f.at, "fault", f) for f in planned],
        key=lambda e: e[0],
    )
    for at, kind, what in events:
        delay = t0 + at - time.time()
        if delay > 0:
            time.sleep(delay)
        if kind == "fault":
            assert isinstance(what, Fault)
            inject(what, box, scale.k)
            continue
        assert isinstance(what, Client)
        t = threading.Thread(target=run_client, args=(box.url, what, traffic), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join(max(DEADLINES) / scale.k * (1 + RESENDS) + 30)
    return clients, planned, t0


def score(
    watcher: str,
    clients: list[Client],
    restarts: list[float],
    planned: list[Fault],
    scale: Scale,
    t0: float,
    steps: list[tuple[float, int, int]],
) -> dict[str, Any]:
    k = scale.k
    attempts = [a for c in clients for a in c.attempts]
    served = [c for c in clients if c.served]
    ttft = sorted(
        ((a.first_byte or a.done or a.sent) - c.attempts[0].sent) * k
        for c in served
        for a in c.attempts
        if a.ok
    )
    false = sum(
        1
        for t in restarts
        if (was_serving(t, attempts, steps, scale) or asleep(t, attempts, planned, k))
        and not broken(t, planned, restarts)
    )
    cures = {
        f.kind: round((f.cured - f.began) * k, 1) if f.cured and f.began else None for f in planned
    }
    return {
        "watcher": watcher,
        "per_minute": per_minute(clients, restarts, planned, k, t0),
        "requests": len(clients),
        "served": len(served),
        "failed": len(clients) - len(served),
        "resent": sum(max(0, len(c.attempts) - 1) for c in clients),
        "tokens": sum(a.tokens for a in attempts if a.ok),
        "ttft_p50_s": round(statistics.median(ttft), 1) if ttft else None,
        "ttft_p99_s": round(ttft[math.ceil(0.99 * len(ttft)) - 1], 1) if ttft else None,
        "outage_min": outage_minutes(attempts, k, t0),
        "restarts": len(restarts),
        "false_restarts": false,
        "cure_s": cures,
    }


PROGRESS = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) - INFO - Prompt processing progress: (\d+)/(\d+)"
)


def prefills(log: Path) -> list[tuple[float, int, int]]:
    """The server's own prefill steps (wall time, done, of), from its log."""
    steps = []
    with log.open(encoding="utf-8", errors="replace") as f:
        for line in f:
            m = PROGRESS.match(line)
            if m:
                at = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
                steps.append((at + int(m.group(2)) / 1000, int(m.group(3)), int(m.group(4))))
    return steps


def was_serving(
    t: float, attempts: list[Attempt], steps: list[tuple[float, int, int]], scale: Scale
) -> bool:
    """A restart at `t` was false when answers were flowing (a client got a byte within the
    last 30 s), or when the server's log shows a prefill under way that would have ended
    within the deadline of a client still waiting."""
    if any(a.first_byte is not None and t - 30 / scale.k <= a.first_byte <= t for a in attempts):
        return True
    last = next((s for s in reversed(steps) if s[0] <= t), None)
    if last is None or last[1] >= last[2]:
        return False
    at, done, of = last
    step = 2048 / scale.rate_here  # mlx-lm logs a line every 2,048 tokens
    if t - at > 2 * step + 1.0:
        return False  # no step for two of them: not known to be working
    ends = t + (of - done) / scale.rate_here - (t - at)
    return any(a.sent <= t < a.ended and not a.ok and a.sent + a.deadline >= ends for a in attempts)


def asleep(t: float, attempts: list[Attempt], planned: list[Fault], k: float) -> bool:
    """A restart of a stopped server (a Mac asleep) that would have woken within the deadline
    of a client still waiting."""
    for f in planned:
        if f.kind != "sigstop" or f.began is None or not f.began <= t < f.began + 30 / k:
            continue
        wakes = f.began + 30 / k
        if any(a.sent <= t < a.ended and a.sent + a.deadline >= wakes for a in attempts):
            return True
    return False


BROKEN = ("gpu", "kill", "thread")  # faults after which the server never serves again unaided


def broken(t: float, planned: list[Fault], restarts: list[float]) -> bool:
    """A restart at `t` of a server a fault had broken (hung, killed, its generation thread
    dead) and no restart had mended since: it would never have answered again, whatever it
    was doing a moment before."""
    return any(
        f.kind in BROKEN
        and f.began is not None
        and f.began <= t
        and not any(f.began <= r < t for r in restarts)
        for f in planned
    )


def per_minute(
    clients: list[Client], restarts: list[float], planned: list[Fault], k: float, t0: float
) -> dict[str, Any]:
    """The day as a picture draws it: requests served and failed in each Mac minute, and
    the minutes of each restart and fault."""

    def at(t: float) -> int:
        return max(0, int((t - t0) * k // 60))

    ends = [
        (c.served, max(a.done or a.sent + c.deadline for a in c.attempts))
        for c in clients
        if c.attempts
    ]
    last = max([at(t) for _, t in ends] + [0])
    served, failed = [0] * (last + 1), [0] * (last + 1)
    for ok, t in ends:
        (served if ok else failed)[at(t)] += 1
    return {
        "served": served,
        "failed": failed,
        "restarts": [at(t) for t in restarts],
        "faults": {f.kind: at(f.began) for f in planned if f.began},
    }


def plot(results: dict[str, Any], folder: Path) -> list[Path]:
    """One picture per run: served and failed per minute, restarts and faults marked (needs
    the `bench` extra: matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    made = []
    trace = "" if results["trace"] == SHIPPED.name else Path(results["trace"]).stem + "-"
    for r in results["runs"]:
        days = r["per_minute"]
        fig, ax = plt.subplots(figsize=(8, 2.4))
        minutes = range(len(days["served"]))
        ax.bar(minutes, days["served"], color="#3a7", label="served")
        ax.bar(minutes, days["failed"], bottom=days["served"], color="#d44", label="failed")
        for m in days["restarts"]:
            ax.axvline(m, color="#333", linestyle="--", linewidth=1)
        for kind, m in days["faults"].items():
            ax.annotate(kind, (m, 0), xytext=(m, -0.9), fontsize=7, ha="center", color="#a40")
        ax.set_title(
            f"{r['watcher']} ({r['server']}): {r['served']} served, {r['failed']} failed, "
            f"{r['restarts']} restarts (dashed)",
            fontsize=9,
        )
        ax.set_xlabel("minute of the trace")
        ax.legend(fontsize=7, loc="upper right")
        fig.tight_layout()
        path = folder / f"replay-{trace}{r['server']}-{r['watcher']}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        made.append(path)
    return made


def outage_minutes(attempts: list[Attempt], k: float, t0: float) -> int:
    """Mac minutes in which some request waited and none was served or got its first byte."""
    minute = 60.0 / k
    waiting: set[int] = set()
    serving: set[int] = set()
    for a in attempts:
        end = a.done or a.first_byte or (a.sent + 1.0)
        first = a.first_byte or a.done or end
        waiting.update(range(int((a.sent - t0) // minute), int((first - t0) // minute) + 1))
        if a.ok or a.first_byte is not None:
            serving.add(int((first - t0) // minute))
    return len(waiting - serving)


LOAD = 0.6  # of one Mac's prefill time: busy, as a shared Mac is, not saturated


def derive(source: Path, seed: int, mac_rate: float) -> None:
    """One Mac's share of Mooncake's conversation hour: whole conversations, seeded."""
    kept, share = one_mac(read(source), load=LOAD, mac_rate=mac_rate, seed=seed)
    header = [
        f"Derived from {source.name}: Kimi's conversation service, one hour (Mooncake,",
        "kvcache-ai/Mooncake FAST25-release/traces/conversation_trace.jsonl at",
        "3b5a594133958449a1feaf1c9e0fc1b553e34a28, Apache-2.0). Times in s, sizes in tokens,",
        f"unscaled. Kept: {share:.4%} of its conversations (whole, seed {seed}), so that one Mac",
        f"prefilling {mac_rate:g} tok/s is busy {LOAD:.0%} of the hour (prefixes seen before",
        "not counted: a cache serves them). bench/replay.py scales times and sizes at run time.",
        f"Made by: python bench/replay.py --derive {source.name} --seed {seed}",
    ]
    SHIPPED.parent.mkdir(exist_ok=True)
    write_derived(SHIPPED, kept, header)
    print(f"{SHIPPED.name}: {len(kept)} requests ({share:.4%} of the conversations)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trace", type=Path, default=SHIPPED)
    parser.add_argument("--start", type=float, default=0.0, help="minute of the trace to start")
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--watchers", default=",".join(WATCHERS))
    parser.add_argument("--servers", default="serial", help="serial, batched, or both")
    parser.add_argument("--k", type=float, default=30.0, help="1 s here is k s on the Mac")
    parser.add_argument("--mac-rate", type=float, default=300.0, help="a Mac's prefill tok/s")
    parser.add_argument("--no-faults", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--quick", action="store_true", help="CI: 10 minutes, two watchers")
    parser.add_argument("--derive", type=Path, help="write the shipped file from this trace")
    parser.add_argument("--plot", type=Path, help="a picture of each run's day into this folder")
    parser.add_argument("--from-json", type=Path, help="with --plot: draw an earlier --json")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the servers it started end too
    if args.from_json is not None:
        if args.plot is None:
            raise SystemExit("--from-json draws pictures: name a folder with --plot")
        for path in plot(json.loads(args.from_json.read_text()), args.plot):
            print(path)
        return
    if args.derive is not None:
        derive(args.derive, args.seed, args.mac_rate)
        return
    if args.quick:
        args.minutes, args.watchers = 10.0, "none,mlx-watchdog"
    watchers = [w for w in args.watchers.split(",") if w]
    unknown = sorted(set(watchers) - set(WATCHERS))
    if unknown:
        raise SystemExit(f"--watchers: {', '.join(unknown)} unknown; known: {', '.join(WATCHERS)}")
    kinds = {"serial": [True], "batched": [False], "both": [True, False]}.get(args.servers)
    if kinds is None:
        raise SystemExit(f"--servers {args.servers!r}: serial, batched or both")
    try:
        requests = sliced(read(args.trace), args.start, args.minutes)
    except (OSError, TraceError) as exc:
        raise SystemExit(f"--trace: {exc}") from None
    if not derived(args.trace):  # a service's traffic: one Mac's share of its conversations
        requests, share = one_mac(requests, load=LOAD, mac_rate=args.mac_rate, seed=args.seed)
        print(f"{args.trace.name}: {share:.4%} of its conversations kept for one Mac")
    from mlx_watchdog.demo.tinymodel import build_model

    results: dict[str, Any] = {"trace": str(args.trace.name), "seed": args.seed, "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = build_model(work / "model")
        port = free_port()
        env = {"HF_HUB_CACHE": str(work / "hub"), "HF_HUB_OFFLINE": "1"}
        (work / "hub").mkdir()
        box = Box(server_command(model, port, serial=False), port, work / "measure.log", env)
        box.start()
        try:
            rate, per_token = measure(box.url)
        finally:
            box.close()
        scale = Scale(args.k, rate / (args.mac_rate * args.k), per_token, rate)
        print(
            f"{len(requests)} requests from {args.trace.name}, minutes {args.start:g}-"
            f"{args.start + args.minutes:g}; {scale.said(args.mac_rate)}"
        )
        results["scale"] = scale.said(args.mac_rate)
        for serial in kinds:
            for name in watchers:
                row = replay(
                    name,
                    requests,
                    scale,
                    model,
                    work,
                    serial=serial,
                    seed=args.seed,
                    faults=not args.no_faults,
                )
                row["server"] = "serial" if serial else "batched"
                results["runs"].append(row)
                print(json.dumps(row))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    if args.plot:
        for path in plot(results, args.plot):
            print(path)
    print(
        "\n| server | watcher | served | failed | resent | ttft p50 / p99 | outage min | "
        "restarts (false) | cure s |\n|---|---|---|---|---|---|---|---|---|"
    )
    for r in results["runs"]:
        print(
            f"| {r['server']} | {r['watcher']} | {r['served']} of {r['requests']} | {r['failed']} "
            f"| {r['resent']} | {r['ttft_p50_s']} / {r['ttft_p99_s']} | {r['outage_min']} | "
            f"{r['restarts']} ({r['false_restarts']}) | "
            + ", ".join(f"{k} {v}" for k, v in r["cure_s"].items())
            + " |"
        )


if __name__ == "__main__":
    main()
