"""What docs/servers.md says llama-server does with a long prompt: how often its progress counter
moves while it prefills, and what it does when the client leaves mid-prefill.

Runs the real llama-server (tests/llamacpp.py builds it once) on the tests' tiny GGUF, one
slot. First a patient client: /metrics polled every second (answer time, n_decode_total).
Then the same size of prompt abandoned after --after seconds: when the server logs the
cancel, when it frees the slot and with how many tokens, and when a tiny request is served.

    python bench/llama_abandon.py [--words 1500] [--after 3] [--quick]   # --quick: 300 words, 1 s (CI)
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

from mlx_watchdog.demo.run import long_prompt, send
from tests import llamacpp
from tests.conftest import free_port, llama_argv, spawn, wait_until_serving
from tests.tinygguf import build as build_gguf

LOG_TIME = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) ")  # llama.cpp's m.ss.mmm.uuu stamps


def metrics(url: str) -> dict[str, float]:
    text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
    return {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line and not line.startswith("#")
    }


def log_seconds(line: str) -> float | None:
    m = LOG_TIME.match(line)
    if m is None:
        return None
    minutes, seconds, ms, us = (int(g) for g in m.groups())
    return minutes * 60 + seconds + ms / 1e3 + us / 1e6


def patient(url: str, words: int) -> None:
    print(f"a patient client, {words}-word prompt; /metrics every second:")
    outcome: list[str] = []
    t0 = time.monotonic()
    client = threading.Thread(target=lambda: outcome.append(send(url, long_prompt(1, words), 600)))
    client.start()
    last, moved_at, gaps = None, t0, []
    while client.is_alive():
        asked = time.monotonic()
        m = metrics(url)
        answered = time.monotonic()
        decodes = m["llamacpp:n_decode_total"]
        if decodes != last:
            if last is not None:
                gaps.append(answered - moved_at)
            last, moved_at = decodes, answered
        print(
            f"  t={asked - t0:5.1f} s  answered in {1000 * (answered - asked):4.0f} ms  "
            f"n_decode_total={decodes:.0f}  processing={m['llamacpp:requests_processing']:.0f}"
        )
        time.sleep(1.0)
    client.join()
    print(
        f"  client {outcome[0]} after {time.monotonic() - t0:.1f} s; the counter moved every "
        f"{min(gaps):.1f}-{max(gaps):.1f} s"
        if gaps
        else ""
    )


def abandoned(url: str, words: int, after: float, log: Path) -> None:
    print(f"the same size of prompt, abandoned after {after:g} s:")
    body = json.dumps(
        {"messages": [{"role": "user", "content": long_prompt(2, words)}], "max_tokens": 8}
    ).encode()
    start = len(log.read_text().splitlines())
    s = socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])))
    s.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
        b"application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    time.sleep(after)
    s.close()
    left = time.monotonic()
    tiny = json.dumps({"messages": [{"role": "user", "content": "ping"}], "max_tokens": 1})
    request = urllib.request.Request(
        url + "/v1/chat/completions", tiny.encode(), {"Content-Type": "application/json"}
    )
    urllib.request.urlopen(request, timeout=600).read()
    served = time.monotonic() - left
    lines = log.read_text().splitlines()[start:]
    launched = next((log_seconds(x) for x in lines if "launch_slot_" in x), None)
    cancel = next((log_seconds(x) for x in lines if "cancel task" in x), None)
    release = next((x for x in lines if "stop processing" in x), "")
    freed = log_seconds(release) if release else None
    tokens = re.search(r"n_tokens = (\d+)", release)
    if launched is not None and cancel is not None and freed is not None:
        print(
            f"  the slot took the prompt; the cancel was logged {cancel - launched:.1f} s later "
            f"(the client left {after:g} s after sending), the slot was freed {freed - cancel:.1f} "
            f"s after that with {tokens.group(1) if tokens else '?'} prompt tokens in it"
        )
    print(f"  a tiny request was served {served:.1f} s after the client left")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--words", type=int, default=1500)
    parser.add_argument("--after", type=float, default=3.0)
    parser.add_argument("--quick", action="store_true", help="300 words, leaving after 1 s (CI)")
    args = parser.parse_args()
    if args.quick:
        args.words, args.after = 300, 1.0
    binary = llamacpp.ensure()
    with tempfile.TemporaryDirectory(prefix="mlx-watchdog-llama-") as tmp:
        root = Path(tmp)
        port = free_port()
        log = root / "llama.log"
        server = spawn(llama_argv(binary, build_gguf(root / "tiny.gguf"), port), port, log)
        try:
            wait_until_serving(server)
            patient(server.url, args.words)
            abandoned(server.url, args.words, args.after, log)
        finally:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
