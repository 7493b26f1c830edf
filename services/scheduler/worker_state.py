"""Per-worker bookkeeping: which sequences run on a worker, the blocks they hold there, the
sequences reserved to decode there, the plans in flight and the worker's counters. Every
change of a sequence's place goes through one method here (admit, requeue, finish, hand_off,
receive), so the blocks and counters stay consistent. Planning a step is planner.py's; where a
sequence goes among workers is router.py's.

Async scheduling (``SchedulerLimits.max_plans_in_flight`` 2, vLLM's async scheduling): the
next plan is built while the worker computes the one before, so the worker never waits for the
scheduler. A sequence that plan samples a token for is scheduled on top of it (a
``PLACEHOLDER`` the worker fills in) when nothing but that token is missing: not with
speculative decoding (drafts follow the last token), not before a hand-off or pooling, not past
its max_tokens. A sequence leaving while a plan in flight still computes it keeps its blocks
until that plan's result (they are written until then); nothing is preempted ahead of results:
a sequence short of blocks waits for them (``must_sync``) and the next plan is built with
nothing in flight.

Roles: a ``both`` worker prefills and decodes its own sequences. A ``prefill`` worker admits
sequences whose decode worker is elsewhere (a ``Route`` with blocks reserved there) and hands
each one off when its prefill samples the first token (``StepOutcome.prefilled``). A ``decode``
worker receives handed-off sequences as TRANSFERRING (their K/V on the way) and schedules them
once the K/V has arrived.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Protocol

from kvflow.services.scheduler.block_manager import BlockHash, BlockManager
from kvflow.services.scheduler.planner import Admission, InFlightStep, plan_step
from kvflow.services.scheduler.policy import SchedulingPolicy
from kvflow.services.scheduler.sequence import (
    RequeueReason,
    Reservation,
    SeqStatus,
    Sequence,
    TierLoad,
)
from kvflow.services.scheduler.speculation import Drafts, Speculator
from kvflow.services.scheduler.waiting import WaitingQueue
from kvflow.shared.messages import FinishReason, StepPlan, StepResult

ROLES = ("both", "prefill", "decode")


@dataclass
class SchedulerLimits:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    max_loras: int = 0  # distinct LoRA adapters running on a worker at most (0: LoRA off)
    max_plans_in_flight: int = 1  # 2: async scheduling (the service's default)


@dataclass
class StepOutcome:
    """What applying a StepResult changed: sequences that finished, by reason, and sequences
    whose prefill here is done and whose decode goes to another worker."""

    finished: list[tuple[Sequence, FinishReason]] = field(default_factory=list)
    prefilled: list[Sequence] = field(default_factory=list)


@dataclass
class Route:
    """Where an admitted sequence decodes: here (``reservation`` None) or on the worker that
    holds ``reservation``."""

    reservation: Reservation | None = None


class WorkerRouter(Protocol):
    """What a worker asks of the router (router.py) about other workers and the KV tiers."""

    def route(self, seq: Sequence, here: WorkerState) -> Route | None: ...

    def release_elsewhere(self, seq: Sequence) -> None: ...

    def tier_lookup(self, seq: Sequence, ws: WorkerState, first: int) -> list[BlockHash]: ...


class WorkerState:
    """One worker as the scheduler sees it: its blocks, running sequences and the plan in
    flight. Requeued sequences go back to the shared ``waiting`` queue."""

    def __init__(
        self,
        worker_id: str,
        blocks: BlockManager,
        limits: SchedulerLimits,
        waiting: WaitingQueue,
        policy: SchedulingPolicy,
        router: WorkerRouter,
        role: str = "both",
        host_tier: bool = False,
        redis_tier: bool = False,
        speculator: Speculator | None = None,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown worker role {role!r} (one of {', '.join(ROLES)})")
        self.worker_id = worker_id
        self.bm = blocks
        self.limits = limits
        self.waiting = waiting
        self.policy = policy
        self.router = router
        self.role = role
        self.offload_enabled = host_tier  # a host tier: send evicted blocks there
        self.store_enabled = redis_tier  # a Redis tier: store completed blocks
        self.draining = False  # take nothing new; finish what runs
        self.loads: list[TierLoad] = []  # tier loads ordered by the last schedule()
        self.running: list[Sequence] = []  # admission order: the last is the newest
        self.to_forget: list[str] = []  # request ids the worker should drop at the next step
        self.in_flight: deque[InFlightStep] = deque()  # plans sent, oldest first
        self.plan_cached: list[int] = []  # blocks whose hashes the plan being built registered
        # blocks of sequences that left while a plan in flight computes them: freed with the
        # result of that plan (step id), not before (the worker writes them until then)
        self.deferred_free: list[tuple[int, list[int]]] = []
        self.must_sync = False  # a sequence waits for blocks: no plan ahead of results
        self.speculator = speculator  # speculative decoding (None: off)
        self.num_reserved = 0  # sequences prefilled elsewhere that will decode here
        self.step_id = 0
        self.num_preemptions = 0
        self.num_prefills = 0  # sequences admitted here for their prefill
        self.num_decodes = 0  # sequences that decode here
        # LoRA adapters the worker holds, least recently used first: the worker's own LRU
        # (services/worker/lora.py) sees the same plans, so this mirrors it (for routing)
        self.loras: OrderedDict[str, None] = OrderedDict()

    def lora_fits(self, seq: Sequence) -> bool:
        """Whether ``seq``'s adapter may run here now: it has none, an adapter already running
        here, or fewer than ``max_loras`` distinct adapters run here (every running sequence
        computes in every step, so this bounds the adapters of a step)."""
        if seq.lora is None or not self.limits.max_loras:
            return True
        names = {s.lora.name for s in self.running if s.lora is not None}
        return seq.lora.name in names or len(names) < self.limits.max_loras

    def holds_lora(self, seq: Sequence) -> bool:
        """Whether this worker has ``seq``'s adapter in memory (as far as plans tell)."""
        return seq.lora is None or seq.lora.name in self.loras

    def used_loras(self, names: list[str]) -> None:
        """A plan ran these adapters: most recently used now, the oldest beyond
        ``max_loras`` evicted (as the worker's own cache does)."""
        for name in names:
            self.loras[name] = None
            self.loras.move_to_end(name)
        while len(self.loras) > max(self.limits.max_loras, 1):
            self.loras.popitem(last=False)

    @property
    def can_prefill(self) -> bool:
        return self.role in ("both", "prefill")

    @property
    def can_decode(self) -> bool:
        return self.role in ("both", "decode")

    def has_room_for_one_more(self) -> bool:
        return len(self.running) + self.num_reserved < self.limits.max_num_seqs

    def propose(self, seq: Sequence, budget: int) -> Drafts | None:
        """Drafts for a decoding ``seq`` (speculative decoding), within ``budget``, its
        max_tokens and the model length; None when off or nothing to propose."""
        if self.speculator is None:
            return None
        return self.speculator.propose(seq, budget, self.limits.max_model_len, len(self.running))

    def schedule(self) -> StepPlan | None:
        """This worker's next plan (planner.py), or None when there is nothing to run."""
        return plan_step(self)

    def can_plan(self) -> bool:
        """Whether another plan may go to the worker now: fewer than ``max_plans_in_flight``
        are in flight, and the last one left no sequence waiting for blocks."""
        if not self.in_flight:
            return True
        return len(self.in_flight) < self.limits.max_plans_in_flight and not self.must_sync

    def ahead(self, seq: Sequence) -> tuple[int, int]:
        """What the plans in flight do for ``seq``: the tokens they compute, and the tokens
        they sample (known only with their results)."""
        computed = pending = 0
        rid = seq.request_id
        for step in self.in_flight:
            n = step.scheduled.get(rid)
            if n is not None:
                computed += n
                pending += rid in step.samples
        return computed, pending

    def may_run_ahead(self, seq: Sequence, pending: int) -> bool:
        """Whether ``seq`` may be scheduled on top of ``pending`` tokens not known yet."""
        if not pending:
            return True
        if pending > 1 or self.speculator is not None or seq.reservation is not None:
            return False
        if seq.pooling is not None:
            return False
        after = len(seq.token_ids) + pending  # the sequence's length once they are known
        return after - seq.prompt_len < seq.params.max_tokens and after < self.limits.max_model_len

    def sent(self, step: InFlightStep) -> None:
        """The plan built last is on its way to the worker."""
        self.in_flight.append(step)
        self.plan_cached = []

    # -- admission and requeue ------------------------------------------------------------------

    def admit(self, seq: Sequence, adm: Admission, route: Route) -> None:
        """Take ``seq`` (popped from the queue) with its cached prefix and fresh blocks. With
        tier blocks to load it waits (TRANSFERRING) for that load, then computes only the rest."""
        if adm.count_prefix:
            self.bm.count_prefix((seq.num_tokens - 1) // self.bm.block_size, len(adm.cached))
        self.bm.take_cached(adm.cached)
        mark = len(self.bm.evicted)
        fresh = self.bm.allocate(adm.need)
        if adm.tier:
            del self.bm.evicted[mark:]  # written by the load, not by a step: nothing to offload
            seq.load = TierLoad("", len(adm.cached), list(zip(fresh, adm.tier, strict=True)))
            self.loads.append(seq.load)
        seq.blocks = list(adm.cached) + fresh
        seq.num_computed = len(adm.cached) * self.bm.block_size
        seq.hashes = self.bm.block_hashes(seq.token_ids[: seq.num_computed], seq.cache_salt)
        seq.status = SeqStatus.TRANSFERRING if adm.tier else SeqStatus.RUNNING
        seq.worker_id = self.worker_id
        seq.reservation = route.reservation
        seq.announced = False
        self.running.append(seq)
        self.num_prefills += 1
        if route.reservation is None and seq.pooling is None:
            self.num_decodes += 1

    def requeue(self, seq: Sequence, reason: RequeueReason) -> None:
        """``seq`` stops running here and waits again with every token it has, to be recomputed
        (so its output does not change); its blocks here and elsewhere are freed."""
        self.running.remove(seq)
        self._free(seq, seq.blocks)
        self.router.release_elsewhere(seq)
        seq.blocks, seq.hashes, seq.num_computed = [], [], 0
        seq.load = None
        seq.status = SeqStatus.WAITING
        seq.worker_id = None
        seq.announced = False
        if reason is RequeueReason.PREEMPTED:
            seq.num_preemptions += 1
            self.num_preemptions += 1
        self.to_forget.append(seq.request_id)
        self.waiting.push(seq)

    def register(self, seq: Sequence, end: int) -> list[int]:
        """Register the full blocks this step fills (up to position ``end``) as cached now, not
        when the result comes back: the worker writes every K/V of a step before any attention
        reads it, so a sequence admitted later in this same step (n > 1 siblings, identical
        prompts arriving together) already shares them. If the step fails they are forgotten
        again (on_failed_step). A block holding a token not known yet (a placeholder) is
        registered by a later plan. Returns the blocks registered."""
        start = len(seq.hashes)  # blocks before this are registered already (or duplicates)
        upto = min(end, seq.num_tokens)
        if upto // self.bm.block_size <= start:  # no block filled (most decode steps)
            return []
        self.bm.extend_hashes(seq.hashes, seq.token_ids, upto, seq.cache_salt)
        added = self.bm.cache_blocks(seq.blocks[start:], seq.hashes[start:])
        self.plan_cached += added
        return added

    def unregister(self, blocks: list[int]) -> None:
        """Forget blocks registered for a sequence taken out of the plan being built."""
        self.bm.uncache(blocks)
        gone = set(blocks)
        self.plan_cached = [b for b in self.plan_cached if b not in gone]

    def loaded(self, seq: Sequence, num_loaded: int) -> None:
        """The tier load of ``seq`` ended with its first ``num_loaded`` blocks filled: register
        them and compute from there (the other blocks are filled by computing)."""
        load, seq.load = seq.load, None
        assert load is not None
        start = load.first_block
        seq.hashes = seq.hashes[:start] + [h for _, h in load.blocks[:num_loaded]]
        self.bm.cache_blocks(seq.blocks[start : start + num_loaded], seq.hashes[start:])
        seq.num_computed = (start + num_loaded) * self.bm.block_size
        seq.status = SeqStatus.RUNNING

    # -- hand-off (disaggregated) --------------------------------------------------------------

    def reserve(self, seq: Sequence) -> Reservation:
        """Take blocks here for the K/V of ``seq``, prefilled on another worker and decoded
        here: the prefix this worker has cached (not transferred; those blocks count as
        prefix hits) and fresh blocks for the rest."""
        limit = seq.num_tokens // self.bm.block_size
        cached = self.bm.lookup_prefix(seq.token_ids, limit, seq.cache_salt)
        self.bm.count_prefix(limit, len(cached))
        self.bm.take_cached(cached)
        blocks = cached + self.bm.allocate(self.bm.blocks_needed(seq.num_tokens) - len(cached))
        self.num_reserved += 1
        return Reservation(self.worker_id, blocks, len(cached))

    def unreserve(self, res: Reservation) -> None:
        """A reservation here is not needed any more (its sequence ended or moved)."""
        self.bm.free_blocks(res.blocks)
        self.num_reserved -= 1

    def release_held(self, blocks: list[int]) -> None:
        """Blocks a handed-off sequence held here while its K/V was copied are free again."""
        self.bm.free_blocks(blocks)

    def hand_off(self, seq: Sequence) -> list[int]:
        """A prefilled sequence leaves for its decode worker: it stops running here, the worker
        drops its state, and its blocks stay held (returned) until the K/V has been copied."""
        self.running.remove(seq)
        self.to_forget.append(seq.request_id)
        self._leave_flight(seq)
        held, seq.blocks = seq.blocks, []
        return held

    def receive(self, seq: Sequence) -> None:
        """A sequence prefilled elsewhere arrives with its reserved blocks, K/V on the way."""
        assert seq.reservation is not None and seq.reservation.worker_id == self.worker_id
        self.num_reserved -= 1
        self.num_decodes += 1
        seq.blocks = list(seq.reservation.blocks)
        seq.reservation = None
        seq.worker_id = self.worker_id
        seq.status = SeqStatus.TRANSFERRING
        seq.announced = False
        self.running.append(seq)

    def kv_arrived(self, seq: Sequence) -> None:
        """The transfer into ``seq``'s blocks is complete: register its full blocks in this
        worker's prefix cache and let it run."""
        self.bm.cache_blocks(seq.blocks, seq.hashes)
        seq.status = SeqStatus.RUNNING

    # -- results -------------------------------------------------------------------------------

    def on_result(self, result: StepResult) -> StepOutcome:
        """Apply a worker's StepResult to its plan (the oldest in flight)."""
        step = self._landed(result.step_id)
        if step is None:
            return StepOutcome()
        scheduled, drafts = step.scheduled, step.drafts
        self._free_deferred(step.step_id)
        by_id = {s.request_id: s for s in self.running}
        for rid, n in scheduled.items():
            seq = by_id.get(rid)
            if seq is None:  # aborted while in flight
                continue
            seq.num_computed += n
        outcome = StepOutcome()
        emitted: dict[str, list[int]] = {rid: [] for rid in drafts}
        for rid, tok, reason in zip(
            result.request_ids, result.token_ids, result.finish_reasons, strict=True
        ):
            seq = by_id.get(rid)
            if seq is None or rid not in scheduled or seq.status is SeqStatus.FINISHED:
                continue
            seq.token_ids.append(tok)
            if rid in emitted:
                emitted[rid].append(tok)
            if reason != FinishReason.NONE:
                self.finish(seq)
                outcome.finished.append((seq, FinishReason(reason)))
            elif seq.reservation is not None:
                outcome.prefilled.append(seq)
        for rid, toks in emitted.items():
            self._verified(by_id.get(rid), drafts[rid], toks)
        for pooled in result.embeddings:  # an embedding request ends with its vector
            seq = by_id.get(pooled.request_id)
            if seq is not None and pooled.request_id in scheduled:
                self.finish(seq)
                outcome.finished.append((seq, FinishReason.STOP))
        return outcome

    def _verified(self, seq: Sequence | None, drafts: Drafts, emitted: list[int]) -> None:
        """A sequence's drafts were verified: the K/V of every token it got but the last is
        now computed (its accepted drafts' included), and blocks taken only for rejected
        drafts go back to the free list."""
        if seq is None or not emitted:
            return
        assert self.speculator is not None  # drafts were proposed by it
        self.speculator.verified(seq, drafts, emitted)
        if seq.status is not SeqStatus.RUNNING:  # finished on one of them
            return
        seq.num_computed = seq.num_tokens - 1
        keep = self.bm.blocks_needed(seq.num_tokens)
        seq.sent_blocks = min(seq.sent_blocks, keep)  # the worker's table is cut there too
        if len(seq.blocks) > keep:
            self.bm.free_blocks(seq.blocks[keep:])
            del seq.blocks[keep:]

    def _landed(self, step_id: int) -> InFlightStep | None:
        """Take the plan ``step_id`` out of flight. Results are applied in plan order (the
        service awaits them so), so it is the oldest; None if it is not in flight."""
        if not self.in_flight or self.in_flight[0].step_id != step_id:
            return None
        return self.in_flight.popleft()

    def _leave_flight(self, seq: Sequence) -> int | None:
        """``seq`` leaves this worker: the plans in flight no longer count for it (their
        results are not applied to it). Returns the newest such plan's step id, if any."""
        last = None
        rid = seq.request_id
        for step in self.in_flight:
            if step.scheduled.pop(rid, None) is not None:
                step.samples.discard(rid)
                step.drafts.pop(rid, None)
                last = step.step_id
        return last

    def _free(self, seq: Sequence, blocks: list[int]) -> None:
        """Free a leaving sequence's blocks, or, while a plan in flight still writes them, once
        that plan's result is in (a block given to another sequence's KV-tier load or
        transfer could be written before that step runs)."""
        last = self._leave_flight(seq)
        if last is None:
            self.bm.free_blocks(blocks)
        elif blocks:
            self.deferred_free.append((last, list(blocks)))

    def _free_deferred(self, upto: int | None = None) -> None:
        """Free the blocks held for plans up to step ``upto`` (None: all)."""
        keep: list[tuple[int, list[int]]] = []
        for step_id, blocks in self.deferred_free:
            if upto is None or step_id <= upto:
                self.bm.free_blocks(blocks)
            else:
                keep.append((step_id, blocks))
        self.deferred_free = keep

    def on_failed_step(self, removing: bool = False) -> list[Sequence]:
        """A step failed (worker error or lost): the plans in flight are void and every
        sequence of them is re-queued from its tokens so far (recompute), nothing is lost. When
        the worker is being removed, the ones waiting for their K/V go too. Returns the
        re-queued sequences."""
        for step in self.in_flight:
            self.bm.uncache(step.cached)
        self.in_flight.clear()
        self._free_deferred()
        self.must_sync = False
        reason = RequeueReason.WORKER_LEFT if removing else RequeueReason.STEP_FAILED
        moved = [s for s in self.running if removing or s.status is SeqStatus.RUNNING]
        for seq in reversed(moved):
            self.requeue(seq, reason)
        return moved

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's blocks (their hashes stay cached)."""
        if seq in self.running:
            self.running.remove(seq)
        self._free(seq, seq.blocks)
        self.router.release_elsewhere(seq)
        seq.blocks = []
        seq.status = SeqStatus.FINISHED
        self.to_forget.append(seq.request_id)
