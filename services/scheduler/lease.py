"""The scheduler leader's lease in Redis, so that one scheduler of a cell plans and a standby
takes over when it dies.

redis-py's ``Lock`` does the hard parts (a random token, atomic check-and-extend in Lua). The
leader extends the lease every ``ttl/6`` (leadership.py) and treats it as valid only until its
last successful extension plus 0.8 ``ttl`` (``valid()``): a leader that stalls past that stops
planning before a standby can have taken over. Each new leader increments an epoch counter; plans carry
the epoch and workers ignore plans of older epochs (fencing a deposed leader that does not know
it yet).

Redis unreachable: the leader keeps leading (nobody else can take the lease either, so there is
no split brain) and tries again; a standby cannot take over until Redis is back.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

from redis.exceptions import LockError, RedisError

from kvflow.shared.access.connect import redis_from_url

if TYPE_CHECKING:
    from kvflow.shared.config import Settings

log = logging.getLogger("kvflow.scheduler.lease")


class LeaseLost(Exception):
    """Another scheduler holds the lease now."""


class Lease:
    def __init__(
        self, redis_url: str, cell: str, ttl_s: float = 3.0, options: dict[str, Any] | None = None
    ) -> None:
        """``options``: more ``redis_from_url`` arguments (the scheduler role's login)."""
        self.redis = redis_from_url(
            redis_url, socket_timeout=1.0, socket_connect_timeout=1.0, **(options or {})
        )
        self.key = f"kvflow:scheduler:{cell}:lease"
        self.epoch_key = f"kvflow:scheduler:{cell}:epoch"
        self.ttl_s = ttl_s
        self.lock = self.redis.lock(self.key, timeout=ttl_s, blocking=False)
        self.held_until = 0.0  # monotonic deadline of the lease as last confirmed
        self.epoch = 0

    async def led_before(self) -> bool:
        """Whether some scheduler has led this cell before (the epoch counter exists)."""
        try:
            return int(await self.redis.get(self.epoch_key) or 0) > 0
        except (RedisError, OSError):
            return False

    async def try_acquire(self) -> bool:
        """Take the lease if it is free; on success the epoch is incremented and kept."""
        try:
            if not await self.lock.acquire(blocking=False):
                return False
            self.held_until = time.monotonic() + self.ttl_s * 0.8
            self.epoch = int(await self.redis.incr(self.epoch_key))
            return True
        except (RedisError, OSError) as e:
            log.warning("lease: Redis unreachable (%s); cannot take the lease", e)
            return False

    async def renew(self) -> None:
        """Extend the lease; raises LeaseLost if another scheduler holds it or led meanwhile."""
        try:
            await self.lock.reacquire()
            self.held_until = time.monotonic() + self.ttl_s * 0.8
        except LockError:
            # not ours any more: it expired while Redis was away (an outage, a failover that
            # promoted a replica) or another scheduler took it
            await self._retake()
        except (RedisError, OSError) as e:
            # nobody can take the lease while Redis is away: keep leading
            log.warning("lease: Redis unreachable (%s); still leading", e)
            self.held_until = time.monotonic() + self.ttl_s * 0.8

    async def _retake(self) -> None:
        """Take the lease again after it expired, keeping this leadership's epoch, if nobody
        else holds it and nobody led since (the epoch counter has not moved past this one)."""
        try:
            if not await self.lock.acquire(blocking=False):
                raise LeaseLost("the lease expired and another scheduler took it")
            current = int(await self.redis.get(self.epoch_key) or 0)
            if current > self.epoch:
                await self.release()
                raise LeaseLost(f"another scheduler led meanwhile (epoch {current})")
            if current < self.epoch:  # the write was lost with a failed primary: put it back
                await self.redis.set(self.epoch_key, self.epoch)
        except (RedisError, OSError) as e:
            log.warning("lease: Redis unreachable (%s); still leading", e)
        else:
            log.warning("lease: taken again after it expired (epoch %d)", self.epoch)
        self.held_until = time.monotonic() + self.ttl_s * 0.8

    def valid(self) -> bool:
        return time.monotonic() < self.held_until

    async def release(self) -> None:
        try:
            await self.lock.release()
        except (LockError, RedisError, OSError):
            pass

    async def close(self) -> None:
        await self.redis.aclose()


async def lease_for(settings: Settings, model_name: str) -> Lease | None:
    """The leader lease of ``--scheduler-ha`` (None without), its Redis login checked."""
    from kvflow.shared.access.connect import redis_options, verify_redis

    if not settings.scheduler.scheduler_ha:
        return None
    if not settings.bus.redis_url:
        raise SystemExit("--scheduler-ha needs --redis-url (the lease lives in Redis)")
    opts = redis_options(settings.bus, "scheduler")
    lease = Lease(settings.bus.redis_url, model_name, options=opts)
    await verify_redis(lease.redis, "scheduler", settings.bus.redis_url)
    return lease
