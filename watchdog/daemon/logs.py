"""Logs that launchd (or the process manager) appends to forever, kept under a size cap.

Rotation copies and truncates instead of renaming: the writer (launchd's StandardOutPath, the
server, the watchdog's own stderr) keeps the file open in append mode, so after a rename it
would go on filling the renamed file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import stat
import sys
from collections.abc import Iterable
from pathlib import Path

from mlx_watchdog.sense.files import NotAFile, create_new, open_append, open_regular

log = logging.getLogger("mlx_watchdog")


def rotate(path: Path, max_bytes: int, keep: int) -> bool:
    """When `path` is over `max_bytes`: shift path.1..path.(keep-1) up, copy to path.1,
    truncate. True when it rotated. Only this user's regular file is rotated, never through a
    link: the copy keeps the log's own mode and a link planted at path.N is replaced, not
    written through (NotAFile, an OSError, says which)."""
    try:
        with open_regular(path, follow=False) as src:
            st = os.fstat(src.fileno())  # this user's regular file: open_regular checked
            if st.st_size <= max_bytes:
                return False
            for i in range(keep - 1, 0, -1):
                older = path.with_name(f"{path.name}.{i}")
                if older.is_symlink() or older.exists():
                    os.replace(older, path.with_name(f"{path.name}.{i + 1}"))
            if keep > 0:
                with create_new(path.with_name(f"{path.name}.1"), stat.S_IMODE(st.st_mode)) as dst:
                    shutil.copyfileobj(src, dst)
            with open_append(path) as writer:  # truncating needs it open for writing
                if os.fstat(writer.fileno()).st_ino != st.st_ino:
                    raise NotAFile(errno.EAGAIN, "replaced while it was rotated", str(path))
                writer.truncate(0)
    except FileNotFoundError:
        return False
    return True


def rotate_all(paths: Iterable[Path], max_bytes: int, keep: int) -> None:
    """`rotate` each; one that cannot be rotated is said and the others still are."""
    for path in paths:
        try:
            if rotate(path, max_bytes, keep):
                log.info("rotated %s (over %d bytes)", path, max_bytes)
        except OSError as exc:
            log.error("cannot rotate %s: %s", path, exc.strerror or exc)


def own_log(fd: int = 2) -> Path | None:
    """The regular file this process's stderr appends to (launchd's StandardErrorPath), if any.

    None for a terminal, a pipe or the journal, and for a file not opened in append mode
    (truncating it would leave the writer's offset behind).
    """
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_APPEND:
            return None
    except OSError:
        return None
    with contextlib.suppress(OSError):
        if sys.platform == "darwin":
            raw = fcntl.fcntl(fd, fcntl.F_GETPATH, bytes(1024))  # type: ignore[attr-defined]
            return Path(raw.split(b"\0", 1)[0].decode())
        return Path(os.readlink(f"/proc/self/fd/{fd}"))
    return None
