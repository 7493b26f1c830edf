"""The KV tiers with a real redis-server: blocks round-trip through Redis, damaged or foreign
values read as misses, two configurations never share keys, and a Redis that stops switches the
tier off (counted) and back on when it returns. The host tier's LRU too."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
import torch

from kvflow.services.worker.kv_blocks import KvBlockIO
from kvflow.services.worker.kv_connectors import tiers as kv_tiers
from kvflow.services.worker.kv_connectors.tiers import HostTier, KvTiers, RedisTier
from kvflow.shared.infra import start_redis
from kvflow.shared.kv_tier import leading_present, tier_key
from kvflow.shared.messages import BlockRef, KvLoad, StepPlan

pytestmark = pytest.mark.integration


def cache(block_size: int, seed: int) -> KvBlockIO:
    g = torch.Generator().manual_seed(seed)
    shape = (8, block_size, 2, 16)
    return KvBlockIO(
        [(torch.randn(shape, generator=g), torch.randn(shape, generator=g)) for _ in range(3)]
    )


@pytest.fixture
def redis_url():
    server = start_redis()
    try:
        yield server.url
    finally:
        server.stop()


async def test_blocks_round_trip_and_damage_reads_as_a_miss(redis_url) -> None:
    io = cache(16, seed=1)
    tier = RedisTier(redis_url, io.layout(), io.block_bytes, ttl_s=60)
    try:
        blocks = {bytes([i]) * 16: io.read(i) for i in range(4)}
        assert await tier.store(list(blocks.items())) == 4
        assert await tier.store(list(blocks.items())) == 0  # already there: not rewritten
        got = await tier.load([*blocks, b"\xee" * 16])
        assert got[:4] == list(blocks.values()) and got[4] is None
        # a damaged value (one byte flipped) is a miss, never wrong K/V
        r = aioredis.from_url(redis_url)
        key = tier.key(bytes([2]) * 16)
        raw = bytearray(await r.get(key))
        raw[100] ^= 0xFF
        await r.set(key, bytes(raw))
        assert (await tier.load([bytes([2]) * 16]))[0] is None
        ttl = await r.ttl(tier.key(bytes([0]) * 16))
        assert 0 < ttl <= 60
        keys = [tier.key(h) for h in blocks]
        missing = tier.key(b"\xee" * 16)
        assert await leading_present(r, keys) == 4
        assert await leading_present(r, [keys[0], missing, keys[1]]) == 1  # up to the first gap
        await r.aclose()
    finally:
        await tier.close()


async def test_many_blocks_go_in_bounded_round_trips(redis_url, monkeypatch) -> None:
    """A long prefix is stored and loaded in batches of about BATCH_BYTES (each round trip
    within the short socket timeout), all blocks in order."""
    io = cache(16, seed=3)
    monkeypatch.setattr(kv_tiers, "BATCH_BYTES", 3 * io.block_bytes)  # 3 blocks per trip
    tier = RedisTier(redis_url, io.layout(), io.block_bytes)
    calls: list[int] = []
    real_mget = tier.redis.mget

    async def mget(keys):  # noqa: ANN001, ANN202 - counts round trips
        calls.append(len(keys))
        return await real_mget(keys)

    monkeypatch.setattr(tier.redis, "mget", mget)
    try:
        blocks = {bytes([i]) * 16: io.read(i % 8) for i in range(10)}
        assert await tier.store(list(blocks.items())) == 10
        assert tier.stored_blocks == 10
        assert await tier.load(list(blocks)) == list(blocks.values())
        assert calls == [3, 3, 3, 1]
    finally:
        await tier.close()


async def test_two_configurations_never_share_keys(redis_url) -> None:
    a, b = cache(16, seed=1), cache(8, seed=2)  # another block size: another layout
    assert a.layout() != b.layout()
    ta = RedisTier(redis_url, a.layout(), a.block_bytes)
    tb = RedisTier(redis_url, b.layout(), b.block_bytes)
    try:
        h = b"\x01" * 16
        assert ta.key(h) != tb.key(h) and ta.key(h) == tier_key(a.layout(), h)
        await ta.store([(h, a.read(0))])
        assert (await tb.load([h]))[0] is None  # b never sees a's block
        assert (await ta.load([h]))[0] == a.read(0)
        # even a value written under b's key by mistake with a's size reads as a miss
        await aioredis.from_url(redis_url).set(tb.key(h), (await ta.redis.get(ta.key(h))))
        assert (await tb.load([h]))[0] is None
    finally:
        await ta.close()
        await tb.close()


async def test_redis_down_switches_the_tier_off_and_back_on() -> None:
    server = start_redis()
    io = cache(16, seed=3)
    tier = RedisTier(server.url, io.layout(), io.block_bytes, timeout_s=0.3, probe_every_s=0.1)
    try:
        assert await tier.store([(b"\x05" * 16, io.read(5))]) == 1
        port = server.port
        server.stop()
        assert await tier.load([b"\x05" * 16]) == [None]  # served by recompute
        assert tier.state == "off" and tier.errors >= 1
        assert await tier.store([(b"\x06" * 16, io.read(6))]) == 0  # off: nothing attempted
        server = start_redis(port=port)  # Redis is back (empty)
        import asyncio

        await asyncio.sleep(0.2)
        assert await tier.available() and tier.state == "on"
        assert await tier.store([(b"\x06" * 16, io.read(6))]) == 1
        assert (await tier.load([b"\x06" * 16]))[0] == io.read(6)
    finally:
        await tier.close()
        server.stop()


def test_host_tier_is_a_bounded_lru() -> None:
    t = HostTier(capacity_bytes=30)
    for i in range(3):
        t.put(bytes([i]), b"x" * 10)
    assert len(t) == 3 and t.get(b"\x00") == b"x" * 10  # 0 is now the most recent
    t.put(b"\x03", b"y" * 10)  # over capacity: the least recently used (1) goes
    assert b"\x01" not in t and b"\x00" in t and t.take_evicted() == [b"\x01"]
    t.put(b"\x04", b"z" * 31)  # larger than the whole tier: not kept
    assert b"\x04" not in t and t.used <= 30


async def test_a_load_takes_the_host_tier_first_then_redis_up_to_the_first_gap(redis_url) -> None:
    """KvTiers (the worker's side of a KvLoad): each tier is asked for what the tiers before it
    lacked; blocks after the first block found in none are left to be computed."""
    src, dst = cache(16, seed=4), cache(16, seed=5)
    tiers = KvTiers.build(dst, host_gib=1.0, redis_url=redis_url, ttl_s=60)
    try:
        hashes = [bytes([i]) * 16 for i in range(6)]
        tiers.before_step(StepPlan(1, [], offload=[BlockRef(i, hashes[i]) for i in (0, 1)]))
        for i in (0, 1):  # host tier copies, taken before the step overwrote them
            assert tiers.host.get(hashes[i]) == dst.read(i)
        tiers.host.put(hashes[0], src.read(0))
        tiers.host.put(hashes[1], src.read(1))
        await tiers.store([(hashes[i], src.read(i)) for i in (1, 2, 3, 5)])  # 4 is missing
        order = KvLoad("l1", "r1", [BlockRef(7 - i, h) for i, h in enumerate(hashes)])
        loaded = await tiers.load(order)
        assert loaded.num_loaded == 4 and loaded.hits == {"host": 2, "redis": 2}
        assert loaded.num_bytes == 4 * dst.block_bytes
        assert all(dst.read(7 - i) == src.read(i) for i in range(4))
        assert dst.read(2) != src.read(5)  # after the gap: not loaded
        fields = tiers.heartbeat_fields()
        assert fields["redis_tier"] == "on" and fields["host_tier_blocks"] == 2
    finally:
        await tiers.redis.close()
