"""Runs a Python server with its threads' stacks to be had on demand, for mlx-watchdog: on
SIGURG (ignored by default, so a signal that misses harms nothing) faulthandler writes every
thread's stack to stderr, the server's log; nothing else changes. It needs no root and no
debugger (py-spy needs root on macOS; `sample` shows native frames only), and it answers while
a thread holds the GIL. Run by the server's own Python, it imports nothing of the watchdog:

    python stacks_launcher.py -m module [args...]
    python stacks_launcher.py path/to/script [args...]
"""

import sys

# Python put this file's folder first on sys.path; the server expects the current folder
# (-m) or its script's (a script), and a module here must never shadow one of the stdlib's.
sys.path[0] = ""

import faulthandler  # noqa: E402
import os  # noqa: E402
import runpy  # noqa: E402
import signal  # noqa: E402


def main() -> None:
    faulthandler.register(signal.SIGURG, file=sys.stderr, all_threads=True, chain=False)
    if len(sys.argv) >= 3 and sys.argv[1] == "-m":
        module = sys.argv[2]
        sys.argv = [module, *sys.argv[3:]]
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    elif len(sys.argv) >= 2:
        script = sys.argv[1]
        sys.path[0] = os.path.dirname(os.path.abspath(script))
        sys.argv = sys.argv[1:]
        runpy.run_path(script, run_name="__main__")
    else:
        sys.exit("usage: python stacks_launcher.py (-m module | script) [args...]")


if __name__ == "__main__":
    main()
