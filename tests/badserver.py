"""A small misbehaving OpenAI-style server, for what the real mlx_lm.server cannot do on demand.

Run as its own process (`python tests/badserver.py --port P --mode M`) so the watchdog inspects
a separate PID, as it would the real server. Every mode answers `GET /v1/models` properly
unless the mode is about that endpoint, and `GET /health` with 200.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

CHUNK = {
    "object": "chat.completion.chunk",
    "choices": [
        {"index": 0, "finish_reason": None, "delta": {"role": "assistant", "content": "x"}}
    ],
}
FINISH = {
    "object": "chat.completion.chunk",
    "choices": [{"index": 0, "finish_reason": "length", "delta": {}}],
}
USAGE = {
    "object": "chat.completion",
    "choices": [],
    "usage": {"prompt_tokens": 6, "completion_tokens": 1},
}


def sse(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


GPU_HUNG = threading.Event()  # SIGUSR1: a command buffer that never completes
# SIGUSR2: the GPU was reset under it; as Ollama's runner then (ollama #18213), every later
# generation answers 200 with no token in about 180 ms
GPU_RESET = threading.Event()


def busy(seconds: float) -> None:
    """Compute for `seconds`, as a prefill does: the process's CPU shows it. Once the GPU hangs
    (SIGUSR1), it waits for good, idle, as a process whose Metal command buffer never ends."""
    ends = time.monotonic() + seconds
    while time.monotonic() < ends:
        if GPU_HUNG.is_set():
            threading.Event().wait()
        sum(range(2000))


def head(status: int, ctype: str, reason: str = "OK") -> bytes:
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nConnection: close\r\n\r\n".encode()
    )


class Handler(socketserver.BaseRequestHandler):
    server: Server
    body = b""

    def handle(self) -> None:
        sock: socket.socket = self.request
        data = b""
        while b"\r\n\r\n" not in data:
            part = sock.recv(65536)
            if not part:
                return
            data += part
        header, _, body = data.partition(b"\r\n\r\n")
        lines = header.decode(errors="replace").split("\r\n")
        method, path, _ = lines[0].split(" ", 2)
        length = 0
        for line in lines[1:]:
            if line.lower().startswith("content-length:"):
                length = int(line.split(":", 1)[1])
        while len(body) < length:
            part = sock.recv(65536)
            if not part:
                return
            body += part
        if path == "/_hostile":  # the tests set what a route answers, in place of its usual
            self.server.hostile.update(json.loads(body or b"{}"))
            self.server.hostile = {k: v for k, v in self.server.hostile.items() if v}
            sock.sendall(head(204, "text/plain", "No Content"))
            return
        hostile = self.server.hostile.get(path.split("?", 1)[0])
        if hostile is not None:
            self.server.requests += path == "/v1/chat/completions"
            self.hostile(sock, hostile)
            return
        mode = self.server.mode
        if self.server.cancels(sock, method, path, body):
            return
        report = REPORTS.get((self.server.kind, path))
        if method == "GET" and report is not None and mode == "report_hang":
            self.server.stop.wait()  # its report comes from a main loop that is stuck
        elif method == "GET" and report is not None:
            status, ctype, text = report(self.server.load_state())
            sock.sendall(head(status, ctype) + text.encode())
        elif method == "GET" and path.startswith("/v1/models"):
            self.models(sock, mode)
        elif method == "GET" and path == "/health":  # like mlx_lm.server: up means 200
            sock.sendall(head(200, "application/json") + b'{"status": "ok"}')
        elif (
            method == "POST"
            and path == "/v1/chat/completions"
            and self.server.kind in ("ollama", "lmstudio")
            and b'"model"' not in body
        ):  # both answer 400 when no model is named
            error = {"error": {"message": "model is required", "type": "invalid_request_error"}}
            sock.sendall(head(400, "application/json", "Bad Request") + json.dumps(error).encode())
        elif method == "POST" and path == "/v1/chat/completions":
            self.server.requests += 1
            self.body = body
            if GPU_RESET.is_set():
                time.sleep(0.18)
                self.gen_zero_tokens(sock)
                return
            getattr(self, "gen_" + mode)(sock)
        else:
            sock.sendall(head(404, "text/plain", "Not Found") + b"Not Found")

    def models(self, sock: socket.socket, mode: str) -> None:
        if mode == "models_empty":
            sock.sendall(head(200, "application/json"))  # headers, then nothing: like mlx_lm
        elif mode == "models_garbage":
            sock.sendall(head(200, "application/json") + b"<<garbage>>")
        else:
            body = {"object": "list", "data": [{"id": "bad-model", "object": "model"}]}
            sock.sendall(head(200, "application/json") + json.dumps(body).encode())

    def hostile(self, sock: socket.socket, answer: dict[str, object]) -> None:
        """An answer set by the tests: {"status", "ctype", "body" (latin-1 text), "trickle"
        (seconds between bytes), "whole" (trickle the status line and headers too),
        "endless" (repeat the body until the client leaves), "hang" (send nothing)}."""
        if answer.get("hang"):  # nothing, until the client leaves (then its socket closes)
            with contextlib.suppress(OSError):
                while sock.recv(1024):
                    pass
            return
        status = int(answer.get("status", 200))  # type: ignore[call-overload]
        top = head(status, str(answer.get("ctype", "application/json")))
        body = str(answer.get("body", "")).encode("latin-1")
        pause = float(answer.get("trickle", 0.0))  # type: ignore[arg-type]
        try:
            if answer.get("whole"):
                body, top = top + body, b""
            sock.sendall(top)
            while True:
                if pause:
                    for i in range(len(body)):
                        sock.sendall(body[i : i + 1])
                        time.sleep(pause)
                else:
                    sock.sendall(body)
                if not answer.get("endless"):
                    return
        except OSError:
            return  # the client left: what a server does then

    # -- generation modes -------------------------------------------------------------------

    def gen_ok(self, sock: socket.socket) -> None:
        sock.sendall(
            head(200, "text/event-stream")
            + sse(CHUNK)
            + sse(FINISH)
            + sse(USAGE)
            + b"data: [DONE]\n\n"
        )

    gen_models_empty = gen_ok
    gen_report_hang = gen_ok
    gen_models_garbage = gen_ok

    def gen_slow(self, sock: socket.socket) -> None:
        time.sleep(self.server.delay)
        self.gen_ok(sock)

    def gen_nonstream(self, sock: socket.socket) -> None:
        body = {
            "choices": [{"message": {"content": "x"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 6, "completion_tokens": 1},
        }
        sock.sendall(head(200, "application/json") + json.dumps(body).encode())

    def gen_reasoning_empty(self, sock: socket.socket) -> None:
        """A reasoning model's 1-token answer: empty content, but usage counts the token."""
        empty = {"choices": [{"index": 0, "finish_reason": "length", "delta": {"content": ""}}]}
        sock.sendall(head(200, "text/event-stream") + sse(empty) + sse(USAGE) + b"data: [DONE]\n\n")

    def gen_html_500(self, sock: socket.socket) -> None:
        sock.sendall(
            head(500, "text/html", "Internal Server Error")
            + b"<html><body><h1>500 Internal Server Error</h1></body></html>"
        )

    def gen_html_200(self, sock: socket.socket) -> None:
        sock.sendall(
            head(200, "text/html") + b"<!doctype html><html><body>proxy login</body></html>"
        )

    def gen_invalid_json(self, sock: socket.socket) -> None:
        sock.sendall(head(200, "text/event-stream") + b'data: {"choices": [{"delta\n\n')

    def gen_no_data(self, sock: socket.socket) -> None:
        sock.sendall(head(200, "text/event-stream") + b": keepalive 1/6\n\n: hello\n\n")

    def gen_done_no_token(self, sock: socket.socket) -> None:
        sock.sendall(head(200, "text/event-stream") + b"data: [DONE]\n\n")

    def gen_zero_tokens(self, sock: socket.socket) -> None:
        empty = {"choices": [{"index": 0, "finish_reason": "stop", "delta": {}}]}
        usage = {"choices": [], "usage": {"prompt_tokens": 6, "completion_tokens": 0}}
        sock.sendall(head(200, "text/event-stream") + sse(empty) + sse(usage))

    def gen_finish_error(self, sock: socket.socket) -> None:
        bad = {"choices": [{"index": 0, "finish_reason": "error", "delta": {}}]}
        sock.sendall(head(200, "text/event-stream") + sse(bad) + b"data: [DONE]\n\n")

    def gen_stream_error(self, sock: socket.socket) -> None:
        sock.sendall(head(200, "text/event-stream") + sse({"error": "out of memory"}))

    def gen_error_404(self, sock: socket.socket) -> None:
        sock.sendall(
            head(404, "application/json", "Not Found")
            + json.dumps({"error": "Model not found: other-model"}).encode()
        )

    def gen_error_500(self, sock: socket.socket) -> None:
        sock.sendall(
            head(500, "application/json", "Internal Server Error")
            + json.dumps({"error": {"message": "Metal out of memory"}}).encode()
        )

    def gen_auth_401(self, sock: socket.socket) -> None:
        sock.sendall(
            head(401, "application/json", "Unauthorized")
            + json.dumps({"error": "invalid api key"}).encode()
        )

    def gen_auth_403(self, sock: socket.socket) -> None:
        sock.sendall(head(403, "text/plain", "Forbidden") + b"forbidden")

    def gen_too_large(self, sock: socket.socket) -> None:
        sock.sendall(head(200, "text/event-stream"))
        try:
            for _ in range(5000):  # about 2 MB of tokens, never a [DONE]
                sock.sendall(sse(CHUNK) * 2)
        except OSError:
            pass

    def gen_trickle(self, sock: socket.socket) -> None:
        sock.sendall(head(200, "text/event-stream"))
        try:
            for i in range(10_000):
                sock.sendall(f": keepalive {i}/999999\n\n".encode())
                time.sleep(0.1)
        except OSError:
            pass

    def gen_reset(self, sock: socket.socket) -> None:
        sock.sendall(head(200, "text/event-stream") + b": keepalive 1/6\n\n")
        time.sleep(0.05)
        self.rst(sock)

    def gen_reset_early(self, sock: socket.socket) -> None:
        self.rst(sock)

    def gen_hang(self, sock: socket.socket) -> None:
        """A slot that is never released: read the request, say nothing, keep the socket."""
        self.server.stop.wait()

    def gen_hang_later(self, sock: socket.socket) -> None:
        """Serves the first --ok-requests requests (or until --hang-file exists), then never
        releases its slot again."""
        hang_file = self.server.hang_file
        if hang_file is not None:
            healthy = not os.path.exists(hang_file)
        else:
            healthy = self.server.requests <= self.server.ok_requests
        if healthy:
            self.gen_ok(sock)
        else:
            self.gen_hang(sock)

    def gen_leak(self, sock: socket.socket) -> None:
        """The first request takes the only slot and never frees it, though its socket is
        closed (no CLOSE_WAIT to see); later ones wait, and the progress counter stops."""
        srv = self.server
        with srv.lock:
            first = not srv.leaked
            srv.leaked = True
            if first:
                srv.running += 1
            else:
                srv.waiting += 1
        if first:
            sock.close()
            return
        try:
            srv.stop.wait()
        finally:
            with srv.lock:
                srv.waiting -= 1

    def gen_work(self, sock: socket.socket) -> None:
        """A serial server that computes each request for --delay seconds, its progress
        counter moving all the while, then answers."""
        srv = self.server
        with srv.lock:
            srv.waiting += 1
        with srv.slot:
            with srv.lock:
                srv.waiting -= 1
                srv.running += 1
                srv.work_started = time.monotonic()
            time.sleep(srv.delay)
            with srv.lock:
                srv.running -= 1
                srv.progress += 10 * srv.delay
                srv.work_started = None
            self.gen_ok(sock)

    def gen_prefill(self, sock: socket.socket) -> None:
        """mlx_lm.server's prefill as its log tells it (0.32.2, the keepalive callback): a
        prompt of a token per 4 bytes of body, 2048 tokens a step at --rate tokens a second,
        each step logged, one request at a time; a client that left is not noticed. It works
        as the real one does, a core busy all the while (the watchdog believes progress lines
        only from a working process). With --stall-at F a long prompt's prefill stops stepping
        at that share, for good, idle."""
        srv, total = self.server, max(1, len(self.body) // 4)
        with srv.slot:
            done = 0
            logging.info("Prompt processing progress: %d/%d", done, total)
            while done < total:
                if srv.stall_at and total > 2048 and done >= srv.stall_at * total:
                    srv.stop.wait()  # stuck: idle, stepping no more
                n = min(2048, total - done)
                busy(n / srv.rate)
                done += n
                logging.info("Prompt processing progress: %d/%d", done, total)
            with contextlib.suppress(OSError):
                self.gen_ok(sock)

    def gen_gpu(self, sock: socket.socket) -> None:
        """mlx_lm.server on a Mac, serial (--draft-model: no progress lines): a prompt of a
        token per 4 bytes of body prefilled at --rate tokens a second on the GPU, while the
        thread waits as MLX's does on a Metal event (the process near 0 % CPU) and the GPU's
        time climbs in --gpu-dir/<pid>.gpu (read by tests/fakes/mac/ioreg). A client that left
        is not noticed. SIGUSR1: the GPU hangs, its command never completes and its time stops;
        --gpu-spin: it spins instead (MLX_METAL_FAST_SYNCH), its time climbing for good."""
        srv, total = self.server, max(1, len(self.body) // 4)
        with srv.slot:
            srv.gpu.busy(True)
            ends = time.monotonic() + total / srv.rate
            while time.monotonic() < ends or (srv.gpu.spin and GPU_HUNG.is_set()):
                if GPU_HUNG.is_set() and not srv.gpu.spin:
                    srv.gpu.busy(False)
                    srv.stop.wait()
                time.sleep(0.02)
            srv.gpu.busy(False)
            with contextlib.suppress(OSError):
                self.gen_ok(sock)

    def gen_traffic(self, sock: socket.socket) -> None:
        """Serves concurrently and counts the tokens it sends. A long prompt (over 1 kB of
        body: a live client) streams a token every 0.1 s for --delay seconds; a short one (the
        probe) is answered at once. Once --hang-file exists, every request is held forever."""
        srv = self.server
        if srv.hang_file is not None and os.path.exists(srv.hang_file):
            srv.stop.wait()
            return
        if len(self.body) <= 1000:
            with srv.lock:
                srv.delivered += 1
            self.gen_ok(sock)
            return
        sock.sendall(head(200, "text/event-stream"))
        ends = time.monotonic() + srv.delay
        with contextlib.suppress(OSError):
            while time.monotonic() < ends:
                sock.sendall(sse(CHUNK))
                with srv.lock:
                    srv.delivered += 1
                time.sleep(0.1)
            sock.sendall(sse(FINISH) + b"data: [DONE]\n\n")

    def gen_cancellable(self, sock: socket.socket) -> None:
        """One request at a time. A long prompt (over 4 kB of body) holds the slot until it is
        cancelled through the server's own route (its kind's: vllm-mlx and Rapid-MLX by id,
        SGLang all at once); a short one waits for the slot, then answers."""
        srv = self.server
        work = srv.register(len(self.body) // 4)
        try:
            while not srv.slot.acquire(timeout=0.05):
                if work["cancelled"].is_set():
                    return
            try:
                work["status"], work["phase"] = "running", "prefill"
                if len(self.body) > 4000:
                    work["cancelled"].wait()
                    logging.info("cancelled %s", work["request_id"])
                    return
                with contextlib.suppress(OSError):
                    self.gen_ok(sock)
            finally:
                srv.slot.release()
        finally:
            srv.unregister(work)

    @staticmethod
    def rst(sock: socket.socket) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


def uptime_ns() -> int:
    """The clock the fake ioreg reads (/proc/uptime, 10 ms steps): the same source, whatever
    a container makes of it."""
    with open("/proc/uptime") as fh:
        up = fh.read().split()[0]
    return int(up.replace(".", "")) * 10_000_000


class FakeGpu:
    """This process's GPU time, kept where the fake ioreg reads it: the time so far (ns) and
    since when it climbs (0: idle), on the boot clock the fake reads (/proc/uptime)."""

    def __init__(self, folder: str | None) -> None:
        self.path = os.path.join(folder, f"{os.getpid()}.gpu") if folder else None
        self.spent, self.since, self.spin = 0, 0, False
        self.lock = threading.Lock()
        self._write()

    def busy(self, on: bool) -> None:
        with self.lock:
            now = uptime_ns()
            if on and not self.since:
                self.since = now
            elif not on and self.since:
                self.spent, self.since = self.spent + now - self.since, 0
            self._write()

    def _write(self) -> None:
        if self.path is None:
            return
        with open(self.path + ".new", "w") as fh:
            fh.write(f"{self.spent} {self.since}\n")
        os.replace(self.path + ".new", self.path)


class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self,
        port: int,
        mode: str,
        delay: float,
        ok_requests: int = 0,
        hang_file: str | None = None,
        kind: str = "mlx_lm",
    ) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.hang_file = hang_file
        self.mode = mode
        self.delay = delay
        self.ok_requests = ok_requests
        self.requests = 0
        self.stop = threading.Event()
        self.kind = kind
        self.lock = threading.Lock()
        self.slot = threading.Lock()
        self.leaked = False
        self.running = 0
        self.waiting = 0
        self.progress = 100.0
        self.work_started: float | None = None
        self.hostile: dict[str, dict[str, object]] = {}
        self.work: dict[str, dict[str, Any]] = {}  # requests by id (mode cancellable)
        self.counter = 0
        self.rate = 2000.0  # prefill tokens a second (mode prefill)
        self.delivered = 0.0  # tokens sent to clients (mode traffic)
        self.lying = False  # the counter grows at every read (mode traffic, --lying)
        self.stall_at = 0.0
        self.gpu = FakeGpu(None)

    def register(self, tokens: int) -> dict[str, Any]:
        with self.lock:
            self.counter += 1
            work = {
                "request_id": f"chatcmpl-{self.counter}",
                "arrival": time.time(),
                "prompt_tokens": tokens,
                "status": "waiting",
                "phase": "queued",
                "cancelled": threading.Event(),
            }
            self.work[str(work["request_id"])] = work
            return work

    def unregister(self, work: dict[str, Any]) -> None:
        with self.lock:
            self.work.pop(str(work["request_id"]), None)

    def cancels(self, sock: socket.socket, method: str, path: str, body: bytes) -> bool:
        """The cancel routes of the kind emulated (shapes: act/cancel.py's sources)."""
        by_id = self.kind in ("vllm-mlx", "rapid-mlx")
        if by_id and method == "GET" and path == "/v1/status":
            now = time.time()
            with self.lock:
                listed = [
                    {
                        "request_id": w["request_id"],
                        "status": w["status"],
                        "phase": w["phase"],
                        "elapsed_s": round(now - w["arrival"], 2),
                        "prompt_tokens": w["prompt_tokens"],
                    }
                    for w in self.work.values()
                ]
            running, waiting, steps, _ = self.load_state()
            doc = {
                "status": "running",
                "num_running": running + sum(w["status"] == "running" for w in listed),
                "num_waiting": waiting + sum(w["status"] == "waiting" for w in listed),
                "steps_executed": int(steps),
                "requests": listed,
            }
            sock.sendall(head(200, "application/json") + json.dumps(doc).encode())
            return True
        target = path.removeprefix("/v1/requests/").removesuffix("/cancel")
        if by_id and path.startswith("/v1/requests/") and method in ("POST", "DELETE"):
            with self.lock:
                work = self.work.get(target)
            if work is None:
                error = {"detail": "Request not found or already finished"}
                sock.sendall(
                    head(404, "application/json", "Not Found") + json.dumps(error).encode()
                )
                return True
            work["cancelled"].set()
            done = {"object": "request.cancel", "id": target, "cancelled": True}
            sock.sendall(head(200, "application/json") + json.dumps(done).encode())
            return True
        if self.kind == "sglang" and method == "POST" and path == "/abort_request":
            asked = json.loads(body or b"{}")
            with self.lock:
                chosen = [
                    w
                    for w in self.work.values()
                    if asked.get("abort_all") or w["request_id"] == asked.get("rid")
                ]
            for w in chosen:
                w["cancelled"].set()
            sock.sendall(head(200, "application/json"))
            return True
        return False

    def load_state(self) -> tuple[int, int, float, float]:
        with self.lock:
            moving = 0.0 if self.work_started is None else time.monotonic() - self.work_started
            if self.lying:
                self.delivered += 10  # a counter that grows whatever the server does
            return self.running, self.waiting, self.progress + 10 * moving, self.delivered


# Each server's load routes, shaped as its source writes them (see tests/test_load.py).
def _prom(lines: dict[str, float]) -> tuple[int, str, str]:
    text = "".join(f"# TYPE {k} gauge\n{k} {v}\n" for k, v in lines.items())
    return 200, "text/plain; version=0.0.4", text


def _json(doc: object) -> tuple[int, str, str]:
    return 200, "application/json", json.dumps(doc)


Report = Callable[[tuple[int, int, float, float]], tuple[int, str, str]]
REPORTS: dict[tuple[str, str], Report] = {
    ("llama.cpp", "/metrics"): lambda s: _prom(
        {
            "llamacpp:requests_processing": s[0],
            "llamacpp:requests_deferred": s[1],
            "llamacpp:n_decode_total": s[2],
        }
    ),
    ("llama.cpp", "/health"): lambda s: _json({"status": "ok"}),
    ("rapid-mlx", "/metrics"): lambda s: _prom(
        {
            'rapid_mlx_requests_running{model="m"}': s[0],
            'rapid_mlx_requests_waiting{model="m"}': s[1],
            'rapid_mlx_steps_executed_total{model="m"}': s[2],
        }
    ),
    ("vllm", "/metrics"): lambda s: _prom(
        {
            'vllm:num_requests_running{model_name="m"}': s[0],
            'vllm:num_requests_waiting{model_name="m"}': s[1],
            'vllm:iteration_tokens_total_count{model_name="m"}': s[2],
            'vllm:generation_tokens_total{model_name="m"}': s[3],
        }
    ),
    # A default vllm-mlx (no lifecycle manager): /health counts nothing; /v1/status does.
    ("vllm-mlx", "/health"): lambda s: _json(
        {"status": "healthy", "model_loaded": True, "model_name": "m", "engine_type": "batched"}
    ),
    ("mlx-openai-server", "/v1/queue/stats"): lambda s: _json(
        {
            "status": "ok",
            "queue_stats": {
                "queue_stats": {"running": True, "queue_size": s[1], "active_requests": s[0]},
                "batch_stats": {"running": False, "queue_size": 0, "active_requests": 0},
            },
        }
    ),
    ("ollama", "/api/ps"): lambda s: _json({"models": [{"name": "bad-model", "size_vram": 1}]}),
    ("sglang", "/metrics"): lambda s: _prom(
        {
            'sglang:num_running_reqs{model_name="m"}': s[0],
            'sglang:num_queue_reqs{model_name="m"}': s[1],
            'sglang:generation_tokens_total{model_name="m"}': s[2],
        }
    ),
}


MODES = sorted(name[4:] for name in dir(Handler) if name.startswith("gen_"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--delay", type=float, default=1.5)
    parser.add_argument("--ok-requests", type=int, default=3)
    parser.add_argument("--hang-file")
    parser.add_argument("--kind", default="mlx_lm", help="emulate this server's load routes")
    parser.add_argument("--rate", type=float, default=2000.0, help="prefill tokens a second")
    parser.add_argument("--stall-at", type=float, default=0.0, help="a prefill stops there")
    parser.add_argument("--lying", action="store_true", help="a token counter that always grows")
    parser.add_argument("--no-generation-thread", action="store_true")
    parser.add_argument("--gpu-dir", help="where its GPU time is kept for the fake ioreg")
    parser.add_argument("--gpu-spin", action="store_true", help="a hung GPU spins (mode gpu)")
    parser.add_argument(
        "--busy-generation", action="store_true", help="its generation thread works (half a core)"
    )
    args = parser.parse_args()
    signal.signal(signal.SIGUSR1, lambda *_: GPU_HUNG.set())
    signal.signal(signal.SIGUSR2, lambda *_: GPU_RESET.set())
    logging.basicConfig(level=logging.INFO, format="%(asctime)s - %(levelname)s - %(message)s")
    server = Server(args.port, args.mode, args.delay, args.ok_requests, args.hang_file, args.kind)
    server.rate, server.stall_at, server.lying = args.rate, args.stall_at, args.lying
    server.gpu = FakeGpu(args.gpu_dir)
    server.gpu.spin = args.gpu_spin
    # Laid out as mlx_lm.server's threads are: a generation thread beside the HTTP ones, so a
    # stack sample (py-spy) finds one, as on the real server; `--no-generation-thread` loses it.
    if not args.no_generation_thread:
        threading.Thread(target=_generate, args=(args.busy_generation,), daemon=True).start()
    print("ready", flush=True)
    server.serve_forever()


def _generate(busy: bool) -> None:
    """Waits forever; or, busy, works half a core (as a process paging looks to its CPU
    reading): never idle."""
    if not busy:
        threading.Event().wait()
    while True:
        until = time.monotonic() + 0.02
        while time.monotonic() < until:
            pass
        time.sleep(0.02)


if __name__ == "__main__":
    main()
