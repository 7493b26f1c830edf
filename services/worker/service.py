"""The worker service: loads the model once, owns the KV cache, runs each StepPlan in order and
publishes one StepResult per step (to the scheduler and the detokenizer).

All model work (loading, calibration, every step) runs on one dedicated thread, so the event loop
keeps sending heartbeats during long steps. A plan goes to that thread as it arrives, and the
thread runs queued plans back to back (the next step starts when the last ends, with no round
trip through the event loop); the loop only publishes the results. One thread, always the
same: OpenMP keeps a thread team per calling thread, and using torch from two threads (say,
loading on the main thread and stepping on an executor's) made every step about 35 % slower
here (docs/benchmarks.md)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import signal
import time
import uuid
from collections.abc import Callable
from typing import TypeVar

from nats.aio.msg import Msg

from kvflow.services.worker import machine
from kvflow.services.worker.kv_blocks import KvBlockIO
from kvflow.services.worker.kv_connectors.factory import create_worker_connector
from kvflow.services.worker.kv_connectors.tiers import KvTiers
from kvflow.services.worker.placeholders import PlaceholderError, StepTokens
from kvflow.services.worker.runner_loading import load_runner
from kvflow.services.worker.step_output import step_result
from kvflow.services.worker.step_runner import StepRunner
from kvflow.services.worker.telemetry import WorkerTelemetry
from kvflow.services.worker.tp_group import KEEPALIVE_S
from kvflow.shared import subjects
from kvflow.shared.access.connect import nats_auth, redis_options, verify_redis
from kvflow.shared.bus import Bus
from kvflow.shared.config import Settings
from kvflow.shared.kv_connectors import connector_spec
from kvflow.shared.lora import LoRAError, read_adapter_config
from kvflow.shared.messages import (
    STALE_EPOCH_ERROR,
    KvLoad,
    KvLoadDone,
    KvPull,
    KvTransferDone,
    LoraAdapters,
    LoraLoad,
    LoRARef,
    LoraUnload,
    Message,
    StepPlan,
    StepResult,
    WorkerHeartbeat,
    WorkerRelease,
)
from kvflow.shared.parallel import check_parallel_settings

log = logging.getLogger("kvflow.worker")

HEARTBEAT_INTERVAL_S = 0.5
T = TypeVar("T")


class ModelThread:
    """The one thread that touches the model (see the module docstring). Its work runs in the
    order it was handed over: steps (``post``) and other calls (``run``) alike."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model")

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the model thread, awaited."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def post(self, fn: Callable[..., object], *args: object) -> None:
        """``fn(*args)`` on the model thread, not awaited: ``fn`` reports its own outcome (an
        exception it lets out is logged)."""
        self._pool.submit(fn, *args).add_done_callback(_log_failure)


def _log_failure(done: concurrent.futures.Future[object]) -> None:
    if (e := done.exception()) is not None:
        log.error("worker: work on the model thread failed", exc_info=e)


class WorkerService:
    def __init__(
        self,
        settings: Settings,
        runner: StepRunner,
        model_name: str,
        model_thread: ModelThread | None = None,
    ) -> None:
        self.settings = settings
        # the model, the simulated model or a tensor-parallel group's rank 0: called only on
        # the model thread (services/worker/step_runner.py)
        self.runner = runner
        self.model_thread = model_thread or ModelThread()
        self.model_name = model_name
        self.worker_id = settings.worker.worker_id or f"worker-{uuid.uuid4().hex[:8]}"
        self.step_subject = subjects.worker_step(self.worker_id)
        self.bus = Bus(self.worker_id)
        # Plans go straight to the model thread as they arrive, and it runs them back to back:
        # a step starts when the one before it ends, not after a round trip through the event
        # loop. Only the model thread touches what a step reads or writes (the runner, the
        # placeholders' tokens, the term, the step's telemetry); the loop publishes results.
        self.plans_received = 0  # counted on the event loop
        self.plans_started = 0  # counted on the model thread
        self.finished: asyncio.Queue[tuple[StepPlan, StepResult, list[tuple[bytes, bytes]]]]
        self.finished = asyncio.Queue()  # steps done, their results to publish in order
        # async scheduling: the tokens of the last step, for the next plan's placeholders
        self.step_tokens = StepTokens()
        self.telemetry = WorkerTelemetry(self.worker_id, self.queued_plans)  # metrics and spans
        self.telemetry.weight_bytes.labels(self.worker_id).set(runner.weight_bytes())
        self.kv_io = KvBlockIO(runner.kv_caches, runner.kv_shards())  # every rank's blocks
        # the transport between workers, by name (services/worker/kv_connectors)
        self.kv = create_worker_connector(
            settings.cache.kv_connector, self.bus, self.kv_io, self.worker_id
        )
        self.tiers = KvTiers.build(
            self.kv_io,
            settings.cache.kv_host_memory,
            settings.bus.redis_url if settings.cache.kv_redis_tier else "",
            settings.cache.kv_tier_ttl,
            redis_options(settings.bus, "worker"),
        )
        self.draining = False
        self.last_heard = time.monotonic()  # the last message from a scheduler (or step end)
        self.stepping = False
        self.step: StepPlan | None = None  # the plan being computed (heartbeats name it)
        self.step_started = 0.0
        self.epoch = 0  # the newest scheduler term seen in a plan
        self.last_done = (0, 0)  # (epoch, step id) of the last step finished here
        self.instance = uuid.uuid4().hex
        self.stopped = asyncio.Event()  # set when released (or the drain timed out)
        self._loop: asyncio.AbstractEventLoop  # the event loop, set by start()
        self._beat = asyncio.Event()  # wakes the heartbeat loop early

    async def start(self) -> None:
        await self.bus.connect(
            self.settings.bus.nats_url, auth=nats_auth(self.settings.bus, "worker")
        )
        if self.tiers.redis is not None:
            await verify_redis(self.tiers.redis.redis, "worker", self.settings.bus.redis_url)
        await self.bus.subscribe(self.step_subject, self._on_message)
        await self.kv.start()
        self._loop = asyncio.get_running_loop()
        self.bus.spawn(self._publish_results())
        self.bus.spawn(self._heartbeat())
        if self.settings.worker.tensor_parallel_size > 1:
            self.bus.spawn(self._keep_group_alive())
        log.info(
            "worker %s ready (role %s): %d KV blocks of %d tokens, layout %s",
            self.worker_id,
            self.settings.worker.role,
            self.runner.num_blocks,
            self.runner.block_size,
            self.kv_io.layout(),
        )

    async def _on_message(self, msg: Message, raw: Msg) -> None:
        self.last_heard = time.monotonic()
        match msg:
            case StepPlan():
                self.plans_received += 1
                self.model_thread.post(self._run_plan, msg)
            case KvPull():
                if msg.epoch and msg.epoch < self.epoch:
                    log.warning("worker: KvPull of an old scheduler term %d ignored", msg.epoch)
                    return
                self.bus.spawn(self._pull(msg, raw.headers))
            case KvLoad():
                self.bus.spawn(self._load(msg))
            case LoraLoad():
                await self.bus.reply(raw, await self._check_lora(msg))
            case LoraUnload():
                await self.model_thread.run(self.runner.forget_lora, msg.name)
            case WorkerRelease() if msg.worker_id == self.worker_id:
                log.info("worker %s released by the scheduler", self.worker_id)
                self.stopped.set()
            case _:
                log.warning("worker: unexpected %s", type(msg).__name__)

    async def _check_lora(self, msg: LoraLoad) -> LoraAdapters:
        """Whether this worker can serve the adapter (read and checked against the model off the
        model thread; nothing kept: it loads when a step needs it)."""
        cache = self.runner.loras
        ref = LoRARef(msg.name, 0, msg.path)
        try:
            if not self.settings.model.enable_lora:
                raise LoRAError("this worker runs without --enable-lora")
            if cache is not None:
                await asyncio.to_thread(cache.check, ref)
            else:  # the simulated worker has no weights: the adapter's config only
                read_adapter_config(msg.path)
        except LoRAError as e:
            return LoraAdapters(error=str(e), code=e.status, param=e.param)
        return LoraAdapters()

    async def _pull(self, order: KvPull, headers: dict[str, str] | None = None) -> None:
        """Copy a sequence's K/V from its prefill worker into our blocks, then tell the
        scheduler (which frees the source's blocks and schedules the sequence here)."""
        span = self.telemetry.pull_started(order, headers)
        result = await self.kv.pull(order)
        self.telemetry.pull_done(span, result.ok, result.num_bytes, result.seconds, result.error)
        done = KvTransferDone(
            transfer_id=order.transfer_id,
            request_id=order.request_id,
            worker_id=self.worker_id,
            ok=result.ok,
            num_bytes=result.num_bytes,
            seconds=result.seconds,
            error=result.error,
        )
        await self.bus.publish(subjects.KV_DONE, done)

    def begin_drain(self) -> None:
        """Stop taking new work (the scheduler learns it from the next heartbeat, sent at
        once), finish what runs here, and exit when the scheduler releases this worker."""
        if not self.draining:
            log.info("worker %s draining", self.worker_id)
            self.draining = True
            self._beat.set()

    def queued_plans(self) -> int:
        """Plans received and not yet begun."""
        return self.plans_received - self.plans_started

    def idle(self) -> bool:
        """No step runs here and none waits to."""
        return not self.stepping and self.queued_plans() == 0

    def _run_plan(self, plan: StepPlan) -> None:
        """On the model thread, for each plan in the order received: run it (or refuse a
        deposed scheduler's) and hand the result to the event loop, which publishes it."""
        self.stepping = True
        self.plans_started += 1
        try:
            if plan.epoch < self.epoch:
                # a deposed scheduler leader: tell it, so it stops; do not run its plan
                log.warning("worker: plan of old scheduler term %d ignored", plan.epoch)
                why = f"{STALE_EPOCH_ERROR} {plan.epoch} (now {self.epoch})"
                self._hand_over(plan, step_result(self.worker_id, plan, error=why), [])
                return
            if plan.epoch > self.epoch:
                if self.epoch:
                    log.info("worker: scheduler term %d starts; dropping old state", plan.epoch)
                    self.runner.reset()
                self.step_tokens.clear()
                self.epoch = plan.epoch
            t0 = self.telemetry.step_started(plan)
            self.step_started, self.step = time.monotonic(), plan  # heartbeats report it
            stored: list[tuple[bytes, bytes]] = []
            try:
                result, stored = self._step(plan)
            except Exception as e:  # noqa: BLE001 - execute reports its own errors; belt and braces
                log.exception("worker: step %d crashed", plan.step_id)
                result = step_result(self.worker_id, plan, error=str(e))
            self.step = None
            self.step_tokens.record(result)
            result.worker_id = self.worker_id
            result.host_tier_evicted = self.tiers.take_evicted()
            self.telemetry.step_done(plan, result, t0)
            self.telemetry.expert_load(self.runner.take_expert_load())
            self._hand_over(plan, result, stored)
        finally:
            self.stepping = False

    def _hand_over(
        self, plan: StepPlan, result: StepResult, stored: list[tuple[bytes, bytes]]
    ) -> None:
        self._loop.call_soon_threadsafe(self.finished.put_nowait, (plan, result, stored))

    async def _publish_results(self) -> None:
        """On the event loop: publish each step's result, in the order the steps ran."""
        while True:
            plan, result, stored = await self.finished.get()
            try:
                await self.bus.publish(subjects.RESULTS, result)
            except Exception:  # noqa: BLE001 - NATS down: the scheduler recomputes the step
                log.exception("worker: the result of step %d was not sent", plan.step_id)
            self.last_done = (plan.epoch, plan.step_id)
            self.last_heard = time.monotonic()  # a step's time is not the scheduler's silence
            if stored:
                self.bus.spawn(self.tiers.store(stored))

    def _step(self, plan: StepPlan) -> tuple[StepResult, list[tuple[bytes, bytes]]]:
        """On the model thread: fill in the plan's placeholders, copy the blocks this step will
        overwrite to the host tier, run the step, and copy the full blocks it completed (for
        Redis, written off this thread). A placeholder with nothing to fill it fails the step
        (its requests are still learnt and forgotten, nothing is computed)."""
        try:
            self.step_tokens.fill(plan)
        except PlaceholderError as e:
            log.error("worker: %s; the step fails and its sequences are recomputed", e)
            plan.seqs = []
            self.runner.execute(plan)
            return step_result(self.worker_id, plan, error=str(e)), []
        self.tiers.before_step(plan)
        result = self.runner.execute(plan)
        return result, [] if result.error else self.tiers.after_step(plan)

    async def _load(self, order: KvLoad) -> None:
        """Fill blocks from the tiers (host first, then Redis), in order, up to the first block
        found in neither; report how many (the scheduler computes the rest)."""
        t0 = time.monotonic()
        loaded = await self.tiers.load(order)
        done = KvLoadDone(
            load_id=order.load_id,
            request_id=order.request_id,
            worker_id=self.worker_id,
            num_loaded=loaded.num_loaded,
            host_hits=loaded.hits.get("host", 0),
            redis_hits=loaded.hits.get("redis", 0),
            num_bytes=loaded.num_bytes,
            seconds=time.monotonic() - t0,
        )
        await self.bus.publish(subjects.KV_DONE, done)

    def heartbeat(self) -> WorkerHeartbeat:
        step = self.step
        return WorkerHeartbeat(
            worker_id=self.worker_id,
            role=self.settings.worker.role,
            num_blocks=self.runner.num_blocks,
            block_size=self.runner.block_size,
            model=self.model_name,
            step_subject=self.step_subject,
            max_model_len=self.runner.max_model_len,
            kv_address=self.kv.address,
            kv_layout=self.kv_io.layout(),
            draining=self.draining,
            instance=self.instance,
            tensor_parallel_size=self.settings.worker.tensor_parallel_size,
            **self.tiers.heartbeat_fields(),
            step_id=step.step_id if step is not None else 0,
            step_epoch=step.epoch if step is not None else 0,
            step_seconds=time.monotonic() - self.step_started if step is not None else 0.0,
            queued_plans=self.queued_plans(),
            last_step_id=self.last_done[1],
            last_step_epoch=self.last_done[0],
        )

    async def _keep_group_alive(self) -> None:
        """An idle group's followers hear from rank 0 now and then (on the model thread, so
        never inside a step)."""
        while True:
            await asyncio.sleep(KEEPALIVE_S / 4)
            if self.idle():
                await self.model_thread.run(self.runner.keepalive)

    async def _heartbeat(self) -> None:
        while True:
            await self.tiers.probe()  # a switched-off tier: on again when it answers
            try:
                await self.bus.publish(subjects.HEARTBEAT, self.heartbeat())
            except Exception as e:  # noqa: BLE001 - NATS down: try again next beat
                log.warning("worker: heartbeat failed: %s", e)
            self._beat.clear()
            try:
                await asyncio.wait_for(self._beat.wait(), HEARTBEAT_INTERVAL_S)
            except TimeoutError:
                pass


async def run(settings: Settings) -> None:
    from kvflow.shared.model_source import resolve_model
    from kvflow.shared.ops_http import start_ops_server

    machine.configure(settings)  # before any kernel loads
    ops = start_ops_server(settings.ops.ops_port, "worker")
    src = resolve_model(settings.model.path, settings.model.served_model_name)
    if not settings.worker.worker_id:
        settings = settings.replace(worker_id=f"worker-{uuid.uuid4().hex[:8]}")
    backend = settings.worker.worker_backend
    if backend not in ("model", "sim"):
        raise SystemExit(f"--worker-backend must be 'model' or 'sim', not {backend!r}")
    try:
        connector_spec(settings.cache.kv_connector)  # an unknown transport fails before loading
        check_parallel_settings(settings)
    except ValueError as e:
        raise SystemExit(f"worker: {e}") from None
    model_thread = ModelThread()
    runner = await model_thread.run(lambda: load_runner(settings, src))
    service = WorkerService(settings, runner, src.name, model_thread)
    await service.start()
    ops.registry.register(service.telemetry.registry)
    ops.set_ready(lambda: service.bus.client.is_connected and not service.draining, service.bus)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, service.begin_drain)
    await _until_released(service, settings)
    await service.bus.close()
    await model_thread.run(runner.close)


# A draining worker that hears nothing from any scheduler for this long exits: no scheduler is
# left to release it (`docker compose stop` stops the schedulers beside it), and a live one
# answers a drain at once, with a release or with plans for the work still here.
DRAIN_SILENCE_S = 5.0


async def _until_released(service: WorkerService, settings: Settings) -> None:
    """Run until the scheduler releases a draining worker, no scheduler is heard from while
    draining, or the drain times out."""
    while not service.stopped.is_set():
        if service.draining:
            deadline = time.monotonic() + settings.ops.drain_timeout
            service.last_heard = max(service.last_heard, time.monotonic())
            while not service.stopped.is_set():
                now = time.monotonic()
                if service.idle() and now - service.last_heard > DRAIN_SILENCE_S:
                    log.info(
                        "worker %s: no scheduler heard for %.0fs while draining; exiting",
                        service.worker_id,
                        now - service.last_heard,
                    )
                    return
                if now > deadline:
                    log.warning(
                        "worker %s: not released within %.0fs of draining; exiting",
                        service.worker_id,
                        settings.ops.drain_timeout,
                    )
                    return
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(service.stopped.wait(), 0.5)
            return
        await asyncio.sleep(0.2)
