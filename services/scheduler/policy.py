"""The scheduling policy for one worker, as plain Python the unit tests drive without NATS.

One model for every step (vLLM V1): each running sequence's computed tokens catch up with its
known tokens under a token budget, so prefill, chunked prefill, prefix hits and decode share one
path. Running sequences go first (decodes keep flowing while long prompts are chunked in), then
waiting ones join while budget, sequence slots and blocks allow. When blocks run out, the newest
running sequence is preempted by recompute: its blocks are freed and it waits again with every
token it has, so its output does not change.

Roles: a ``both`` worker prefills and decodes its own sequences. A ``prefill`` worker admits
sequences whose decode worker is elsewhere (a ``Route`` from the router, with blocks reserved
there) and hands each one off when its prefill samples the first token (``StepOutcome.prefilled``).
A ``decode`` worker receives handed-off sequences as TRANSFERRING (their K/V on the way) and
schedules them once the K/V has arrived.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from services.scheduler.block_manager import BlockHash, BlockManager
from services.scheduler.sequence import Reservation, SeqStatus, Sequence, TierLoad, WaitingQueue
from shared.messages import (
    BlockRef,
    FinishReason,
    NewRequest,
    ScheduledSeq,
    StepPlan,
    StepResult,
)

ROLES = ("both", "prefill", "decode")


@dataclass
class SchedulerLimits:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192


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


# router(seq, worker, blocks needed here) -> Route to admit seq on this worker now, or None
Router = Callable[[Sequence, "WorkerScheduler"], Route | None]
# called when a sequence stops running here but holds blocks on another worker
Releaser = Callable[[Sequence], None]
# tier_lookup(seq, worker, first block) -> hashes of the blocks from there on that a KV tier
# (this worker's host tier, Redis) probably holds
TierLookup = Callable[[Sequence, "WorkerScheduler", int], list[BlockHash]]


def _admit_all(seq: Sequence, ws: WorkerScheduler) -> Route | None:
    return Route()


class WorkerScheduler:
    """Bookkeeping and planning for one worker: its blocks, its running sequences, and the one
    plan in flight."""

    def __init__(
        self,
        worker_id: str,
        blocks: BlockManager,
        limits: SchedulerLimits,
        role: str = "both",
    ) -> None:
        if role not in ROLES:
            raise ValueError(f"unknown worker role {role!r} (one of {', '.join(ROLES)})")
        self.worker_id = worker_id
        self.bm = blocks
        self.limits = limits
        self.role = role
        self.draining = False  # take nothing new; finish what runs
        self.router: Router = _admit_all
        self.release_elsewhere: Releaser = lambda seq: None
        self.tier_lookup: TierLookup = lambda seq, ws, first: []
        self.offload_enabled = False  # the worker has a host tier: send evicted blocks there
        self.store_enabled = False  # the worker has a Redis tier: store completed blocks
        self.loads: list[TierLoad] = []  # tier loads ordered by the last schedule()
        self.running: list[Sequence] = []  # admission order: the last is the newest
        self.to_forget: list[str] = []  # request ids the worker should drop at the next step
        self.in_flight: dict[str, int] | None = None  # request_id -> tokens scheduled
        self.in_flight_cached: list[int] = []  # blocks whose hashes the plan in flight registered
        self.num_reserved = 0  # sequences prefilled elsewhere that will decode here
        self.step_id = 0
        self.num_preemptions = 0
        self.num_prefills = 0  # sequences admitted here for their prefill
        self.num_decodes = 0  # sequences that decode here

    @property
    def can_prefill(self) -> bool:
        return self.role in ("both", "prefill")

    @property
    def can_decode(self) -> bool:
        return self.role in ("both", "decode")

    def has_room_for_one_more(self) -> bool:
        return len(self.running) + self.num_reserved < self.limits.max_num_seqs

    # -- planning ----------------------------------------------------------------------------

    def schedule(self, waiting: WaitingQueue) -> StepPlan | None:
        """Build the next plan, or None when there is nothing to run."""
        assert self.in_flight is None, "one plan at a time per worker"
        budget = self.limits.max_num_batched_tokens
        self.in_flight_cached = []
        chosen: list[tuple[Sequence, int]] = []
        preempted_now = False

        for seq in list(self.running):
            if budget <= 0:
                break
            if seq.status is not SeqStatus.RUNNING:  # preempted in this loop, or K/V in flight
                continue
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            if num_new <= 0:
                continue
            need = self.bm.blocks_needed(seq.num_computed + num_new) - len(seq.blocks)
            while need > self.bm.num_free_blocks:
                victim = self._newest_preemptible()
                if victim is None:
                    break
                self._preempt(victim, waiting)
                preempted_now = True
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING or need > self.bm.num_free_blocks:
                continue
            seq.blocks += self.bm.allocate(max(need, 0))
            self._register(seq, num_new)
            chosen.append((seq, num_new))
            budget -= num_new

        # Admit waiting sequences, unless this step had to preempt (memory is short).
        while (
            not preempted_now
            and budget > 0
            and self.can_prefill
            and not self.draining
            and self.has_room_for_one_more()
        ):
            seq = waiting.peek()
            if seq is None:
                break
            cached = (
                self.bm.lookup_prefix(seq.token_ids) if seq.params.prompt_logprobs is None else []
            )
            tier = (
                self.tier_lookup(seq, self, len(cached))
                if seq.params.prompt_logprobs is None
                else []
            )
            if tier:
                if not self._admit_loading(seq, cached, tier, waiting):
                    break
                continue
            num_computed = len(cached) * self.bm.block_size
            num_new = min(seq.num_tokens - num_computed, budget)
            need = self.bm.blocks_needed(num_computed + num_new) - len(cached)
            if not self.bm.can_allocate(need, cached):
                break
            route = self.router(seq, self)
            if route is None:  # another worker is the better place (or none can decode it)
                break
            waiting.pop()
            if seq.params.prompt_logprobs is None:
                self.bm.prefix_queries += (seq.num_tokens - 1) // self.bm.block_size
                self.bm.prefix_hits += len(cached)
            self.bm.take_cached(cached)
            seq.blocks = list(cached) + self.bm.allocate(need)
            seq.hashes = self.bm.block_hashes(seq.token_ids[:num_computed])
            seq.num_computed = num_computed
            seq.status = SeqStatus.RUNNING
            seq.worker_id = self.worker_id
            seq.reservation = route.reservation
            seq.announced = False
            self.running.append(seq)
            self.num_prefills += 1
            if route.reservation is None:
                self.num_decodes += 1
            self._register(seq, num_new)
            chosen.append((seq, num_new))
            budget -= num_new

        if not chosen and not self.to_forget:
            return None
        self.step_id += 1
        # Evicted blocks go to the host tier only when this plan's step is what overwrites
        # them: the worker copies them first. Blocks taken for a tier load or a reservation
        # are written by other paths, which might get there before the copy: not offloaded.
        written = {b for s, _ in chosen for b in s.blocks}
        offload = [
            BlockRef(b, h)
            for b, h in self.bm.take_evicted()
            if self.offload_enabled and b in written
        ]
        store = (
            [BlockRef(b, h) for b in self.in_flight_cached if (h := self.bm.block_hash[b])]
            if self.store_enabled
            else []
        )
        new_requests = []
        for s, _ in chosen:
            if not s.announced:
                s.announced = True
                new_requests.append(
                    NewRequest(
                        request_id=s.request_id,
                        params=s.params,
                        prompt_len=s.prompt_len,
                        num_output_tokens=s.num_output_tokens,
                        eos_token_ids=s.eos_token_ids,
                        token_history=list(s.token_ids) if s.params.needs_token_history() else [],
                    )
                )
        plan = StepPlan(
            step_id=self.step_id,
            seqs=[
                ScheduledSeq(
                    request_id=s.request_id,
                    token_ids=s.token_ids[s.num_computed : s.num_computed + n],
                    start_pos=s.num_computed,
                    block_table=list(s.blocks),
                    sample=s.num_computed + n == s.num_tokens,
                )
                for s, n in chosen
            ],
            new_requests=new_requests,
            finished_request_ids=self.to_forget,
            offload=offload,
            store=store,
        )
        self.to_forget = []
        self.in_flight = {s.request_id: n for s, n in chosen}
        return plan

    def _admit_loading(
        self, seq: Sequence, cached: list[int], tier: list[BlockHash], waiting: WaitingQueue
    ) -> bool:
        """Admit ``seq`` with fresh blocks for the prefix blocks a KV tier holds; it waits
        (TRANSFERRING) while this worker loads them, then computes only the rest."""
        if not self.bm.can_allocate(len(tier), cached):
            return False
        route = self.router(seq, self)
        if route is None:
            return False
        waiting.pop()
        self.bm.prefix_queries += (seq.num_tokens - 1) // self.bm.block_size
        self.bm.prefix_hits += len(cached)
        self.bm.take_cached(cached)
        mark = len(self.bm.evicted)
        fresh = self.bm.allocate(len(tier))
        del self.bm.evicted[mark:]  # written by the load, not by a step: nothing to offload
        seq.blocks = list(cached) + fresh
        seq.num_computed = len(cached) * self.bm.block_size
        seq.hashes = self.bm.block_hashes(seq.token_ids[: seq.num_computed])
        seq.status = SeqStatus.TRANSFERRING
        seq.worker_id = self.worker_id
        seq.reservation = route.reservation
        seq.announced = False
        seq.load = TierLoad("", len(cached), list(zip(fresh, tier, strict=True)))
        self.running.append(seq)
        self.num_prefills += 1
        if route.reservation is None:
            self.num_decodes += 1
        self.loads.append(seq.load)
        return True

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

    def _register(self, seq: Sequence, num_new: int) -> None:
        """Register the full blocks this step fills as cached now, not when the result comes
        back: the worker writes every K/V of a step before any attention reads it, so a sequence
        admitted later in this same step (n > 1 siblings, identical prompts arriving together)
        already shares them. If the step fails they are forgotten again (on_failed_step)."""
        start = len(seq.hashes)  # blocks before this are registered already (or duplicates)
        self.bm.extend_hashes(seq.hashes, seq.token_ids, seq.num_computed + num_new)
        self.in_flight_cached += self.bm.cache_blocks(seq.blocks[start:], seq.hashes[start:])

    def _newest_preemptible(self) -> Sequence | None:
        """The newest running sequence whose blocks may be taken back: not one whose K/V is
        being written by a transfer."""
        for seq in reversed(self.running):
            if seq.status is SeqStatus.RUNNING:
                return seq
        return None

    def _preempt(self, seq: Sequence, waiting: WaitingQueue) -> None:
        self.running.remove(seq)
        self.bm.free_blocks(seq.blocks)
        self.release_elsewhere(seq)
        seq.blocks, seq.hashes, seq.num_computed = [], [], 0
        seq.load = None
        seq.status = SeqStatus.WAITING
        seq.worker_id = None
        seq.announced = False
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.to_forget.append(seq.request_id)
        waiting.push(seq)

    # -- hand-off (disaggregated) --------------------------------------------------------------

    def hand_off(self, seq: Sequence) -> list[int]:
        """A prefilled sequence leaves for its decode worker: it stops running here, the worker
        drops its state, and its blocks stay held (returned) until the K/V has been copied."""
        self.running.remove(seq)
        self.to_forget.append(seq.request_id)
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

    # -- results -----------------------------------------------------------------------------

    def on_result(self, result: StepResult) -> StepOutcome:
        """Apply a worker's StepResult to the plan in flight."""
        scheduled = self.in_flight or {}
        self.in_flight = None
        by_id = {s.request_id: s for s in self.running}
        for rid, n in scheduled.items():
            seq = by_id.get(rid)
            if seq is None:  # aborted while in flight
                continue
            seq.num_computed += n
        outcome = StepOutcome()
        for rid, tok, reason in zip(
            result.request_ids, result.token_ids, result.finish_reasons, strict=True
        ):
            seq = by_id.get(rid)
            if seq is None or rid not in scheduled:
                continue
            seq.token_ids.append(tok)
            if reason != FinishReason.NONE:
                self.finish(seq)
                outcome.finished.append((seq, FinishReason(reason)))
            elif seq.reservation is not None:
                outcome.prefilled.append(seq)
        return outcome

    def on_failed_step(self, waiting: WaitingQueue, removing: bool = False) -> list[Sequence]:
        """The step failed (worker error or lost): every sequence of it is re-queued from its
        tokens so far (recompute), nothing is lost. When the worker is being removed, the ones
        waiting for their K/V go too. Returns the re-queued sequences."""
        self.in_flight = None
        self.bm.uncache(self.in_flight_cached)
        self.in_flight_cached = []
        moved = [s for s in self.running if removing or s.status is SeqStatus.RUNNING]
        for seq in reversed(moved):
            self._preempt(seq, waiting)
        self.num_preemptions -= len(moved)  # not memory preemptions
        return moved

    # -- removal -----------------------------------------------------------------------------

    def finish(self, seq: Sequence) -> None:
        """Release a finished or aborted sequence's blocks (their hashes stay cached)."""
        if seq in self.running:
            self.running.remove(seq)
        self.bm.free_blocks(seq.blocks)
        self.release_elsewhere(seq)
        seq.blocks = []
        seq.status = SeqStatus.FINISHED
        self.to_forget.append(seq.request_id)
