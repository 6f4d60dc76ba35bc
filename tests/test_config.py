"""Config: one test per kind of bad input; every message names the key and quotes the value."""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from mlx_watchdog.config import (
    ConfigError,
    ProbeSettings,
    effective,
    format_duration,
    load_config,
    parse_config,
    parse_duration,
    template,
)


def load(text: str) -> object:
    return parse_config(tomllib.loads(text))


def error_of(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        load(text)
    return str(info.value)


def test_no_server_watches_the_mlx_default() -> None:
    cfg = load("")
    assert [(s.name, s.url) for s in cfg.servers] == [("mlx-8080", "http://127.0.0.1:8080")]  # type: ignore[attr-defined]


def test_missing_default_file_is_the_embedded_default(tmp_path: Path) -> None:
    cfg = load_config(None, {"XDG_CONFIG_HOME": str(tmp_path)})
    assert cfg.source is None and cfg.servers[0].port == 8080


def test_env_var_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "w.toml"
    path.write_text('[[server]]\nname = "a"\nurl = "http://127.0.0.1:9000"\n')
    cfg = load_config(None, {"MLX_WATCHDOG_CONFIG": str(path)})
    assert cfg.source == path and cfg.servers[0].name == "a"


def test_a_named_file_that_is_missing_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", {})


def test_invalid_toml_says_where(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[watchdog\ninterval = 3")
    with pytest.raises(ConfigError, match=r"bad.toml: not valid TOML"):
        load_config(path, {})


@pytest.mark.parametrize(
    ("text", "value", "expected"),
    [
        ("500ms", 0.5, "500ms"),
        ("30s", 30.0, "30s"),
        ("15m", 900.0, "15m"),
        ("1h", 3600.0, "1h"),
        ("1h30m", 5400.0, "90m"),
        ("1.5s", 1.5, "1.5s"),
    ],
)
def test_durations(text: str, value: float, expected: str) -> None:
    assert parse_duration(text, "k") == value
    assert format_duration(value) == expected


BAD = [
    (
        "no unit",
        '[[server]]\nname = "qwen"\nurl = "http://127.0.0.1:8080"\n[server.probe]\nwedge_after = "30"',
        'server "qwen": probe.wedge_after = "30" has no unit; write "30s"',
    ),
    (
        "number duration",
        "[watchdog]\ninterval = 30",
        'watchdog.interval = 30 has no unit; write "30s"',
    ),
    (
        "bad unit",
        '[watchdog]\ninterval = "30 minutes"',
        'watchdog.interval = "30 minutes" is not a duration',
    ),
    (
        "zero duration",
        '[watchdog]\ninterval = "0s"',
        'watchdog.interval = "0s" must be longer than zero',
    ),
    (
        "interval too large for any clock",
        '[watchdog]\ninterval = "99999999999999999999d"',
        'watchdog.interval = "99999999999999999999d" is out of range; write a duration from "100ms" to "1d"',
    ),
    (
        "interval below a tick",
        '[watchdog]\ninterval = "0.0001ms"',
        'watchdog.interval = "0.0001ms" is out of range',
    ),
    (
        "duration below a millisecond",
        '[[server]]\nname = "q"\nurl = "http://127.0.0.1:8080"\n[server.probe]\nslow_after = "0.0001ms"',
        'server "q": probe.slow_after = "0.0001ms" is out of range; write a duration from "1ms" to "366d"',
    ),
    (
        "duration of 400 digits",
        '[[server]]\nname = "q"\nurl = "http://127.0.0.1:8080"\n[server.probe]\nhard_timeout = "'
        + "9" * 400
        + 's"',
        'probe.hard_timeout = "999',
    ),
    (
        "unknown key",
        '[[server]]\nname = "qwen"\nurl = "http://127.0.0.1:8080"\n[server.probe]\nwedge_afer = "30s"',
        'server "qwen": [server.probe]: unknown key "wedge_afer"; did you mean "wedge_after"?',
    ),
    (
        "unknown top key",
        '[watchdg]\ninterval = "3s"',
        'unknown key "watchdg"; did you mean "watchdog"?',
    ),
    (
        "unknown server key",
        '[[server]]\nurl = "http://127.0.0.1:8080"\nmanger = "none"',
        'unknown key "manger"; did you mean "manager"?',
    ),
    (
        "a manager misspelt",
        '[[server]]\nurl = "http://127.0.0.1:8080"\nmanager = "proces"',
        'manager = "proces" must be one of: none, launchd, systemd, process, command; did you '
        'mean "process"?',
    ),
    (
        "a kind misspelt",
        '[[server]]\nurl = "http://127.0.0.1:8080"\nkind = "MLX-LM"',
        'did you mean "mlx_lm"?',
    ),
    ("missing url", '[[server]]\nname = "qwen"', 'server "qwen": url is required'),
    (
        "bad url",
        '[[server]]\nname = "qwen"\nurl = "localhost:8080"',
        'server "qwen": url = "localhost:8080" must be an http(s) URL',
    ),
    (
        "url with path",
        '[[server]]\nname = "qwen"\nurl = "http://127.0.0.1:8080/v1"',
        'url = "http://127.0.0.1:8080/v1" must be the server\'s base URL, without /v1, a query '
        'or a fragment, like "http://127.0.0.1:8080"',
    ),
    (
        "bad manager",
        '[[server]]\nname = "qwen"\nurl = "http://127.0.0.1:8080"\nmanager = "docker"',
        'server "qwen": manager = "docker" must be one of: none, launchd, systemd, process, command',
    ),
    (
        "launchd without label",
        '[[server]]\nname = "q"\nurl = "http://127.0.0.1:8080"\nmanager = "launchd"',
        'server "q": manager = "launchd" needs label to be set',
    ),
    (
        "command as a string",
        '[[server]]\nname = "q"\nurl = "http://127.0.0.1:8080"\nmanager = "process"\ncommand = "mlx_lm.server --port 8080"',
        'server "q": command = "mlx_lm.server --port 8080" must be a list of arguments, like ["mlx_lm.server", "--port", "8080"]',
    ),
    (
        "max_tokens range",
        '[[server]]\nname = "q"\nurl = "http://127.0.0.1:8080"\n[server.probe]\nmax_tokens = 0',
        'server "q": probe.max_tokens = 0 must be a whole number from 1 to 64',
    ),
    (
        "bool as number",
        '[[server]]\nname = "q"\nurl = "http://127.0.0.1:8080"\n[server.restart]\nmax_restarts = true',
        'server "q": restart.max_restarts = true must be a whole number',
    ),
    (
        "order of thresholds",
        '[[server]]\nname = "q"\nurl = "http://127.0.0.1:8080"\n[server.probe]\nslow_after = "2m"\nwedge_after = "1m"',
        'server "q": probe.slow_after = "2m" must be at most probe.wedge_after = "1m"',
    ),
    (
        "hard timeout too short",
        '[[server]]\nname = "q"\nurl = "http://127.0.0.1:8080"\n[server.probe]\nmax_busy = "15m"\nhard_timeout = "15m"',
        'probe.max_busy = "15m" must be shorter than probe.hard_timeout = "15m"',
    ),
    (
        "duplicate names",
        '[[server]]\nname = "q"\nurl = "http://127.0.0.1:8080"\n[[server]]\nname = "q"\nurl = "http://127.0.0.1:8081"',
        'server "q": name is used twice',
    ),
    (
        "same default name",
        '[[server]]\nurl = "http://127.0.0.1:8080"\n[[server]]\nurl = "http://[::1]:8080"',
        'server "mlx-8080": name is used twice; names must be unique',
    ),
    (
        "bad name",
        '[[server]]\nname = "my server"\nurl = "http://127.0.0.1:8080"',
        'name = "my server" is not a valid name',
    ),
    ("bad listen", '[watchdog]\nlisten = "9464"', 'watchdog.listen = "9464" must be host:port'),
    (
        "alerts not a list",
        '[watchdog]\nalerts = "ntfy://x"',
        'watchdog.alerts = "ntfy://x" must be a list of strings',
    ),
    (
        "env value not a string",
        '[[server]]\nname = "q"\nurl = "http://127.0.0.1:8080"\nenv = { A = 1 }',
        'server "q": env.A = 1 must be a string',
    ),
    (
        "probe not a table",
        '[[server]]\nname = "q"\nurl = "http://127.0.0.1:8080"\nprobe = 3',
        'server "q": [server.probe] must be a table, not 3',
    ),
]


@pytest.mark.parametrize(("text", "message"), [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input_names_key_and_value(text: str, message: str) -> None:
    assert message in error_of(text)


def test_all_errors_are_reported_at_once() -> None:
    msg = error_of('[watchdog]\ninterval = "x"\nlisten = "y"')
    assert "watchdog.interval" in msg and "watchdog.listen" in msg


def test_api_key_file_others_can_read_is_a_warning(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_text("sk-secret-123\n")
    os.chmod(key, 0o644)
    cfg = load(f'[[server]]\nname = "q"\nurl = "http://127.0.0.1:8080"\napi_key_file = "{key}"')
    assert len(cfg.warnings) == 1  # type: ignore[attr-defined]
    assert "can be read by other users (mode 0644)" in cfg.warnings[0]  # type: ignore[attr-defined]
    assert "sk-secret" not in cfg.warnings[0]  # type: ignore[attr-defined]
    os.chmod(key, 0o600)
    cfg = load(f'[[server]]\nname = "q"\nurl = "http://127.0.0.1:8080"\napi_key_file = "{key}"')
    assert cfg.warnings == ()  # type: ignore[attr-defined]
    assert cfg.servers[0].api_key() == "sk-secret-123"  # type: ignore[attr-defined]


def test_an_api_key_file_that_is_a_directory_is_refused_naming_the_key(tmp_path: Path) -> None:
    folder = tmp_path / "keys"
    folder.mkdir()
    text = f'[[server]]\nname = "q"\nurl = "http://127.0.0.1:8080"\napi_key_file = "{folder}"'
    assert f'server "q": api_key_file = "{folder}" is a directory' in error_of(text)


def test_missing_api_key_file_is_an_error(tmp_path: Path) -> None:
    msg = error_of(
        f'[[server]]\nname = "q"\nurl = "http://127.0.0.1:8080"\napi_key_file = "{tmp_path}/k"'
    )
    assert f'server "q": api_key_file = "{tmp_path}/k" does not exist' in msg


def test_template_is_valid_and_shows_the_defaults() -> None:
    text = template()
    cfg = parse_config(tomllib.loads(text))
    default = parse_config({"server": [{"name": "mlx", "url": "http://127.0.0.1:8080"}]})
    assert cfg == default
    # Uncomment every default (not the examples): the same configuration comes out, so the
    # template cannot disagree with the defaults.
    lines = text.splitlines()
    # An example says so on its own line or in the note above it.
    example = [
        ("example;" in line or "example;" in before)
        for before, line in zip(["", *lines[:-1]], lines, strict=True)
    ]
    uncommented = "\n".join(
        line[2:] if line.startswith("# ") and " = " in line and not is_example else line
        for line, is_example in zip(lines, example, strict=True)
    )
    assert uncommented != text and 'wedge_after = "1m"' in uncommented
    assert parse_config(tomllib.loads(uncommented)) == default
    assert sum(" = " in line and e for line, e in zip(lines, example, strict=True)) >= 10


def test_effective_masks_secrets(tmp_path: Path) -> None:
    cfg = load(
        '[watchdog]\nalerts = ["slack://TokenA/TokenB/TokenC", "ntfy://my-topic"]\n'
        '[[server]]\nname = "q"\nurl = "http://user:hunter2@127.0.0.1:8080"\n'
        'env = { HF_TOKEN = "hf_abc", HF_HOME = "/data/hf" }'
    )
    text = repr(effective(cfg))  # type: ignore[arg-type]
    for secret in ("TokenA", "my-topic", "hunter2", "hf_abc"):
        assert secret not in text
    assert "slack://***" in text and "/data/hf" in text and "http://***@127.0.0.1:8080" in text


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        # The thresholds left out are derived from those written: only written ones conflict.
        ({"wedge_after": "6s"}, (3.0, 6.0, 900.0, 1800.0)),
        ({"slow_after": "2m"}, (120.0, 120.0, 900.0, 1800.0)),
        ({"max_busy": "1h"}, (10.0, 60.0, 3600.0, 7200.0)),
        ({"hard_timeout": "10m"}, (10.0, 60.0, 300.0, 600.0)),
        ({"slow_after": "20m", "hard_timeout": "30m"}, (1200.0, 1200.0, 1200.0, 1800.0)),
        ({"slow_after": "2m", "max_busy": "3m"}, (120.0, 120.0, 180.0, 1800.0)),
        ({}, (10.0, 60.0, 900.0, 1800.0)),
    ],
)
def test_unwritten_thresholds_follow_the_written_ones(
    written: dict[str, str], expected: tuple[float, float, float, float]
) -> None:
    config = parse_config({"server": [{"url": "http://127.0.0.1:8080", "probe": written}]})
    p = config.servers[0].probe
    assert (p.slow_after, p.wedge_after, p.max_busy, p.hard_timeout) == expected


def test_written_thresholds_that_conflict_are_named_even_when_not_adjacent() -> None:
    probe = {"slow_after": "2m", "max_busy": "1m"}
    with pytest.raises(ConfigError) as info:
        parse_config({"server": [{"name": "q", "url": "http://127.0.0.1:8080", "probe": probe}]})
    assert (
        str(info.value)
        == 'server "q": probe.slow_after = "2m" must be at most probe.max_busy = "1m"'
    )


@pytest.mark.parametrize(
    "args",
    [
        ["config", "check"],
        ["probe"],
        ["status"],
        ["history"],
        ["doctor"],
        ["run"],
    ],
    ids=" ".join,
)
def test_a_file_that_is_not_utf8_is_one_clear_error_in_every_command(
    tmp_path: Path, args: list[str]
) -> None:
    from tests.conftest import mlx_watchdog

    path = tmp_path / "c.toml"
    path.write_bytes(b'[watchdog]\n# caf\xe9, a comment saved as Latin-1\ninterval = "1s"\n')
    run = mlx_watchdog(*args, "--config", str(path), timeout=60)
    assert run.returncode == 3, run.stderr
    assert f"{path}: line 2 is not UTF-8 (byte 0xe9); save the file as UTF-8" in run.stderr
    assert "Traceback" not in run.stderr


def test_a_nul_in_a_path_or_an_argument_names_the_key() -> None:
    msg = error_of('[watchdog]\nstate_dir = "/tmp/a\\u0000b"')
    assert 'watchdog.state_dir = "/tmp/a\\u0000b" holds a NUL character' in msg
    msg = error_of(
        '[[server]]\nname = "q"\nurl = "http://127.0.0.1:8080"\nmanager = "process"\n'
        'command = ["mlx_lm.server", "--x\\u0000"]'
    )
    assert 'server "q": command' in msg and "holds a NUL character" in msg


@pytest.mark.parametrize("key", ["slow_after", "wedge_after", "max_busy", "hard_timeout"])
@pytest.mark.parametrize("seconds", [0.001, 0.5, 45.0, 3600.0, 86400.0 * 3])
def test_one_span_moved_keeps_the_others_in_order(key: str, seconds: float) -> None:
    """`probe --wedge-after`, calibrate and the config file share one ordering rule."""
    from mlx_watchdog.config.schema import SPANS

    before = ProbeSettings()
    after = before.around(key, seconds)
    values = [getattr(after, k) for k in SPANS]
    assert getattr(after, key) == seconds
    assert values == sorted(values)
    if key != "hard_timeout":  # set by hand, the hard timeout may be shorter than that
        assert after.hard_timeout >= 2 * after.max_busy
    for k in SPANS:  # moved only as far as the order needs
        if getattr(after, k) != getattr(before, k):
            assert k == key or getattr(after, k) in (seconds, 2 * after.max_busy)


@pytest.mark.parametrize(
    ("section", "key", "value"),
    [
        ("watchdog", "daily_summary", "²³:00"),
        ("watchdog", "interval", "٣s"),
        ("watchdog", "listen", "127.0.0.1:\uff18\uff10"),
    ],
)
def test_digits_are_ascii_and_a_bad_one_names_its_key(section: str, key: str, value: str) -> None:
    """str.isdigit() and \\d take "²³" and "٣" for digits; int() and float() then fail with no key
    named, or read a value nobody wrote."""
    doc: dict[str, object] = {"watchdog": {}, "server": [{"name": "m", "url": "http://h:1"}]}
    doc[section][key] = value  # type: ignore[index]
    with pytest.raises(ConfigError) as info:
        parse_config(doc)
    assert key in str(info.value) and value in str(info.value)


@pytest.mark.parametrize(
    ("host", "loopback"),
    [("127.0.0.1", True), ("::1", True), ("::ffff:127.0.0.1", True), ("::ffff:10.0.0.1", False)],
)
def test_an_ipv4_mapped_loopback_is_loopback(host: str, loopback: bool) -> None:
    """[::ffff:127.0.0.1] was warned as reachable from other machines (ipaddress before 3.13)."""
    cfg = parse_config({"watchdog": {"listen": f"[{host}]:9999"}})
    reachable = [w for w in cfg.warnings if "reachable from other machines" in w]
    assert bool(reachable) is not loopback, cfg.warnings


def test_a_program_the_config_names_that_cannot_run_is_a_problem_for_check_and_doctor(
    tmp_path: Path,
) -> None:
    """A `command` not on the PATH passed `config check` ("config ok") and showed only as "the
    server process is gone". Now check and doctor name the key and the value; a program found
    only on this shell's PATH is named too (a service's PATH is shorter)."""
    import os
    import stat

    from mlx_watchdog.config.programs import unrunnable
    from tests.conftest import mlx_watchdog

    mine = tmp_path / "bin"
    mine.mkdir()
    tool = mine / "my-server"
    tool.write_text("#!/bin/sh\n")
    tool.chmod(tool.stat().st_mode | stat.S_IXUSR)
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        f'[watchdog]\nstate_dir = "{tmp_path / "s"}"\n\n'
        '[[server]]\nname = "a"\nurl = "http://127.0.0.1:8080"\nmanager = "process"\n'
        'command = ["mlx_lm.serverx", "--port", "8080"]\n\n'
        '[[server]]\nname = "b"\nurl = "http://127.0.0.1:8081"\nmanager = "process"\n'
        'command = ["my-server"]\n\n'
        '[[server]]\nname = "c"\nurl = "http://127.0.0.1:8082"\nmanager = "process"\n'
        'command = ["/bin/sh", "-c", "true"]\n'
    )
    from mlx_watchdog.config import load_config

    said = unrunnable(load_config(cfg), {"PATH": f"{mine}{os.pathsep}/usr/bin:/bin"})
    assert (
        said[0]
        == '[[server]] "a": command[0] = "mlx_lm.serverx" is not on the PATH; name it by its absolute path'
    )
    assert said[1].startswith('[[server]] "b": command[0] = "my-server" is found only on this')
    assert str(tool) in said[1] and len(said) == 2
    checked = mlx_watchdog("config", "check", "--config", str(cfg))
    assert checked.returncode == 1 and "config ok" not in checked.stderr
    assert 'command[0] = "mlx_lm.serverx" is not on the PATH' in checked.stderr
    doctor = mlx_watchdog("doctor", "--json", "--config", str(cfg))
    import json

    problems = [f["detail"] for f in json.loads(doctor.stdout) if f["level"] == "problem"]
    assert any('"mlx_lm.serverx" is not on the PATH' in p for p in problems), problems


def test_a_url_with_a_proxys_path_keeps_it_and_never_takes_the_proxy_for_the_server(
    tmp_path: Path,
) -> None:
    """A reverse proxy's prefix is the base the routes go after; the port behind it is the
    proxy's, so its listener is never inspected, blamed or signalled as the server."""
    from mlx_watchdog.act.managers.base import identity_problem
    from mlx_watchdog.sense.process import Inspector, ProcessTable

    path = tmp_path / "c.toml"
    path.write_text('[[server]]\nname = "q"\nurl = "https://user:pw@gw.lan:8443/mlx/"\n')
    server = load_config(path).servers[0]
    assert server.url == "https://gw.lan:8443/mlx" and server.credentials == "user:pw"
    assert server.behind_proxy and server.port == 8443
    path.write_text('[[server]]\nname = "d"\nurl = "http://127.0.0.1:8080/"\n')
    direct = load_config(path).servers[0]
    assert direct.url == "http://127.0.0.1:8080" and not direct.behind_proxy

    proxied = dataclasses.replace(server, url="http://127.0.0.1:8443/mlx", match="python")
    assert not Inspector(proxied).local
    assert Inspector(proxied).sample(os.getpid()).error == "the server is behind a proxy"
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    try:
        port = holder.getsockname()[1]
        # This very process holds the port: a PID that is not its holder is refused directly,
        # but behind a path only `match` identifies it.
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
        try:
            at = dataclasses.replace(proxied, url=f"http://127.0.0.1:{port}", match="python")
            assert "does not hold port" in str(identity_problem(at, child.pid, ProcessTable()))
            behind = dataclasses.replace(at, url=f"http://127.0.0.1:{port}/mlx")
            assert identity_problem(behind, child.pid, ProcessTable()) is None
        finally:
            child.kill()
            child.wait()
    finally:
        holder.close()
