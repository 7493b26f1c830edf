"""The scheduler service: a thin NATS shell around SchedulerCore. It receives tokenized requests,
aborts, worker heartbeats, step results and KV-transfer reports; for each worker it runs a loop
that plans a step, sends it, and waits for that step's result before planning the next. Prefill
hand-offs become KvPull orders to the decode worker; a draining worker is released (and
forgotten) once nothing of it is needed."""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg

from services.scheduler.engine import QueueFullError, SchedulerCore
from services.scheduler.policy import ROLES, SchedulerLimits, WorkerScheduler
from shared import subjects
from shared.bus import Bus
from shared.config import Settings
from shared.messages import (
    Abort,
    KvTransferDone,
    Message,
    RequestError,
    StatsRequest,
    StepResult,
    TokenizedRequest,
    WorkerHeartbeat,
    WorkerRelease,
)

log = logging.getLogger("kvflow.scheduler")

HEARTBEAT_TIMEOUT_S = 10.0  # a worker silent this long is considered gone
STEP_TIMEOUT_S = 120.0  # a step that takes longer is considered lost
TRANSFER_TIMEOUT_S = 120.0  # a KV transfer not reported done by then is given up


class SchedulerService:
    def __init__(self, settings: Settings, model_name: str, max_model_len: int) -> None:
        limits = SchedulerLimits(
            max_num_seqs=settings.max_num_seqs,
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_model_len=max_model_len,
        )
        self.settings = settings
        self.core = SchedulerCore(limits, settings.max_waiting, model_name)
        self.bus = Bus("scheduler")
        self.wake: dict[str, asyncio.Event] = {}
        self.pending: dict[tuple[str, int], asyncio.Future[StepResult]] = {}
        self.step_subject: dict[str, str] = {}
        self.last_seen: dict[str, float] = {}

    async def start(self) -> None:
        await self.bus.connect(self.settings.nats_url)
        await self.bus.subscribe(subjects.REQUESTS, self._on_message)
        await self.bus.subscribe(subjects.ABORT, self._on_message)
        await self.bus.subscribe(subjects.RESULTS, self._on_message)
        await self.bus.subscribe(subjects.HEARTBEAT, self._on_message)
        await self.bus.subscribe(subjects.SCHEDULER_STATS, self._on_message)
        await self.bus.subscribe(subjects.KV_DONE, self._on_message)
        self.bus.spawn(self._watch_workers())
        log.info(
            "scheduler ready (model %s, max_model_len %d)",
            self.core.model,
            self.core.limits.max_model_len,
        )

    async def _on_message(self, msg: Message, raw: Msg) -> None:
        match msg:
            case TokenizedRequest():
                await self._on_request(msg)
            case Abort():
                if self.core.abort(msg.request_id):
                    self._wake_all()
            case StepResult():
                fut = self.pending.pop((msg.worker_id, msg.step_id), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            case WorkerHeartbeat():
                await self._on_heartbeat(msg)
            case KvTransferDone():
                self.core.on_transfer_done(msg)
                self._wake_all()
            case StatsRequest():
                await self.bus.reply(raw, self.core.stats())
            case _:
                log.warning("scheduler: unexpected %s on %s", type(msg).__name__, raw.subject)

    async def _on_request(self, req: TokenizedRequest) -> None:
        try:
            self.core.add_request(req, req.priority)
        except QueueFullError as e:
            err = RequestError(req.request_id, f"{e}; retry later", "RateLimitError", None, 429)
            await self.bus.publish(req.reply_to, err)
            return
        self._wake_all()

    async def _on_heartbeat(self, hb: WorkerHeartbeat) -> None:
        self.last_seen[hb.worker_id] = time.monotonic()
        known = hb.worker_id in self.core.workers
        if known:
            if hb.draining and not self.core.workers[hb.worker_id].draining:
                log.info("worker %s is draining: no new work goes there", hb.worker_id)
                self.core.set_draining(hb.worker_id)
                await self._release_drained()
            return
        if hb.draining:  # a draining worker we do not know: nothing of ours runs there
            self.step_subject[hb.worker_id] = hb.step_subject
            await self.bus.publish(hb.step_subject, WorkerRelease(hb.worker_id))
            return
        if hb.role not in ROLES:
            log.warning("worker %s has unknown role %r; ignored", hb.worker_id, hb.role)
            return
        ws = self.core.add_worker(
            hb.worker_id,
            hb.num_blocks,
            hb.block_size,
            role=hb.role,
            kv_subject=hb.kv_subject,
            kv_layout=hb.kv_layout,
        )
        self.step_subject[hb.worker_id] = hb.step_subject
        self.wake[hb.worker_id] = asyncio.Event()
        self.wake[hb.worker_id].set()
        self.bus.spawn(self._worker_loop(ws))
        log.info(
            "worker %s joined (role %s): %d blocks of %d tokens",
            hb.worker_id,
            hb.role,
            hb.num_blocks,
            hb.block_size,
        )
        self._wake_all()

    async def _release_drained(self) -> None:
        """Release draining workers that nothing needs any more: they exit on WorkerRelease."""
        for wid in list(self.core.workers):
            if self.core.drained(wid):
                log.info("worker %s drained; releasing it", wid)
                self.core.remove_worker(wid)
                self.wake.pop(wid, None)
                await self.bus.publish(self.step_subject[wid], WorkerRelease(wid))

    def _wake_all(self) -> None:
        for ev in self.wake.values():
            ev.set()

    async def _worker_loop(self, ws: WorkerScheduler) -> None:
        wid = ws.worker_id
        loop = asyncio.get_running_loop()
        while wid in self.core.workers:
            ev = self.wake[wid]
            await ev.wait()
            if wid not in self.core.workers:
                return
            plan = ws.schedule(self.core.waiting)
            if plan is None:
                ev.clear()
                continue
            fut: asyncio.Future[StepResult] = loop.create_future()
            self.pending[(wid, plan.step_id)] = fut
            try:
                await self.bus.publish(self.step_subject[wid], plan)
                result = await asyncio.wait_for(fut, STEP_TIMEOUT_S)
            except (TimeoutError, Exception) as e:  # noqa: BLE001 - a lost step is recovered below
                self.pending.pop((wid, plan.step_id), None)
                log.error(
                    "worker %s: step %d lost (%s); re-queueing its sequences", wid, plan.step_id, e
                )
                self.core.remove_worker(wid)
                self._wake_all()
                return
            if result.error:
                log.error("worker %s: step %d failed: %s", wid, plan.step_id, result.error)
            outcome = self.core.on_result(result)
            for dst, pull in outcome.pulls:
                if dst in self.step_subject:
                    await self.bus.publish(self.step_subject[dst], pull)
            if outcome.finished or outcome.prefilled:
                self._wake_all()  # freed blocks or slots: waiting requests may fit somewhere
                if ws.draining:
                    await self._release_drained()
            if not ws.running and not len(self.core.waiting) and not ws.to_forget:
                ev.clear()

    async def _watch_workers(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            if self.core.expire_transfers(TRANSFER_TIMEOUT_S):
                self._wake_all()
            await self._release_drained()
            now = time.monotonic()
            for wid in list(self.core.workers):
                if now - self.last_seen.get(wid, now) > HEARTBEAT_TIMEOUT_S:
                    log.error(
                        "worker %s: no heartbeat for %.0fs; re-queueing its sequences",
                        wid,
                        HEARTBEAT_TIMEOUT_S,
                    )
                    self.core.remove_worker(wid)
                    self.wake.pop(wid, None)
                    self._wake_all()


async def run(settings: Settings) -> None:
    from shared.model_loader import load_config
    from shared.model_source import resolve_model
    from shared.ops_http import start_ops_server

    ops = start_ops_server(settings.ops_port, "scheduler")
    src = resolve_model(settings.model, settings.served_model_name)
    cfg = load_config(src)
    max_len = min(settings.max_model_len, cfg.max_position_embeddings)
    service = SchedulerService(settings, src.name, max_len)
    await service.start()
    ops.set_ready(lambda: service.bus.client.is_connected, service.bus)
    await asyncio.Event().wait()
