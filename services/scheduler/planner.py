"""Planning one worker's next step: pure functions of what the worker state holds, returning a
decision (decision.py) that the worker state applies; the unit tests drive them without NATS.

One model for every step (vLLM V1): each running sequence's computed tokens catch up with its
known tokens under a token budget, so prefill, chunked prefill, prefix hits and decode share one
path. Running sequences go first (decodes keep flowing while long prompts are chunked in), then
waiting ones join, in the policy's queue order, while budget, sequence slots and blocks allow.
When blocks run out, the policy's victim is preempted by recompute; a step that had to preempt
admits nothing new. With speculative decoding a decoding sequence also computes draft tokens
(speculation.py): they take budget and blocks like known tokens, but are dropped before
anything is preempted for them.

With async scheduling a plan is built while earlier ones are in flight (worker_state.py): a
sequence's tokens start after what those plans compute, a token they sample goes in as a
``PLACEHOLDER``, and a sequence short of blocks is left for the next plan instead of preempting
(``must_sync``: that plan is built once the results are in).

The running sequences are decided in one pass (``plan_running``), which counts the blocks its
own decisions take and free as it goes. Admissions are decided one at a time
(``plan_admissions``), each on the state the one before left once applied: an admission's
blocks registered in this step are prefix hits for the next (identical prompts arriving
together share them), its fresh blocks may evict cached ones, and the router weighs this
worker's load; deciding them all up front would mean a second block manager.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from collections.abc import Sequence as Seq
from typing import Protocol

from kvflow.services.scheduler.block_manager import BlockHash
from kvflow.services.scheduler.decision import (
    Admission,
    Admit,
    Preempt,
    Route,
    Run,
    RunningDecision,
)
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.services.scheduler.policy import SchedulingPolicy
from kvflow.services.scheduler.sequence import SeqStatus, Sequence
from kvflow.services.scheduler.speculation import Proposal, Speculator

MAX_PASSED_OVER = 64  # waiting sequences passed over per step for their LoRA adapter, at most


class Blocks(Protocol):
    """What the planner asks of a worker's block manager (block_manager.py): queries only."""

    block_size: int
    ref_counts: list[int]

    @property
    def num_free_blocks(self) -> int: ...

    def blocks_needed(self, num_tokens: int) -> int: ...

    def lookup_prefix(
        self, token_ids: Seq[int], limit: int | None = None, cache_salt: str | None = None
    ) -> list[int]: ...

    def can_allocate(self, num_blocks: int, reused: Seq[int] = ()) -> bool: ...


class PlanView(Protocol):
    """What the planner reads of a worker (worker_state.py's WorkerState)."""

    bm: Blocks
    limits: SchedulerLimits
    policy: SchedulingPolicy
    speculator: Speculator | None
    running: list[Sequence]
    draining: bool

    @property
    def in_flight(self) -> Seq[object]: ...

    @property
    def can_prefill(self) -> bool: ...

    def ahead(self, seq: Sequence) -> tuple[int, int]: ...

    def may_run_ahead(self, seq: Sequence, pending: int) -> bool: ...

    def has_room_for_one_more(self) -> bool: ...

    def lora_fits(self, seq: Sequence) -> bool: ...

    def route(self, seq: Sequence) -> Route | None: ...

    def tier_lookup(self, seq: Sequence, first: int) -> list[BlockHash]: ...


def plan_running(ws: PlanView) -> RunningDecision:
    """Give running sequences their next tokens, preempting the policy's victims while blocks
    are short (with plans in flight: leaving the sequence for a plan built after their
    results)."""
    bm = ws.bm
    budget = ws.limits.max_num_batched_tokens
    free = bm.num_free_blocks
    runs: dict[Sequence, Run] = {}
    actions: list[Run | Preempt] = []
    proposals: list[tuple[Sequence, Proposal]] = []
    gone: _Victims | None = None  # preempted in this pass
    must_sync = False
    speculator, max_len = ws.speculator, ws.limits.max_model_len
    for seq in ws.running:
        if budget <= 0:
            break
        if seq.status is not SeqStatus.RUNNING:  # K/V in flight
            continue
        if gone is not None and seq in gone.seqs:
            continue
        ahead, pending = ws.ahead(seq)
        if not ws.may_run_ahead(seq, pending):
            continue
        start = seq.num_computed + ahead
        end_known = len(seq.token_ids) + pending
        num_new = min(end_known - start, budget)
        if num_new <= 0:
            continue
        drafts = None
        if speculator is not None and num_new == 1 and not ahead:
            batch = len(ws.running) - (len(gone.seqs) if gone is not None else 0)
            proposal = speculator.propose(seq, budget - 1, max_len, batch)
            proposals.append((seq, proposal))
            drafts = proposal.drafts
        extra = drafts.count if drafts else 0
        need = bm.blocks_needed(start + num_new + extra) - len(seq.blocks)
        if need > 0:  # (most decode steps fill a block already held: nothing to allocate)
            if drafts and need > free:  # drafts never cost a preemption
                drafts, extra = None, 0
                need = bm.blocks_needed(start + num_new) - len(seq.blocks)
            if need > free and ws.in_flight:
                must_sync = True  # preempt only once the plans in flight are done
                continue
            while need > free:
                victim = ws.policy.choose_victim(
                    ws.running if gone is None else gone.left(ws.running)
                )
                if victim is None:
                    break
                if gone is None:
                    gone = _Victims(bm.ref_counts)
                actions.append(Preempt(victim))
                unrun = runs.pop(victim, None)
                if unrun is not None:  # a victim scheduled earlier (only a priority policy)
                    budget += unrun.num_new + (unrun.drafts.count if unrun.drafts else 0)
                free += gone.add(victim, unrun.need if unrun is not None else 0)
                if victim is seq:
                    break
            if (gone is not None and seq in gone.seqs) or need > free:
                continue
            free -= need
        else:
            need = 0
        end = start + num_new
        # (most decode steps fill no block: nothing to register)
        fills = end // bm.block_size > len(seq.hashes)
        run = runs[seq] = Run(seq, start, num_new, end == end_known, need, drafts, fills)
        if need or fills:
            actions.append(run)
        budget -= num_new + extra
    admit = gone is None and not must_sync  # memory is short: admit nothing new
    return RunningDecision(actions, runs, proposals, budget, admit, must_sync)


class _Victims:
    """The sequences preempted in the pass being planned, and the references their blocks
    lose: a block is free once its last holder is gone."""

    def __init__(self, ref_counts: list[int]) -> None:
        self.ref_counts = ref_counts
        self.seqs: set[Sequence] = set()
        self.dropped: dict[int, int] = {}

    def left(self, running: list[Sequence]) -> list[Sequence]:
        return [s for s in running if s not in self.seqs]

    def add(self, seq: Sequence, fresh: int) -> int:
        """``seq`` is preempted (``fresh``: blocks this pass gave it); returns the blocks that
        become free."""
        self.seqs.add(seq)
        freed = fresh
        for b in seq.blocks:
            left = self.ref_counts[b] - self.dropped.get(b, 0)
            self.dropped[b] = self.dropped.get(b, 0) + 1
            freed += left == 1
        return freed


def plan_admissions(ws: PlanView, waiting: Iterable[Sequence], budget: int) -> Iterator[Admit]:
    """The waiting sequences to admit, in queue order, until one does not fit (it keeps its
    place), each yielded to be applied before the next is decided. A sequence whose LoRA
    adapter would be one more than the worker may run is passed over (as vLLM's), keeping its
    place for a later step."""
    passed = 0
    queue = iter(waiting)
    while budget > 0 and ws.can_prefill and not ws.draining and ws.has_room_for_one_more():
        seq = next(queue, None)
        if seq is None:
            return
        if not ws.lora_fits(seq):
            if passed >= MAX_PASSED_OVER:
                return
            passed += 1
            continue
        adm = fit(ws, seq, budget)
        if adm is None:
            return
        route = ws.route(seq)
        if route is None:  # another worker is the better place (or none can decode it)
            return
        yield Admit(seq, adm, route)
        budget -= adm.num_new


def fit(ws: PlanView, seq: Sequence, budget: int) -> Admission | None:
    """How ``seq`` would be admitted on ``ws`` now, or None when its blocks do not fit. With
    prompt_logprobs, MEAN/CLS pooling or an encoder the whole prompt is computed (no cache, no
    tier); an encoder's in one step."""
    bm = ws.bm
    use_cache = not seq.computes_whole_prompt
    cached = bm.lookup_prefix(seq.token_ids, cache_salt=seq.cache_salt) if use_cache else []
    tier = ws.tier_lookup(seq, len(cached)) if use_cache else []
    if tier:
        num_new, need = 0, len(tier)
    else:
        num_computed = len(cached) * bm.block_size
        num_new = min(seq.num_tokens - num_computed, budget)
        if num_new < seq.num_tokens and seq.pooling is not None and seq.pooling.bidirectional:
            # an encoder's input runs whole: it waits for a step with room, or runs alone in
            # one past the budget (vLLM raises an encoder's budget to max_model_len)
            if budget < ws.limits.max_num_batched_tokens:
                return None
            num_new = seq.num_tokens
        need = bm.blocks_needed(num_computed + num_new) - len(cached)
    if not bm.can_allocate(need, cached):
        return None
    return Admission(cached, tier, need, num_new, count_prefix=use_cache)
