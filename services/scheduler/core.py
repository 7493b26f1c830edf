"""The scheduler's state across workers, tying its layers together: the waiting queue in the
policy's order (policy.py, waiting.py), every live request, one WorkerState per worker
(worker_state.py, planned by planner.py) and the Router (router.py) for placement, prefill ->
decode hand-offs and KV tier loads. Plain Python (no NATS), so tests can drive it offline.

Owners: the core makes the sequences and owns ``requests``, the waiting queue and the workers
(others read ``workers`` as a mapping); a worker's state and the placement of its sequences
are its WorkerState's; a sequence a worker lets go comes back here to be queued.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kvflow.services.scheduler.block_manager import BlockManager
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.services.scheduler.policy import SchedulingPolicy, make_policy
from kvflow.services.scheduler.router import Moves, Router
from kvflow.services.scheduler.sequence import RequeueReason, SeqStatus, Sequence
from kvflow.services.scheduler.speculation import Speculator
from kvflow.services.scheduler.waiting import WaitingQueue
from kvflow.services.scheduler.worker_state import StepOutcome, WorkerState
from kvflow.shared.kv_connectors import KvConnectorScheduler
from kvflow.shared.lora import adapter_salt
from kvflow.shared.messages import (
    KvLoad,
    KvLoadDone,
    KvPull,
    KvTransferDone,
    SchedulerStats,
    StepPlan,
    StepResult,
    TokenizedRequest,
    WorkerHeartbeat,
    WorkerStats,
)
from kvflow.shared.speculative import SpeculativeConfig


class QueueFullError(RuntimeError):
    pass


@dataclass
class CoreOutcome(StepOutcome):
    """A StepOutcome plus the KV pulls the service must send (to the decode workers)."""

    pulls: list[tuple[str, KvPull]] = field(default_factory=list)  # (decode worker id, order)


class SchedulerCore:
    def __init__(
        self,
        limits: SchedulerLimits,
        policy: SchedulingPolicy | None = None,
        max_waiting: int = 1024,
        model: str = "",
        kv_connector: KvConnectorScheduler | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.limits = limits
        # speculative decoding: one proposer for every worker (its counters are the metrics')
        self.speculator = Speculator(speculative) if speculative is not None else None
        self.policy = policy or make_policy("priority")
        self.max_waiting = max_waiting
        self.model = model
        self.waiting = WaitingQueue(self.policy)
        self.requests: dict[str, Sequence] = {}
        self._workers: dict[str, WorkerState] = {}
        self.router = Router(self._workers, kv_connector)
        self.num_finished = 0
        self.num_computed_tokens = 0  # as reported by the workers' StepResults
        # the last step id of each worker given up: a worker that comes back numbers its steps
        # on from there, so a late result of a step planned before it was given up can never
        # be taken for one planned after (results are matched by worker, term and step id)
        self._last_step_ids: dict[str, int] = {}

    @property
    def workers(self) -> Mapping[str, WorkerState]:
        """Every worker's state, by id (read only: workers join and leave through the core)."""
        return self._workers

    # -- workers --------------------------------------------------------------------------------

    def add_worker(
        self,
        worker_id: str,
        num_blocks: int,
        block_size: int,
        role: str = "both",
        kv_address: str = "",
        kv_layout: str = "",
        host_tier: bool = False,
        redis_tier: bool = False,
    ) -> WorkerState:
        salt = f"{self.model}|{block_size}".encode()
        ws = WorkerState(
            worker_id,
            BlockManager(num_blocks, block_size, salt),
            self.limits,
            self.policy,
            self.router,
            role=role,
            host_tier=host_tier,
            redis_tier=redis_tier,
            speculator=self.speculator,
            step_id=self._last_step_ids.get(worker_id, 0),
        )
        self._workers[worker_id] = ws
        self.router.add_worker(worker_id, kv_address, kv_layout)
        return ws

    def join(self, hb: WorkerHeartbeat) -> WorkerState:
        """Add the worker a heartbeat announces, as it describes itself."""
        return self.add_worker(
            hb.worker_id,
            hb.num_blocks,
            hb.block_size,
            role=hb.role,
            kv_address=hb.kv_address,
            kv_layout=hb.kv_layout,
            host_tier=hb.host_tier_bytes > 0,
            redis_tier=bool(hb.redis_tier),
        )

    def remove_worker(self, worker_id: str) -> list[Sequence]:
        """A worker left: its sequences wait again, to be recomputed elsewhere; sequences
        prefilling elsewhere for a decode here are re-queued too (their reservation is gone)."""
        ws = self._workers.pop(worker_id, None)
        self.router.remove_worker(worker_id)
        if ws is None:
            return []
        self._last_step_ids[worker_id] = ws.step_id
        moved = ws.on_failed_step(removing=True)
        for other in self._workers.values():
            for seq in list(other.running):
                if seq.reservation is not None and seq.reservation.worker_id == worker_id:
                    # (nothing to free there any more: the worker is gone)
                    other.requeue(seq, RequeueReason.WORKER_LEFT)
                    moved.append(seq)
        self._wait(moved)
        return moved

    def set_draining(self, worker_id: str) -> None:
        ws = self._workers.get(worker_id)
        if ws is not None:
            ws.drain()

    def drained(self, worker_id: str) -> bool:
        """A draining worker with nothing running, reserved or being copied from it."""
        ws = self._workers.get(worker_id)
        if ws is None or not ws.draining or ws.busy():
            return False
        return not self.router.busy_source(ws)

    def _wait(self, seqs: Iterable[Sequence]) -> None:
        """Sequences a worker let go wait again (those aborted meanwhile are dropped)."""
        for seq in seqs:
            if seq.request_id in self.requests:
                self.waiting.push(seq)

    # -- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        req: TokenizedRequest,
        priority: int = 0,
        output_ids: list[int] | None = None,
        redis_prefix_blocks: int = 0,
    ) -> Sequence:
        """Queue a request; ``output_ids`` are tokens it generated before (a takeover resumes
        requests from their prompt plus those, by recompute); ``redis_prefix_blocks``: the
        prompt's leading full blocks the Redis KV tier held when it arrived."""
        if req.request_id in self.requests:
            return self.requests[req.request_id]  # a resubmission of the same request: run once
        if len(self.waiting) >= self.max_waiting:
            raise QueueFullError(f"the waiting queue is full ({self.max_waiting} requests)")
        seq = Sequence(
            request_id=req.request_id,
            token_ids=list(req.prompt_token_ids) + list(output_ids or []),
            prompt_len=len(req.prompt_token_ids),
            params=req.params,
            eos_token_ids=list(req.eos_token_ids),
            arrival_time=req.arrival_time,
            priority=priority,
            cache_salt=adapter_salt(req.cache_salt, req.lora),
            pooling=req.pooling,
            lora=req.lora,
            redis_prefix_blocks=redis_prefix_blocks,
        )
        self.requests[seq.request_id] = seq
        self.waiting.push(seq)
        return seq

    def abort(self, request_id: str) -> bool:
        seq = self.requests.pop(request_id, None)
        if seq is None:
            return False
        if seq.status is SeqStatus.WAITING:
            self.waiting.remove(request_id)  # never placed: nothing else holds it
        elif seq.worker_id in self._workers:
            self._workers[seq.worker_id].abort(seq)
        return True

    # -- steps ----------------------------------------------------------------------------------

    def schedule(self, ws: WorkerState) -> tuple[StepPlan | None, list[KvLoad]]:
        """``ws``'s next plan, and the tier loads it ordered (to send to the same worker)."""
        step = ws.schedule(self.waiting.in_order())
        for seq in step.admitted:
            self.waiting.remove(seq.request_id)
        self._wait(step.requeued)
        return step.plan, self.router.planned(ws, step.plan)

    def on_result(self, result: StepResult) -> CoreOutcome:
        self.num_computed_tokens += result.num_computed_tokens
        self.router.host_evicted(result.worker_id, result.host_tier_evicted)
        ws = self._workers.get(result.worker_id)
        if ws is None:
            return CoreOutcome()
        if result.error:
            self.steps_lost(result.worker_id)
            return CoreOutcome()
        step = ws.on_result(result)
        outcome = CoreOutcome(finished=step.finished, prefilled=step.prefilled)
        for seq, _reason in step.finished:
            self.requests.pop(seq.request_id, None)
            self.num_finished += 1
        for seq in step.prefilled:
            outcome.pulls += self._settle(self.router.hand_off(ws, seq)).pulls
        return outcome

    def steps_lost(self, worker_id: str) -> None:
        """The plans in flight on ``worker_id`` failed or got no result: they are void, and
        their sequences wait again, to be recomputed (nothing is lost)."""
        ws = self._workers.get(worker_id)
        if ws is not None:
            self._wait(ws.on_failed_step())

    def _settle(self, moves: Moves) -> Moves:
        self._wait(moves.requeued)
        return moves

    def on_transfer_done(self, msg: KvTransferDone) -> str | None:
        """A KV transfer ended; returns the worker that may now have work."""
        woken = self._settle(self.router.on_transfer_done(msg)).woken
        return woken[0] if woken else None

    def on_load_done(self, msg: KvLoadDone) -> str | None:
        return self.router.on_load_done(msg)

    def expire_transfers(self, timeout_s: float, now: float | None = None) -> list[str]:
        return self._settle(self.router.expire(timeout_s, now)).woken

    def redis_keys_for(self, token_ids: list[int], cache_salt: str | None = None) -> list[str]:
        return self.router.redis_keys_for(token_ids, cache_salt)

    # -- stats ----------------------------------------------------------------------------------

    def stats(self, heartbeats: Mapping[str, WorkerHeartbeat] | None = None) -> SchedulerStats:
        """Totals and per-worker figures; a worker's tier figures come from its last
        heartbeat in ``heartbeats``, when given."""
        ws = self._workers.values()
        hbs = heartbeats or {}
        t, tiers = self.router.transfer_totals, self.router.tier_totals
        return SchedulerStats(
            num_workers=len(self._workers),
            num_total_blocks=sum(w.bm.num_blocks for w in ws),
            num_free_blocks=sum(w.bm.num_free_blocks for w in ws),
            num_running=sum(len(w.running) for w in ws),
            num_waiting=len(self.waiting),
            num_finished=self.num_finished,
            num_preemptions=sum(w.num_preemptions for w in ws),
            model=self.model,
            max_model_len=self.limits.max_model_len,
            num_computed_tokens=self.num_computed_tokens,
            prefix_cache_queries=sum(w.bm.prefix_queries for w in ws),
            prefix_cache_hits=sum(w.bm.prefix_hits for w in ws),
            workers=[_worker_stats(w, hbs.get(w.worker_id)) for w in ws],
            kv_transfers=t.done,
            kv_transfer_failures=t.failed,
            kv_transfer_bytes=t.num_bytes,
            kv_transfer_seconds=t.seconds,
            tier_loads=tiers.loads,
            tier_host_hits=tiers.host_hits,
            tier_redis_hits=tiers.redis_hits,
            tier_misses=tiers.misses,
            tier_bytes=tiers.num_bytes,
            tier_load_seconds=tiers.seconds,
            tier_offloaded_blocks=tiers.offloaded,
        )


def _worker_stats(w: WorkerState, hb: WorkerHeartbeat | None) -> WorkerStats:
    stats = WorkerStats(
        worker_id=w.worker_id,
        role=w.role,
        num_blocks=w.bm.num_blocks,
        num_free_blocks=w.bm.num_free_blocks,
        num_running=len(w.running),
        prefix_cache_queries=w.bm.prefix_queries,
        prefix_cache_hits=w.bm.prefix_hits,
        num_prefills=w.num_prefills,
        num_decodes=w.num_decodes,
        draining=w.draining,
    )
    if hb is not None:
        stats.redis_tier, stats.redis_tier_errors = hb.redis_tier, hb.redis_tier_errors
        stats.redis_stored_blocks = hb.redis_stored_blocks
        stats.host_tier_blocks = hb.host_tier_blocks
        stats.tensor_parallel_size = hb.tensor_parallel_size
    return stats
