"""The scheduler service: a thin NATS shell around SchedulerCore. It wires the scheduler's
concerns and dispatches each message by type to the one it belongs to:

- leadership.py: the lease, the epoch, standby and takeover (``--scheduler-ha``);
- membership.py: workers joining, leaving (silent, replaced) and draining;
- intake.py: requests (accepted, or refused: queue full, shutting down), aborts;
- plan_loop.py: per worker, plan a step, send it, apply the results in order;
- lora_control.py: the LoRA adapter registry's requests.

Shutdown (SIGTERM): with a standby (a lease), hand over at once (release the lease; the
standby resumes every live request from the shadow it keeps) and stop; alone, accept nothing
new, finish what is queued and running, then stop (or after ``--drain-timeout``).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid

from nats.aio.msg import Msg

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.intake import Intake
from kvflow.services.scheduler.leadership import Leadership
from kvflow.services.scheduler.lease import Lease, lease_for
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.services.scheduler.lora_control import LoraControl
from kvflow.services.scheduler.lora_registry import LoraRegistry
from kvflow.services.scheduler.membership import Membership
from kvflow.services.scheduler.plan_loop import PlanLoop
from kvflow.services.scheduler.policy import make_policy
from kvflow.services.scheduler.shadow import ShadowState
from kvflow.services.scheduler.telemetry import SchedulerTelemetry
from kvflow.shared import subjects
from kvflow.shared.access.connect import nats_auth, redis_client, verify_redis
from kvflow.shared.bus import Bus
from kvflow.shared.config import Settings
from kvflow.shared.kv_connectors import create_scheduler_connector
from kvflow.shared.lora import parse_lora_modules
from kvflow.shared.messages import (
    Abort,
    KvLoadDone,
    KvTransferDone,
    LiveRequests,
    LiveRequestsQuery,
    LoraList,
    LoraLoad,
    LoraUnload,
    Message,
    StatsRequest,
    StepResult,
    StepVoid,
    TokenizedRequest,
    WorkerHeartbeat,
)
from kvflow.shared.speculative import parse_speculative_config

log = logging.getLogger("kvflow.scheduler")

INBOX = (subjects.REQUESTS, subjects.ABORT, subjects.RESULTS, subjects.HEARTBEAT, subjects.KV_DONE)
# answered by the leader
LEADER_INBOX = (subjects.SCHEDULER_STATS, subjects.SCHEDULER_LORA, subjects.SCHEDULER_LIVE)


class SchedulerService:
    def __init__(
        self,
        settings: Settings,
        model_name: str,
        max_model_len: int,
        lease: Lease | None = None,
        scheduler_id: str = "",
    ) -> None:
        sc, ms = settings.scheduler, settings.model
        self.settings = settings
        self.model_name = model_name
        self.scheduler_id = scheduler_id or f"scheduler-{uuid.uuid4().hex[:8]}"
        limits = SchedulerLimits(
            sc.max_num_seqs,
            sc.max_num_batched_tokens,
            max_model_len,
            ms.max_loras if ms.enable_lora else 0,
            max_plans_in_flight=2 if sc.async_scheduling else 1,
        )
        # one core for the service's life: a scheduler leads once (a standby's stays empty)
        self.core = SchedulerCore(
            limits,
            make_policy(sc.scheduling_policy),  # the one read of the setting
            sc.max_waiting,
            model_name,
            create_scheduler_connector(settings.cache.kv_connector),  # its scheduler half
            parse_speculative_config(ms.speculative_config),
        )
        self.stopped = asyncio.Event()
        self.draining = False
        self.bus = Bus(self.scheduler_id)
        self.shadow = ShadowState()
        self.leadership = Leadership(lease, self.scheduler_id, self.stopped)
        self.telemetry = SchedulerTelemetry(  # metrics and spans
            self.core,
            model_name,
            self.scheduler_id,
            lambda: self.leadership.leading,
            lora_enabled=ms.enable_lora,
        )
        self.plan_loop = PlanLoop(
            self.core,
            self.bus,
            self.leadership,
            self.telemetry,
            self.shadow,
            sc.step_timeout,
            self.stopped,
        )
        self.membership = Membership(
            self.core, self.bus, self.leadership, self.plan_loop, sc.worker_timeout
        )
        registry = LoraRegistry(parse_lora_modules(ms.lora_modules), ms.enable_lora)
        self.lora_control = LoraControl(
            registry, self.bus, model_name, self.membership, _lora_store(settings, lease, registry)
        )
        tier_redis = (
            redis_client(settings.bus, "scheduler", socket_timeout=0.5, socket_connect_timeout=0.5)
            if settings.cache.kv_redis_tier and settings.bus.redis_url
            else None
        )
        self.intake = Intake(
            self.core,
            self.bus,
            self.shadow,
            self.leadership,
            self.lora_control,
            self.plan_loop.wake_all,
            tier_redis,
        )

    async def start(self) -> None:
        await self.bus.connect(
            self.settings.bus.nats_url, auth=nats_auth(self.settings.bus, "scheduler")
        )
        if self.intake.tier_redis is not None:
            await verify_redis(self.intake.tier_redis, "scheduler", self.settings.bus.redis_url)
        for subject in INBOX:
            await self.bus.subscribe(subject, self._on_message)
        self.bus.spawn(self.membership.watch(self.stopped))
        if self.leadership.lease is None:
            await self._take_over(epoch=1)
        else:
            self.bus.spawn(self.leadership.campaign(self._take_over))
        log.info(
            "%s up (model %s, max_model_len %d, %s)",
            self.scheduler_id,
            self.model_name,
            self.core.limits.max_model_len,
            "leading" if self.leadership.leading else "standby until it holds the lease",
        )

    async def _take_over(self, epoch: int) -> None:
        """Lead a new epoch: resume every live request the shadow knows of."""
        # adapters loaded under the previous leader, known before any request is led (a request
        # naming one, arriving once leading, must find it)
        await self.lora_control.restore()
        resumed = await self.intake.resume()
        self.leadership.lead(epoch)
        for subject in LEADER_INBOX:
            await self.bus.subscribe(subject, self._on_message)
        await self.membership.rejoin()  # the workers alive now join the core
        await self.intake.acknowledge_live()
        log.info("%s leads epoch %d; resumed %d live requests", self.scheduler_id, epoch, resumed)

    async def _on_message(self, msg: Message, raw: Msg) -> None:
        leading = self.leadership.leading
        match msg:
            case TokenizedRequest():
                await self.intake.on_request(msg)
                self.telemetry.on_request(msg, raw.headers)
            case Abort():
                self.telemetry.on_abort(msg.request_id, msg.reason)
                self.intake.on_abort(msg)
            case StepResult():
                # the leader's core holds the tokens (a deposed leader stops, never to lead
                # from its shadow again); a standby keeps them in its shadow
                if self.plan_loop.deliver(msg) and not leading:
                    self.shadow.apply(msg)
            case StepVoid():
                self.plan_loop.voided(msg)
            case WorkerHeartbeat():
                await self.membership.on_heartbeat(msg)
            case KvTransferDone():
                if leading:
                    self.core.on_transfer_done(msg)
                    self.plan_loop.wake_all()
            case KvLoadDone():
                if leading and self.core.on_load_done(msg):
                    self.plan_loop.wake_all()
            case StatsRequest():
                if leading:
                    stats = self.core.stats(self.membership.heartbeats)
                    stats.scheduler_id, stats.epoch = self.scheduler_id, self.leadership.epoch
                    await self.bus.reply(raw, stats)
            case LiveRequestsQuery():
                if leading:
                    await self.bus.reply(raw, self.live_requests(msg.ended_lately))
            case LoraList() | LoraLoad() | LoraUnload():
                if leading:
                    self.bus.spawn(self.lora_control.serve(msg, raw))
            case _:
                log.warning("scheduler: unexpected %s on %s", type(msg).__name__, raw.subject)

    def live_requests(self, ended_lately: bool = False) -> LiveRequests:
        """Every request the core runs or queues, with the tokens it has generated, and with
        ``ended_lately`` those that ended at their worker in the last seconds (what a
        detokenizer that starts watches: services/detokenizer/takeover.py)."""
        out = LiveRequests()
        for rid, live in self.shadow.live.items():
            seq = self.core.requests.get(rid)
            if seq is not None:
                out.requests.append(live.request)
                out.output_ids.append(seq.token_ids[seq.prompt_len :])
                out.finish_reasons.append(0)
        for live in self.shadow.ended_lately() if ended_lately else ():
            out.requests.append(live.request)
            out.output_ids.append(live.output_ids)
            out.finish_reasons.append(live.finish_reason)
        return out

    # -- shutdown -------------------------------------------------------------------------------

    def begin_drain(self) -> None:
        """SIGTERM. With a standby (a lease): hand over at once and stop. Alone: accept
        nothing new, finish what is queued and running, then stop."""
        if self.draining:
            return
        self.draining = True
        log.info("%s draining", self.scheduler_id)
        self.intake.close()
        if self.leadership.lease is not None:
            self.leadership.hand_over()
        else:
            self.bus.spawn(self._drain())

    async def _drain(self) -> None:
        """Stop once no request is left, or after --drain-timeout."""
        timeout = self.settings.ops.drain_timeout
        deadline = time.monotonic() + timeout
        period = min(1.0, self.settings.scheduler.worker_timeout / 3)
        while not self.stopped.is_set():
            left = deadline - time.monotonic()
            if not self.core.requests:
                break
            if left <= 0:
                what = (self.scheduler_id, len(self.core.requests), timeout)
                log.warning(
                    "%s: %d requests still running after %.0fs of draining; stopping", *what
                )
                break
            await asyncio.sleep(min(period, left))
        self.stopped.set()

    async def close(self) -> None:
        await self.leadership.close()
        await self.bus.close()


def _lora_store(settings: Settings, lease: Lease | None, registry: LoraRegistry) -> object:
    """Where the LoRA registry is kept: the lease's Redis, else the stack's Redis
    (``--redis-url``), else nowhere (a restarted scheduler then knows only ``--lora-modules``)."""
    if not registry.enabled:
        return None
    if lease is not None:
        return lease.redis
    if settings.bus.redis_url:
        opts = {"socket_timeout": 1.0, "socket_connect_timeout": 1.0}
        return redis_client(settings.bus, "scheduler", **opts)
    return None


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
