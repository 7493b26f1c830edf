"""Planning one worker's next step, as plain Python the unit tests drive without NATS.

One model for every step (vLLM V1): each running sequence's computed tokens catch up with its
known tokens under a token budget, so prefill, chunked prefill, prefix hits and decode share one
path. Running sequences go first (decodes keep flowing while long prompts are chunked in), then
waiting ones join, in the policy's queue order, while budget, sequence slots and blocks allow.
When blocks run out, the policy's victim is preempted by recompute (WorkerState.requeue); a
step that had to preempt admits nothing new. With speculative decoding a decoding sequence also
computes draft tokens (speculation.py): they take budget and blocks like known tokens, but are
dropped before anything is preempted for them.

With async scheduling a plan is built while earlier ones are in flight (worker_state.py): a
sequence's tokens start after what those plans compute, a token they sample goes in as a
``PLACEHOLDER``, and a sequence short of blocks is left for the next plan instead of preempting
(``must_sync``: that plan is built once the results are in).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.services.scheduler.block_manager import BlockHash
from kvflow.services.scheduler.sequence import RequeueReason, SeqStatus, Sequence
from kvflow.services.scheduler.speculation import Drafts
from kvflow.shared.messages import PLACEHOLDER, BlockRef, NewRequest, ScheduledSeq, StepPlan
from kvflow.shared.sampling import needs_token_history

if TYPE_CHECKING:
    from kvflow.services.scheduler.worker_state import WorkerState

MAX_PASSED_OVER = 64  # waiting sequences passed over per step for their LoRA adapter, at most


@dataclass
class Admission:
    """How a waiting sequence fits on a worker: the cached prefix blocks it reuses, the
    hashes of the next blocks a KV tier holds (loaded instead of computed), the fresh blocks it
    needs and the tokens it computes in this step (none while a tier load fills its blocks)."""

    cached: list[int]
    tier: list[BlockHash]
    need: int
    num_new: int
    count_prefix: bool  # a prefix-cache lookup (not for sequences computing their whole prompt)


@dataclass
class InFlightStep:
    """A plan sent to the worker whose result has not come back."""

    step_id: int
    scheduled: dict[str, int]  # request_id -> tokens it computes (known ones and placeholders)
    samples: set[str]  # requests it samples a token for: tokens not known until its result
    drafts: dict[str, Drafts]  # request_id -> the drafts it verifies
    cached: list[int]  # blocks whose hashes it registered


@dataclass(slots=True)
class _Chosen:
    """Tokens a sequence computes in the plan being built, from position ``start`` (known
    ones, then placeholders, then ``drafts``), whether it samples after them, and the blocks
    registered for it."""

    start: int
    num_new: int
    sample: bool
    registered: list[int] = field(default_factory=list)
    drafts: Drafts | None = None


def plan_step(ws: WorkerState) -> StepPlan | None:
    """Build ``ws``'s next plan, or None when there is nothing to run."""
    assert ws.can_plan(), "plans in flight are at their limit"
    ws.plan_cached = []
    ws.must_sync = False
    chosen: dict[Sequence, _Chosen] = {}
    budget, preempted = _schedule_running(ws, chosen, ws.limits.max_num_batched_tokens)
    if not preempted and not ws.must_sync:  # memory is short: admit nothing new
        _admit_waiting(ws, chosen, budget)
    if not chosen and not ws.to_forget:
        return None
    return _build_plan(ws, chosen)


def _schedule_running(
    ws: WorkerState, chosen: dict[Sequence, _Chosen], budget: int
) -> tuple[int, bool]:
    """Give running sequences their next tokens, preempting the policy's victims while blocks
    are short (with plans in flight: leaving the sequence for a plan built after their
    results). Returns the budget left and whether anything was preempted."""
    preempted = False
    bm = ws.bm
    for seq in list(ws.running):
        if budget <= 0:
            break
        if seq.status is not SeqStatus.RUNNING:  # preempted in this loop, or K/V in flight
            continue
        ahead, pending = ws.ahead(seq)
        if not ws.may_run_ahead(seq, pending):
            continue
        start = seq.num_computed + ahead
        end_known = len(seq.token_ids) + pending
        num_new = min(end_known - start, budget)
        if num_new <= 0:
            continue
        drafts = ws.propose(seq, budget - 1) if num_new == 1 and not ahead else None
        extra = drafts.count if drafts else 0
        need = bm.blocks_needed(start + num_new + extra) - len(seq.blocks)
        if need > 0:  # (most decode steps fill a block already held: nothing to allocate)
            if drafts and need > bm.num_free_blocks:  # drafts never cost a preemption
                drafts, extra = None, 0
                need = bm.blocks_needed(start + num_new) - len(seq.blocks)
            if need > bm.num_free_blocks and ws.in_flight:
                ws.must_sync = True  # preempt only once the plans in flight are done
                continue
            while need > bm.num_free_blocks:
                victim = ws.policy.choose_victim(ws.running)
                if victim is None:
                    break
                budget += _unschedule(ws, chosen, victim)
                ws.requeue(victim, RequeueReason.PREEMPTED)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING or need > bm.num_free_blocks:
                continue
            seq.blocks += bm.allocate(max(need, 0))
        end = start + num_new
        # (most decode steps fill no block: nothing to register, no call)
        registered = ws.register(seq, end) if end // bm.block_size > len(seq.hashes) else []
        chosen[seq] = _Chosen(start, num_new, end == end_known, registered, drafts)
        budget -= num_new + extra
    return budget, preempted


def _unschedule(ws: WorkerState, chosen: dict[Sequence, _Chosen], seq: Sequence) -> int:
    """Take ``seq`` out of the plan being built (a victim scheduled earlier in this step, which
    only a priority policy picks): its blocks are not written, so their hashes are forgotten.
    Returns the tokens of budget it gives back."""
    c = chosen.pop(seq, None)
    if c is None:
        return 0
    ws.unregister(c.registered)
    return c.num_new + (c.drafts.count if c.drafts else 0)


def _admit_waiting(ws: WorkerState, chosen: dict[Sequence, _Chosen], budget: int) -> None:
    """Admit waiting sequences in queue order until one does not fit (it keeps its place).
    A sequence whose LoRA adapter would be one more than the worker may run is passed over
    (as vLLM's), keeping its place for a later step."""
    passed: list[Sequence] = []
    try:
        _admit_in_order(ws, chosen, budget, passed)
    finally:
        for seq in passed:
            ws.waiting.push(seq)


def _admit_in_order(
    ws: WorkerState, chosen: dict[Sequence, _Chosen], budget: int, passed: list[Sequence]
) -> None:
    while budget > 0 and ws.can_prefill and not ws.draining and ws.has_room_for_one_more():
        seq = ws.waiting.peek()
        if seq is None:
            break
        if not ws.lora_fits(seq):
            if len(passed) >= MAX_PASSED_OVER:
                break
            passed.append(ws.waiting.pop())
            continue
        adm = _fit(ws, seq, budget)
        if adm is None:
            break
        route = ws.router.route(seq, ws)
        if route is None:  # another worker is the better place (or none can decode it)
            break
        ws.waiting.pop()
        ws.admit(seq, adm, route)
        if adm.tier:  # it waits for its tier load: nothing to compute in this step
            continue
        end = seq.num_computed + adm.num_new
        chosen[seq] = _Chosen(
            seq.num_computed, adm.num_new, end == seq.num_tokens, ws.register(seq, end)
        )
        budget -= adm.num_new


def _fit(ws: WorkerState, seq: Sequence, budget: int) -> Admission | None:
    """How ``seq`` would be admitted on ``ws`` now, or None when its blocks do not fit. With
    prompt_logprobs, MEAN/CLS pooling or an encoder the whole prompt is computed (no cache, no
    tier); an encoder's in one step."""
    use_cache = not seq.computes_whole_prompt
    cached = ws.bm.lookup_prefix(seq.token_ids, cache_salt=seq.cache_salt) if use_cache else []
    tier = ws.router.tier_lookup(seq, ws, len(cached)) if use_cache else []
    if tier:
        num_new, need = 0, len(tier)
    else:
        num_computed = len(cached) * ws.bm.block_size
        num_new = min(seq.num_tokens - num_computed, budget)
        if num_new < seq.num_tokens and seq.pooling is not None and seq.pooling.bidirectional:
            # an encoder's input runs whole: it waits for a step with room, or runs alone in
            # one past the budget (vLLM raises an encoder's budget to max_model_len)
            if budget < ws.limits.max_num_batched_tokens:
                return None
            num_new = seq.num_tokens
        need = ws.bm.blocks_needed(num_computed + num_new) - len(cached)
    if not ws.bm.can_allocate(need, cached):
        return None
    return Admission(cached, tier, need, num_new, count_prefix=use_cache)


def _build_plan(ws: WorkerState, chosen: dict[Sequence, _Chosen]) -> StepPlan:
    """The StepPlan message for ``chosen``; from here on that plan is in flight."""
    ws.step_id += 1
    # Evicted blocks go to the host tier only when this plan's step is what overwrites them:
    # the worker copies them first. Blocks taken for a tier load or a reservation are written
    # by other paths, which might get there before the copy: not offloaded.
    evicted = ws.bm.take_evicted()
    offload: list[BlockRef] = []
    if evicted and ws.offload_enabled:  # the set of every block of the batch only then
        written = {b for s in chosen for b in s.blocks}
        offload = [BlockRef(b, h) for b, h in evicted if b in written]
    store = (
        [BlockRef(b, h) for b in ws.plan_cached if (h := ws.bm.block_hash[b])]
        if ws.store_enabled
        else []
    )
    seqs: list[ScheduledSeq] = []
    new_requests: list[NewRequest] = []
    scheduled: dict[str, int] = {}
    samples: set[str] = set()
    drafts: dict[str, Drafts] = {}
    loras: list[str] = []
    for s, c in chosen.items():  # one pass: the plan's entries and what the flight keeps
        seqs.append(_scheduled(s, c))
        rid = s.request_id
        scheduled[rid] = c.num_new
        if c.sample:
            samples.add(rid)
        if c.drafts:
            drafts[rid] = c.drafts
        if not s.announced:
            new_requests.append(_announce(s))
            s.announced = True
        if s.lora is not None:
            loras.append(s.lora.name)
    plan = StepPlan(
        step_id=ws.step_id,
        seqs=seqs,
        new_requests=new_requests,
        finished_request_ids=ws.to_forget,
        offload=offload,
        store=store,
    )
    ws.used_loras(loras)
    ws.to_forget = []
    ws.sent(InFlightStep(ws.step_id, scheduled, samples, drafts, ws.plan_cached))
    return plan


def _scheduled(s: Sequence, c: _Chosen) -> ScheduledSeq:
    """A sequence's share of the plan: its next known tokens, a placeholder for each token
    a plan in flight samples, then its drafts; its block table whole when the worker is new
    to it (its NewRequest goes in this plan), else only the blocks added since the last plan."""
    start, end = c.start, c.start + c.num_new
    have = len(s.token_ids)
    if end <= have:
        token_ids = s.token_ids[start:end]
    elif start >= have:  # a decode step on top of a plan in flight: its token is not known
        token_ids = [PLACEHOLDER] * c.num_new
    else:
        token_ids = s.token_ids[start:] + [PLACEHOLDER] * (end - have)
    num_draft = num_worker = 0
    if c.drafts:
        tokens, num_worker = c.drafts
        token_ids += tokens
        num_draft = len(tokens)
    held = len(s.blocks)
    table_from = min(s.sent_blocks, held) if s.announced else -1
    s.sent_blocks = held
    table = s.blocks[table_from:] if table_from > 0 else list(s.blocks)
    return ScheduledSeq(
        request_id=s.request_id,
        token_ids=token_ids,
        start_pos=start,
        block_table=table,
        sample=c.sample,
        num_draft=num_draft,
        num_propose=num_worker,
        block_table_from=table_from,
    )


def _announce(seq: Sequence) -> NewRequest:
    """What a worker needs to know of a sequence the first time it runs there."""
    return NewRequest(
        request_id=seq.request_id,
        params=seq.params,
        prompt_len=seq.prompt_len,
        num_output_tokens=seq.num_output_tokens,
        eos_token_ids=seq.eos_token_ids,
        token_history=list(seq.token_ids) if needs_token_history(seq.params) else [],
        pooling=seq.pooling,
        lora=seq.lora,
    )
