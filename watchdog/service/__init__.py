"""Install the watchdog, or an mlx_lm.server, as a launchd agent or a systemd user unit.

A plan is the file to write and the commands to run; `--dry-run` prints it, `apply` carries it
out. The templates are `launchd/*.plist` and `units/*.service` at the top of the repository,
shipped inside the package. launchd has no shell PATH, so every program is named by the
absolute path of the interpreter the tool is installed in.
"""

from __future__ import annotations

import os
import plistlib
import re
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from mlx_watchdog.act.managers import System

Target = Literal["launchd", "systemd"]
TARGETS: tuple[Target, ...] = ("launchd", "systemd")
WATCHDOG_LABEL = "io.github.mlx-watchdog"
WATCHDOG_UNIT = "mlx-watchdog.service"
SERVER_ENV = ("HF_HOME", "HF_HUB_CACHE")  # where the server finds its models
NOT_LOADED = (3, 113)  # launchctl bootout: "No such process", "Could not find service"


class ServiceError(Exception):
    """The service cannot be installed or removed; the message says why and what to do."""


@dataclass(frozen=True)
class Plan:
    target: Target
    path: Path
    content: bytes | None  # None: remove the file
    commands: tuple[tuple[str, ...], ...]
    tolerated: Mapping[int, frozenset[int]] = field(default_factory=dict)  # step -> ok codes
    hints: tuple[str, ...] = ()
    label: str = ""  # the launchd label or the systemd unit
    dirs: tuple[Path, ...] = ()  # made first: launchd does not create a log file's folder


def default_target() -> Target:
    return "launchd" if sys.platform == "darwin" else "systemd"


def interpreter() -> str:
    # The venv's own python (not the base it links to): only it sees the installed packages.
    return os.path.abspath(sys.executable)


def logs_dir(home: Path) -> Path:
    return home / "Library" / "Logs" / "mlx-watchdog"


def unit_dir(env: Mapping[str, str], home: Path) -> Path:
    base = env.get("XDG_CONFIG_HOME") or str(home / ".config")
    return Path(base) / "systemd" / "user"


def server_label(name: str) -> str:
    return f"{WATCHDOG_LABEL}.server.{name}"


def server_unit(name: str) -> str:
    return f"mlx-server-{name}.service"


# -- rendering -----------------------------------------------------------------------------


def _template(target: Target, name: str) -> str:
    folder, ext = ("launchd", "plist") if target == "launchd" else ("units", "service")
    package = Path(__file__).parent.parent
    # Installed: inside the package; in a checkout (editable install): at the top.
    for base in (package / folder, package.parent / folder):
        if (base / f"{name}.{ext}").is_file():
            return (base / f"{name}.{ext}").read_text()
    raise ServiceError(f"the template {folder}/{name}.{ext} is missing from this install")


def render_plist(
    name: str,
    *,
    label: str,
    python: str,
    log: Path,
    env: Mapping[str, str],
    values: Mapping[str, str] = {},
    args: Sequence[str] = (),
) -> bytes:
    """Fill the plist template: @NAMES@ from `values`, @SERVER_ARGS@ becomes `args`."""
    plist = plistlib.loads(_template("launchd", name).encode())
    fill = {"@LABEL@": label, "@PYTHON@": python, "@LOG@": str(log), **values}
    argv: list[str] = []
    for item in plist["ProgramArguments"]:
        argv.extend(args if item == "@SERVER_ARGS@" else [fill.get(item, item)])
    plist["ProgramArguments"] = argv
    for key, value in list(plist.items()):
        if isinstance(value, str):
            plist[key] = fill.get(value, value)
    plist["EnvironmentVariables"] = dict(env)
    _no_placeholders(plist)
    return plistlib.dumps(plist, sort_keys=False)


def render_unit(
    name: str,
    *,
    python: str,
    env: Mapping[str, str],
    values: Mapping[str, str] = {},
    args: Sequence[str] = (),
) -> bytes:
    lines = _template("systemd", name).splitlines(keepends=True)
    while lines and lines[0].startswith("#"):
        lines.pop(0)  # the template's own comment
    text = "# Written by mlx-watchdog; running the install again replaces it.\n" + "".join(lines)
    environment = "\n".join(f"Environment={_quote(f'{k}={v}')}" for k, v in env.items())
    text = text.replace("Environment=@ENV@", environment)
    text = text.replace("@PYTHON@", _quote(python))
    text = text.replace("@SERVER_ARGS@", " ".join(_quote(a) for a in args))
    for key, value in values.items():
        text = text.replace(key, _quote(value) if key == "@CONFIG@" else value)
    _no_placeholders(text)
    return text.encode()


def _quote(arg: str) -> str:
    """One argument of a systemd command line: % and $ are specifiers there."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if arg and not re.search(r"[\s\"'\\;]", arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _no_placeholders(doc: Any) -> None:
    if re.search(r"@[A-Z_]+@", repr(doc)):
        raise AssertionError(f"a template placeholder was left unfilled: {doc!r}")


def service_env(env: Mapping[str, str], extra: Sequence[str] = ()) -> dict[str, str]:
    """PATH (launchd gives none worth having) and the named variables that are set."""
    out = {"PATH": env.get("PATH") or "/usr/local/bin:/usr/bin:/bin"}
    out.update({k: env[k] for k in extra if env.get(k)})
    return out


# -- plans ---------------------------------------------------------------------------------


def install_plan(
    target: Target,
    *,
    label: str,
    content: bytes,
    home: Path,
    env: Mapping[str, str],
    uid: int,
) -> Plan:
    """Write the file, then load it; running it again replaces the job with the new file."""
    if target == "launchd":
        path = home / "Library" / "LaunchAgents" / f"{label}.plist"
        domain = f"gui/{uid}"
        return Plan(
            target,
            path,
            content,
            (
                ("launchctl", "bootout", f"{domain}/{label}"),
                ("launchctl", "enable", f"{domain}/{label}"),
                ("launchctl", "bootstrap", domain, str(path)),
            ),
            tolerated={0: frozenset(NOT_LOADED)},
            label=label,
            dirs=(logs_dir(home),),
        )
    path = unit_dir(env, home) / label
    return Plan(
        target,
        path,
        content,
        (
            ("systemctl", "--user", "daemon-reload"),
            ("systemctl", "--user", "enable", label),
            ("systemctl", "--user", "restart", label),
        ),
        hints=(
            "to keep it running while you are logged out: loginctl enable-linger "
            + (env.get("USER") or "$USER"),
        ),
        label=label,
    )


def uninstall_plan(
    target: Target, *, label: str, home: Path, env: Mapping[str, str], uid: int
) -> Plan:
    if target == "launchd":
        path = home / "Library" / "LaunchAgents" / f"{label}.plist"
        return Plan(
            target,
            path,
            None,
            (("launchctl", "bootout", f"gui/{uid}/{label}"),),
            tolerated={0: frozenset(NOT_LOADED)},
            label=label,
        )
    path = unit_dir(env, home) / label
    return Plan(
        target,
        path,
        None,
        (
            ("systemctl", "--user", "disable", "--now", label),
            ("systemctl", "--user", "daemon-reload"),
        ),
        tolerated={0: frozenset({1, 5})},  # not loaded / no such unit: already gone
        label=label,
    )


def apply(plan: Plan, system: System, timeout: float = 60.0) -> list[str]:
    """Write (or remove) the file, then run the commands; what was done, line by line.

    Removal runs the commands first (stop, then delete), installation writes first.
    """
    done: list[str] = []
    for folder in plan.dirs:
        folder.mkdir(parents=True, exist_ok=True)
    if plan.content is not None:
        _write(plan.path, plan.content)
        done.append(f"wrote {plan.path}")
    for step, argv in enumerate(plan.commands):
        code, out = system.run(argv, timeout)
        ok = code == 0 or code in plan.tolerated.get(step, frozenset())
        done.append(f"{' '.join(argv)}: exit {code}")
        if not ok:
            raise ServiceError(
                f"{' '.join(argv)} exited {code}: {out.strip()[-300:]}\n" + "\n".join(done)
            )
    if plan.content is None and plan.path.exists():
        plan.path.unlink()
        done.append(f"removed {plan.path}")
    return done


def _write(path: Path, content: bytes) -> None:
    """Atomically, mode 0644, owned by the user who runs the command."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(content)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# -- what gets installed -------------------------------------------------------------------


def watchdog_content(
    target: Target, *, config: Path, home: Path, env: Mapping[str, str], python: str
) -> bytes:
    values = {"@CONFIG@": str(config)}
    if target == "launchd":
        return render_plist(
            "mlx-watchdog",
            label=WATCHDOG_LABEL,
            python=python,
            log=logs_dir(home) / "watchdog.log",
            env=service_env(env),
            values=values,
        )
    return render_unit("mlx-watchdog", python=python, env=service_env(env), values=values)


def server_args(model: str, port: int, draft_model: str | None) -> list[str]:
    args = ["--model", model, "--port", str(port)]
    return [*args, "--draft-model", draft_model] if draft_model else args


def server_content(
    target: Target,
    *,
    name: str,
    args: Sequence[str],
    home: Path,
    env: Mapping[str, str],
    python: str,
) -> tuple[bytes, Path | None]:
    """The server's service file, and its log file (launchd only; systemd has the journal)."""
    environment = service_env(env, SERVER_ENV)
    if target == "launchd":
        log = logs_dir(home) / f"server-{name}.log"
        content = render_plist(
            "mlx-server",
            label=server_label(name),
            python=python,
            log=log,
            env=environment,
            args=args,
        )
        return content, log
    content = render_unit(
        "mlx-server", python=python, env=environment, values={"@NAME@": name}, args=args
    )
    return content, None
