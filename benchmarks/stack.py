"""``kvflow serve`` as a benchmark's child process: on a free port, in a session of its own (so
the caller stops it and every service it started with one signal), ready once its /health
answers."""

from __future__ import annotations

import subprocess
import sys

from kvflow.shared.infra import free_port, wait_for_http


def start_stack(extra: list[str]) -> tuple[subprocess.Popen, str]:
    """A started ``kvflow serve`` with the flags ``extra``, and its base URL."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvflow.cli.main", "serve", "--port", str(port), *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    wait_for_http(f"{base}/health", proc, "kvflow serve")
    return proc, base
