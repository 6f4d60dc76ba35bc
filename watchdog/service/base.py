"""What both service targets share: a plan (the file to write and the steps to run), the
job's user and environment, the templates, and carrying a plan out.

A plan is the file to write and the steps to run; `--dry-run` prints it, `apply` carries it
out. The templates are `launchd/*.plist` and `units/*.service` at the top of the repository,
shipped inside the package. A service gets no shell environment, so every program is named by
the absolute path of the interpreter the tool is installed in, and every path is absolute.
`launchd.Launchd` and `systemd.Systemd` are the two targets.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Protocol

from mlx_watchdog.act.managers import System
from mlx_watchdog.config import RestartSettings
from mlx_watchdog.judge.bounds import INTERRUPT_TIMEOUT, STOP_TIMEOUT

ServiceKind = Literal["launchd", "systemd"]
WATCHDOG_LABEL = "io.github.mlx-watchdog"
WATCHDOG_UNIT = "mlx-watchdog.service"
SERVER_ENV = ("HF_HOME", "HF_HUB_CACHE")  # where the server finds its models
# Where the installing user's watchdog keeps its state, when they moved it: a job of their own
# must keep it there too (`status` run from their shell reads that folder). A --system job runs
# as another user, with that user's defaults.
WATCHDOG_ENV = ("XDG_STATE_HOME",)
# The watchdog's own bounded stop: a restart in progress, then its interrupted command, then
# each managed server's stop_grace (its default), and a margin. The service manager waits longer.
STOP_BOUND = int(STOP_TIMEOUT + INTERRUPT_TIMEOUT + RestartSettings().stop_grace + 10)


class ServiceError(Exception):
    """The service cannot be installed or removed; the message says why and what to do."""


@dataclass(frozen=True)
class Step:
    """One command of an install or uninstall plan, with what counts as done."""

    argv: tuple[str, ...]
    ok: frozenset[int] = frozenset({0})
    # launchd: after this step, wait until the job is gone (bootout is asynchronous) ...
    wait_gone: str | None = None
    # ... and retry this step while the old job is still being torn down (bootstrap).
    retry_busy: bool = False

    def show(self) -> str:
        import shlex

        text = shlex.join(self.argv)
        if self.wait_gone:
            text += f"   # then wait until {self.wait_gone} is gone"
        if self.retry_busy:
            text += "   # retried while the old job is torn down"
        return text


@dataclass(frozen=True)
class InstallPlan:
    """What an install or uninstall does: the file it writes or removes and the commands it runs."""

    kind: ServiceKind
    path: Path
    content: bytes | None  # None: remove the file
    steps: tuple[Step, ...]
    hints: tuple[str, ...] = ()
    label: str = ""  # the launchd label or the systemd unit
    domain: str = ""  # launchd: where it is loaded; systemd: "user" or "system"
    dirs: tuple[Path, ...] = ()  # made first: launchd does not create a log file's folder
    dirs_owner: int | None = None  # root making the log folder of another user's job


@dataclass(frozen=True)
class WatchdogJob:
    """What the watchdog's own job runs: `mlx-watchdog run --config config` with `python`."""

    config: Path
    home: Path
    env: Mapping[str, str]
    python: str
    writable: Sequence[Path] = ()  # folders it writes outside its user's home (systemd's sandbox)


class Target(Protocol):
    """A service manager the watchdog installs into (launchd or systemd)."""

    kind: ServiceKind
    watchdog_label: str

    def server_label(self, name: str) -> str: ...

    def watchdog_plan(self, job: WatchdogJob) -> InstallPlan: ...

    def server_plan(
        self, *, name: str, args: Sequence[str], home: Path, env: Mapping[str, str], python: str
    ) -> tuple[InstallPlan, dict[str, Any]]: ...

    def uninstall_plan(self, label: str, *, home: Path, env: Mapping[str, str]) -> InstallPlan: ...


def default_kind() -> ServiceKind:
    return "launchd" if sys.platform == "darwin" else "systemd"


@dataclass(frozen=True)
class JobUser:
    """Who a --system job runs as: the user who ran sudo, never root."""

    name: str
    uid: int
    gid: int
    home: Path

    def groups(self) -> set[int]:
        import grp

        return {self.gid} | {g.gr_gid for g in grp.getgrall() if self.name in g.gr_mem}


def job_user(env: Mapping[str, str], what: str = "job", preview: bool = False) -> JobUser:
    """The user who ran sudo, from `SUDO_USER` (sudo sets it; its `HOME` may be root's own);
    for a preview without sudo, the user asking."""
    import os
    import pwd

    name = env.get("SUDO_USER")
    if preview and not name and os.getuid() != 0:
        name = pwd.getpwuid(os.getuid()).pw_name
    if not name or name == "root":
        raise ServiceError(
            f"--system runs the {what} as the user who ran sudo; run it as "
            "`sudo mlx-watchdog install --system` from that user's shell"
        )
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ServiceError(f'SUDO_USER = "{name}" is not a user of this machine') from None
    return JobUser(name, entry.pw_uid, entry.pw_gid, Path(entry.pw_dir))


def unreadable_by(path: Path, user: JobUser) -> Path | None:
    """The first folder `user` cannot enter on the way to `path`, or `path` itself when the user
    cannot read it; None when the user can read it (owner, group and other bits, as the kernel
    checks them for an ordinary user; ACLs are not read)."""
    import stat

    groups = user.groups()

    def allowed(target: Path, bits: tuple[int, int, int]) -> bool:
        st = target.stat()
        if st.st_uid == user.uid:
            return bool(st.st_mode & bits[0])
        if st.st_gid in groups:
            return bool(st.st_mode & bits[1])
        return bool(st.st_mode & bits[2])

    path = path.absolute()
    for folder in reversed(path.parents):
        if folder.exists() and not allowed(folder, (stat.S_IXUSR, stat.S_IXGRP, stat.S_IXOTH)):
            return folder
    if path.exists() and not allowed(path, (stat.S_IRUSR, stat.S_IRGRP, stat.S_IROTH)):
        return path
    return None


def interpreter() -> str:
    # The venv's own python (not the base it links to): only it sees the installed packages.
    return os.path.abspath(sys.executable)


def server_label(name: str) -> str:
    return f"{WATCHDOG_LABEL}.server.{name}"


def server_unit(name: str) -> str:
    return f"mlx-server-{name}.service"


def server_args(model: str, port: int, draft_model: str | None) -> list[str]:
    """The server's arguments; a model folder given by a relative path is made absolute, as the
    service runs elsewhere (launchd: in `/`)."""

    def resolved(model: str) -> str:
        path = Path(model).expanduser()
        return str(path.resolve()) if path.exists() else model  # else a repo id

    args = ["--model", resolved(model), "--port", str(port)]
    return [*args, "--draft-model", resolved(draft_model)] if draft_model else args


def service_env(env: Mapping[str, str], home: Path, extra: Sequence[str] = ()) -> dict[str, str]:
    """What the job gets (nothing of the installing shell comes along): PATH, HOME, and the
    named variables that are set."""
    out = {"PATH": env.get("PATH") or "/usr/local/bin:/usr/bin:/bin", "HOME": str(home)}
    out.update({k: env[k] for k in extra if env.get(k)})
    return out


def template(folder: str, name: str) -> str:
    package = Path(__file__).parent.parent
    # Installed: inside the package; in a checkout (editable install): at the top.
    for base in (package / folder, package.parent / folder):
        if (base / name).is_file():
            return (base / name).read_text()
    raise ServiceError(f"the template {folder}/{name} is missing from this install")


def no_placeholders(doc: Any) -> None:
    if re.search(r"@[A-Z_]+@", repr(doc)):
        raise AssertionError(f"a template placeholder was left unfilled: {doc!r}")


NO_BUS = "Failed to connect to bus"  # systemctl --user with no user manager running


def apply(plan: InstallPlan, system: System, timeout: float = 60.0) -> list[str]:
    """Write (or remove) the file, then run the steps; what was done, line by line.

    Removal runs the steps first (stop, then delete), installation writes first.
    """
    from mlx_watchdog.act.managers import wait_for  # what installs needs of the managers
    from mlx_watchdog.act.managers.launchd import BOOTSTRAP_BUSY, bootstrap, job_info

    done: list[str] = []
    for folder in plan.dirs:
        folder.mkdir(parents=True, exist_ok=True)
        if plan.dirs_owner is not None:
            os.chown(folder, plan.dirs_owner, -1)
    if plan.content is not None:
        write(plan.path, plan.content)
        done.append(f"wrote {plan.path}")
    for step in plan.steps:
        if step.retry_busy and step.argv[:2] == ("launchctl", "bootstrap"):
            code, said = bootstrap(system, step.argv[2], Path(step.argv[3]))
            out = said
        else:
            code, out = system.run(step.argv, timeout)
            said = f"{' '.join(step.argv)}: exit {code}"
        done.append(said)
        if code not in step.ok and plan.content is None and NO_BUS in out:
            # No user manager runs (no session, no lingering): nothing runs the unit to stop.
            done[-1] = f"{' '.join(step.argv)}: no systemd user manager runs; nothing to stop"
            continue
        if code not in step.ok:
            why = " (launchd was still tearing the old job down)" if code in BOOTSTRAP_BUSY else ""
            if NO_BUS in out:
                why = (
                    " (no systemd user manager runs for this user: no session and no lingering;"
                    " run `sudo loginctl enable-linger $USER`, or `sudo mlx-watchdog install"
                    " --system`)"
                )
            raise ServiceError(
                f"{' '.join(step.argv)} exited {code}{why}: {out.strip()[-300:]}\n"
                + "\n".join(done)
            )
        if step.wait_gone:
            target = step.wait_gone

            def gone(target: str = target) -> bool:
                return job_info(system, target) is None

            if not wait_for(gone, STOP_BOUND + 10, system):
                raise ServiceError(
                    f"{target} was still loaded {STOP_BOUND + 10} s after bootout\n"
                    + "\n".join(done)
                )
            done.append(f"{target} is gone")
    if plan.content is None and plan.path.exists():
        plan.path.unlink()
        done.append(f"removed {plan.path}")
    return done


def write(path: Path, content: bytes) -> None:
    """Atomically, mode 0644 (launchd refuses a file others may write), owned by whoever runs
    this: the user for an agent, root for a LaunchDaemon or a system unit."""
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
