"""`kvflow serve --redis-sentinel`: Redis as a primary, a replica and three sentinels, with every
Redis client of the stack on it (the scheduler lease of two schedulers, API keys and their
limits, the LoRA registry, the KV tier). The primary is SIGKILLed while streams run: the
streams finish with their undisturbed text, and after the failover keys still apply, an
adapter loaded at run time still serves (also from a new leader, which finds it in the
registry on the promoted server) and the KV tier stores blocks again."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import redis

from kvflow.shared.access.grants import SENTINEL_MASTER
from tests.helpers.faults import (
    MODEL,
    Stream,
    kvflow_keys,
    service_pids,
    stack_credentials,
    stack_urls,
)
from tests.helpers.lora_stack import make_adapter
from tests.helpers.stack import running_stack, wait_all_blocks_free

pytestmark = pytest.mark.e2e
NAME = "sentinel"
KEY = "sk-static-sentinel"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPTS = [f"Write a short note about {t}." for t in ("rivers", "lamps", "clouds", "maps")]


@pytest.fixture(scope="module")
def adapter(hf_model, tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("sentinel-lora") / "notes"
    make_adapter(hf_model, path, seed=7, r=8, targets=["q_proj", "v_proj", "down_proj"])
    return str(path)


def _stats(base: str) -> dict:
    return httpx.get(f"{base}/stats", headers=AUTH, timeout=5).json()


def _wait(cond, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.2)
    return time.monotonic() - t0


def _texts(base: str, prompts: list[str], max_tokens: int, **kw) -> list[Stream]:
    streams = [Stream(base, p, max_tokens, headers=AUTH, **kw).start() for p in prompts]
    return [s.join() for s in streams]


def _primary_pid(redis_url: str) -> int:
    """The Redis primary's process, found by asking a sentinel (as the gateway role)."""
    sentinel_port = int(redis_url.split("://", 1)[1].split(",", 1)[0].split(":")[1])
    password = stack_credentials(NAME).redis_password_file("gateway").read_text().strip()
    s = redis.Redis(port=sentinel_port, username="gateway", password=password, socket_timeout=2)
    _host, port = s.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SENTINEL_MASTER)
    s.close()
    title = f"redis-server 127.0.0.1:{int(port)}".encode()
    for p in os.listdir("/proc"):
        try:
            if p.isdigit() and title in open(f"/proc/{p}/cmdline", "rb").read():  # noqa: SIM115
                return int(p)
        except OSError:
            continue
    raise AssertionError(f"no process is the Redis primary on port {int(port)}")


def test_a_killed_redis_primary_is_replaced_and_nothing_is_lost(adapter) -> None:
    args = ["--redis-sentinel", "--schedulers", "2", "--api-key", KEY, "--key-store", "redis"]
    args += ["--kv-redis-tier", "--enable-lora", "--max-lora-rank", "8", "--max-model-len", "1024"]
    with running_stack(NAME, *args) as base:
        nats_url, redis_url = stack_urls(NAME)
        assert redis_url.startswith("redis+sentinel://")
        key = kvflow_keys(NAME, redis_url, "add", "tenant-a", "--rpm", "1000")
        r = httpx.post(
            f"{base}/v1/load_lora_adapter",
            json={"lora_name": "notes", "lora_path": adapter},
            headers=AUTH,
            timeout=120,
        )
        assert r.status_code == 200, r.text
        reference = [s.text for s in _texts(base, PROMPTS, 40)]
        with_lora = _texts(base, PROMPTS[:1], 16, model="notes")[0]
        assert with_lora.error is None and with_lora.text and all(reference)
        stored = _stats(base)["workers"][0]["redis_stored_blocks"]
        assert stored > 0  # the tier works before the kill

        streams = [Stream(base, p, 40, headers=AUTH).start() for p in PROMPTS]
        _wait(lambda: min(len(s.pieces) for s in streams) >= 3, 120, "the streams to start")
        os.kill(_primary_pid(redis_url), signal.SIGKILL)
        t_kill = time.monotonic()
        for s in streams:
            s.join()
        assert [s.error for s in streams] == [None] * len(PROMPTS)
        assert [s.text for s in streams] == reference

        # API keys: the key made before the kill admits, a wrong one is refused
        def served(k: str) -> int:
            body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
            h = {"Authorization": f"Bearer {k}"}
            return httpx.post(
                f"{base}/v1/completions", json=body, headers=h, timeout=60
            ).status_code

        took = _wait(lambda: served(key) == 200, 60, "the key store after the failover")
        print(
            f"\nRedis failover: a stored API key admitted {time.monotonic() - t_kill:.1f} s "
            f"after SIGKILL of the primary (waited {took:.1f} s after the streams)"
        )
        assert served("sk-not-a-key") == 401
        # the KV tier stores blocks again (on the promoted server)
        before = _stats(base)["workers"][0]["redis_stored_blocks"]
        _texts(base, ["A fresh prompt about orchards and lanterns, " * 6], 4)
        _wait(
            lambda: _stats(base)["workers"][0]["redis_stored_blocks"] > before,
            30,
            "the KV tier to store blocks after the failover",
        )
        assert _stats(base)["workers"][0]["redis_tier"] == "on"
        # the adapter loaded at run time: served, and found by a new leader in the registry
        leader = _stats(base)["scheduler_id"]
        os.kill(service_pids(nats_url)[f"scheduler:{leader}"], signal.SIGKILL)
        _wait(lambda: served(key) == 200, 90, "a new leader scheduler")
        assert _stats(base)["epoch"] >= 2
        again = _texts(base, PROMPTS[:1], 16, model="notes")[0]
        assert again.error is None and again.text == with_lora.text
        wait_all_blocks_free(base, timeout=30)
