"""``kvflow serve`` as a benchmark's child process: on a free port, in a session of its own (so
the caller stops it and every service it started with one signal), ready once its /health
answers."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

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


@contextlib.contextmanager
def logged_stack(
    extra: list[str], log_path: Path, timeout: float = 600
) -> Iterator[tuple[str, str]]:
    """``kvflow serve`` with the flags ``extra``, its output in ``log_path``, until the block
    exits (then SIGTERM to its session, SIGKILL after 90 s); yields (base URL, NATS URL)."""
    port = free_port()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvflow.cli.main", "serve", "--port", str(port), *extra],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            base = f"http://127.0.0.1:{port}"
            print(f"starting kvflow serve {' '.join(extra)} (log: {log_path}) ...", flush=True)
            wait_for_http(f"{base}/health", proc, "kvflow serve", timeout=timeout)
            nats_url = re.search(r"kvflow: nats (nats://\S+),", log_path.read_text())[1]
            yield base, nats_url
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
