"""The KV tiers through the whole stack (`kvflow serve --kv-redis-tier --kv-host-memory ...`):
a worker restarted with SIGKILL serves a repeated 1,000-token prompt from blocks another
process stored in Redis (the computed-token counter shows it) with identical greedy output;
with Redis stopped every request still completes correctly, and the tier comes back with it."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from kvflow.shared.infra import start_redis
from tests.helpers.faults import service_pids, stack_credentials, stack_urls
from tests.helpers.stack import long_prompt, running_stack, timed, wait_for

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
