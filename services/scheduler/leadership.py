"""Whether this scheduler leads, and in which epoch (high availability: ``--scheduler-ha``).

Schedulers of a cell compete for a lease in Redis (lease.py). The leader plans; a standby keeps
a shadow of every live request and its tokens from the bus (shadow.py) and, when the leader's
lease lapses, takes over: a new epoch (workers drop the old leader's state and ignore its
plans), every live request re-queued from its prompt plus the tokens it already has (what
leading takes is the service's ``take_over``). With no lease the scheduler simply leads, in
epoch 1. A leader leads once: deposed (its lease lost, a plan answered with a newer epoch) or
handing over (SIGTERM), it stops."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from kvflow.services.scheduler.lease import Lease, LeaseLost

log = logging.getLogger("kvflow.scheduler")


class Leadership:
    """The lease, the epoch and whether this scheduler may plan."""

    def __init__(self, lease: Lease | None, scheduler_id: str, stopped: asyncio.Event) -> None:
        self.lease = lease
        self.scheduler_id = scheduler_id
        self.stopped = stopped  # set when this scheduler is to stop (deposed, handed over)
        self.leading = False
        self.epoch = 0
        self._handing_over = False

    def lead(self, epoch: int) -> None:
        """Lead from now on, in ``epoch``."""
        assert not self.leading, "a scheduler leads once"
        self.epoch = epoch
        self.leading = True

    def may_plan(self) -> bool:
        """Leading, with the lease (if any) confirmed recently enough."""
        return self.leading and (self.lease is None or self.lease.valid())

    async def campaign(self, take_over: Callable[[int], Awaitable[None]]) -> None:
        """With a lease: try for it as a standby (``take_over`` once it is ours); keep it as the
        leader, or stop if another scheduler has it."""
        lease = self.lease
        assert lease is not None
        if await lease.led_before():
            # a scheduler started after a leader existed knows none of the requests in flight
            # (its shadow is empty): it lets a standby that shadowed them take the lease first
            # (a standby tries every 0.25 s once the lease is free), and leads only if none did
            await asyncio.sleep(2 * lease.ttl_s)
        while not self.stopped.is_set():
            if not self.leading:
                if not self._handing_over and await lease.try_acquire():
                    await take_over(lease.epoch)
            else:
                try:
                    await lease.renew()
                except LeaseLost as e:
                    log.error("%s lost the lease (%s); stopping", self.scheduler_id, e)
                    self.stopped.set()
                    return
            await asyncio.sleep(lease.ttl_s / 6 if self.leading else 0.25)

    def deposed(self, why: str) -> None:
        """A newer epoch leads (a worker said so): stop planning, and stop."""
        log.error("%s: deposed (%s); stopping", self.scheduler_id, why)
        self.leading = False
        self.stopped.set()

    def hand_over(self) -> None:
        """SIGTERM with a standby: let the lease go (``close``); the standby resumes every live
        request from the shadow it keeps."""
        self._handing_over = True
        self.leading = False
        self.stopped.set()

    async def close(self) -> None:
        if self.lease is not None:
            await self.lease.release()
            await self.lease.close()
