"""The whole stack as a user starts it: `kvflow serve` as a child process (embedded nats-server
and redis-server, every service its own process), on a free port."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvflow.shared.infra import free_port
from tests import hf_reference
from tests.worker_schedule import OWN_STACKS

ROOT = Path(__file__).resolve().parents[2]
# stacks told to stop (SIGTERM) and not yet waited for: each drains while the tests go on, and
# the session's end waits for them together (one after another, each ~3 s or more, added up)
_STOPPING: dict[str, tuple[subprocess.Popen, object]] = {}  # by stack name (its log file)


def _reap(proc: subprocess.Popen, log: object) -> None:
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()


SESSION_STACKS = frozenset({"stack", "small_stack", "guarded_stack"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A module in tests/worker_schedule.py's OWN_STACKS may run in the other worker, beside the
    session's stacks: one of them used there would start a second copy under the same name (the
    log that stack_urls reads). Refused before anything starts."""
    for item in items:
        module = item.nodeid.split("::", 1)[0]
        used = SESSION_STACKS.intersection(getattr(item, "fixturenames", ()))
        if module in OWN_STACKS and used:
            raise pytest.UsageError(
                f"{item.nodeid} uses the session's {', '.join(sorted(used))}: take {module} out "
                "of OWN_STACKS in tests/worker_schedule.py (it then runs with the session's stacks)"
            )


@pytest.fixture(scope="session", autouse=True)
def _stacks_stop_together():
    """Set up before every stack, so torn down after them all: waits for the stacks still
    stopping."""
    yield
    while _STOPPING:
        _reap(*_STOPPING.popitem()[1])


@contextlib.contextmanager
def running_stack(name: str, *args: str):
    """`kvflow serve ARGS` on a free port until the block exits; yields the base URL."""
    if name in _STOPPING:  # the same name's last stack writes the same log: let it finish
        _reap(*_STOPPING.pop(name))
    port = free_port()
    log_path = ROOT / ".pytest_cache" / f"kvflow-serve-{name}.log"
    log_path.parent.mkdir(exist_ok=True)
    log = open(log_path, "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvflow.cli.main", "serve", "--port", str(port), *args],
        cwd=ROOT,
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
        proc.send_signal(signal.SIGTERM)  # waited for at the session's end
        _STOPPING[name] = (proc, log)


@pytest.fixture(scope="session")
def stack():
    """The default configuration (as `make serve` runs it), with a 2,048-token context."""
    with running_stack("default", "--max-model-len", "2048", "--max-num-seqs", "32") as base:
        yield base


@pytest.fixture(scope="session")
def small_stack():
    """A constrained configuration: 256-token step budget (chunked prefill) and a KV cache of
    160 blocks x 16 tokens, too small for many long sequences at once (preemption); streamed
    output goes 3 tokens per delta (--stream-interval 3), so every output compared with the
    default stack's also checks that nothing is lost or repeated in the merged deltas."""
    args = ["--max-num-batched-tokens", "256", "--num-kv-blocks", "160", "--max-model-len", "2048"]
    args += ["--stream-interval", "3"]
    with running_stack("small", *args) as base:
        yield base


def openai_client(base: str):
    import openai

    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="session")
def client(stack):
    return openai_client(stack)


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


GUARDED_KEY = "sk-static-e2e"


@pytest.fixture(scope="session")
def guarded_stack():
    """API keys on (the static --api-key and keys in the stack's own Redis), a short
    --request-timeout and a 64 KiB body limit: yields (base URL, the stack's Redis URL)."""
    args = ["--api-key", GUARDED_KEY, "--key-store", "redis", "--request-timeout", "5"]
    args += ["--max-body-bytes", "65536"]
    with running_stack("guarded", "--max-model-len", "2048", *args) as base:
        log = (ROOT / ".pytest_cache" / "kvflow-serve-guarded.log").read_text()
        # `kvflow serve` prints the URLs of the nats-server and redis-server it started
        redis_url = log.split(", redis ", 1)[1].split()[0]
        yield base, redis_url


@pytest.fixture(scope="session")
def hf_model(model_src):
    """SmolLM2 in Hugging Face transformers, from the same GGUF file (dequantized to fp32)."""
    import torch

    from tests.gguf_without_vocabulary import transformers_model

    return transformers_model(model_src.path, torch.float32)


def hf_greedy_texts(hf_model, tokenizer, prompts: list[str], new_tokens: int) -> dict:
    """Hugging Face's greedy continuation of each prompt: {prompt: (text, token count)}
    (tests/hf_reference.py: computed once on a machine)."""
    out = {}
    for p in prompts:
        ids = tokenizer(p)["input_ids"]
        (new,) = hf_reference.generate(hf_model, ids, max_new_tokens=new_tokens, do_sample=False)
        out[p] = (tokenizer.decode(new, skip_special_tokens=True), len(new))
    return out
