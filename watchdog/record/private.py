"""The state folder is the watchdog's own: its token, its daemon record and its history decide
what it restarts and whom it believes. As ssh treats `~/.ssh`, a folder others may write is
refused, and no file in it is read or written through a symlink someone planted."""

from __future__ import annotations

import fcntl
import os
import stat
import tempfile
from pathlib import Path


class UnsafeState(Exception):
    """The state folder or a file in it is not the watchdog's alone; the message says the fix."""


def private_dir(path: Path) -> None:
    """Create `path` (mode 0700) or check it: owned by this user, writable by no one else."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    check_private(path)


def check_private(path: Path) -> None:
    """UnsafeState unless `path` is a folder of this user's that no one else may write."""
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeState(f"state_dir {path} is not a folder")
    if st.st_uid != os.getuid():
        raise UnsafeState(
            f"state_dir {path} belongs to user {st.st_uid}, not to this user ({os.getuid()}); "
            "give the watchdog a folder of its own (state_dir)"
        )
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeState(
            f"state_dir {path} can be written by other users "
            f"(mode {stat.S_IMODE(st.st_mode):04o}); run: chmod 700 {path}"
        )


def read_private(path: Path, limit: int = 64 << 10) -> str:
    """A file of the watchdog's, never through a symlink; OSError when it is missing, a link
    or not a regular file, UnsafeState when another user owns it."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{path} is not a regular file")
        if st.st_uid != os.getuid():
            raise UnsafeState(f"{path} belongs to user {st.st_uid}, not to this user")
        return os.read(fd, limit).decode("utf-8", errors="replace")
    finally:
        os.close(fd)


def write_private(path: Path, text: str) -> None:
    """Write `path` whole (mode 0600): a fresh file renamed over it, so a planted symlink is
    replaced, never written through, and a reader never sees half a file."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}-")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def create_private(path: Path) -> bool:
    """Create `path` empty with mode 0600 unless it exists; True when created. A symlink in
    its place is an error (O_EXCL never follows one)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        if path.is_symlink():
            raise UnsafeState(f"{path} is a symlink; remove it: the watchdog writes it") from None
        return False
    os.close(fd)
    return True


class AlreadyRunning(Exception):
    """Another daemon holds this state folder; the message names its PID."""


def hold_lock(path: Path) -> int:
    """An exclusive lock on `path`, held while the returned descriptor is open. The kernel
    releases it on any exit (kill -9 included), so a service manager's relaunch takes it."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:  # a link (ELOOP), a folder (EISDIR), a FIFO with no reader...
        raise UnsafeState(
            f"{path} is not the watchdog's lock file ({exc.strerror}); remove it and start again"
        ) from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeState(f"{path} is not a regular file (a FIFO or a device); remove it")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise AlreadyRunning(
            f"another watchdog (PID {holder}) runs on the state folder {path.parent}; "
            "stop it first, or give this one another state_dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def lock_lost(fd: int, path: Path) -> str | None:
    """Why the lock held on `fd` no longer guards `path` (None: it does): its file or its
    folder was removed or replaced under the running watchdog, so a second watchdog could
    take a new lock there and both would act on one server."""
    try:
        held = os.fstat(fd)
        there = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        there = None
    if (
        there is None
        or held.st_nlink == 0
        or (held.st_dev, held.st_ino)
        != (
            there.st_dev,
            there.st_ino,
        )
    ):
        return f"the state folder's lock {path} was removed or replaced under the running watchdog"
    return None
