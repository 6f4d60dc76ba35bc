"""One way to open the files the watchdog reads and appends to beside a server (its log, a
launchd plist, the log's rotated copies): never blocking on a FIFO put where a file was, and,
for the files it writes or copies, never through a symbolic link nor into another user's file.

A FIFO opened with O_NONBLOCK cannot hang the open (reading: it opens at once; writing with no
reader: ENXIO), and fstat on the open descriptor then refuses it: the check and the use are the
same file, so nothing can be swapped in between.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO, cast

_QUIET = os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)


class NotAFile(OSError):
    """Something other than this user's regular file is where one was expected."""


def open_regular(path: Path, *, follow: bool = True) -> BinaryIO:
    """A regular file for reading, opened without blocking. `follow=False` refuses a symbolic
    link at `path` and a file another user owns. OSError for anything else."""
    flags = os.O_RDONLY | _QUIET | (0 if follow else os.O_NOFOLLOW)
    return _checked(_open(path, flags), path, own=not follow, mode="rb")


def open_append(path: Path, mode: int = 0o600) -> BinaryIO:
    """This user's regular file at `path` for appending, created with `mode` when missing;
    never through a symbolic link, never a FIFO or a device (the open does not block)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | _QUIET
    fh = _checked(_open(path, flags, mode), path, own=True, mode="ab")
    os.set_blocking(fh.fileno(), True)  # a child that inherits it writes as to any file
    return fh


def create_new(path: Path, mode: int) -> BinaryIO:
    """A fresh regular file at `path` for writing, replacing what a link or a file there was
    (it is unlinked first, so a planted link is never written through)."""
    with contextlib.suppress(FileNotFoundError):
        path.unlink()
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | _QUIET
    return _checked(_open(path, flags, mode), path, own=True, mode="wb")


def _open(path: Path, flags: int, mode: int = 0o600) -> int:
    try:
        return os.open(path, flags, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise NotAFile(errno.ELOOP, "a symbolic link, not followed", str(path)) from None
        if exc.errno == errno.ENXIO:
            raise NotAFile(errno.ENXIO, "a FIFO or a device, not a file", str(path)) from None
        raise


def _checked(fd: int, path: Path, *, own: bool, mode: str) -> BinaryIO:
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotAFile(errno.EINVAL, "not a regular file", str(path))
        if own and st.st_uid != os.geteuid():
            raise NotAFile(errno.EPERM, f"owned by another user (uid {st.st_uid})", str(path))
    except OSError:
        os.close(fd)
        raise
    return cast(BinaryIO, os.fdopen(fd, mode))
