"""The KV tiers through the whole stack (`kvflow serve --kv-redis-tier --kv-host-memory ...`):
a worker restarted with SIGKILL serves a repeated 1,000-token prompt from blocks another
process stored in Redis (the computed-token counter shows it) with identical greedy output;
with Redis stopped every request still completes correctly, and the tier comes back with it."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from kvflow.shared.infra import start_redis
from tests.e2e.conftest import running_stack
from tests.e2e.faults import MODEL, service_pids, stack_credentials, stack_urls

pytestmark = pytest.mark.e2e
NAME = "tiers"


@pytest.fixture(scope="module")
def tier_stack():
    extra: list = []
    args = ["--kv-redis-tier", "--kv-host-memory", "0.25", "--max-model-len", "1200"]
    with running_stack(NAME, *args) as base:
        yield base, extra
    for server in extra:
        server.stop()


def stats(base: str) -> dict:
    return httpx.get(f"{base}/stats", timeout=5).json()


def timed(base: str, prompt, max_tokens: int = 16) -> tuple[str, float]:
    """Text and time to first token of a streamed greedy completion."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    body |= {"stream": True, "ignore_eos": True}
    t0, ttft, text = time.perf_counter(), None, []
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for c in json.loads(line[6:]).get("choices", []):
                    if c.get("text") and ttft is None:
                        ttft = time.perf_counter() - t0
                    text.append(c.get("text", ""))
    return "".join(text), ttft or time.perf_counter() - t0


def long_prompt(tokenizer, n: int, seed: int) -> list[int]:
    words = ["harbor", "signal", "copper", "meadow", "lantern", "orchard", "valley", "ember"]
    return tokenizer(" ".join(f"{words[(i * 3 + seed) % 8]} {i}," for i in range(n)))["input_ids"][
        :n
    ]


def wait_for(cond, timeout: float = 120, what="condition") -> None:
    """``what``: a text, or a function giving one (the state when the wait ran out)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out waiting for {what() if callable(what) else what}")
        time.sleep(0.3)


def test_a_restarted_worker_loads_the_prefix_from_redis(tier_stack, tokenizer) -> None:
    base, _ = tier_stack
    nats_url, _ = stack_urls(NAME)
    prompt = long_prompt(tokenizer, 1000, seed=1)  # 62 full blocks
    before = stats(base)
    first, ttft_cold = timed(base, prompt)
    cold = stats(base)["num_computed_tokens"] - before["num_computed_tokens"]
    assert cold >= 1000
    t0 = time.monotonic()
    wait_for(
        lambda: stats(base)["workers"][0]["redis_stored_blocks"] >= 62,
        120,
        lambda: f"62 blocks stored in Redis; worker stats: {stats(base)['workers'][0]}",
    )
    print(f"\n62 blocks written through to Redis {time.monotonic() - t0:.1f} s after the request")

    old = service_pids(nats_url)["worker:worker-0"]
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: service_pids(nats_url).get("worker:worker-0", old) != old, 60, "restart")
    wait_for(lambda: _healthy_with_new_worker(base), 180, "the new worker to join")

    before = stats(base)
    second, ttft_warm = timed(base, prompt)
    after = stats(base)
    computed = after["num_computed_tokens"] - before["num_computed_tokens"]
    redis_hits = after["tier_redis_hits"] - before["tier_redis_hits"]
    print(
        f"\n1,000-token prompt: TTFT {ttft_cold:.2f} s computed, {ttft_warm:.2f} s after a "
        f"worker restart with {redis_hits} blocks loaded from Redis ({computed} tokens computed)"
    )
    assert second == first
    assert redis_hits >= 60
    assert computed <= 1000 - 60 * 16 + 16  # the rest of the prompt, then the decodes


def _healthy_with_new_worker(base: str) -> bool:
    """The scheduler knows the restarted worker (a fresh entry: no prefills routed yet; the
    dead one stays listed until its heartbeat times out)."""
    try:
        s = stats(base)
    except httpx.HTTPError:
        return False
    w = s["workers"]
    return len(w) == 1 and w[0]["num_prefills"] == 0 and w[0]["redis_tier"] == "on"


def test_redis_stopped_requests_still_complete_then_the_tier_resumes(tier_stack, tokenizer) -> None:
    base, extra = tier_stack
    _, redis_url = stack_urls(NAME)
    port = int(redis_url.rsplit(":", 1)[1].split("/")[0])
    prompts = [long_prompt(tokenizer, 300, seed=10 + i) for i in range(3)]
    reference = [timed(base, p, 12)[0] for p in prompts]
    # redis-server rewrites its process title to "redis-server 127.0.0.1:PORT"
    redis_pid = next(
        int(p)
        for p in os.listdir("/proc")
        if p.isdigit() and f"redis-server 127.0.0.1:{port}".encode() in _cmdline(int(p))
    )
    os.kill(redis_pid, signal.SIGKILL)
    # every request completes, by recompute, with the same text (prompts already stored too)
    fresh = [long_prompt(tokenizer, 300, seed=20 + i) for i in range(2)]
    assert [timed(base, p, 12)[0] for p in prompts] == reference
    assert all(timed(base, p, 12)[0] for p in fresh)
    wait_for(lambda: stats(base)["workers"][0]["redis_tier"] == "off", 30, "the tier to switch off")
    assert stats(base)["workers"][0]["redis_tier_errors"] >= 1

    extra.append(start_redis(port=port, aclfile=stack_credentials(NAME).redis_acl))
    wait_for(lambda: stats(base)["workers"][0]["redis_tier"] == "on", 30, "the tier to resume")
    stored = stats(base)["workers"][0]["redis_stored_blocks"]
    timed(base, long_prompt(tokenizer, 300, seed=40), 4)
    wait_for(lambda: stats(base)["workers"][0]["redis_stored_blocks"] > stored, 30, "new stores")


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
