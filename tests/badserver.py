"""A small misbehaving OpenAI-style server, for what the real mlx_lm.server cannot do on demand.

Run as its own process (`python tests/badserver.py --port P --mode M`) so the watchdog inspects
a separate PID, as it would the real server. Every mode answers `GET /v1/models` properly
unless the mode is about that endpoint, and `GET /health` with 200.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import socketserver
import struct
import threading
import time

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


def head(status: int, ctype: str, reason: str = "OK") -> bytes:
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {ctype}\r\nConnection: close\r\n\r\n".encode()
    )


class Handler(socketserver.BaseRequestHandler):
    server: Server

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
        mode = self.server.mode
        if method == "GET" and path.startswith("/v1/models"):
            self.models(sock, mode)
        elif method == "GET" and path == "/health":  # like mlx_lm.server: up means 200
            sock.sendall(head(200, "application/json") + b'{"status": "ok"}')
        elif method == "POST" and path == "/v1/chat/completions":
            self.server.requests += 1
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

    @staticmethod
    def rst(sock: socket.socket) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()


class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(
        self, port: int, mode: str, delay: float, ok_requests: int = 0, hang_file: str | None = None
    ) -> None:
        super().__init__(("127.0.0.1", port), Handler)
        self.hang_file = hang_file
        self.mode = mode
        self.delay = delay
        self.ok_requests = ok_requests
        self.requests = 0
        self.stop = threading.Event()


MODES = sorted(name[4:] for name in dir(Handler) if name.startswith("gen_"))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--mode", choices=MODES, required=True)
    parser.add_argument("--delay", type=float, default=1.5)
    parser.add_argument("--ok-requests", type=int, default=3)
    parser.add_argument("--hang-file")
    args = parser.parse_args()
    server = Server(args.port, args.mode, args.delay, args.ok_requests, args.hang_file)
    print("ready", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
