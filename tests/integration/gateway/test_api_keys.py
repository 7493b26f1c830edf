"""API keys and rate limits with a real redis-server: the key store (atomic admission under
concurrency, token limits, windows, usage), the `kvflow keys` command, and the gateway (over a
real nats-server, with the stand-in pipeline) answering 401 / 429 + Retry-After."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator

import httpx
import pytest
import redis.asyncio as aioredis
import uvicorn

from kvflow.services.gateway.app import create_app
from kvflow.services.gateway.keys import WINDOW_S, KeyStore
from kvflow.shared.config import Settings
from kvflow.shared.infra import free_port, start_redis
from tests.helpers.gateway import MODEL, StandIn

pytestmark = pytest.mark.integration
STATIC = "static-test-key"


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    server = start_redis()
    try:
        yield server.url
    finally:
        server.stop()


@contextlib.asynccontextmanager
async def keystore(redis_url: str) -> AsyncIterator[KeyStore]:
    """A store on an emptied database (a client per test: each test has its own loop)."""
    client = aioredis.from_url(redis_url, decode_responses=True)
    await client.flushdb()
    try:
        yield KeyStore(client)
    finally:
        await client.aclose()


async def test_keys_add_list_remove(redis_url) -> None:
    async with keystore(redis_url) as store:
        key = await store.add("alice", rpm=5, tpm=100)
        assert key.startswith("sk-kvflow-") and len(key) > 40
        with pytest.raises(ValueError):
            await store.add("alice")
        raw = await store.redis.hgetall(f"kvflow:key:{(await store.admit(key)).key_hash}")
        assert key not in str(raw)  # only the hash is stored
        [info] = await store.list()
        assert (info.name, info.rpm, info.tpm, info.requests) == ("alice", 5, 100, 1)
        assert (await store.admit("sk-kvflow-nope")).status == "unknown"
        assert await store.remove("alice") and not await store.remove("alice")
        assert (await store.admit(key)).status == "unknown"
        assert await store.list() == []


async def test_request_limit_is_atomic_under_concurrency(redis_url) -> None:
    async with keystore(redis_url) as store:
        key = await store.add("burst", rpm=7)
        now = 1_000_000 * WINDOW_S + 15.2  # 15.2 s into a window
        results = await asyncio.gather(*(store.admit(key, now=now) for _ in range(40)))
        statuses = [r.status for r in results]
        assert statuses.count("ok") == 7 and statuses.count("limited") == 33
        limited = next(r for r in results if r.status == "limited")
        assert (limited.limit, limited.retry_after, limited.name) == ("requests", 45, "burst")
        # the next window admits again
        assert (await store.admit(key, now=now + WINDOW_S)).status == "ok"
        [info] = await store.list()
        assert info.requests == 8  # refused requests are not counted as usage


async def test_token_limit_counts_finished_requests(redis_url) -> None:
    async with keystore(redis_url) as store:
        key = await store.add("tokens", tpm=50)
        now = 2_000_000 * WINDOW_S + 1.0
        first = await store.admit(key, now=now)
        assert first.status == "ok"
        await store.record(first.key_hash, 30, 10, now=now)
        assert (await store.admit(key, now=now)).status == "ok"  # 40 < 50
        await store.record(first.key_hash, 5, 5, now=now)
        refused = await store.admit(key, now=now)
        assert (refused.status, refused.limit, refused.retry_after) == ("limited", "tokens", 59)
        [info] = await store.list()
        assert (info.prompt_tokens, info.completion_tokens, info.requests) == (35, 15, 2)
        await store.remove("tokens")
        await store.record(first.key_hash, 1, 1, now=now)  # a request that ends after removal
        assert await store.list() == [] and (await store.admit(key, now=now)).status == "unknown"


def kvflow_keys(redis_url: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVFLOW_REDIS_URL": redis_url}
    return subprocess.run(
        [sys.executable, "-m", "kvflow.cli.main", "keys", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture(scope="module")
def gateway(nats_url, redis_url) -> Iterator[tuple[str, StandIn]]:
    stand_in = StandIn(nats_url)
    stand_in.start()
    port = free_port()
    settings = Settings.of(
        nats_url=nats_url,
        redis_url=redis_url,
        port=port,
        served_model_name=MODEL,
        api_key=STATIC,
        key_store="redis",
        request_timeout=5,
    )
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), port=port, log_level="warning", log_config=None)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "gateway did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", stand_in
    server.should_exit = True
    thread.join(10)
    stand_in.stop()


def post(base: str, key: str | None, prompt: str = "one two three", max_tokens: int = 4):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens}
    return httpx.post(f"{base}/v1/completions", json=body, headers=headers, timeout=10)


def test_gateway_401_without_a_valid_key_and_open_ops_routes(gateway) -> None:
    base, _ = gateway
    for key in (None, "sk-kvflow-wrong"):
        r = post(base, key)
        assert r.status_code == 401, r.text
        err = r.json()["error"]
        assert (err["type"], err["code"], err["param"]) == ("AuthenticationError", 401, None)
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx.get(f"{base}/v1/models", headers={"Authorization": "Basic abc"}, timeout=5)
    assert r.status_code == 401
    assert post(base, STATIC).status_code == 200
    for path in ("/version", "/metrics", "/openapi.json"):
        assert httpx.get(f"{base}{path}", timeout=5).status_code == 200, path
    assert httpx.get(f"{base}/health", timeout=5).status_code == 503  # open, not ready


def test_gateway_429_with_retry_after_and_usage_in_the_cli(gateway, redis_url) -> None:
    base, _ = gateway
    made = kvflow_keys(redis_url, "add", "limited", "--rpm", "2")
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    # 2 per one-minute window: a third request is refused (unless a new window began in
    # between, which allows at most two more)
    replies = [post(base, key) for _ in range(5)]
    codes = [r.status_code for r in replies]
    assert codes[:2] == [200, 200] and codes.count(200) <= 4 and 429 in codes, codes
    r = replies[codes.index(429)]
    assert (
        r.json()["error"]["type"] == "RateLimitError" and "requests" in r.json()["error"]["message"]
    )
    assert 1 <= int(r.headers["retry-after"]) <= WINDOW_S
    # token limit: 3 prompt + 4 generated tokens per request against 5 per minute
    tok = kvflow_keys(redis_url, "add", "thrifty", "--tpm", "5").stdout.strip()
    assert post(base, tok).status_code == 200
    deadline = time.monotonic() + 10  # usage is recorded just after the response
    while (r := post(base, tok)).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.status_code == 429 and "tokens" in r.json()["error"]["message"]
    listing = kvflow_keys(redis_url, "list")
    assert listing.returncode == 0
    rows = {line.split()[0]: line.split() for line in listing.stdout.splitlines()[1:]}
    assert rows["limited"][1:3] == ["2", "0"]  # rpm, tpm
    assert int(rows["limited"][3]) == codes.count(200)  # requests served
    assert int(rows["thrifty"][4]) >= 3 and int(rows["thrifty"][5]) >= 4  # prompt, completion
    assert kvflow_keys(redis_url, "remove", "limited").returncode == 0
    assert post(base, key).status_code == 401
    assert kvflow_keys(redis_url, "remove", "limited").returncode == 1
