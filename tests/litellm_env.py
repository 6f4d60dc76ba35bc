"""LiteLLM's Router for the balancer tests, in a venv of its own (its many dependencies stay out
of the watchdog's test environment): built once into the tests' cache, as llama-server is, and
found there by later runs. A fresh machine (CI's empty cache) builds it in about a minute."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

VERSION = "1.110.2"


@contextlib.contextmanager
def _locked(lock: Path) -> Iterator[None]:
    lock.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # two runs at once build it once
        yield
    finally:
        os.close(fd)


def python(cache: str) -> Path:
    """The venv's interpreter, with litellm==VERSION; built under `cache` when missing."""
    target = Path(cache) / "mlx-watchdog-tests" / f"litellm-{VERSION}"
    interpreter = target / "bin" / "python"
    with _locked(target.parent / f".litellm-{VERSION}.lock"):
        if (target / ".complete").exists():
            return interpreter
        shutil.rmtree(target, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "venv", str(target)], check=True)
        install = [str(interpreter), "-m", "pip", "install", "-q", f"litellm=={VERSION}"]
        subprocess.run(install, check=True, timeout=1200, stdin=subprocess.DEVNULL)
        (target / ".complete").write_text(VERSION)
    return interpreter
