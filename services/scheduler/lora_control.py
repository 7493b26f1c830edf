"""The scheduler's LoRA requests: list, load and unload adapters for the gateways (request/reply
on ``kvflow.scheduler.lora``, answered by the leader), and the adapter check of each incoming
request. Loading asks every live worker to read and check the adapter first (``LoraLoad`` on its
step subject, request/reply): the adapter exists only when all of them can serve it, so every
worker agrees on which adapters exist; unloading tells them all to forget it."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

import msgspec
from nats.aio.msg import Msg

from kvflow.shared.access.connect import redis_client
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

if TYPE_CHECKING:
    from kvflow.services.scheduler.service import SchedulerService

log = logging.getLogger("kvflow.scheduler")

WORKER_CHECK_TIMEOUT_S = 60.0  # a worker reads and checks an adapter's files within this


async def serve(svc: SchedulerService, msg: LoraList | LoraLoad | LoraUnload, raw: Msg) -> None:
    """Answer one gateway LoRA request (the leader only)."""
    reg = svc.loras
    try:
        match msg:
            case LoraLoad():
                if reg.check_new(msg.name, msg.path, svc.model_name):
                    await _check_on_workers(svc, msg)
                    # again: a concurrent load of the same name may have finished meanwhile
                    if reg.check_new(msg.name, msg.path, svc.model_name):
                        ref = reg.add(msg.name, msg.path)
                        log.info(
                            "LoRA adapter %s (id %d) loaded from %s", ref.name, ref.id, ref.path
                        )
            case LoraUnload():
                ref = reg.remove(msg.name)
                for wid in svc.core.workers:
                    if wid in svc.step_subject:
                        await svc.bus.publish(svc.step_subject[wid], LoraUnload(ref.name))
                log.info("LoRA adapter %s unloaded", ref.name)
        if not isinstance(msg, LoraList):
            await _persist(svc)
        answer = LoraAdapters(reg.list())
    except LoRAError as e:
        answer = LoraAdapters(reg.list(), str(e), e.status, e.param)
    await svc.bus.reply(raw, answer)


async def _check_on_workers(svc: SchedulerService, msg: LoraLoad) -> None:
    """Have every live worker read and check the adapter; raises LoRAError with the first
    refusal (or 503 when no worker answers)."""
    wids = [w for w in svc.core.workers if w in svc.step_subject]
    if not wids:
        raise LoRAError("no worker is up to check the adapter; retry", None, 503)

    async def ask(wid: str) -> LoraAdapters:
        try:
            got = await svc.bus.request(
                svc.step_subject[wid], LoraLoad(msg.name, msg.path), WORKER_CHECK_TIMEOUT_S
            )
        except Exception as e:  # noqa: BLE001 - a worker that cannot answer refuses
            return LoraAdapters(error=f"worker {wid} did not answer ({type(e).__name__})", code=503)
        if not isinstance(got, LoraAdapters):
            return LoraAdapters(error=f"worker {wid} answered {type(got).__name__}", code=500)
        return got

    answers = await asyncio.gather(*(ask(w) for w in wids))
    for wid, a in zip(wids, answers, strict=True):
        if a.error:
            log.warning("LoRA adapter %s refused by worker %s: %s", msg.name, wid, a.error)
            raise LoRAError(a.error, a.param or "lora_path", a.code)


def _key(svc: SchedulerService) -> str:
    return f"kvflow:scheduler:lora:{svc.model_name}"


def _store(svc: SchedulerService) -> Any:
    """Where the registry is kept: the lease's Redis, else the stack's Redis (``--redis-url``),
    else nowhere (a restarted scheduler then knows only ``--lora-modules``)."""
    reg = svc.loras
    if reg.store is None and reg.enabled:
        if svc.lease is not None:
            reg.store = svc.lease.redis
        elif svc.settings.bus.redis_url:
            opts = {"socket_timeout": 1.0, "socket_connect_timeout": 1.0}
            reg.store = redis_client(svc.settings.bus, "scheduler", **opts)
    return reg.store


async def _persist(svc: SchedulerService) -> None:
    """Keep the registry in Redis: a restarted scheduler, or the standby that takes over,
    serves the adapters loaded at run time (``restore``)."""
    store = _store(svc)
    if store is None:
        return
    try:
        await store.set(_key(svc), msgspec.json.encode(svc.loras.list()))
    except Exception as e:  # noqa: BLE001 - the adapters still work; only a restart forgets
        log.warning("LoRA registry not saved in Redis (%s): a restart forgets it", e)


async def restore(svc: SchedulerService) -> None:
    """A new leader (or a restarted one): take the adapters the registry had."""
    store = _store(svc)
    if store is None:
        return
    try:
        raw = await store.get(_key(svc))
        refs = msgspec.json.decode(raw, type=list[LoRARef]) if raw else []
    except Exception as e:  # noqa: BLE001 - the static adapters remain
        log.warning("LoRA registry not read from Redis (%s)", e)
        return
    for ref in refs:
        if ref.name not in svc.loras.adapters:
            svc.loras.restore(ref)
    if refs:
        log.info("LoRA adapters restored from Redis: %s", ", ".join(r.name for r in refs))


async def resolve(svc: SchedulerService, req: TokenizedRequest) -> bool:
    """Give ``req`` the registry's adapter for the one it names; False (and a 404 to its
    gateway) when that adapter does not exist."""
    if req.lora is None:
        return True
    try:
        req.lora = svc.loras.resolve(req.lora)
        return True
    except LoRAError as e:
        err = RequestError(req.request_id, str(e), "NotFoundError", e.param, e.status)
        await svc.bus.publish(req.reply_to, err)
        return False
