"""Requests into the scheduler: each tokenized request is queued in the core (its adapter
checked against the registry, the Redis KV tier asked how much of its prompt it holds) and
acknowledged to its gateway (Accepted; the gateway resubmits until then, and an id runs once),
or refused: 429 with the queue full, 503 while the scheduler shuts down, 404 for an adapter
that does not exist. Aborts end requests. A standby only remembers requests (the shadow); a new
leader resumes the live ones from it."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvflow.services.scheduler.core import QueueFullError, SchedulerCore
from kvflow.services.scheduler.leadership import Leadership
from kvflow.services.scheduler.lora_control import LoraControl
from kvflow.services.scheduler.shadow import ShadowState
from kvflow.shared.bus import Bus
from kvflow.shared.kv_tier import leading_present
from kvflow.shared.lora import adapter_salt
from kvflow.shared.messages import Abort, Accepted, RequestError, TokenizedRequest

log = logging.getLogger("kvflow.scheduler")


class Intake:
    """Requests and aborts, as the leader answers them and a standby remembers them."""

    def __init__(
        self,
        core: SchedulerCore,
        bus: Bus,
        shadow: ShadowState,
        leadership: Leadership,
        loras: LoraControl,
        wake: Callable[[], None],
        tier_redis: Any = None,
    ) -> None:
        """``wake``: tells every worker's loop there may be work; ``tier_redis``: the Redis KV
        tier's client (None without one)."""
        self.core = core
        self.bus = bus
        self.shadow = shadow
        self.leadership = leadership
        self.loras = loras
        self.wake = wake
        self.tier_redis = tier_redis
        self.accepting = True  # False once the scheduler shuts down

    async def on_request(self, req: TokenizedRequest) -> None:
        if self.shadow.is_finished(req.request_id):
            return  # a resubmission of a request that already ran: it runs once
        if not self.leadership.leading:
            self.shadow.add(req)  # the leader answers; a standby only remembers
            return
        if not self.accepting:
            await self._reject(req, "the scheduler is shutting down; retry", 503)
            return
        if not await self.loras.resolve(req):
            return
        redis_blocks = await self._redis_prefix(req)
        try:
            self.core.add_request(req, req.priority, redis_prefix_blocks=redis_blocks)
        except QueueFullError as e:
            await self._reject(req, f"{e}; retry later")
            return
        self.shadow.add(req)
        await self.bus.publish(req.reply_to, Accepted(req.request_id))
        self.wake()

    def on_abort(self, msg: Abort) -> None:
        self.shadow.end(msg.request_id)
        if self.leadership.leading and self.core.abort(msg.request_id):
            self.wake()

    def close(self) -> None:
        """Accept nothing new (the scheduler shuts down): 503 from now on."""
        self.accepting = False

    async def resume(self) -> int:
        """A new leader: every live request the shadow knows of is queued again, from its
        prompt plus the tokens it already has (recompute). Returns how many."""
        resumed = 0
        for rid, live in list(self.shadow.live.items()):
            try:
                self.core.add_request(live.request, live.request.priority, live.output_ids)
                resumed += 1
            except QueueFullError:
                self.shadow.end(rid)
                await self._reject(live.request, "the scheduler changed and its queue is full")
        return resumed

    async def acknowledge_live(self) -> None:
        """A new leader acknowledges every live request (their gateways may still wait)."""
        for live in self.shadow.live.values():
            await self.bus.publish(live.request.reply_to, Accepted(live.request.request_id))

    async def _reject(self, req: TokenizedRequest, why: str, code: int = 429) -> None:
        kind = "RateLimitError" if code == 429 else "ServiceUnavailableError"
        await self.bus.publish(req.reply_to, RequestError(req.request_id, why, kind, None, code))

    async def _redis_prefix(self, req: TokenizedRequest) -> int:
        """How many of the prompt's leading full blocks the Redis KV tier holds (asked before
        admission, so that a prefix stored by any worker, before any restart, is loaded rather
        than recomputed; bounded by a short timeout, and 0 without a tier)."""
        if self.tier_redis is None or req.params.prompt_logprobs is not None:
            return 0
        keys = self.core.redis_keys_for(
            req.prompt_token_ids, adapter_salt(req.cache_salt, req.lora)
        )
        return await leading_present(self.tier_redis, keys) if keys else 0
