"""Commands that advise: calibrate, drill, doctor."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import click

from mlx_watchdog.cli.app import (
    config_option,
    err,
    escape,
    load_or_exit,
    or_exit,
    out,
    pick_servers,
    server_names,
    suggest,
    unmoved,
)

if TYPE_CHECKING:
    from mlx_watchdog.advice.calibrate import Advice, Calibration
    from mlx_watchdog.config import Config, ServerConfig
    from mlx_watchdog.record.left_probes import LeftProbes

T = TypeVar("T")


@click.command()
@config_option
@click.option(
    "--server",
    "server_name",
    shell_complete=server_names,
    help="The configured server to calibrate.",
)
@click.option("--url", help="Calibrate this server URL instead of a configured one.")
@click.option(
    "--sizes", default="1k,4k,16k", show_default=True, help="Prompt sizes to measure, in tokens."
)
@click.option(
    "--max-prompt", help="The largest prompt clients send, e.g. 64k (default: the context length)."
)
@click.option(
    "--answer-tokens", default=1024, show_default=True, help="The longest answer clients ask for."
)
@click.option("--force", is_flag=True, help="Calibrate even though the server is busy.")
@click.option(
    "--litellm-config",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Warn when this LiteLLM config's timeouts are below the need.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the measurements and advice as JSON.")
def calibrate(
    config_path: Path | None,
    server_name: str | None,
    url: str | None,
    sizes: str,
    max_prompt: str | None,
    answer_tokens: int,
    force: bool,
    litellm_config: Path | None,
    as_json: bool,
) -> None:
    """Measure prefill and decode speed and print the timeout each client layer needs.

    Sends prompts of the given sizes with a unique prefix (no prompt cache helps), fits how the
    time to the first token grows with the prompt, stores the result in the history and turns
    it into timeouts for the client, an agent framework and the load balancer. It is heavy on a
    serial server, so it refuses while the server is busy unless --force.
    """
    import json

    from mlx_watchdog.advice.calibrate import (
        advise,
        context_length,
        refusal,
    )
    from mlx_watchdog.record.left_probes import left_probes
    from mlx_watchdog.record.store import open_history

    cfg, server, sizes_n, limit = _calibration_inputs(
        config_path, server_name, url, sizes, max_prompt
    )
    why, cmdline = refusal(server, left_probes(cfg.watchdog.state_dir))
    if why is not None and not force:
        err.print(
            f"[yellow]not calibrating {server.name}:[/yellow] {escape(why)}; calibration sends "
            "long prompts that everyone behind them would wait for. Try again when it is idle, "
            "or pass --force.",
            soft_wrap=True,
        )
        sys.exit(1)
    cal = _measure(server, sizes_n, quiet=as_json, left=left_probes(cfg.watchdog.state_dir))
    prompt = limit or context_length(cmdline)
    assumed = prompt is None
    prompt = prompt or 32 * 1024
    advice = advise(cal, prompt, answer_tokens)
    store = open_history(cfg.watchdog.state_dir)
    store.save_calibration(server.name, cal.at, {**cal.to_json(), "advice": advice.to_json()})
    store.close()
    if as_json:
        doc = {**cal.to_json(), "advice": advice.to_json(), "max_prompt_assumed": assumed}
        click.echo(json.dumps(doc, indent=2))
        return
    _print_calibration(server, cal, advice, prompt, assumed, answer_tokens)
    if litellm_config is not None:
        _litellm_warnings(litellm_config, cfg, server, advice)


def _measure(
    server: ServerConfig, sizes: list[int], *, quiet: bool, left: LeftProbes
) -> Calibration:
    """Run the calibration; nothing is kept when another process serves afterwards."""
    from mlx_watchdog.advice.calibrate import run_calibration

    return unmoved(
        [server],
        lambda say: run_calibration(server, sizes, say=say, left=left),
        quiet=quiet,
        failed=1,
        mixed="not kept, its timings mix two processes; calibrate again once it serves",
    )


def _litellm_warnings(path: Path, cfg: Config, server: ServerConfig, advice: Advice) -> None:
    import dataclasses

    from mlx_watchdog.advice.doctor import litellm_findings

    cfg_one = dataclasses.replace(cfg, servers=(server,))
    for f in litellm_findings(path, cfg_one, {server.name: advice}):
        if f.level != "ok":
            err.print(f"[yellow]{f.level}:[/yellow] {escape(f.detail)}", soft_wrap=True)


def _calibration_inputs(
    config_path: Path | None,
    server_name: str | None,
    url: str | None,
    sizes: str,
    max_prompt: str | None,
) -> tuple[Config, ServerConfig, list[int], int | None]:
    """The config, the one server, the sizes and the largest prompt; a usage error else."""
    from mlx_watchdog.advice.calibrate import parse_tokens

    cfg, server = _one_server(config_path, url, server_name)
    sizes_n = or_exit(lambda: [parse_tokens(s, "--sizes") for s in sizes.split(",") if s.strip()])
    limit = or_exit(lambda: parse_tokens(max_prompt, "--max-prompt") if max_prompt else None)
    if len(sizes_n) < 2:
        raise click.UsageError("--sizes needs at least two sizes, like 1k,4k,16k")
    return cfg, server, sizes_n, limit


def _one_server(
    config_path: Path | None, url: str | None, server_name: str | None
) -> tuple[Config, ServerConfig]:
    """The config and the one server a command acts on: --url, --server, or the only one."""
    if url and server_name:
        raise click.UsageError("give --url or --server, not both")
    cfg = load_or_exit(config_path)
    servers = or_exit(lambda: pick_servers(cfg, url, server_name))
    if len(servers) != 1:
        raise click.UsageError("several servers are configured; name one with --server")
    return cfg, servers[0]


def _print_calibration(
    server: ServerConfig,
    cal: Calibration,
    advice: Advice,
    prompt: int,
    assumed: bool,
    answer_tokens: int,
) -> None:
    from rich.table import Table

    from mlx_watchdog.judge.advice import article, tokens_label

    table = Table(box=None, padding=(0, 1), header_style="dim")
    for column in ("prompt tokens", "first token after", "prefill rate"):
        table.add_column(column, justify="right")
    for p in cal.points:
        table.add_row(
            str(p.prompt_tokens),
            f"{p.prefill_s:.2f} s",
            f"{p.prompt_tokens / p.prefill_s:.0f} tok/s",
        )
    out.print(f"[bold]{server.name}[/bold] {server.url}")
    out.print(table)
    decode = (
        f"{cal.decode_tps:.1f} tok/s"
        if cal.decode_tps
        else f"not measured: {cal.decode_note or 'unknown'}"
    )
    out.print(f"decode: {escape(decode)}", soft_wrap=True)
    size = tokens_label(prompt)
    note = " (assumed; pass --max-prompt)" if assumed else ""
    answer = (
        f"a {answer_tokens}-token answer about {advice.answer_s:.0f} s more"
        if advice.answer_s is not None
        else f"the time of a {answer_tokens}-token answer on top, which was not measured"
    )
    out.print(
        f"{article(size).capitalize()} {size}-token prompt{note} needs about {advice.prefill_s:.0f} s of prefill here, "
        f"and {answer}.",
        soft_wrap=True,
    )
    largest = max(p.prompt_tokens for p in cal.points)
    if prompt > 4 * largest:
        out.print(
            f"[yellow]This is extrapolated from prompts up to {largest} tokens; measure closer "
            f"to it for a firmer figure (--sizes ...,{size}).[/yellow]",
            soft_wrap=True,
        )
    out.print("Set these timeouts at least (no layer may give up before the server answers):")
    out.print(f"  client request timeout   {advice.client_s} s")
    out.print(f"  agent framework          {advice.agent_s} s")
    out.print(f"  load balancer / proxy    {advice.load_balancer_s} s")


@click.command()
@config_option
@click.option(
    "--server", "server_name", shell_complete=server_names, help="The configured server to drill."
)
@click.option("--url", help="Drill this server URL instead of a configured one.")
@click.option(
    "--prompt",
    "prompt_size",
    default="16k",
    show_default=True,
    help="Tokens in the abandoned prompt.",
)
@click.option(
    "--give-up-after", default="3s", show_default=True, help="When the drill's client gives up."
)
@click.option(
    "--max-wait", default="10m", show_default=True, help="Then restart through the watchdog."
)
@click.option("--yes", is_flag=True, help="Run it: the server stalls for its other clients.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def drill(
    config_path: Path | None,
    server_name: str | None,
    url: str | None,
    prompt_size: str,
    give_up_after: str,
    max_wait: str,
    yes: bool,
    as_json: bool,
) -> None:
    """Reproduce the abandoned-request wedge on purpose and measure how long it lasts.

    Sends one long unique prompt, gives up on it mid-prefill, then measures how long a tiny
    request waits. Without --yes it only says what it would do. It ends when the server answers
    again, or restarts it through the running watchdog after --max-wait. Exit 0 when the server
    answered again, 1 when it had to be restarted or did not come back.
    """
    import json

    from mlx_watchdog.advice.calibrate import parse_tokens, refusal
    from mlx_watchdog.advice.drill import plan, restart_through_daemon, run_drill
    from mlx_watchdog.config import parse_duration
    from mlx_watchdog.record.left_probes import left_probes

    cfg, server = _one_server(config_path, url, server_name)
    tokens = or_exit(lambda: parse_tokens(prompt_size, "--prompt"))
    give_up = or_exit(lambda: parse_duration(give_up_after, "--give-up-after"))
    limit = or_exit(lambda: parse_duration(max_wait, "--max-wait"))
    if not yes:
        said = plan(server, tokens, give_up)
        if as_json:  # a script reads stdout: what would be done, and that nothing was
            click.echo(json.dumps({"server": server.name, "done": False, "plan": said}))
        err.print(escape(said), soft_wrap=True)
        err.print("Run it again with --yes to go ahead.")
        sys.exit(1)
    left = left_probes(cfg.watchdog.state_dir)
    why, _ = refusal(server, left)
    if why is not None:
        raise click.ClickException(f"not drilling {server.name}: {why}; try when it is idle")
    say = (lambda _: None) if as_json else (lambda m: err.print(escape(m), style="dim"))
    result = run_drill(
        server,
        prompt_tokens=tokens,
        give_up_after=give_up,
        max_wait=limit,
        restart=restart_through_daemon(cfg.watchdog.state_dir),
        say=say,
        left=left,
    )
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        out.print(escape(result.summary()), soft_wrap=True)
    # As its help says: 0 only when the server answered by itself.
    sys.exit(0 if result.stall_s is not None else 1)


@click.command()
@config_option
@click.option(
    "--litellm-config",
    type=click.Path(dir_okay=False, path_type=Path),
    help="A LiteLLM proxy config to check: timeouts, retries and fallbacks.",
)
@click.option(
    "--balancer-config",
    type=click.Path(dir_okay=False, path_type=Path),
    help="An HAProxy or nginx config to check: timeouts, retries, a queue for serial servers.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the findings as JSON.")
def doctor(
    config_path: Path | None,
    litellm_config: Path | None,
    balancer_config: Path | None,
    as_json: bool,
) -> None:
    """Check what decides whether the wedge can happen here, and say how to fix it.

    Config, service, the watchdog's endpoint, each server (a generation, the probe's cost,
    serial serving, API key file, last calibration) and, with --litellm-config or
    --balancer-config (HAProxy, nginx), the balancer's timeouts, retries, fallbacks and queue.
    Exit 0 all ok, 1 warnings, 2 problems.
    """
    import dataclasses
    import json

    from mlx_watchdog.advice.doctor import exit_code, run_doctor

    cfg = load_or_exit(config_path)
    findings = []
    style = {"ok": "green", "note": "cyan", "warning": "yellow", "problem": "bold red"}
    names = {s.name for s in cfg.servers}
    for found in run_doctor(cfg, litellm=litellm_config, balancer=balancer_config):
        # Each command it suggests works as typed: this one's --config, the server it is about.
        about = found.what if found.what in names else None
        f = dataclasses.replace(
            found,
            detail=suggest(found.detail, config_path, about),
            fix=suggest(found.fix, config_path, about) if found.fix else found.fix,
        )
        findings.append(f)
        if not as_json:
            line = (
                f"[{style[f.level]}]{f.level:8}[/] [bold]{escape(f.what)}[/bold] {escape(f.detail)}"
            )
            out.print(line, soft_wrap=True)
            if f.fix:
                label = "avoid" if f.level == "note" else "fix"
                out.print(f"         {label}: {escape(f.fix)}", style="dim", soft_wrap=True)
    if as_json:
        click.echo(json.dumps([dataclasses.asdict(f) for f in findings], indent=2))
    sys.exit(exit_code(findings))


COMMANDS = (calibrate, drill, doctor)
