"""Which workers belong to the scheduler: they join with their first heartbeat (as they
describe themselves: role, blocks, KV layout, step subject), leave when silent for
``--worker-timeout`` seconds or replaced by a new process with their id (their sequences are
recomputed elsewhere), and drain: a draining worker takes nothing new and is released
(WorkerRelease: it may exit) once nothing of it is needed. Every worker's last heartbeat and step
subject are kept here; the plan loop (plan_loop.py) is told when a worker joins or leaves."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from typing import Protocol

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.leadership import Leadership
from kvflow.services.scheduler.limits import ROLES
from kvflow.services.scheduler.worker_state import WorkerState
from kvflow.shared.bus import Bus
from kvflow.shared.messages import WorkerHeartbeat, WorkerRelease

log = logging.getLogger("kvflow.scheduler")

TRANSFER_TIMEOUT_S = 120.0  # a KV transfer not reported done by then is given up


class WorkerLoops(Protocol):
    """What membership tells the plan loop (plan_loop.py)."""

    def start(self, ws: WorkerState, links: Membership) -> None: ...

    def stop(self, worker_id: str) -> None: ...

    def wake_all(self) -> None: ...


class Membership:
    """The workers' heartbeats and step subjects, their joining, leaving and draining."""

    def __init__(
        self,
        core: SchedulerCore,
        bus: Bus,
        leadership: Leadership,
        loops: WorkerLoops,
        worker_timeout: float,
    ) -> None:
        self.core = core
        self.bus = bus
        self.leadership = leadership
        self.loops = loops
        self.worker_timeout = worker_timeout
        self._heartbeats: dict[str, WorkerHeartbeat] = {}  # worker id -> its last heartbeat
        self._seen: dict[str, float] = {}  # worker id -> when it was last heard (monotonic)
        self._subjects: dict[str, str] = {}  # worker id -> its step subject
        self._instances: dict[str, str] = {}  # worker id -> the process the core knows

    # -- what others read -----------------------------------------------------------------------

    @property
    def heartbeats(self) -> Mapping[str, WorkerHeartbeat]:
        return self._heartbeats

    def heartbeat(self, worker_id: str) -> WorkerHeartbeat | None:
        return self._heartbeats.get(worker_id)

    def heard_at(self, worker_id: str) -> float:
        """When ``worker_id`` was last heard from (monotonic; 0 if never)."""
        return self._seen.get(worker_id, 0.0)

    def subject(self, worker_id: str) -> str | None:
        """Where ``worker_id`` takes plans and orders (None for a worker never heard of)."""
        return self._subjects.get(worker_id)

    def live_subjects(self) -> list[tuple[str, str]]:
        """(id, step subject) of every worker of the core."""
        return [(w, self._subjects[w]) for w in self.core.workers if w in self._subjects]

    # -- heartbeats -----------------------------------------------------------------------------

    async def on_heartbeat(self, hb: WorkerHeartbeat) -> None:
        wid = hb.worker_id
        self._seen[wid] = time.monotonic()
        self._heartbeats[wid] = hb
        if not self.leadership.leading:
            return
        core = self.core
        known = wid in core.workers
        if known and hb.instance != self._instances.get(wid, hb.instance):
            # the same id from a new process: the old one died (its steps will never return)
            self.remove(wid, "restarted (a new process has its id)")
            known = False
        if known:
            if hb.draining and not core.workers[wid].draining:
                log.info("worker %s is draining: no new work goes there", wid)
                core.set_draining(wid)
                await self.release_drained()
            return
        if hb.draining:  # a draining worker we do not know: nothing of ours runs there
            self._subjects[wid] = hb.step_subject
            await self.bus.publish(hb.step_subject, WorkerRelease(wid))
            return
        if hb.role not in ROLES:
            log.warning("worker %s has unknown role %r; ignored", wid, hb.role)
            return
        self._instances[wid] = hb.instance
        ws = core.join(hb)
        self._subjects[wid] = hb.step_subject
        self.loops.start(ws, self)
        log.info("worker %s joined (role %s): %d blocks of %d tokens", *_joined(hb))
        self.loops.wake_all()

    async def rejoin(self) -> None:
        """A new leader: the workers alive now join its core."""
        for hb in list(self._heartbeats.values()):
            if time.monotonic() - self._seen.get(hb.worker_id, 0) < self.worker_timeout:
                await self.on_heartbeat(hb)

    # -- leaving --------------------------------------------------------------------------------

    def remove(self, worker_id: str, why: str) -> None:
        """A worker is given up: its sequences wait again, to be recomputed elsewhere."""
        log.error("worker %s: %s; re-queueing its sequences", worker_id, why)
        self.core.remove_worker(worker_id)
        self.loops.stop(worker_id)
        self.loops.wake_all()

    async def release_drained(self) -> None:
        """Release draining workers that nothing needs any more: they exit on WorkerRelease."""
        for wid in list(self.core.workers):
            if self.core.drained(wid):
                log.info("worker %s drained; releasing it", wid)
                self.core.remove_worker(wid)
                self.loops.stop(wid)
                await self.bus.publish(self._subjects[wid], WorkerRelease(wid))

    async def watch(self, stopped: asyncio.Event) -> None:
        """While leading: give up lost KV transfers, release drained workers, and remove the
        workers silent for longer than the worker timeout."""
        while not stopped.is_set():
            await asyncio.sleep(min(1.0, self.worker_timeout / 3))
            if not self.leadership.leading:
                continue
            if self.core.expire_transfers(TRANSFER_TIMEOUT_S):
                self.loops.wake_all()
            await self.release_drained()
            now = time.monotonic()
            for wid in list(self.core.workers):
                silent = now - self._seen.get(wid, now)
                if silent > self.worker_timeout:
                    self.remove(wid, f"no heartbeat for {silent:.1f}s")


def _joined(hb: WorkerHeartbeat) -> tuple[str, str, int, int]:
    return hb.worker_id, hb.role, hb.num_blocks, hb.block_size
