"""The scheduler service: a thin NATS shell around SchedulerCore.

It receives tokenized requests, aborts, worker heartbeats, step results and KV-transfer reports;
for each worker it runs a loop that plans a step, sends it, and applies the results in order.
With async scheduling (the default) the loop plans step N+1 as soon as N is sent, so two plans
are in flight and the worker finds its next plan waiting when a step ends; with
``--async-scheduling false`` it waits for each result before planning again. Prefill hand-offs
become KvPull orders to the decode worker; a draining worker is released (and forgotten) once
nothing of it is needed. Each accepted request is acknowledged to its gateway (Accepted); the
gateway resubmits until then, and an id runs once.

High availability (``--redis-url`` set and more than one scheduler): schedulers compete for a
lease in Redis (lease.py). The leader plans; a standby keeps a shadow of every live request and
its tokens from the bus (shadow.py) and, when the leader's lease lapses, takes over: a new epoch
(workers drop the old leader's state and ignore its plans), every live request re-queued from
its prompt plus the tokens it already has. With no Redis the scheduler simply leads.

Worker failure: a worker silent for ``--worker-timeout`` seconds is removed and its sequences
are recomputed elsewhere; a step with no result within ``--step-timeout`` is given up (its
sequences recomputed) but the worker stays.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid
from collections import deque

from nats.aio.msg import Msg

from kvflow.services.scheduler import lora_control
from kvflow.services.scheduler.core import QueueFullError, SchedulerCore
from kvflow.services.scheduler.lease import Lease, LeaseLost, lease_for
from kvflow.services.scheduler.lora_registry import LoraRegistry
from kvflow.services.scheduler.policy import make_policy
from kvflow.services.scheduler.shadow import ShadowState
from kvflow.services.scheduler.telemetry import SchedulerTelemetry
from kvflow.services.scheduler.worker_state import ROLES, SchedulerLimits, WorkerState
from kvflow.shared import subjects
from kvflow.shared.access.connect import nats_auth, redis_client, verify_redis
from kvflow.shared.bus import Bus
from kvflow.shared.config import Settings
from kvflow.shared.kv_connectors import create_scheduler_connector
from kvflow.shared.kv_tier import leading_present
from kvflow.shared.lora import adapter_salt, parse_lora_modules
from kvflow.shared.messages import (
    STALE_EPOCH_ERROR,
    Abort,
    Accepted,
    KvLoadDone,
    KvTransferDone,
    LoraList,
    LoraLoad,
    LoraUnload,
    Message,
    RequestError,
    StatsRequest,
    StepPlan,
    StepResult,
    StepVoid,
    TokenizedRequest,
    WorkerHeartbeat,
    WorkerRelease,
)
from kvflow.shared.speculative import parse_speculative_config
from kvflow.shared.voided_steps import VoidedSteps

log = logging.getLogger("kvflow.scheduler")

TRANSFER_TIMEOUT_S = 120.0  # a KV transfer not reported done by then is given up
LOST_CHECK_S = 1.0  # how often a step's wait looks at the worker's heartbeats
# a heartbeat received this long after a plan went out that shows the worker idle with nothing
# queued: the plan or its result was lost (worker heartbeats come every 0.5 s)
MISSED_AFTER_S = 2.0
INBOX = (subjects.REQUESTS, subjects.ABORT, subjects.RESULTS, subjects.HEARTBEAT, subjects.KV_DONE)


class SchedulerService:
    def __init__(
        self,
        settings: Settings,
        model_name: str,
        max_model_len: int,
        lease: Lease | None = None,
        scheduler_id: str = "",
    ) -> None:
        sc = settings.scheduler
        ms = settings.model
        loras = ms.max_loras if ms.enable_lora else 0
        self.limits = SchedulerLimits(
            sc.max_num_seqs,
            sc.max_num_batched_tokens,
            max_model_len,
            loras,
            max_plans_in_flight=2 if sc.async_scheduling else 1,
        )
        self.loras = LoraRegistry(parse_lora_modules(ms.lora_modules), ms.enable_lora)
        self.settings = settings
        self.model_name = model_name
        self.scheduler_id = scheduler_id or f"scheduler-{uuid.uuid4().hex[:8]}"
        self.lease = lease
        self.policy = make_policy(sc.scheduling_policy)  # the one read of the setting
        self.core = self._new_core()
        self.shadow = ShadowState()
        self.leading = False
        self.epoch = 0
        self.draining = False
        self.stopped = asyncio.Event()
        self.bus = Bus(self.scheduler_id)
        self.telemetry = SchedulerTelemetry(self, model_name)  # metrics and spans
        self.wake: dict[str, asyncio.Event] = {}
        self.pending: dict[tuple[str, int, int], asyncio.Future[StepResult]] = {}
        self.step_subject: dict[str, str] = {}
        self.last_seen: dict[str, float] = {}
        self.slow_steps = 0  # step timeouts waited through: the worker said it was computing
        self.voided = VoidedSteps()  # steps given up: their late results are not applied
        self.heartbeats: dict[str, WorkerHeartbeat] = {}
        self.heartbeats_known: dict[str, str] = {}  # worker id -> instance the core knows
        self.took_over_at: float | None = None
        self.tier_redis = (
            redis_client(settings.bus, "scheduler", socket_timeout=0.5, socket_connect_timeout=0.5)
            if settings.cache.kv_redis_tier and settings.bus.redis_url
            else None
        )

    async def start(self) -> None:
        await self.bus.connect(
            self.settings.bus.nats_url, auth=nats_auth(self.settings.bus, "scheduler")
        )
        if self.tier_redis is not None:
            await verify_redis(self.tier_redis, "scheduler", self.settings.bus.redis_url)
        for subject in INBOX:
            await self.bus.subscribe(subject, self._on_message)
        self.bus.spawn(self._watch_workers())
        if self.lease is None:
            await self._lead(epoch=1)
        else:
            self.bus.spawn(self._campaign())
        log.info(
            "%s up (model %s, max_model_len %d, %s)",
            self.scheduler_id,
            self.model_name,
            self.limits.max_model_len,
            "leading" if self.leading else "standby until it holds the lease",
        )

    # -- leadership -----------------------------------------------------------------------------

    async def _campaign(self) -> None:
        """Standby: try for the lease; leader: keep it, or stop if another scheduler has it."""
        assert self.lease is not None
        if await self.lease.led_before():
            # a scheduler started after a leader existed knows none of the requests in flight
            # (its shadow is empty): it lets a standby that shadowed them take the lease first
            # (a standby tries every 0.25 s once the lease is free), and leads only if none did
            await asyncio.sleep(2 * self.lease.ttl_s)
        while not self.stopped.is_set():
            if not self.leading:
                if not self.draining and await self.lease.try_acquire():
                    await self._lead(self.lease.epoch)
            else:
                try:
                    await self.lease.renew()
                except LeaseLost as e:
                    log.error("%s lost the lease (%s); stopping", self.scheduler_id, e)
                    self.stopped.set()
                    return
            await asyncio.sleep(self.lease.ttl_s / 6 if self.leading else 0.25)

    def _new_core(self) -> SchedulerCore:
        kv = create_scheduler_connector(self.settings.cache.kv_connector)  # its scheduler half
        max_waiting = self.settings.scheduler.max_waiting
        spec = parse_speculative_config(self.settings.model.speculative_config)
        return SchedulerCore(self.limits, self.policy, max_waiting, self.model_name, kv, spec)

    def _may_plan(self) -> bool:
        return self.leading and (self.lease is None or self.lease.valid())

    async def _lead(self, epoch: int) -> None:
        """Become the leader of a new epoch: resume every live request the shadow knows of."""
        # adapters loaded under the previous leader, known before any request is led (a request
        # naming one, arriving once ``leading`` is set, must find it)
        await lora_control.restore(self)
        self.epoch = epoch
        self.core = self._new_core()
        self.heartbeats_known.clear()
        self.wake.clear()
        resumed = 0
        for rid, live in list(self.shadow.live.items()):
            try:
                self.core.add_request(live.request, live.request.priority, live.output_ids)
                resumed += 1
            except QueueFullError:
                self.shadow.end(rid)
                await self._reject(live.request, "the scheduler changed and its queue is full")
        self.leading = True
        self.took_over_at = time.monotonic()
        await self.bus.subscribe(subjects.SCHEDULER_STATS, self._on_message)
        await self.bus.subscribe(subjects.SCHEDULER_LORA, self._on_message)
        timeout = self.settings.scheduler.worker_timeout
        for hb in list(self.heartbeats.values()):  # the workers alive now join the new core
            if time.monotonic() - self.last_seen.get(hb.worker_id, 0) < timeout:
                await self._on_heartbeat(hb)
        for live in self.shadow.live.values():
            await self.bus.publish(live.request.reply_to, Accepted(live.request.request_id))
        log.info("%s leads epoch %d; resumed %d live requests", self.scheduler_id, epoch, resumed)

    # -- messages -------------------------------------------------------------------------------

    async def _on_message(self, msg: Message, raw: Msg) -> None:
        match msg:
            case TokenizedRequest():
                await self._on_request(msg)
                self.telemetry.on_request(msg, raw.headers)
            case Abort():
                self.shadow.end(msg.request_id)
                self.telemetry.on_abort(msg.request_id, msg.reason)
                if self.leading and self.core.abort(msg.request_id):
                    self._wake_all()
            case StepResult():
                if self.voided.drops(msg):
                    log.warning(
                        "a result of voided step %d of %s dropped", msg.step_id, msg.worker_id
                    )
                    return
                if not self.leading:  # the leader's core holds the tokens (a deposed leader
                    self.shadow.apply(msg)  # stops, never to lead from its shadow again)
                fut = self.pending.pop((msg.worker_id, msg.epoch, msg.step_id), None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            case StepVoid():
                self.voided.add(msg)
            case WorkerHeartbeat():
                await self._on_heartbeat(msg)
            case KvTransferDone():
                if self.leading:
                    self.core.on_transfer_done(msg)
                    self._wake_all()
            case KvLoadDone():
                if self.leading and self.core.on_load_done(msg):
                    self._wake_all()
            case StatsRequest():
                if self.leading:
                    stats = self.core.stats(self.heartbeats)
                    stats.scheduler_id, stats.epoch = self.scheduler_id, self.epoch
                    await self.bus.reply(raw, stats)
            case LoraList() | LoraLoad() | LoraUnload():
                if self.leading:
                    self.bus.spawn(lora_control.serve(self, msg, raw))
            case _:
                log.warning("scheduler: unexpected %s on %s", type(msg).__name__, raw.subject)

    async def _reject(self, req: TokenizedRequest, why: str, code: int = 429) -> None:
        kind = "RateLimitError" if code == 429 else "ServiceUnavailableError"
        await self.bus.publish(req.reply_to, RequestError(req.request_id, why, kind, None, code))

    async def _on_request(self, req: TokenizedRequest) -> None:
        if self.shadow.is_finished(req.request_id):
            return  # a resubmission of a request that already ran: it runs once
        if not self.leading:
            self.shadow.add(req)  # the leader answers; a standby only remembers
            return
        if self.draining:
            await self._reject(req, "the scheduler is shutting down; retry", 503)
            return
        if not await lora_control.resolve(self, req):
            return
        redis_blocks = await self._redis_prefix(req)
        try:
            seq = self.core.add_request(req, req.priority)
        except QueueFullError as e:
            await self._reject(req, f"{e}; retry later")
            return
        seq.redis_prefix_blocks = max(seq.redis_prefix_blocks, redis_blocks)
        self.shadow.add(req)
        await self.bus.publish(req.reply_to, Accepted(req.request_id))
        self._wake_all()

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

    async def _on_heartbeat(self, hb: WorkerHeartbeat) -> None:
        self.last_seen[hb.worker_id] = time.monotonic()
        self.heartbeats[hb.worker_id] = hb
        if not self.leading:
            return
        known = hb.worker_id in self.core.workers
        if known and hb.instance != self.heartbeats_known.get(hb.worker_id, hb.instance):
            # the same id from a new process: the old one died (its steps will never return)
            self._remove_worker(hb.worker_id, "restarted (a new process has its id)")
            known = False
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
        self.heartbeats_known[hb.worker_id] = hb.instance
        ws = self.core.join(hb)
        self.step_subject[hb.worker_id] = hb.step_subject
        self.wake[hb.worker_id] = asyncio.Event()
        self.wake[hb.worker_id].set()
        self.bus.spawn(self._worker_loop(ws))
        what = (hb.worker_id, hb.role, hb.num_blocks, hb.block_size)
        log.info("worker %s joined (role %s): %d blocks of %d tokens", *what)
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

    def _remove_worker(self, wid: str, why: str) -> None:
        log.error("worker %s: %s; re-queueing its sequences", wid, why)
        self.core.remove_worker(wid)
        self.wake.pop(wid, None)
        lost = []
        for key, fut in list(self.pending.items()):
            if key[0] == wid and not fut.done():
                fut.cancel()
                lost.append(key[2])
        if lost:
            self._void(wid, lost)
        self._wake_all()

    def _void(self, wid: str, step_ids: list[int]) -> None:
        """Tell the detokenizers and the standbys that these steps' results, should they still
        come, are not to be applied: their sequences are recomputed."""
        self.bus.spawn(self.bus.publish(subjects.RESULTS, StepVoid(wid, self.epoch, step_ids)))

    # -- planning -------------------------------------------------------------------------------

    async def _worker_loop(self, ws: WorkerState) -> None:
        """Plan ``ws``'s steps and apply their results, in order, while it is a worker of this
        core: a new plan whenever the worker state allows one (up to two in flight with async
        scheduling), else the oldest plan's result."""
        wid = ws.worker_id
        core = self.core
        flight: deque[tuple[StepPlan, asyncio.Future[StepResult]]] = deque()
        while self.core is core and wid in core.workers and not self.stopped.is_set():
            ev = self.wake.get(wid)
            if ev is None:
                return
            if not flight:
                await ev.wait()
                if self.core is not core or wid not in core.workers:
                    return
                if not self._may_plan():
                    await asyncio.sleep(0.05)  # lease unconfirmed: no plan until it is
                    continue
            if ws.can_plan() and self._may_plan():
                plan = await self._plan(ws, flight)
                if plan is not None:
                    continue  # another plan may follow it at once
                if not flight:
                    continue
            if not await self._apply_oldest(ws, flight):
                return

    async def _plan(
        self, ws: WorkerState, flight: deque[tuple[StepPlan, asyncio.Future[StepResult]]]
    ) -> StepPlan | None:
        """Plan ``ws``'s next step and send it (with the tier loads it ordered); None when
        there is nothing to run (the wake event cleared when nothing is in flight either)."""
        wid = ws.worker_id
        plan, loads = self.core.schedule(ws)
        for load in loads:
            load.epoch = self.epoch
            await self.bus.publish(self.step_subject[wid], load)
        if plan is None:
            if not flight and not loads:
                self.wake[wid].clear()
            return None
        plan.epoch = self.epoch
        self.telemetry.on_plan(wid, plan)
        fut: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        self.pending[(wid, self.epoch, plan.step_id)] = fut
        flight.append((plan, fut))
        await self.bus.publish(self.step_subject[wid], plan)
        return plan

    async def _apply_oldest(
        self, ws: WorkerState, flight: deque[tuple[StepPlan, asyncio.Future[StepResult]]]
    ) -> bool:
        """Wait for the oldest plan's result and apply it. A step lost or failed voids every
        plan in flight (their sequences are recomputed). False when the loop should end."""
        wid, core = ws.worker_id, self.core
        plan, fut = flight[0]
        try:
            result = await self._step_result(wid, plan, fut)
        except asyncio.CancelledError:
            if self.stopped.is_set():
                raise
            return False  # the worker was removed meanwhile
        except Exception as e:  # noqa: BLE001 - a lost step is recovered below
            if wid not in core.workers:
                return False
            log.error(
                "worker %s: step %d got no result and the worker is not computing it (%s); "
                "recomputing",
                wid,
                plan.step_id,
                type(e).__name__,
            )
            self._void_flight(wid, flight)
            ws.on_failed_step()
            self._wake_all()
            return True
        flight.popleft()
        if result.error and result.error.startswith(STALE_EPOCH_ERROR):
            log.error("%s: deposed (%s); stopping", self.scheduler_id, result.error)
            self.leading = False
            self.stopped.set()
            return False
        if result.error:
            log.error("worker %s: step %d failed: %s", wid, plan.step_id, result.error)
            self._void_flight(wid, flight)  # planned on top of this step: void with it
        outcome = core.on_result(result)
        self.telemetry.on_result(plan, result, outcome.finished)
        for rid_seq, _reason in outcome.finished:
            self.shadow.end(rid_seq.request_id)
        for dst, pull in outcome.pulls:
            if dst in self.step_subject:
                pull.epoch = self.epoch
                headers = self.telemetry.headers(pull.request_id)
                await self.bus.publish(self.step_subject[dst], pull, headers)
        if outcome.finished or outcome.prefilled or result.error:
            self._wake_all()  # freed blocks or slots: waiting requests may fit somewhere
            if ws.draining:
                await self._release_drained()
        if not flight and not ws.running and not len(core.waiting) and not ws.to_forget:
            ev = self.wake.get(wid)
            if ev is not None:
                ev.clear()
        return True

    def _void_flight(
        self, wid: str, flight: deque[tuple[StepPlan, asyncio.Future[StepResult]]]
    ) -> None:
        """Give up every plan in flight: their futures are dropped and their results, should
        they still come, are voided (the core recomputes their sequences)."""
        if not flight:
            return
        for plan, fut in flight:
            self.pending.pop((wid, plan.epoch, plan.step_id), None)
            fut.cancel()
        self._void(wid, [plan.step_id for plan, _ in flight])
        flight.clear()

    async def _step_result(
        self, wid: str, plan: StepPlan, fut: asyncio.Future[StepResult]
    ) -> StepResult:
        """The plan's result. A step is lost (TimeoutError: its sequences are recomputed) when
        the worker's heartbeats show it idle with nothing queued well after the plan went out
        (the plan or its result was lost on the way: a NATS node failed), or when
        ``--step-timeout`` passed and the heartbeats do not say it is computing this step: a
        slow step on a live worker is waited for, however long (a recompute would be as slow,
        and lose the work done). A worker that falls silent is given up by ``_watch_workers``,
        which cancels the wait."""
        timeout = self.settings.scheduler.step_timeout
        slice_s = min(timeout, LOST_CHECK_S)
        sent = time.monotonic()
        waited = 0.0
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(fut), slice_s)
            except TimeoutError:
                waited += slice_s
                hb = self.heartbeats.get(wid)
                computing = hb is not None and (hb.step_id, hb.step_epoch) == (
                    plan.step_id,
                    plan.epoch,
                )
                if not computing and self._missed(wid, sent):
                    assert hb is not None
                    done = (hb.last_step_epoch, hb.last_step_id) >= (plan.epoch, plan.step_id)
                    log.warning(
                        "worker %s: idle with nothing queued %.1fs after step %d went out: %s "
                        "was lost in transit",
                        wid,
                        time.monotonic() - sent,
                        plan.step_id,
                        "its result" if done else "the plan",
                    )
                    fut.cancel()
                    raise
                if waited < timeout:
                    continue
                if not computing:
                    fut.cancel()
                    raise
                assert hb is not None
                what = (wid, plan.step_id, hb.step_seconds, waited)
                log.warning("worker %s: step %d is slow (computing for %.0fs, waited %.0fs)", *what)
                self.slow_steps += 1
                waited = 0.0

    def _missed(self, wid: str, sent: float) -> bool:
        """Whether a heartbeat that left the worker well after a plan was sent (``sent``) shows
        it idle with no plan queued: the plan never came, or its result was lost."""
        hb = self.heartbeats.get(wid)
        heard = self.last_seen.get(wid, 0.0)
        return (
            hb is not None
            and heard - sent > MISSED_AFTER_S
            and hb.step_id == 0
            and hb.queued_plans == 0
        )

    async def _watch_workers(self) -> None:
        while not self.stopped.is_set():
            await asyncio.sleep(min(1.0, self.settings.scheduler.worker_timeout / 3))
            if not self.leading:
                continue
            if self.core.expire_transfers(TRANSFER_TIMEOUT_S):
                self._wake_all()
            await self._release_drained()
            now = time.monotonic()
            for wid in list(self.core.workers):
                silent = now - self.last_seen.get(wid, now)
                if silent > self.settings.scheduler.worker_timeout:
                    self._remove_worker(wid, f"no heartbeat for {silent:.1f}s")
            if self.draining and not self.core.requests:
                self.stopped.set()

    # -- shutdown -------------------------------------------------------------------------------

    def begin_drain(self) -> None:
        """SIGTERM. With a standby (a lease): hand over at once (release the lease; the standby
        resumes every live request from the shadow it keeps) and stop. Alone: accept nothing
        new, finish what is queued and running, then stop (or after --drain-timeout)."""
        if self.draining:
            return
        self.draining = True
        log.info("%s draining", self.scheduler_id)
        if self.lease is not None:
            self.leading = False
            self.stopped.set()
        else:
            self.bus.spawn(self._drain_deadline())

    async def _drain_deadline(self) -> None:
        await asyncio.sleep(self.settings.ops.drain_timeout)
        if not self.stopped.is_set():
            what = (self.scheduler_id, len(self.core.requests), self.settings.ops.drain_timeout)
            log.warning("%s: %d requests still running after %.0fs of draining; stopping", *what)
            self.stopped.set()

    async def close(self) -> None:
        if self.lease is not None:
            await self.lease.release()
            await self.lease.close()
        await self.bus.close()


async def run(settings: Settings) -> None:
    from kvflow.shared.model_config import load_config
    from kvflow.shared.model_source import resolve_model
    from kvflow.shared.ops_http import start_ops_server

    ops = start_ops_server(settings.ops.ops_port, "scheduler")
    src = resolve_model(settings.model.path, settings.model.served_model_name)
    cfg = load_config(src)
    max_len = min(settings.model.max_model_len, cfg.max_position_embeddings)
    lease = await lease_for(settings, src.name)
    service = SchedulerService(settings, src.name, max_len, lease, settings.scheduler.scheduler_id)
    await service.start()
    # a standby is ready too (healthy, just not planning); whether it leads is in its logs/stats
    ops.registry.register(service.telemetry.registry)
    ops.set_ready(lambda: service.bus.client.is_connected, service.bus)
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, service.begin_drain)
    try:
        await service.stopped.wait()
    finally:
        await service.close()
