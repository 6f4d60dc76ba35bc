"""A restart_command for tests: replace the bad server recorded in PIDFILE with a new one.

usage: restart_bad.py PIDFILE PORT MODE [DELAY]
"""

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

pidfile, port, mode = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
time.sleep(float(sys.argv[4]) if len(sys.argv) > 4 else 0)
if pidfile.exists():
    with contextlib.suppress(ProcessLookupError):
        os.kill(int(pidfile.read_text()), signal.SIGKILL)
deadline = time.monotonic() + 10
while time.monotonic() < deadline:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            break
        except OSError:
            time.sleep(0.05)
here = Path(__file__).parent.parent
proc = subprocess.Popen(
    [sys.executable, str(here / "badserver.py"), "--port", str(port), "--mode", mode],
    stdin=subprocess.DEVNULL,
    stdout=subprocess.DEVNULL,
    stderr=subprocess.DEVNULL,
    start_new_session=True,
)
pidfile.write_text(str(proc.pid))
