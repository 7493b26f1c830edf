"""Starting and stopping kvflow services as child processes (`python -m kvflow.cli.main run
SERVICE` with the settings as KVFLOW_* variables), for `kvflow serve` and for the Python API's
embedded pipeline. Services are processes that meet on the bus; nothing here imports them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import IO

from kvflow.shared.config import Settings


def spawn_service(
    service: str, settings: Settings, log: IO[bytes] | None = None, **overrides: str
) -> subprocess.Popen:
    """Start one service; ``overrides`` set more variables (``worker_id="w1"`` ->
    KVFLOW_WORKER_ID=w1); ``log`` receives its stdout and stderr (default: inherited)."""
    env = {**os.environ, **settings.to_env(), "PYTHONUNBUFFERED": "1"}
    env.update({"KVFLOW_" + k.upper(): v for k, v in overrides.items()})
    return subprocess.Popen(
        [sys.executable, "-m", "kvflow.cli.main", "run", service],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT if log is not None else None,
    )


def stop_processes(procs: list[subprocess.Popen], timeout: float = 10.0) -> None:
    """SIGINT every live process (newest first), wait up to ``timeout`` in all, then kill."""
    for p in reversed(procs):
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    deadline = time.monotonic() + timeout
    for p in reversed(procs):
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
