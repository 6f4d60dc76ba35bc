"""The `mlx-watchdog fleet` output in docs/fleet.md: two watchdogs on this machine, each watching
one of the tests' misbehaving servers; two clients give up on the first, which then holds
every request (wedged), the second serves.

    python bench/fleet_example.py
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent))

from mlx_watchdog.config import parse_config
from mlx_watchdog.daemon import Daemon
from tests.conftest import BadByPidfile, DaemonThread, until


def config(server: BadByPidfile, state: Path) -> dict[str, object]:
    probe = {"slow_after": "1s", "wedge_after": "3s", "startup_grace": "1s"}
    return {
        "watchdog": {"interval": "1s", "listen": "127.0.0.1:0", "state_dir": str(state)},
        "server": [{"name": "qwen", "url": server.url, "match": "badserver", "probe": probe}],
    }


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="mlx-watchdog-fleet-") as tmp:
        root = Path(tmp)
        (root / "ok").mkdir()
        hanging, ok = BadByPidfile(root, "hang"), BadByPidfile(root / "ok", "ok")
        wedged = Daemon(parse_config(config(hanging, root / "a"))).open()
        serving = Daemon(parse_config(config(ok, root / "b"))).open()
        threads = [DaemonThread(wedged), DaemonThread(serving)]
        try:
            until(lambda: wedged.endpoint and serving.endpoint, 30, "both endpoints")
            for _ in range(2):  # clients that send a request and leave at once
                with socket.create_connection(("127.0.0.1", hanging.port)) as s:
                    s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n\r\n")
            until(
                lambda: (
                    wedged.status().servers[0].gave_up_24h == 2
                    and wedged.status().servers[0].state == "wedged"
                ),
                30,
                "the wedge",
            )
            until(lambda: serving.status().servers[0].state == "healthy", 30, "healthy")
            urls = [
                "http://{}:{}".format(*d.endpoint.server_address[:2])  # type: ignore[union-attr]
                for d in (wedged, serving)
            ]
            done = subprocess.run(
                [sys.executable, "-m", "mlx_watchdog", "fleet", *urls],
                env={**os.environ, "COLUMNS": "120"},
            )
            print(f"exit code {done.returncode}")
            return 0
        finally:
            for t in threads:
                t.stop()
            hanging.kill()
            ok.kill()


if __name__ == "__main__":
    sys.exit(main())
