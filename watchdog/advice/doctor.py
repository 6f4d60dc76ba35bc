"""`mlx-watchdog doctor`: each thing that decides whether the wedge can happen here, checked
and explained, with the fix."""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from mlx_watchdog import service
from mlx_watchdog.act.managers import System
from mlx_watchdog.advice.balancer import findings as balancer_findings
from mlx_watchdog.advice.balancer import served_at
from mlx_watchdog.advice.calibrate import Advice, refusal, serving_process
from mlx_watchdog.advice.finding import Finding, Level, exit_code
from mlx_watchdog.advice.host import mac_findings, read_job, service_findings
from mlx_watchdog.advice.litellm import LiteLLMConfigError, fallback_problems, load
from mlx_watchdog.config import Config, ServerConfig
from mlx_watchdog.config.programs import unrunnable
from mlx_watchdog.judge.advice import retry_loop, tokens_label, unattended
from mlx_watchdog.judge.states import BAD_STATES, EventKind
from mlx_watchdog.record.left_probes import LeftProbes, left_probes
from mlx_watchdog.record.private import UnsafeState, check_private
from mlx_watchdog.record.rows import calibration_advice
from mlx_watchdog.record.store import Store, open_history
from mlx_watchdog.record.tally import DAY, abandoned_lately
from mlx_watchdog.sense import platform, selfdump
from mlx_watchdog.sense.dump import stack_command
from mlx_watchdog.sense.findings import EMPTY_MODELS_FIX
from mlx_watchdog.sense.load import LoadReader
from mlx_watchdog.sense.models import check_models
from mlx_watchdog.sense.probe import OK, Probe
from mlx_watchdog.sense.process import is_local_host
from mlx_watchdog.sense.progress import PARSED_KINDS, progress_source, unread_cost
from mlx_watchdog.sense.sched import Clamp, clamp
from mlx_watchdog.serve.client import DaemonNotRunning, live_status

__all__ = ["Finding", "Level", "exit_code", "mac_findings", "run_doctor"]

LITELLM_DEFAULT_TIMEOUT = 600.0  # what the proxy waits when the config names no timeout


def run_doctor(
    config: Config,
    *,
    litellm: Path | None = None,
    balancer: Path | None = None,
    system: System | None = None,
    home: Path | None = None,
    env: Mapping[str, str] | None = None,
    now: Callable[[], float] = time.time,
    clamp_of: Clamp = clamp,
) -> Iterator[Finding]:
    system = system or System()
    home = home or Path.home()
    env = os.environ if env is None else env
    source = str(config.source) if config.source else "no file: the embedded default"
    yield Finding("ok", "config", f"valid ({source})")
    for warning in config.warnings:
        yield Finding("warning", "config", warning)
    for problem in unrunnable(config, env):
        yield Finding("problem", "config", problem, "the watchdog cannot start or restart it")
    yield from service_findings(system, home, env)
    if service.default_kind() == "launchd":
        yield from mac_findings(config, home, system, python=service.interpreter())
    yield _endpoint(config)
    yield _state_dir(config.watchdog.state_dir)
    store = open_history(config.watchdog.state_dir, create=False)
    try:
        advice: dict[str, Advice] = {}
        serial: set[str] = set()
        for server in config.servers:
            left = left_probes(config.watchdog.state_dir)
            yield from _server(server, store, now(), advice, left, serial)
            yield from _throttle(server, home, clamp_of)
            yield from _spawn_type(server, system)
            yield from _stack_source(server)
        if litellm is not None:
            yield from litellm_findings(litellm, config, advice)
        if balancer is not None:
            for level, detail, fix in balancer_findings(balancer, config, advice, serial):
                yield Finding(level, "balancer", detail, fix)
    finally:
        store.close()


def _state_dir(path: Path) -> Finding:
    """The folder `run` refuses when others can write it (its token decides who may restart)."""
    if not path.exists():
        return Finding("ok", "state", f"{path} does not exist yet; run creates it, mode 0700")
    try:
        check_private(path)
    except UnsafeState as exc:
        return Finding("problem", "state", str(exc), "run refuses it until that is fixed")
    return Finding("ok", "state", f"{path} is this user's alone")


def _endpoint(config: Config) -> Finding:
    try:
        doc = live_status(config.watchdog.state_dir)
    except DaemonNotRunning as exc:
        return Finding("warning", "watchdog", str(exc), "mlx-watchdog install, or mlx-watchdog run")
    return Finding("ok", "watchdog", f"running (PID {doc.watchdog.pid}); its endpoint answers")


def _server(
    server: ServerConfig,
    store: Store,
    now: float,
    advice: dict[str, Advice],
    left: LeftProbes,
    serial: set[str],
) -> Iterator[Finding]:
    name = f"{server.name}"
    if server.api_key_file is not None:
        yield _key_file(name, server.api_key_file)
    why, cmdline = refusal(server, left)
    yield from _generation(name, server, why)
    yield from _profile(server, cmdline)
    yield from _progress(server)
    if "--draft-model" in cmdline:
        serial.add(server.name)
        yield Finding(
            "warning",
            name,
            "serves one request at a time (--draft-model disables batching): one abandoned "
            "long prompt holds every client behind it until its prefill ends; and it logs no "
            "prefill progress then, so the watchdog cannot tell when the abandoned work ends: "
            "it waits while that costs less than a restart (longer while a client resends the "
            "abandoned prompt), then restarts (losing every client's prompt cache)",
            "give every client and proxy a timeout above the longest prefill "
            "(mlx-watchdog calibrate); or serve without --draft-model: batched, it logs its "
            "progress and serves small requests between an abandoned prompt's steps",
        )
    elif cmdline:
        yield Finding(
            "ok", name, "batched (no --draft-model): abandoned work still slows, less long"
        )
    yield from _calibration(name, server, store, now, advice)
    loop = retry_loop(abandoned_lately(store, server.name, now))
    if loop is not None:
        yield Finding(
            "warning",
            name,
            f"a retry loop in the last day: {loop}",
            "raise that client's timeout (and its proxy's) to the figure above, or stop it "
            "resending the prompt",
        )
    resent = [
        e.data["resent"]
        for e in store.events(server.name, since=now - DAY, kind=EventKind.RECOVERED)
        if isinstance(e.data.get("resent"), str)
    ]
    if resent:
        yield Finding(
            "warning",
            name,
            f"in the last day {resent[-1]}",
            "raise that client's timeout (and its proxy's) to the figure above",
        )


THROTTLE_FIX = "set <key>ProcessType</key><string>Interactive</string> in {}, then reload the job"


def _throttle(server: ServerConfig, home: Path, clamp_of: Clamp) -> Iterator[Finding]:
    """What holds the server back where a shell would not: its launchd job's ProcessType, and
    the limits the system puts on its process now."""
    if server.manager == "launchd" and (server.plist or server.label):
        path = server.plist or home / "Library" / "LaunchAgents" / f"{server.label}.plist"
        kind, problem = process_type(path)
        if problem is not None:
            yield Finding("warning", server.name, f"cannot read its job's ProcessType: {problem}")
        elif kind != "Interactive":
            said = f"ProcessType {kind}" if kind else "no ProcessType"
            yield Finding(
                "warning",
                server.name,
                f"its launchd job has {said} ({path}): launchd then throttles its CPU and I/O "
                "(a prefill several times slower than from a shell)",
                THROTTLE_FIX.format(path),
            )
        else:
            yield Finding("ok", server.name, "its launchd job runs as ProcessType Interactive")
    if not is_local_host(server.host):
        return
    found = serving_process(server)
    held = clamp_of(found[0]) if found is not None else None
    if held is not None:
        yield Finding(
            "warning",
            server.name,
            f"the system holds its process (PID {found[0] if found else '?'}) back: {held}",
            "run it without the limit (a unit's Nice=, CPUSchedulingPolicy=, CPUQuota=; a "
            "launchd job's ProcessType Interactive)",
        )


def _stack_source(server: ServerConfig) -> Iterator[Finding]:
    """Where the server's Python stacks come from when a wedge is suspected: its own dump (a
    server the watchdog starts, through its launcher), py-spy, or nothing (then a deadlock or a
    lost generation thread is `unknown`)."""
    if not is_local_host(server.host) or server.behind_proxy:
        return
    env = {**os.environ, **server.env}
    started = server.manager == "process" and selfdump.wrap(server.command, env) is not None
    if server.manager == "launchd" and server.plist is not None:
        doc, _ = read_job(server.plist)
        args = doc.get("ProgramArguments") if doc is not None else None
        started = isinstance(args, list) and selfdump.launched([str(a) for a in args])
    if started and server.log_file:
        yield Finding(
            "ok",
            server.name,
            "its stacks: its own dump (faulthandler on SIGURG, through the watchdog's launcher; "
            "no root, no debugger)",
        )
        return
    tool = stack_command(0)
    name = tool[0].rsplit("/", 1)[-1] if tool else None
    if name == "py-spy" and not (platform.is_mac() and os.geteuid() != 0):
        yield Finding("ok", server.name, "its stacks: py-spy")
        return
    said = (
        "py-spy needs root on macOS and `sample` shows native frames only"
        if platform.is_mac()
        else "py-spy is not installed"
    )
    yield Finding(
        "warning",
        server.name,
        f"its Python stacks cannot be read ({said}): a deadlock or a lost generation thread "
        "is then `unknown`",
        'let the watchdog start it (manager = "process": its own stack dump, no root)',
    )


def _spawn_type(server: ServerConfig, system: System) -> Iterator[Finding]:
    """How launchd runs the loaded job now (`launchctl print`'s spawn type): what the plist
    says takes effect only once the job is loaded again."""
    if server.manager != "launchd" or not server.label:
        return
    from mlx_watchdog.act.managers.launchd import job_info

    target = f"{server.domain or f'gui/{system.uid()}'}/{server.label}"
    info = job_info(system, target)
    if info is None or info.spawn_type is None:
        return
    if info.spawn_type.startswith("background"):
        yield Finding(
            "warning",
            server.name,
            f"launchd runs its job in the background band (launchctl print {target}: spawn "
            f"type = {info.spawn_type}): CPU, I/O and the GPU's priority held back (decode 11 "
            "tokens/s against 87 as Interactive: nix-ai #916)",
            THROTTLE_FIX.format(server.plist or f"its plist ({server.label})"),
        )
    elif info.spawn_type.startswith("interactive"):
        yield Finding("ok", server.name, f"launchd runs its job as {info.spawn_type}")
    else:
        yield Finding(
            "warning",
            server.name,
            f"launchd runs its job as {info.spawn_type} (launchctl print {target}): light "
            "resource limits, CPU and I/O throttled",
            THROTTLE_FIX.format(server.plist or f"its plist ({server.label})"),
        )


def process_type(path: Path) -> tuple[str | None, str | None]:
    """A launchd plist's ProcessType (None: unset), or why it could not be read."""
    doc, problem = read_job(path)
    if doc is None:
        return None, problem
    kind = doc.get("ProcessType")
    return (str(kind) if kind is not None else None), None


def _progress(server: ServerConfig) -> Iterator[Finding]:
    """Where the server's prefill progress is read, or what reading none costs."""
    unread = unread_cost(server)
    if unread is not None:
        yield Finding("warning", server.name, *unread)
        return
    source = progress_source(server)
    if source is not None and server.kind in PARSED_KINDS:
        yield Finding("ok", server.name, f"its prefill progress is read from {source}")


def _generation(name: str, server: ServerConfig, why: str | None) -> Iterator[Finding]:
    """One generation, when the server is idle: does it serve, and what a probe costs."""
    if why is not None and any(f"is {state}:" in why for state in BAD_STATES):
        yield Finding("problem", name, f"no generation: {why}", "start or fix the server")
    elif why is not None:
        yield Finding("warning", name, f"cannot check generation now: {why}")
    else:
        second = Probe(replace(server, probe=replace(server.probe, hard_timeout=60))).run()
        if second.finding != OK:
            yield Finding("problem", name, f"a generation failed: {second.finding}")
        else:
            yield Finding("ok", name, f"serves: first token in {second.ttft or 0:.2f} s")
            models = check_models(server)
            if models.finding == "empty_body":
                yield Finding(
                    "note", name, "/v1/models answers 200 with an empty body", EMPTY_MODELS_FIX
                )
            computed = (second.prompt_tokens or 0) - (second.cached_tokens or 0)
            if second.cached_tokens is None:
                yield Finding(
                    "warning", name, "the server reports no cached tokens; probe cost unknown"
                )
            elif computed <= 2:
                yield Finding(
                    "ok", name, f"probe cost: {computed} prompt token(s) computed, the rest cached"
                )
            else:
                yield Finding(
                    "warning",
                    name,
                    f"probe cost: {computed} prompt tokens computed on every probe",
                    "keep probe.prompt fixed; a prompt cache must be enabled on the server",
                )


def _calibration(
    name: str, server: ServerConfig, store: Store, now: float, advice: dict[str, Advice]
) -> Iterator[Finding]:
    last = store.last_calibration(server.name)
    read = calibration_advice(last)
    again = f"mlx-watchdog calibrate --server {server.name}"
    if last is None or (isinstance(last, dict) and "advice" not in last):
        yield Finding(
            "warning", name, "never calibrated: the timeouts clients need here are unknown", again
        )
        return
    if read is None:
        yield Finding(
            "warning",
            name,
            "its last calibration cannot be read (edited by hand, or from another version): "
            "the timeouts clients need here are unknown",
            again,
        )
        return
    a = Advice(
        prompt_tokens=int(read["prompt_tokens"]),
        answer_tokens=int(read["answer_tokens"] or 0),
        prefill_s=read["prefill_s"],
        answer_s=read["answer_s"],
        client_s=int(read["client_s"]),
        agent_s=int(read["agent_s"]),
        load_balancer_s=int(read["load_balancer_s"]),
    )
    advice[server.name] = a
    when = "at an unknown time" if read["at"] is None else _age(now - read["at"])
    yield Finding(
        "ok",
        name,
        f"calibrated {when}: a {tokens_label(a.prompt_tokens)}-token prompt needs about "
        f"{a.prefill_s:.0f} s; clients need {a.client_s} s, proxies {a.load_balancer_s} s",
    )


def _profile(server: ServerConfig, cmdline: Sequence[str]) -> Iterator[Finding]:
    """What this kind of server is known to do, and whether its load report can be read."""
    profile = server.profile
    route = profile.load
    if route is not None:
        report = LoadReader(server).read()
        if report is not None and report.ok:
            yield Finding("ok", server.name, f"{profile.title}: {report.describe()}")
        elif report is not None:
            yield Finding(
                "warning",
                server.name,
                f"{profile.title}: its load report cannot be read ({report.describe()}); "
                "the watchdog judges by sockets alone",
                route.enable or f"check that {route.path} answers on this server",
            )
    if cmdline and server.match and server.match not in " ".join(cmdline):
        yield Finding(
            "warning",
            server.name,
            f'the process on the port is not what match = "{server.match}" expects '
            f'(kind = "{server.kind}"): {" ".join(cmdline)[:120]}; the watchdog will not '
            "signal it",
            "set kind to the server you run (see docs/servers.md, supported servers), or match",
        )
    if server.manager == "none":
        yield Finding("note", server.name, *unattended(server.name))
    for what, avoid in profile.failure_modes:
        yield Finding("note", server.name, f"{profile.title}: {what}", avoid)


def _age(seconds: float) -> str:
    if seconds < 3600:
        return f"{max(1, round(seconds / 60))} min ago"
    if seconds < 2 * 86400:
        return f"{seconds / 3600:.0f} h ago"
    return f"{seconds / 86400:.0f} days ago"


def _key_file(name: str, path: Path) -> Finding:
    try:
        mode = stat.S_IMODE(path.stat().st_mode)
    except OSError as exc:
        return Finding("problem", name, f"api_key_file {path}: {exc.strerror}")
    if mode & 0o077:
        return Finding(
            "problem",
            name,
            f"api_key_file {path} is readable by others (mode {mode:o})",
            f"chmod 600 {path}",
        )
    return Finding("ok", name, f"api_key_file {path} is private (mode {mode:o})")


def litellm_findings(path: Path, config: Config, advice: dict[str, Advice]) -> Iterator[Finding]:
    """The proxy's timeouts against what each calibrated server needs, its retries, fallbacks."""
    try:
        cfg = load(path)
    except LiteLLMConfigError as exc:
        yield Finding("problem", "litellm", str(exc), "fix the file, then run doctor again")
        return
    n = len(cfg.deployments)
    yield Finding("ok", "litellm", f"{path}: {n} deployment{'s' if n != 1 else ''}")
    watched = [(d, s) for d in cfg.deployments if (s := _served_by(d.api_base, config))]
    if watched and not cfg.cancel_on_disconnect:
        yield Finding(
            "warning",
            "litellm",
            "no general_settings.cancel_on_disconnect: a client that gives up at LiteLLM's "
            "proxy leaves its request on the server, whose connection stays open to the end "
            "of the prefill, so the server (and the watchdog) sees a live client being served "
            "while it computes for nobody",
            "general_settings: {cancel_on_disconnect: true}",
        )
    for d, server in watched:
        need = advice.get(server.name)
        timeout = d.timeout or cfg.router_timeout or LITELLM_DEFAULT_TIMEOUT
        stream = d.stream_timeout or timeout
        where = f'"{d.group}" ({d.api_base})'
        if need is None:
            yield Finding(
                "warning",
                "litellm",
                f"{where} waits {timeout:g} s (stream {stream:g} s); whether that outlasts the "
                f"prefill of {server.name} is unknown",
                f"mlx-watchdog calibrate --server {server.name}",
            )
            continue
        short = [
            (k, v)
            for k, v in (("timeout", timeout), ("stream_timeout", stream))
            if v < need.load_balancer_s
        ]
        if short:
            said = ", ".join(f"{k} {v:g} s" for k, v in short)
            yield Finding(
                "problem",
                "litellm",
                f"{where}: {said}, below the {need.load_balancer_s} s a "
                f"{tokens_label(need.prompt_tokens)}-token prompt needs on {server.name}: the "
                "proxy gives up "
                "mid-prefill and the server keeps computing for nobody",
                f"set timeout and stream_timeout to at least {need.load_balancer_s}",
            )
        else:
            yield Finding(
                "ok", "litellm", f"{where} waits {min(timeout, stream):g} s: outlasts the prefill"
            )
    if cfg.num_retries:
        yield Finding(
            "warning",
            "litellm",
            f"num_retries = {cfg.num_retries}: a long prompt that timed out is sent again, one "
            "more abandoned request on a serial server",
            "num_retries: 0, with fallbacks to another machine",
        )
    for problem in fallback_problems(cfg):
        yield Finding("problem", "litellm", problem, "reorder the fallbacks")


def _served_by(api_base: str, config: Config) -> ServerConfig | None:
    from urllib.parse import urlsplit

    parts = urlsplit(api_base)
    return served_at(parts.hostname or "", parts.port, config)
