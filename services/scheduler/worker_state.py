"""Per-worker bookkeeping: which sequences run on a worker, the blocks they hold there, the
sequences reserved to decode there, the plans in flight and the worker's counters. This is the
one writer of that state and of its sequences' placement: the planner (planner.py) only
decides, and ``schedule`` applies its decision; results, hand-offs and ends come in through
the methods below. Where a sequence goes among workers is router.py's, which asks the
WorkerStates involved; the waiting queue is the core's (core.py): a sequence this worker lets
go to wait again is handed back to it, never queued from here.

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
sequences whose decode worker is elsewhere (a ``Route`` naming it, with blocks reserved there)
and hands each one off when its prefill samples the first token (``StepOutcome.prefilled``). A
``decode`` worker receives handed-off sequences as TRANSFERRING (their K/V on the way) and
schedules them once the K/V has arrived.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple, Protocol

from kvflow.services.scheduler.block_manager import BlockHash, BlockManager
from kvflow.services.scheduler.decision import Admission, Admit, Route, Run, RunningDecision
from kvflow.services.scheduler.limits import ROLES, SchedulerLimits
from kvflow.services.scheduler.planner import plan_admissions, plan_running
from kvflow.services.scheduler.policy import SchedulingPolicy
from kvflow.services.scheduler.sequence import (
    RequeueReason,
    Reservation,
    SeqStatus,
    Sequence,
    TierLoad,
    Transfer,
)
from kvflow.services.scheduler.speculation import Drafts, Speculator
from kvflow.services.scheduler.step_message import announce, scheduled_seq
from kvflow.shared.lora_residency import LoraResidency
from kvflow.shared.messages import (
    BlockRef,
    FinishReason,
    NewRequest,
    ScheduledSeq,
    StepPlan,
    StepResult,
)


@dataclass
class StepOutcome:
    """What applying a StepResult changed: sequences that finished, by reason, and sequences
    whose prefill here is done and whose decode goes to another worker."""

    finished: list[tuple[Sequence, FinishReason]] = field(default_factory=list)
    prefilled: list[Sequence] = field(default_factory=list)


@dataclass(slots=True)
class InFlightStep:
    """A plan sent to the worker whose result has not come back."""

    step_id: int
    scheduled: dict[str, int]  # request_id -> tokens it computes (known ones and placeholders)
    samples: set[str]  # requests it samples a token for: tokens not known until its result
    drafts: dict[str, Drafts]  # request_id -> the drafts it verifies
    cached: list[int]  # blocks whose hashes it registered


class Scheduled(NamedTuple):
    """A planned step: the plan to send (None: nothing to run), the waiting sequences it
    admitted (the core takes them out of its queue) and those it preempted (the core queues
    them again)."""

    plan: StepPlan | None
    admitted: list[Sequence]
    requeued: list[Sequence]


class WorkerRouter(Protocol):
    """What a worker asks of the router (router.py) about other workers and the KV tiers."""

    def route(self, seq: Sequence, here: WorkerState) -> Route | None: ...

    def tier_lookup(self, seq: Sequence, ws: WorkerState, first: int) -> list[BlockHash]: ...

    def reserve(self, seq: Sequence, worker_id: str) -> Reservation: ...

    def unreserve(self, res: Reservation) -> None: ...

    def drop_transfer(self, transfer: Transfer) -> None: ...


class WorkerState:
    """One worker as the scheduler sees it: its blocks, running sequences and the plans in
    flight."""

    def __init__(
        self,
        worker_id: str,
        blocks: BlockManager,
        limits: SchedulerLimits,
        policy: SchedulingPolicy,
        router: WorkerRouter,
        role: str = "both",
        host_tier: bool = False,
        redis_tier: bool = False,
        speculator: Speculator | None = None,
        step_id: int = 0,
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown worker role {role!r} (one of {', '.join(ROLES)})")
        self.worker_id = worker_id
        self.bm = blocks
        self.limits = limits
        self.policy = policy
        self.router = router
        self.role = role
        self.offload_enabled = host_tier  # a host tier: send evicted blocks there
        self.store_enabled = redis_tier  # a Redis tier: store completed blocks
        self.draining = False  # take nothing new; finish what runs
        self.running: list[Sequence] = []  # admission order: the last is the newest
        self.to_forget: list[str] = []  # request ids the worker should drop at the next step
        self.in_flight: deque[InFlightStep] = deque()  # plans sent, oldest first
        # blocks of sequences that left while a plan in flight computes them: freed with the
        # result of that plan (step id), not before (the worker writes them until then)
        self.deferred_free: list[tuple[int, list[int]]] = []
        self.must_sync = False  # a sequence waits for blocks: no plan ahead of results
        self.speculator = speculator  # speculative decoding (None: off)
        self.num_reserved = 0  # sequences prefilled elsewhere that will decode here
        self.step_id = step_id  # of the last plan (a worker given up and back numbers on)
        self.num_preemptions = 0
        self.num_prefills = 0  # sequences admitted here for their prefill
        self.num_decodes = 0  # sequences that decode here
        # LoRA adapters the worker holds, by the rule its own cache follows
        # (services/worker/lora.py), fed with the plans it is sent (for routing)
        self.loras = LoraResidency(limits.max_loras)
        self._plan_cached: list[int] = []  # blocks whose hashes the plan being built registered
        self._loads: list[Sequence] = []  # sequences whose tier load the last plan ordered

    # -- queries --------------------------------------------------------------------------------

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

    @property
    def can_prefill(self) -> bool:
        return self.role in ("both", "prefill")

    @property
    def can_decode(self) -> bool:
        return self.role in ("both", "decode")

    def has_room_for_one_more(self) -> bool:
        return len(self.running) + self.num_reserved < self.limits.max_num_seqs

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

    def route(self, seq: Sequence) -> Route | None:
        """Whether ``seq`` is admitted here now, and where it decodes (router.py)."""
        return self.router.route(seq, self)

    def tier_lookup(self, seq: Sequence, first: int) -> list[BlockHash]:
        """The hashes of ``seq``'s blocks from ``first`` on that a KV tier holds for here."""
        return self.router.tier_lookup(seq, self, first)

    def busy(self) -> bool:
        """Something runs, is reserved or is in flight here."""
        return bool(self.running or self.num_reserved or self.in_flight)

    # -- planning -------------------------------------------------------------------------------

    def schedule(self, waiting: Iterable[Sequence]) -> Scheduled:
        """Plan the next step (planner.py) over the waiting sequences in queue order, apply the
        decision, and build the plan (None when there is nothing to run)."""
        assert self.can_plan(), "plans in flight are at their limit"
        self._plan_cached = []
        decision = plan_running(self)
        self.must_sync = decision.must_sync
        requeued = self._apply_running(decision)
        runs, admitted = decision.runs, []
        if decision.admit:
            for admit in plan_admissions(self, waiting, decision.budget):
                run = self._apply_admit(admit)
                admitted.append(admit.seq)
                if run is not None:  # (none while its tier load fills its blocks)
                    runs[admit.seq] = run
        plan = self._send(runs) if runs or self.to_forget else None
        return Scheduled(plan, admitted, requeued)

    def _apply_running(self, decision: RunningDecision) -> list[Sequence]:
        """The running sequences' share of a decision: proposals spent, blocks taken and
        registered, victims preempted, in the decided order. Returns the victims."""
        if decision.proposals:
            assert self.speculator is not None  # the proposals are its
            for seq, proposal in decision.proposals:
                if seq.spec is None:
                    seq.spec = proposal.state
                self.speculator.proposed(proposal)
        victims: list[Sequence] = []
        registered: dict[Sequence, list[int]] = {}
        for action in decision.actions:
            seq = action.seq
            if isinstance(action, Run):
                if action.need:
                    seq.blocks += self.bm.allocate(action.need)
                if action.fills:
                    added = self.register(seq, action.start + action.num_new)
                    if added:
                        registered[seq] = added
                continue
            # a victim's blocks are not written by this step: its registrations are void
            self.unregister(registered.pop(seq, []))
            self.requeue(seq, RequeueReason.PREEMPTED)
            victims.append(seq)
        return victims

    def _apply_admit(self, admit: Admit) -> Run | None:
        """Admit a waiting sequence as decided: its decode blocks reserved where it decodes,
        its blocks here taken; returns its share of the step (None while a tier load fills
        its blocks)."""
        seq, adm = admit.seq, admit.admission
        decode = admit.route.decode
        self._admit(seq, adm, self.router.reserve(seq, decode) if decode is not None else None)
        if adm.tier:
            return None
        start = seq.num_computed
        end = start + adm.num_new
        self.register(seq, end)
        return Run(seq, start, adm.num_new, end == seq.num_tokens)

    def _send(self, runs: dict[Sequence, Run]) -> StepPlan:
        """The StepPlan of ``runs``; from here on that plan is in flight and the worker holds
        what it says (announced requests, block tables)."""
        self.step_id += 1
        bm = self.bm
        # Evicted blocks go to the host tier only when this plan's step is what overwrites them:
        # the worker copies them first. Blocks taken for a tier load or a reservation are written
        # by other paths, which might get there before the copy: not offloaded.
        evicted = bm.take_evicted()
        offload: list[BlockRef] = []
        if evicted and self.offload_enabled:  # the set of every block of the batch only then
            written = {b for s in runs for b in s.blocks}
            offload = [BlockRef(b, h) for b, h in evicted if b in written]
        store: list[BlockRef] = []
        if self.store_enabled:
            store = [BlockRef(b, h) for b in self._plan_cached if (h := bm.block_hash[b])]
        seqs: list[ScheduledSeq] = []
        new_requests: list[NewRequest] = []
        scheduled: dict[str, int] = {}
        samples: set[str] = set()
        drafts: dict[str, Drafts] = {}
        loras: list[str] = []
        for s, run in runs.items():  # one pass: the plan's entries and what the flight keeps
            held = len(s.blocks)
            seqs.append(scheduled_seq(run, min(s.sent_blocks, held) if s.announced else -1))
            s.sent_blocks = held
            rid = s.request_id
            scheduled[rid] = run.num_new
            if run.sample:
                samples.add(rid)
            if run.drafts:
                drafts[rid] = run.drafts
            if not s.announced:
                new_requests.append(announce(s))
                s.announced = True
            if s.lora is not None:
                loras.append(s.lora.name)
        plan = StepPlan(
            step_id=self.step_id,
            seqs=seqs,
            new_requests=new_requests,
            finished_request_ids=self.to_forget,
            offload=offload,
            store=store,
        )
        if loras:
            self.loras.step(loras)
        self.to_forget = []
        self.in_flight.append(
            InFlightStep(self.step_id, scheduled, samples, drafts, self._plan_cached)
        )
        self._plan_cached = []
        return plan

    def take_loads(self) -> list[Sequence]:
        """The sequences whose tier loads the last plan ordered (for the router to send)."""
        out, self._loads = self._loads, []
        return out

    # -- admission and requeue ------------------------------------------------------------------

    def _admit(self, seq: Sequence, adm: Admission, reservation: Reservation | None) -> None:
        """Take ``seq`` (out of the queue) with its cached prefix and fresh blocks. With tier
        blocks to load it waits (TRANSFERRING) for that load, then computes only the rest."""
        bm = self.bm
        if adm.count_prefix:
            bm.count_prefix((seq.num_tokens - 1) // bm.block_size, len(adm.cached))
        bm.take_cached(adm.cached)
        fresh = bm.allocate(adm.need, offload=not adm.tier)
        if adm.tier:  # written by the load, not by a step: nothing to offload
            seq.load = TierLoad(len(adm.cached), list(zip(fresh, adm.tier, strict=True)))
            self._loads.append(seq)
        seq.blocks = list(adm.cached) + fresh
        seq.num_computed = len(adm.cached) * bm.block_size
        seq.hashes = bm.block_hashes(seq.token_ids[: seq.num_computed], seq.cache_salt)
        seq.status = SeqStatus.TRANSFERRING if adm.tier else SeqStatus.RUNNING
        seq.worker_id = self.worker_id
        seq.reservation = reservation
        seq.announced = False
        self.running.append(seq)
        self.num_prefills += 1
        if reservation is None and seq.pooling is None:
            self.num_decodes += 1

    def requeue(self, seq: Sequence, reason: RequeueReason) -> None:
        """``seq`` stops running here to wait again with every token it has, to be recomputed
        (so its output does not change); its blocks here and elsewhere are freed. The caller
        hands it back to the core's queue."""
        self.running.remove(seq)
        self._free(seq, seq.blocks)
        self._release_elsewhere(seq)
        seq.blocks, seq.hashes, seq.num_computed = [], [], 0
        seq.load = None
        seq.status = SeqStatus.WAITING
        seq.worker_id = None
        seq.announced = False
        if reason is RequeueReason.PREEMPTED:
            seq.num_preemptions += 1
            self.num_preemptions += 1
        self.to_forget.append(seq.request_id)

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
        self._plan_cached += added
        return added

    def unregister(self, blocks: list[int]) -> None:
        """Forget blocks registered for a sequence taken out of the plan being built."""
        if not blocks:
            return
        self.bm.uncache(blocks)
        gone = set(blocks)
        self._plan_cached = [b for b in self._plan_cached if b not in gone]

    def load_ended(self, seq: Sequence, num_loaded: int) -> None:
        """The tier load of ``seq`` ended with its first ``num_loaded`` blocks filled: register
        them and compute from there (the other blocks are filled by computing); an aborted
        sequence ends now."""
        load, seq.load = seq.load, None
        assert load is not None
        if seq.aborted:
            self.finish(seq)
            return
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

    def receive(self, seq: Sequence, transfer: Transfer | None) -> None:
        """A sequence prefilled elsewhere arrives with its reserved blocks, its K/V on the way
        (``transfer``; None when this worker had every block cached: it runs at once)."""
        assert seq.reservation is not None and seq.reservation.worker_id == self.worker_id
        self.num_reserved -= 1
        self.num_decodes += 1
        seq.blocks = list(seq.reservation.blocks)
        seq.reservation = None
        seq.worker_id = self.worker_id
        seq.transfer = transfer
        seq.status = SeqStatus.TRANSFERRING
        seq.announced = False
        self.running.append(seq)
        if transfer is None:
            self.kv_arrived(seq)

    def kv_arrived(self, seq: Sequence) -> None:
        """The transfer into ``seq``'s blocks is complete: register its full blocks in this
        worker's prefix cache and let it run."""
        self.bm.cache_blocks(seq.blocks, seq.hashes)
        seq.status = SeqStatus.RUNNING

    def transfer_ended(self, seq: Sequence, ok: bool) -> bool:
        """The K/V transfer into ``seq``'s blocks ended: it runs (``ok``), ends (aborted
        meanwhile) or waits again to be recomputed. Returns whether it is to wait again (the
        caller hands it back to the core's queue)."""
        seq.transfer = None
        if seq.aborted:
            self.finish(seq)
        elif ok:
            self.kv_arrived(seq)
        else:  # recompute from its tokens
            self.requeue(seq, RequeueReason.TRANSFER_FAILED)
            return True
        return False

    def _release_elsewhere(self, seq: Sequence) -> None:
        """Free what ``seq`` holds on other workers: its decode reservation, or the source
        blocks of its transfer."""
        res, t = seq.reservation, seq.transfer
        if res is not None:
            seq.reservation = None
            self.router.unreserve(res)
        if t is not None:
            seq.transfer = None
            self.router.drop_transfer(t)

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
        re-queued sequences (the caller hands them back to the core's queue)."""
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
        self._release_elsewhere(seq)
        seq.blocks = []
        seq.status = SeqStatus.FINISHED
        self.to_forget.append(seq.request_id)

    def abort(self, seq: Sequence) -> None:
        """``seq`` (placed here) is aborted: it ends now, or, while a transfer or a tier load
        writes its blocks, when that ends (its blocks are freed then)."""
        if seq.status is SeqStatus.TRANSFERRING:
            seq.aborted = True
        else:
            self.finish(seq)

    def drain(self) -> None:
        """The worker is draining: it takes nothing new and finishes what runs."""
        self.draining = True
