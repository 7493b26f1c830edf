"""What the scheduler and the workers must agree on about the Redis KV tier: the key of a block,
and a quick check of how much of a prefix Redis holds (the scheduler asks when a request
arrives; the workers read and write the values, services/worker/kv_connectors/tiers.py)."""

from __future__ import annotations

import asyncio

import redis.asyncio as aioredis
from redis.exceptions import RedisError


def tier_key(layout: str, block_hash: bytes) -> str:
    """``kvflow:kv:<layout>:<hash>``. The hash is chained over the prefix's tokens and salted
    with the model and block size; the layout names the dtype and block shape: two
    configurations never share a key."""
    return f"kvflow:kv:{layout}:{block_hash.hex()}"


async def leading_present(redis: aioredis.Redis, keys: list[str], timeout_s: float = 0.5) -> int:
    """How many leading ``keys`` exist in Redis; 0 when it does not answer in time (a miss is
    always safe: the blocks are recomputed)."""
    if not keys:
        return 0
    try:
        async with asyncio.timeout(timeout_s):
            async with redis.pipeline(transaction=False) as pipe:
                for k in keys:
                    pipe.exists(k)
                found = await pipe.execute()
    except (RedisError, OSError, TimeoutError):
        return 0
    n = 0
    for f in found:
        if not f:
            break
        n += 1
    return n
