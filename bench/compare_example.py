"""The `mlx-watchdog compare` tables in docs/servers.md: the real mlx_lm.server on the tiny model,
serial (--draft-model) against batched, and serial mlx_lm.server against llama.cpp's
llama-server (one slot, then four) on a tiny GGUF of the same size class.

    python bench/compare_example.py [--prompt-tokens 4k] [--quick]   # --quick: 512 tokens (CI)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

from mlx_watchdog.demo.run import server_command
from tests import llamacpp
from tests.conftest import Running, free_port, wait_until_serving
from tests.tinygguf import build as build_gguf


def start(cmd: list[str], port: int, log: Path) -> Running:
    with log.open("wb") as fh:
        proc = subprocess.Popen(
            cmd,
            stdout=fh,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
    server = Running(proc, f"http://127.0.0.1:{port}", port, log)
    wait_until_serving(server)
    return server


def compare(a: Running, b: Running, tokens: str) -> None:
    argv = [
        sys.executable,
        "-m",
        "mlx_watchdog",
        "compare",
        a.url,
        b.url,
        "--prompt-tokens",
        tokens,
    ]
    print("$ mlx-watchdog compare", a.url, b.url, "--prompt-tokens", tokens, flush=True)
    subprocess.run(argv, env={**os.environ, "COLUMNS": "120"}, check=False)
    print(flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt-tokens", default="4k")
    parser.add_argument("--quick", action="store_true", help="a 512-token prompt (CI's smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.prompt_tokens = "512"
    binary = llamacpp.ensure()
    with tempfile.TemporaryDirectory(prefix="mlx-watchdog-compare-") as tmp:
        root = Path(tmp)
        subprocess.run(
            [sys.executable, "-m", "mlx_watchdog.demo.tinymodel", str(root / "mlx")],
            check=True,
            capture_output=True,
        )
        gguf = build_gguf(root / "tiny.gguf")
        running: list[Running] = []
        try:
            p1, p2, p3 = free_port(), free_port(), free_port()
            serial = start(server_command(root / "mlx", p1, serial=True), p1, root / "s.log")
            running.append(serial)
            batched = start(server_command(root / "mlx", p2, serial=False), p2, root / "b.log")
            running.append(batched)
            compare(serial, batched, args.prompt_tokens)
            batched.stop()
            llama = [
                str(binary),
                "-m",
                str(gguf),
                "--host",
                "127.0.0.1",
                "--port",
                str(p3),
                "--metrics",
                "-c",
                "32768",
            ]
            four = start([*llama, "-np", "4"], p3, root / "l.log")
            running.append(four)
            compare(serial, four, args.prompt_tokens)
        finally:
            for server in running:
                server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
