"""The whole stack as a user starts it: `kvflow serve` as a child process (embedded nats-server
and redis-server, every service its own process), on a free port."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from shared.infra import free_port

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def stack():
    port = free_port()
    log_path = ROOT / ".pytest_cache" / "kvflow-serve.log"
    log_path.parent.mkdir(exist_ok=True)
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    env = {**os.environ, "KVFLOW_MAX_NUM_SEQS": "32", "KVFLOW_KV_CACHE_MEMORY": "0.5"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "services.cli",
            "serve",
            "--port",
            str(port),
            "--max-model-len",
            "2048",
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"kvflow serve exited ({proc.returncode}):\n{log_path.read_text()[-4000:]}"
                )
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"stack not ready:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.5)
        yield base
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture(scope="session")
def client(stack):
    import openai

    return openai.OpenAI(base_url=f"{stack}/v1", api_key="unused", max_retries=0, timeout=120)


def wait_all_blocks_free(base: str, timeout: float = 10.0) -> dict:
    """The scheduler's counters once nothing runs: every KV block must be free again."""
    deadline = time.monotonic() + timeout
    while True:
        stats = httpx.get(f"{base}/stats", timeout=5).json()
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            if stats["num_free_blocks"] == stats["num_total_blocks"] or time.monotonic() > deadline:
                return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.1)
