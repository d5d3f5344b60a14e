"""Native llama.cpp tools built once from source, the baseline of ``pagedllm bench scale`` and
``pagedllm bench serve --baseline llama-server``.

The llama.cpp source is the one vendored in the llama-cpp-python sdist of the ``llamacpp`` extra's pinned
version (:data:`LLAMA_CPP_PYTHON_VERSION`), so the native tools and the Python binding run the same
llama.cpp. :func:`ensure_tools` downloads the sdist with pip when it is not in the cache, extracts its
``vendor/llama.cpp``, and builds :data:`TOOLS` with cmake (Release, ``GGML_NATIVE=ON`` for this CPU's
instructions, OpenMP, static libraries, only those targets) under
``<cache root>/llama.cpp/<version>/``:

* ``sdist/``: the downloaded sdist; ``src/``: its llama.cpp; ``build/``: cmake's build tree;
* ``bin/``: the finished tools, published atomically (copied into a temporary folder, then renamed),
  so a present ``bin/`` always holds every tool.

Concurrent builds are serialised by a lock file beside them. The build is a one-off cost of minutes
(tens of minutes on two cores); :func:`find_tools` only looks and never builds.
"""

from __future__ import annotations

import argparse
import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pagedllm.utils import cache_root

logger = logging.getLogger("pagedllm_bench")

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TOOLS = ("llama-bench", "llama-batched-bench", "llama-quantize", "llama-server")
# cmake options of the build: this CPU's instructions, OpenMP threads, static tools, no tests, no web
# UI (its assets would be fetched from the network), no HTTPS or curl (the tools read local files).
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",
    "-DGGML_OPENMP=ON",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_CURL=OFF",
)


@dataclass(frozen=True)
class NativeTools:
    """Paths of the built tools (every one of :data:`TOOLS` exists)."""

    bin_dir: Path
    version: str

    def path(self, tool: str) -> str:
        if tool not in TOOLS:
            raise ValueError(f"unknown llama.cpp tool {tool!r}; built: {', '.join(TOOLS)}.")
        return str(self.bin_dir / tool)


def tools_root(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """``<cache root>/llama.cpp/<version>``: where the sdist, source, build tree and tools live."""
    return cache_root() / "llama.cpp" / version


def find_tools(version: str = LLAMA_CPP_PYTHON_VERSION) -> NativeTools | None:
    """The cached tools of ``version``, or None when they have not been built (never builds)."""
    bin_dir = tools_root(version) / "bin"
    if all(os.access(bin_dir / t, os.X_OK) for t in TOOLS):
        return NativeTools(bin_dir, version)
    return None


def missing_tools_reason(version: str = LLAMA_CPP_PYTHON_VERSION) -> str:
    """Why :func:`find_tools` finds nothing, with the command that builds the tools."""
    return (
        f"the native llama.cpp tools are not built in {tools_root(version) / 'bin'}; build them once "
        "(minutes) with: pagedllm bench build-llama-cpp"
    )


@contextmanager
def _build_lock(root: Path) -> Iterator[None]:
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _run(cmd: list[str], log: Path) -> None:
    """Run a build step, appending its output to ``log``; RuntimeError naming the log on failure."""
    logger.info("llama.cpp build: %s", " ".join(cmd))
    with open(log, "a", encoding="utf-8") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        rc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, check=False).returncode
    if rc != 0:
        raise RuntimeError(f"{cmd[0]} failed with status {rc} while building llama.cpp; see {log}.")


def sdist_path(root: Path, version: str) -> Path:
    """The llama-cpp-python sdist in the cache, downloaded with pip when absent."""
    sdist_dir = root / "sdist"
    name = f"llama_cpp_python-{version}.tar.gz"
    if not (sdist_dir / name).is_file():
        sdist_dir.mkdir(parents=True, exist_ok=True)
        _run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-binary",
                ":all:",
                "--no-deps",
                "--dest",
                str(sdist_dir),
                f"llama-cpp-python=={version}",
            ],
            root / "download.log",
        )
    if not (sdist_dir / name).is_file():
        raise RuntimeError(f"pip did not download {name} into {sdist_dir}.")
    return sdist_dir / name


def extract_source(sdist: Path, dest: Path, version: str) -> None:
    """Extract the sdist's ``vendor/llama.cpp`` into ``dest`` (through a temporary folder beside it)."""
    prefix = f"llama_cpp_python-{version}/vendor/llama.cpp/"
    tmp = Path(tempfile.mkdtemp(prefix="src.", dir=dest.parent))
    try:
        with tarfile.open(sdist) as tar:
            members = []
            for m in tar.getmembers():
                if m.name.startswith(prefix) and (m.isfile() or m.isdir()):
                    m.name = m.name[len(prefix) :]
                    members.append(m)
            if not members:
                raise RuntimeError(f"{sdist} holds no vendor/llama.cpp.")
            tar.extractall(tmp, members=members, filter="data")
        tmp.rename(dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_tools(version: str = LLAMA_CPP_PYTHON_VERSION, jobs: int | None = None) -> NativeTools:
    """The native tools of ``version``, built first when not cached (see the module docstring).

    ``jobs``: parallel compile jobs (default: the CPU count). RuntimeError names the failing step and
    its log file.
    """
    found = find_tools(version)
    if found is not None:
        return found
    root = tools_root(version)
    with _build_lock(root):
        found = find_tools(version)
        if found is not None:
            return found
        if shutil.which("cmake") is None:
            raise RuntimeError("building llama.cpp needs cmake (and a C++ compiler) on the PATH.")
        start = time.perf_counter()
        log = root / "build.log"
        src = root / "src"
        if not (src / "CMakeLists.txt").is_file():
            shutil.rmtree(src, ignore_errors=True)
            extract_source(sdist_path(root, version), src, version)
        build = root / "build"
        _run(["cmake", "-S", str(src), "-B", str(build), *CMAKE_OPTIONS], log)
        jobs = jobs or os.cpu_count() or 1
        _run(
            ["cmake", "--build", str(build), "--config", "Release", "-j", str(jobs), "--target", *TOOLS], log
        )
        staging = Path(tempfile.mkdtemp(prefix="bin.", dir=root))
        try:
            for tool in TOOLS:
                built = build / "bin" / tool
                if not built.is_file():
                    raise RuntimeError(f"the llama.cpp build made no {built}; see {log}.")
                shutil.copy2(built, staging / tool)
            os.chmod(staging, 0o755)  # mkdtemp's folders are private; the tools are for every user
            shutil.rmtree(root / "bin", ignore_errors=True)
            staging.rename(root / "bin")
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        logger.warning("Built llama.cpp tools in %s in %.0f s.", root / "bin", time.perf_counter() - start)
    found = find_tools(version)
    assert found is not None
    return found


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--jobs", type=int, default=None, help="Parallel compile jobs (default: the CPU count)."
    )


def run(args: argparse.Namespace) -> int:
    """``pagedllm bench build-llama-cpp``: build (or find) the native tools and print their folder."""
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.jobs is not None and args.jobs < 1:
        logger.error("--jobs must be at least 1, got %d.", args.jobs)
        return 2
    try:
        tools = ensure_tools(jobs=args.jobs)
    except RuntimeError as exc:
        logger.error("%s", exc)
        return 1
    for tool in TOOLS:
        print(f"{tool}: {tools.path(tool)}")
    return 0
