"""Behind a real HAProxy: one of two servers wedges and is cured under a client stream.

    python bench/balancer.py            # each setup once, 40 requests after the cure
    python bench/balancer.py --quick    # CI's smoke run: 10 after the cure
    python bench/balancer.py --real     # the seed's setup: two real mlx_lm.servers (minutes)
    python bench/balancer.py --real --through   # ... its long prompts sent through HAProxy

Two misbehaving servers of our own (tests/badserver.py) behind HAProxy 2.6 (Debian's), one
watchdog watching both (restarts through the `command` manager, each taking 1.5 s), a client
sending a small request every 0.1 s through HAProxy, and server "a" made to hold every request
it is sent (its hang file) until the watchdog restarts it. Three setups, the rest alike:

- agent: docs/endpoint.md's configuration as it is (the watchdog's agent check, maxconn 1,
  the resend of what a restart cut off);
- /v1/models: HAProxy checks each server's /v1/models itself (the seed's probe), no agent;
- no check: HAProxy checks nothing;
- agent, no queue, no resend: the agent, without `maxconn 1` and the resend (what the docs
  showed before);
- nginx: Debian's nginx with the docs' block (no health check, no queue, no resend of a POST).

With --real, the servers are two real `mlx_lm.server`s on the tiny model, serial through
`--draft-model` as in the field, started and restarted by the watchdog (`process` manager,
`restart.drain = true`: its balancer has another server), and server "a" is wedged the seed's
way: two long prompts sent to it directly by clients that give up after 1 s; with --through,
the field's way: the long prompts sent through HAProxy, their clients giving up there (one,
then two at once), for the agent setup; then the `timeout server 5s` mistake, two patient
clients whose long prompts HAProxy cuts off.

It prints one JSON document and a Markdown table (served, failed, p99 and max wait); nothing is
asserted. Needs `haproxy` (apt-get install haproxy).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.balancing import (  # noqa: E402
    Stream,
    configured,
    haproxy_config,
    nginx_config,
    run_real,
    server_states,
    summary,
    watching,
)
from tests.builders import QUICK_TOML, badserver_argv, command_server  # noqa: E402
from tests.conftest import free_port, listens, until  # noqa: E402

SETUPS = ("agent", "/v1/models", "no check", "agent, no queue, no resend", "nginx")


def run(setup: str, after: int, haproxy: str, nginx: str | None) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        procs, servers = [], []
        for name, mode in (("a", "hang_later"), ("b", "ok")):
            (folder / name).mkdir()
            port = free_port()
            argv = badserver_argv(port, mode, "--hang-file", str(folder / name / "hang"))
            procs.append(subprocess.Popen(argv, start_new_session=True, stdin=subprocess.DEVNULL))
            (folder / name / "bad.pid").write_text(str(procs[-1].pid))
            until(lambda p=port: listens(p), 10, f"server {name}")
            url = f"http://127.0.0.1:{port}"
            s = command_server(url, folder / name / "bad.pid", port, delay=1.5, probe=QUICK_TOML)
            servers.append(({**s, "name": name}, port))
        agent, front = free_port(), free_port()
        daemon = watching([s for s, _ in servers], folder / "state", agent, "200ms")
        if setup == "nginx" and nginx is not None:
            (folder / "nginx.conf").write_text(nginx_config(folder, front, [p for _, p in servers]))
            argv = [nginx, "-c", str(folder / "nginx.conf"), "-g", "daemon off;"]
        else:
            text = haproxy_config(folder, front, [(s["name"], p) for s, p in servers], agent)
            (folder / "haproxy.cfg").write_text(configured(text, setup))
            argv = [haproxy, "-db", "-f", str(folder / "haproxy.cfg")]
        proxy = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        stats = folder / "admin.sock"
        try:
            if setup == "nginx":
                until(lambda: listens(front), 20, "nginx")
            else:
                until(lambda: stats.exists() and len(server_states(stats)) == 2, 20, "HAProxy")
                ready = {"UP", "no check"}
                until(lambda: set(server_states(stats).values()) <= ready, 20, "both UP")
            stream = Stream(f"http://127.0.0.1:{front}")
            until(lambda: len(stream.results) >= 10, 20, "the stream")
            (folder / "a" / "hang").write_text("")
            store = daemon.daemon.store

            def cured() -> bool:
                return any(r.outcome == "recovered" for r in store.restarts("a", 0.0))

            until(cured, 60, "the cure")
            cured_at = len(stream.results)
            until(lambda: len(stream.results) >= cured_at + after, 60, "requests after it")
            results = stream.end()
        finally:
            proxy.terminate()
            proxy.wait(10)
            daemon.stop()
            for p in procs:
                p.kill()
                p.wait(10)
            for name in ("a", "b"):  # the one a restart started, by the PID it recorded
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int((folder / name / "bad.pid").read_text()), signal.SIGKILL)
    return summary(setup, results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="CI's smoke run")
    parser.add_argument("--real", action="store_true", help="two real mlx_lm.servers")
    parser.add_argument(
        "--through", action="store_true", help="with --real: the long prompts sent through HAProxy"
    )
    args = parser.parse_args()
    haproxy = shutil.which("haproxy") or shutil.which("haproxy", path="/usr/sbin:/sbin")
    if haproxy is None:
        raise SystemExit("needs haproxy (apt-get install haproxy)")
    nginx = shutil.which("nginx") or shutil.which("nginx", path="/usr/sbin:/sbin")
    if args.real:
        from mlx_watchdog.demo.tinymodel import build_model

        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            model = build_model(work / "model")
            if args.through:
                rows = []
                for n in (1, 2):
                    (work / str(n)).mkdir()
                    row = run_real(
                        "agent", 30, haproxy, work / str(n), model, through=True, prompts=n
                    )
                    rows.append({**row, "setup": f"agent, {n} long prompt(s) through HAProxy"})
                (work / "cut").mkdir()
                row = run_real(
                    "agent", 30, haproxy, work / "cut", model, through=True, timeout_server="5s"
                )
                rows.append({**row, "setup": "agent, timeout server 5s, 2 patient long prompts"})
            else:
                setups = ("agent", "/v1/models")
                rows = [run_real(setup, 30, haproxy, work, model) for setup in setups]
    else:
        setups = [s for s in SETUPS if s != "nginx" or nginx is not None]
        rows = [run(setup, 10 if args.quick else 40, haproxy, nginx) for setup in setups]
    print(json.dumps(rows, indent=2))
    print("\n| setup | served | failed | p99 wait | max wait |\n|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['setup']} | {r['served']} | {r['failed']} | {r['p99_wait_s']} s "
            f"| {r['max_wait_s']} s |"
        )


if __name__ == "__main__":
    main()
