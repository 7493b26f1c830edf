"""The scheduler's leader lease on a real redis-server: a lease that expired while Redis was
away (an outage, a Sentinel failover that lost the last writes) is taken again by its holder
with the same epoch, unless another scheduler holds it or led meanwhile."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvflow.services.scheduler.lease import Lease, LeaseLost
from kvflow.shared.infra import Server, start_redis

pytestmark = pytest.mark.integration


@pytest.fixture
def rds() -> Iterator[Server]:
    server = start_redis()
    try:
        yield server
    finally:
        server.stop()


async def test_an_expired_lease_is_taken_again_with_its_epoch(rds) -> None:
    a, b = Lease(rds.url, "m"), Lease(rds.url, "m")
    try:
        assert await a.try_acquire() and a.epoch == 1
        await a.redis.delete(a.key)  # expired while Redis was away
        await a.renew()
        assert a.valid() and a.epoch == 1
        assert not await b.try_acquire()  # a holds it again
        # the epoch write was lost with a failed primary: the holder puts it back, so a later
        # leader's epoch is still past this one
        await a.redis.set(a.epoch_key, 0)
        await a.redis.delete(a.key)
        await a.renew()
        assert int(await a.redis.get(a.epoch_key)) == 1
    finally:
        await a.close()
        await b.close()


async def test_an_expired_lease_another_took_or_led_is_lost(rds) -> None:
    a, b = Lease(rds.url, "m"), Lease(rds.url, "m")
    try:
        assert await a.try_acquire()
        await a.redis.delete(a.key)
        assert await b.try_acquire() and b.epoch == 2  # b took it while a was cut off
        with pytest.raises(LeaseLost, match="another scheduler took it"):
            await a.renew()
        await b.release()  # b led and let go: a must not lead again under its old epoch
        with pytest.raises(LeaseLost, match="led meanwhile"):
            await a.renew()
        assert await b.try_acquire()  # a gave the lease back
    finally:
        await a.close()
        await b.close()
