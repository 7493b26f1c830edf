"""The scheduler service: a thin NATS shell around SchedulerCore. It receives tokenized requests,
aborts, worker heartbeats and step results; for each worker it runs a loop that plans a step,
sends it, and waits for that step's result before planning the next."""

from __future__ import annotations

import asyncio
import logging
import time

from nats.aio.msg import Msg

from services.scheduler.engine import QueueFullError, SchedulerCore
from services.scheduler.policy import SchedulerLimits, WorkerScheduler
from shared import subjects
from shared.bus import Bus
from shared.config import Settings
from shared.messages import (
    Abort,
    Message,
    RequestError,
    StatsRequest,
    StepResult,
    TokenizedRequest,
    WorkerHeartbeat,
)

log = logging.getLogger("kvflow.scheduler")

HEARTBEAT_TIMEOUT_S = 10.0  # a worker silent this long is considered gone
STEP_TIMEOUT_S = 120.0  # a step that takes longer is considered lost


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
                self._on_heartbeat(msg)
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

    def _on_heartbeat(self, hb: WorkerHeartbeat) -> None:
        self.last_seen[hb.worker_id] = time.monotonic()
        if hb.worker_id in self.core.workers:
            return
        if hb.role not in ("both",):
            log.warning(
                "worker %s has role %s, which this scheduler does not drive yet",
                hb.worker_id,
                hb.role,
            )
            return
        ws = self.core.add_worker(hb.worker_id, hb.num_blocks, hb.block_size)
        self.step_subject[hb.worker_id] = hb.step_subject
        self.wake[hb.worker_id] = asyncio.Event()
        self.wake[hb.worker_id].set()
        self.bus.spawn(self._worker_loop(ws))
        log.info(
            "worker %s joined: %d blocks of %d tokens", hb.worker_id, hb.num_blocks, hb.block_size
        )

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
            self.core.on_result(result)
            if not ws.running and not len(self.core.waiting) and not ws.to_forget:
                ev.clear()

    async def _watch_workers(self) -> None:
        while True:
            await asyncio.sleep(1.0)
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
