"""KV cache tiers below a worker's paged cache: a bounded host-memory LRU of evicted blocks, and
Redis, shared by every worker and surviving restarts. Both are ``KvTier``s (sources and sinks of
blocks by hash); ``KvTiers`` is the worker's side of them (offload, store, load, heartbeat).

Values are a block's bytes (``KvBlockIO.read``: every layer's K and V) behind a 4-byte CRC-32,
so a damaged value reads as a miss. Redis keys come from shared.kv_tier.tier_key (layout and
salted prefix hash), so two configurations never share a key. Values expire
after ``ttl_s`` and Redis evicts by its own memory policy: a tier may lose a block at any time,
and a lost block is simply recomputed.

Redis unreachable or slow (every call has a short timeout): the tier switches off with a
warning and counts the error; requests are served by recompute; a probe every few seconds
switches it on again when Redis answers.
"""

from __future__ import annotations

import logging
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from redis.exceptions import RedisError

from kvflow.services.worker.kv_blocks import KvBlockIO
from kvflow.services.worker.kv_connectors.base import KvTier
from kvflow.shared.access.connect import redis_from_url
from kvflow.shared.kv_tier import tier_key
from kvflow.shared.messages import KvLoad, StepPlan

log = logging.getLogger("kvflow.worker.tiers")

_CRC = struct.Struct("<I")


def pack(data: bytes) -> bytes:
    return _CRC.pack(zlib.crc32(data)) + data


def unpack(value: bytes | None, size: int) -> bytes | None:
    """The block's bytes, or None when missing, of another size, or damaged."""
    if value is None or len(value) != _CRC.size + size:
        return None
    data = value[_CRC.size :]
    return data if _CRC.unpack_from(value)[0] == zlib.crc32(data) else None


class HostTier:
    """Evicted blocks in host memory, least recently used dropped first. The model thread puts,
    the event loop gets: a lock keeps the LRU consistent."""

    name = "host"

    def __init__(self, capacity_bytes: int) -> None:
        self._lock = threading.Lock()
        self.capacity = max(0, capacity_bytes)
        self.used = 0
        self.blocks: OrderedDict[bytes, bytes] = OrderedDict()
        self.evicted: list[bytes] = []  # hashes dropped since the last take_evicted()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self.blocks)

    def __contains__(self, key: object) -> bool:
        return key in self.blocks

    def put(self, key: bytes, data: bytes) -> None:
        if len(data) > self.capacity:
            return
        with self._lock:
            old = self.blocks.pop(key, None)
            if old is not None:
                self.used -= len(old)
            self.blocks[key] = data
            self.used += len(data)
            while self.used > self.capacity:
                k, v = self.blocks.popitem(last=False)
                self.used -= len(v)
                self.evicted.append(k)

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            data = self.blocks.get(key)
            if data is None:
                self.misses += 1
                return None
            self.blocks.move_to_end(key)
            self.hits += 1
            return data

    async def load(self, hashes: list[bytes]) -> list[bytes | None]:
        """The leading blocks held here; None from the first missing one on (blocks after a
        gap are of no use, and looking them up would reorder the LRU)."""
        out: list[bytes | None] = []
        for h in hashes:
            data = self.get(h)
            if data is None:
                break
            out.append(data)
        return out + [None] * (len(hashes) - len(out))

    async def store(self, items: list[tuple[bytes, bytes]]) -> int:
        for h, data in items:
            self.put(h, data)
        return len(items)

    def take_evicted(self) -> list[bytes]:
        with self._lock:
            out, self.evicted = self.evicted, []
        return out


# bytes of KV per Redis round trip (a pipeline of SETs, one MGET)
BATCH_BYTES = 4 * 1024 * 1024


class RedisTier:
    name = "redis"

    def __init__(
        self,
        url: str,
        layout: str,
        block_bytes: int,
        ttl_s: int = 3600,
        timeout_s: float = 0.5,
        probe_every_s: float = 2.0,
        options: dict[str, Any] | None = None,
    ) -> None:
        """``options``: more ``redis_from_url`` arguments (the worker role's login,
        shared/access/connect.redis_options)."""
        self.redis = redis_from_url(
            url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, **(options or {})
        )
        self.layout = layout
        self.block_bytes = block_bytes
        self.ttl_s = ttl_s
        self.probe_every_s = probe_every_s
        self.enabled = True
        self.errors = 0
        self.stored_blocks = 0
        self._next_probe = 0.0

    def key(self, block_hash: bytes) -> str:
        return tier_key(self.layout, block_hash)

    @property
    def state(self) -> str:
        return "on" if self.enabled else "off"

    def _failed(self, what: str, e: Exception) -> None:
        self.errors += 1
        if self.enabled:
            log.warning(
                "Redis KV tier off (%s failed: %s); blocks are recomputed until Redis answers",
                what,
                e,
            )
        self.enabled = False
        self._next_probe = time.monotonic() + self.probe_every_s

    async def available(self) -> bool:
        """On, or back on after a successful probe (at most every ``probe_every_s``)."""
        if self.enabled:
            return True
        if time.monotonic() < self._next_probe:
            return False
        try:
            await self.redis.ping()
        except (RedisError, OSError) as e:
            self._failed("probe", e)
            return False
        log.info("Redis KV tier on again")
        self.enabled = True
        return True

    def _batch(self) -> int:
        """Blocks per round trip: each call's timeout then covers a few MiB, not a whole
        1,000-token prefix (~44 MiB of fp32 KV) on a busy machine."""
        return max(1, BATCH_BYTES // max(1, self.block_bytes))

    async def store(self, items: list[tuple[bytes, bytes]]) -> int:
        """SET each (hash, bytes) with the expiry, unless present; returns blocks written."""
        if not items or not await self.available():
            return 0
        written = 0
        n = self._batch()
        try:
            for i in range(0, len(items), n):
                async with self.redis.pipeline(transaction=False) as pipe:
                    for h, data in items[i : i + n]:
                        pipe.set(self.key(h), pack(data), ex=self.ttl_s, nx=True)
                    done = sum(1 for ok in await pipe.execute() if ok)
                written += done
                self.stored_blocks += done
        except (RedisError, OSError) as e:
            self._failed("store", e)
        return written

    async def load(self, hashes: list[bytes]) -> list[bytes | None]:
        """Each block's bytes, or None (missing, damaged, or the tier is off)."""
        if not hashes or not await self.available():
            return [None] * len(hashes)
        values: list[bytes | None] = []
        n = self._batch()
        try:
            for i in range(0, len(hashes), n):
                values += await self.redis.mget([self.key(h) for h in hashes[i : i + n]])
        except (RedisError, OSError) as e:
            self._failed("load", e)
            return [None] * len(hashes)
        return [unpack(v, self.block_bytes) for v in values]

    async def close(self) -> None:
        try:
            await self.redis.aclose()
        except (RedisError, OSError):
            pass


@dataclass
class LoadResult:
    """What a KvLoad filled: the leading blocks found, and where."""

    num_loaded: int = 0
    hits: dict[str, int] = field(default_factory=dict)  # tier name -> blocks found there
    num_bytes: int = 0


class KvTiers:
    """The worker's tiers in lookup order (host, then Redis). The scheduler decides what goes
    where: a plan's ``offload`` blocks (about to be overwritten) go to the host tier, its
    ``store`` blocks (completed) to Redis."""

    def __init__(self, io: KvBlockIO, host: HostTier, redis: RedisTier | None = None) -> None:
        self.io = io
        self.host = host
        self.redis = redis
        self.tiers: list[KvTier] = [host] + ([redis] if redis else [])

    @classmethod
    def build(
        cls,
        io: KvBlockIO,
        host_gib: float,
        redis_url: str = "",
        ttl_s: int = 3600,
        redis_options: dict[str, Any] | None = None,
    ) -> KvTiers:
        """A host tier of ``host_gib`` (0: none) and a Redis tier at ``redis_url`` ("": none)."""
        host = HostTier(int(host_gib * 2**30))
        redis = (
            RedisTier(redis_url, io.layout(), io.block_bytes, ttl_s=ttl_s, options=redis_options)
            if redis_url
            else None
        )
        return cls(io, host, redis)

    def before_step(self, plan: StepPlan) -> None:
        """On the model thread: copy the blocks this step will overwrite to the host tier."""
        for ref in plan.offload:
            self.host.put(ref.hash, self.io.read(ref.block))

    def after_step(self, plan: StepPlan) -> list[tuple[bytes, bytes]]:
        """On the model thread: the full blocks the step completed, for ``store`` (Redis)."""
        if self.redis is None:
            return []
        return [(ref.hash, self.io.read(ref.block)) for ref in plan.store]

    async def store(self, items: list[tuple[bytes, bytes]]) -> None:
        if items and self.redis is not None:
            await self.redis.store(items)

    async def load(self, order: KvLoad) -> LoadResult:
        """Fill the order's blocks from the tiers, in order, each tier asked for what the
        ones before it lacked, up to the first block found in none."""
        data: list[bytes] = []
        hits: dict[str, int] = {}
        for tier in self.tiers:
            rest = order.blocks[len(data) :]
            if not rest:
                break
            found = 0
            for d in await tier.load([r.hash for r in rest]):
                if d is None:
                    break
                data.append(d)
                found += 1
            hits[tier.name] = found
        for ref, d in zip(order.blocks, data, strict=False):
            self.io.write(ref.block, d)
        return LoadResult(len(data), hits, sum(len(d) for d in data))

    def take_evicted(self) -> list[bytes]:
        return self.host.take_evicted()

    async def probe(self) -> None:
        """A switched-off Redis tier tries again (on when Redis answers)."""
        if self.redis is not None and not self.redis.enabled:
            await self.redis.available()

    def heartbeat_fields(self) -> dict[str, str | int]:
        r = self.redis
        return {
            "redis_tier": r.state if r is not None else "",
            "redis_tier_errors": r.errors if r is not None else 0,
            "redis_stored_blocks": r.stored_blocks if r is not None else 0,
            "host_tier_blocks": len(self.host),
            "host_tier_bytes": self.host.capacity,
        }
