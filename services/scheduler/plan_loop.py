"""The plan loop: for each worker, an asyncio loop that plans a step (the core), sends it, and
applies the results in plan order. With async scheduling (the default) it plans step N+1 as
soon as N is sent, so two plans are in flight and the worker finds its next plan waiting when
a step ends; with ``--async-scheduling false`` it waits for each result before planning again.
Prefill hand-offs become KvPull orders to the decode worker.

A step is lost (its sequences recomputed) when the worker's heartbeats show it idle with
nothing queued well after the plan went out, or when ``--step-timeout`` passed and they do not
say it is computing it; a slow step on a live worker is waited for. A failed or lost step voids
every plan in flight (StepVoid tells the detokenizers and standbys not to apply their late
results)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable
from typing import Protocol

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.leadership import Leadership
from kvflow.services.scheduler.shadow import ShadowState
from kvflow.services.scheduler.telemetry import SchedulerTelemetry
from kvflow.services.scheduler.worker_state import WorkerState
from kvflow.shared import subjects
from kvflow.shared.bus import Bus
from kvflow.shared.messages import (
    STALE_EPOCH_ERROR,
    StepPlan,
    StepResult,
    StepVoid,
    WorkerHeartbeat,
)
from kvflow.shared.voided_steps import VoidedSteps

log = logging.getLogger("kvflow.scheduler")

LOST_CHECK_S = 1.0  # how often a step's wait looks at the worker's heartbeats
# a heartbeat received this long after a plan went out that shows the worker idle with nothing
# queued: the plan or its result was lost (worker heartbeats come every 0.5 s)
MISSED_AFTER_S = 2.0

Flight = deque[tuple[StepPlan, "asyncio.Future[StepResult]"]]


class WorkerLinks(Protocol):
    """What the plan loop asks of membership (membership.py) about the workers."""

    def subject(self, worker_id: str) -> str | None: ...

    def heartbeat(self, worker_id: str) -> WorkerHeartbeat | None: ...

    def heard_at(self, worker_id: str) -> float: ...

    def release_drained(self) -> Awaitable[None]: ...


def lost_in_transit(hb: WorkerHeartbeat | None, heard_at: float, sent: float) -> bool:
    """Whether a heartbeat that left the worker well after a plan was sent (``sent``) shows
    it idle with no plan queued: the plan never came, or its result was lost."""
    return (
        hb is not None
        and heard_at - sent > MISSED_AFTER_S
        and hb.step_id == 0
        and hb.queued_plans == 0
    )


class PlanLoop:
    """Every worker's loop, the results awaited (by worker, epoch and step id) and the steps
    voided."""

    def __init__(
        self,
        core: SchedulerCore,
        bus: Bus,
        leader: Leadership,
        telemetry: SchedulerTelemetry,
        shadow: ShadowState,
        step_timeout: float,
        stopped: asyncio.Event,
    ) -> None:
        self.core = core
        self.bus = bus
        self.leader = leader
        self.telemetry = telemetry
        self.shadow = shadow
        self.step_timeout = step_timeout
        self.stopped = stopped
        self._wake: dict[str, asyncio.Event] = {}  # worker id -> "there may be work"
        self._pending: dict[tuple[str, int, int], asyncio.Future[StepResult]] = {}
        self._voided = VoidedSteps()  # steps given up: their late results are not applied

    # -- membership's calls ---------------------------------------------------------------------

    def start(self, ws: WorkerState, links: WorkerLinks) -> None:
        """A worker joined: run its loop."""
        ev = self._wake[ws.worker_id] = asyncio.Event()
        ev.set()
        self.bus.spawn(self._run(ws, links))

    def stop(self, worker_id: str) -> None:
        """A worker left: its loop ends, and the steps it had in flight are void."""
        ev = self._wake.pop(worker_id, None)
        if ev is not None:
            ev.set()  # an idle loop wakes up to end
        lost = []
        for key, fut in list(self._pending.items()):
            if key[0] == worker_id and not fut.done():
                fut.cancel()
                lost.append(key[2])
        if lost:
            self._void(worker_id, lost)

    def wake_all(self) -> None:
        for ev in self._wake.values():
            ev.set()

    # -- results --------------------------------------------------------------------------------

    def deliver(self, result: StepResult) -> bool:
        """A StepResult arrived: to the loop awaiting it, if any. False for a result of a step
        voided (not to be applied anywhere)."""
        if self._voided.drops(result):
            log.warning(
                "a result of voided step %d of %s dropped", result.step_id, result.worker_id
            )
            return False
        fut = self._pending.pop((result.worker_id, result.epoch, result.step_id), None)
        if fut is not None and not fut.done():
            fut.set_result(result)
        return True

    def voided(self, msg: StepVoid) -> None:
        """Another scheduler voided steps: their late results are not applied."""
        self._voided.add(msg)

    # -- one worker's loop ----------------------------------------------------------------------

    async def _run(self, ws: WorkerState, links: WorkerLinks) -> None:
        """Plan ``ws``'s steps and apply their results, in order, while it is a worker of the
        core: a new plan whenever the worker state allows one (up to two in flight with async
        scheduling), else the oldest plan's result."""
        wid, core = ws.worker_id, self.core
        flight: Flight = deque()
        while core.workers.get(wid) is ws and not self.stopped.is_set():
            ev = self._wake.get(wid)
            if ev is None:
                return
            if not flight:
                await ev.wait()
                if core.workers.get(wid) is not ws:
                    return
                if not self.leader.may_plan():
                    await asyncio.sleep(0.05)  # lease unconfirmed: no plan until it is
                    continue
            if ws.can_plan() and self.leader.may_plan():
                plan = await self._plan(ws, links, flight)
                if plan is not None:
                    continue  # another plan may follow it at once
                if not flight:
                    continue
            if not await self._apply_oldest(ws, links, flight):
                return

    async def _plan(self, ws: WorkerState, links: WorkerLinks, flight: Flight) -> StepPlan | None:
        """Plan ``ws``'s next step and send it (with the tier loads it ordered); None when
        there is nothing to run (the wake event cleared when nothing is in flight either)."""
        wid, epoch = ws.worker_id, self.leader.epoch
        subject = links.subject(wid)
        assert subject is not None  # a worker of the core has one
        plan, loads = self.core.schedule(ws)
        for load in loads:
            load.epoch = epoch
            await self.bus.publish(subject, load)
        if plan is None:
            if not flight and not loads:
                self._wake[wid].clear()
            return None
        plan.epoch = epoch
        self.telemetry.on_plan(wid, plan)
        fut: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
        self._pending[(wid, epoch, plan.step_id)] = fut
        flight.append((plan, fut))
        await self.bus.publish(subject, plan)
        return plan

    async def _apply_oldest(self, ws: WorkerState, links: WorkerLinks, flight: Flight) -> bool:
        """Wait for the oldest plan's result and apply it. A step lost or failed voids every
        plan in flight (their sequences are recomputed). False when the loop should end."""
        wid, core = ws.worker_id, self.core
        plan, fut = flight[0]
        try:
            result = await self._step_result(wid, links, plan, fut)
        except asyncio.CancelledError:
            if self.stopped.is_set():
                raise
            return False  # the worker was removed meanwhile
        except Exception as e:  # noqa: BLE001 - a lost step is recovered below
            if core.workers.get(wid) is not ws:
                return False
            log.error(
                "worker %s: step %d got no result and the worker is not computing it (%s); "
                "recomputing",
                wid,
                plan.step_id,
                type(e).__name__,
            )
            self._void_flight(wid, flight)
            core.steps_lost(wid)
            self.wake_all()
            return True
        flight.popleft()
        if result.error and result.error.startswith(STALE_EPOCH_ERROR):
            self.leader.deposed(result.error)
            return False
        if result.error:
            log.error("worker %s: step %d failed: %s", wid, plan.step_id, result.error)
            self._void_flight(wid, flight)  # planned on top of this step: void with it
        outcome = core.on_result(result)
        self.telemetry.on_result(plan, result, outcome.finished)
        for seq, reason in outcome.finished:
            self.shadow.end(seq.request_id, seq.token_ids[seq.prompt_len :], reason)
        for dst, pull in outcome.pulls:
            subject = links.subject(dst)
            if subject is not None:
                pull.epoch = self.leader.epoch
                await self.bus.publish(subject, pull, self.telemetry.headers(pull.request_id))
        if outcome.finished or outcome.prefilled or result.error:
            self.wake_all()  # freed blocks or slots: waiting requests may fit somewhere
            if ws.draining:
                await links.release_drained()
        if not flight and not ws.running and not len(core.waiting) and not ws.to_forget:
            ev = self._wake.get(wid)
            if ev is not None:
                ev.clear()
        return True

    def _void_flight(self, wid: str, flight: Flight) -> None:
        """Give up every plan in flight: their futures are dropped and their results, should
        they still come, are voided (the core recomputes their sequences)."""
        if not flight:
            return
        for plan, fut in flight:
            self._pending.pop((wid, plan.epoch, plan.step_id), None)
            fut.cancel()
        self._void(wid, [plan.step_id for plan, _ in flight])
        flight.clear()

    def _void(self, wid: str, step_ids: list[int]) -> None:
        """Tell the detokenizers and the standbys that these steps' results, should they still
        come, are not to be applied: their sequences are recomputed."""
        void = StepVoid(wid, self.leader.epoch, step_ids)
        self.bus.spawn(self.bus.publish(subjects.RESULTS, void))

    async def _step_result(
        self, wid: str, links: WorkerLinks, plan: StepPlan, fut: asyncio.Future[StepResult]
    ) -> StepResult:
        """The plan's result. A step is lost (TimeoutError: its sequences are recomputed) when
        the worker's heartbeats show it idle with nothing queued well after the plan went out
        (the plan or its result was lost on the way: a NATS node failed), or when
        ``--step-timeout`` passed and the heartbeats do not say it is computing this step: a
        slow step on a live worker is waited for, however long (a recompute would be as slow,
        and lose the work done). A worker that falls silent is given up by membership, which
        cancels the wait."""
        timeout = self.step_timeout
        slice_s = min(timeout, LOST_CHECK_S)
        sent = time.monotonic()
        waited = 0.0
        while True:
            try:
                return await asyncio.wait_for(asyncio.shield(fut), slice_s)
            except TimeoutError:
                waited += slice_s
                hb = links.heartbeat(wid)
                computing = hb is not None and (hb.step_id, hb.step_epoch) == (
                    plan.step_id,
                    plan.epoch,
                )
                if not computing and lost_in_transit(hb, links.heard_at(wid), sent):
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
                waited = 0.0
