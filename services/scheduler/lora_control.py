"""The scheduler's LoRA requests: list, load and unload adapters for the gateways (request/reply
on ``kvflow.scheduler.lora``, answered by the leader), and the adapter check of each incoming
request. Loading asks every live worker to read and check the adapter first (``LoraLoad`` on its
step subject, request/reply): the adapter exists only when all of them can serve it, so every
worker agrees on which adapters exist; unloading tells them all to forget it. The registry is
kept in Redis (when there is one) for a restarted scheduler or the standby that takes over."""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

import msgspec
from nats.aio.msg import Msg

from kvflow.services.scheduler.lora_registry import LoraRegistry
from kvflow.shared.bus import Bus
from kvflow.shared.lora import LoRAError
from kvflow.shared.messages import (
    LoraAdapters,
    LoraList,
    LoraLoad,
    LoRARef,
    LoraUnload,
    RequestError,
    TokenizedRequest,
)

log = logging.getLogger("kvflow.scheduler")

WORKER_CHECK_TIMEOUT_S = 60.0  # a worker reads and checks an adapter's files within this


class LiveWorkers(Protocol):
    """The workers to ask (membership.py): (id, step subject) of each."""

    def live_subjects(self) -> list[tuple[str, str]]: ...


class LoraControl:
    """The adapter registry's requests, its checks on the workers and its copy in Redis
    (``store``: a Redis client, or None: a restarted scheduler then knows only
    ``--lora-modules``)."""

    def __init__(
        self,
        registry: LoraRegistry,
        bus: Bus,
        model_name: str,
        workers: LiveWorkers,
        store: Any = None,
    ) -> None:
        self.registry = registry
        self.bus = bus
        self.model_name = model_name
        self.workers = workers
        self.store = store
        self.key = f"kvflow:scheduler:lora:{model_name}"

    async def serve(self, msg: LoraList | LoraLoad | LoraUnload, raw: Msg) -> None:
        """Answer one gateway LoRA request (the leader only)."""
        reg = self.registry
        try:
            match msg:
                case LoraLoad():
                    if reg.check_new(msg.name, msg.path, self.model_name):
                        await self._check_on_workers(msg)
                        # again: a concurrent load of the same name may have finished meanwhile
                        if reg.check_new(msg.name, msg.path, self.model_name):
                            ref = reg.add(msg.name, msg.path)
                            log.info(
                                "LoRA adapter %s (id %d) loaded from %s", ref.name, ref.id, ref.path
                            )
                case LoraUnload():
                    ref = reg.remove(msg.name)
                    for _, subject in self.workers.live_subjects():
                        await self.bus.publish(subject, LoraUnload(ref.name))
                    log.info("LoRA adapter %s unloaded", ref.name)
            if not isinstance(msg, LoraList):
                await self._persist()
            answer = LoraAdapters(reg.list())
        except LoRAError as e:
            answer = LoraAdapters(reg.list(), str(e), e.status, e.param)
        await self.bus.reply(raw, answer)

    async def _check_on_workers(self, msg: LoraLoad) -> None:
        """Have every live worker read and check the adapter; raises LoRAError with the first
        refusal (or 503 when no worker answers)."""
        live = self.workers.live_subjects()
        if not live:
            raise LoRAError("no worker is up to check the adapter; retry", None, 503)

        async def ask(wid: str, subject: str) -> LoraAdapters:
            try:
                got = await self.bus.request(
                    subject, LoraLoad(msg.name, msg.path), WORKER_CHECK_TIMEOUT_S
                )
            except Exception as e:  # noqa: BLE001 - a worker that cannot answer refuses
                why = f"worker {wid} did not answer ({type(e).__name__})"
                return LoraAdapters(error=why, code=503)
            if not isinstance(got, LoraAdapters):
                return LoraAdapters(error=f"worker {wid} answered {type(got).__name__}", code=500)
            return got

        answers = await asyncio.gather(*(ask(w, s) for w, s in live))
        for (wid, _), a in zip(live, answers, strict=True):
            if a.error:
                log.warning("LoRA adapter %s refused by worker %s: %s", msg.name, wid, a.error)
                raise LoRAError(a.error, a.param or "lora_path", a.code)

    async def _persist(self) -> None:
        """Keep the registry in Redis: a restarted scheduler, or the standby that takes over,
        serves the adapters loaded at run time (``restore``)."""
        if self.store is None:
            return
        try:
            await self.store.set(self.key, msgspec.json.encode(self.registry.list()))
        except Exception as e:  # noqa: BLE001 - the adapters still work; only a restart forgets
            log.warning("LoRA registry not saved in Redis (%s): a restart forgets it", e)

    async def restore(self) -> None:
        """A new leader (or a restarted one): take the adapters the registry had."""
        if self.store is None:
            return
        try:
            raw = await self.store.get(self.key)
            refs = msgspec.json.decode(raw, type=list[LoRARef]) if raw else []
        except Exception as e:  # noqa: BLE001 - the static adapters remain
            log.warning("LoRA registry not read from Redis (%s)", e)
            return
        for ref in refs:
            if ref.name not in self.registry.adapters:
                self.registry.restore(ref)
        if refs:
            log.info("LoRA adapters restored from Redis: %s", ", ".join(r.name for r in refs))

    async def resolve(self, req: TokenizedRequest) -> bool:
        """Give ``req`` the registry's adapter for the one it names; False (and a 404 to its
        gateway) when that adapter does not exist."""
        if req.lora is None:
            return True
        try:
            req.lora = self.registry.resolve(req.lora)
            return True
        except LoRAError as e:
            err = RequestError(req.request_id, str(e), "NotFoundError", e.param, e.status)
            await self.bus.publish(req.reply_to, err)
            return False
