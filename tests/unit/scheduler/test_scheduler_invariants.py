"""The scheduler's block and reservation invariants under random workloads (hypothesis state
machine through the real SchedulerCore): requests arrive (shared prefixes, priorities,
adapters, Redis-held prefixes, prompt logprobs), are aborted, run on workers of every role
with two plans in flight, finish at random or at their length, hand off from prefill to decode
workers, have their K/V transfers and tier loads succeed, fail or expire; steps fail; workers
leave, come back and drain. After every step: each block is free or referenced, never both;
its reference count is the number of its holders (running sequences, decode reservations,
blocks held for a transfer, frees deferred until a plan in flight is back); the free counters
agree; no sequence is in two places and every live one is somewhere; each worker's
``num_reserved`` is its reservations. When everything has finished, nothing is held."""

from __future__ import annotations

import random
from collections import Counter, deque
from collections.abc import Mapping

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.services.scheduler.policy import make_policy
from kvflow.services.scheduler.sequence import SeqStatus, Sequence
from kvflow.services.scheduler.worker_state import WorkerState
from kvflow.services.worker.block_tables import BlockTables
from kvflow.services.worker.placeholders import PlaceholderError, StepTokens
from kvflow.shared.messages import (
    FinishReason,
    KvLoad,
    KvLoadDone,
    KvPull,
    KvTransferDone,
    LoRARef,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenizedRequest,
)
from kvflow.shared.speculative import SpeculativeConfig

BS = 4
VOCAB = 12
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 1, 1, 2, 2], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]]
CLUSTERS = [("both",), ("both", "both"), ("prefill", "decode"), ("prefill", "decode", "both")]
ADAPTERS = [None, LoRARef("a", 1, "/a"), LoRARef("b", 2, "/b")]


class FakeWorker:
    """A worker's bookkeeping without a model: it keeps every request's block table from the
    plans' differences, fills placeholders from its last step, drops what that step ended and
    ends a request at its max_tokens (or at random: EOS)."""

    def __init__(self) -> None:
        self.tables = BlockTables(num_blocks=1 << 16)
        self.tokens = StepTokens()
        self.flight: deque[StepPlan] = deque()
        self.max_tokens: dict[str, int] = {}
        self.outputs: dict[str, int] = {}

    def receive(self, plan: StepPlan) -> None:
        self.tables.apply(plan)  # a difference that does not apply raises
        self.flight.append(plan)

    def run(self, rng: random.Random, stop_chance: float) -> StepResult:
        plan = self.flight.popleft()
        for rid in plan.finished_request_ids:
            self.max_tokens.pop(rid, None)
        for nr in plan.new_requests:
            self.max_tokens[nr.request_id] = nr.params.max_tokens
            self.outputs[nr.request_id] = nr.num_output_tokens
        try:
            self.tokens.fill(plan)
        except PlaceholderError as e:
            result = StepResult("", plan.step_id, [], [], [], error=str(e))
            self.tokens.record(result)
            return result
        ids, toks, reasons = [], [], []
        for s in plan.seqs:
            if not s.sample:
                continue
            # a verification step returns its accepted drafts and one token of its own
            for _ in range(1 + rng.randint(0, s.num_draft + s.num_propose)):
                n = self.outputs[s.request_id] = self.outputs[s.request_id] + 1
                done = n >= self.max_tokens[s.request_id] or rng.random() < stop_chance
                ids.append(s.request_id)
                toks.append(rng.randrange(VOCAB))
                reasons.append(int(FinishReason.LENGTH if done else FinishReason.NONE))
                if done:
                    break
        result = StepResult("", plan.step_id, ids, toks, reasons)
        self.tokens.record(result)
        return result


def check_invariants(core: SchedulerCore, sources: Mapping[str, WorkerState]) -> None:
    """Blocks, reservations and places, across every worker of ``core``; ``sources``: the
    worker each transfer started from (a worker given up and back under its id is another,
    which holds none of that transfer's blocks)."""
    workers = core.workers
    places: Counter[int] = Counter()
    for seq in core.waiting.sequences():
        assert seq.status is SeqStatus.WAITING and seq.worker_id is None
        places[id(seq)] += 1
    holders: dict[str, Counter[int]] = {wid: Counter() for wid in workers}
    reserved: Counter[str] = Counter()
    every: dict[int, Sequence] = {}
    for wid, ws in workers.items():
        for seq in ws.running:
            every[id(seq)] = seq
            places[id(seq)] += 1
            assert seq.worker_id == wid and seq.status is not SeqStatus.WAITING
            holders[wid].update(seq.blocks)
            if seq.reservation is not None:
                assert seq.reservation.worker_id in workers, "a reservation on a worker gone"
                holders[seq.reservation.worker_id].update(seq.reservation.blocks)
                reserved[seq.reservation.worker_id] += 1
            t = seq.transfer
            if t is not None and workers.get(t.src_worker) is sources[t.transfer_id]:
                holders[t.src_worker].update(t.held_blocks)
        for _, blocks in ws.deferred_free:
            holders[wid].update(blocks)
        for step in ws.in_flight:  # plans in flight count only for sequences running here
            assert set(step.scheduled) <= {s.request_id for s in ws.running}
    assert all(n == 1 for n in places.values()), "a sequence in two places"
    for rid, seq in core.requests.items():
        assert places[id(seq)] == 1, f"live request {rid} is nowhere"
    for seq in every.values():  # a sequence not live any more waits only for its K/V
        assert seq.request_id in core.requests or seq.aborted
    for tid, seq in core.router.transfers.items():
        assert seq.transfer is not None and seq.transfer.transfer_id == tid
    for wid, ws in workers.items():
        bm = ws.bm
        assert [bm.ref_counts[b] for b in range(bm.num_blocks)] == [
            holders[wid][b] for b in range(bm.num_blocks)
        ], f"{wid}: reference counts are not the holders"
        assert all((bm.ref_counts[b] == 0) == (b in bm.free) for b in range(bm.num_blocks))
        assert bm.num_free_blocks == len(bm.free) == sum(r == 0 for r in bm.ref_counts)
        assert all(bm.block_hash[b] == h for h, b in bm.cached.items())
        assert ws.num_reserved == reserved[wid], f"{wid}: num_reserved is not its reservations"


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.core: SchedulerCore
        self.configs: dict[str, dict] = {}
        self.fakes: dict[str, FakeWorker] = {}
        self.pulls: list[tuple[str, KvPull]] = []
        self.sources: dict[str, WorkerState] = {}  # transfer id -> the worker it copies from
        self.loads: list[tuple[str, KvLoad]] = []
        self.next_id = 0

    @initialize(
        cluster=st.sampled_from(CLUSTERS),
        blocks=st.integers(8, 24),  # the longest request (31 tokens) fits alone
        seqs=st.integers(1, 5),
        budget=st.integers(4, 32),
        policy=st.sampled_from(["fcfs", "priority"]),
        max_loras=st.integers(0, 2),
        speculate=st.booleans(),
        redis_tier=st.booleans(),
    )
    def setup(self, cluster, blocks, seqs, budget, policy, max_loras, speculate, redis_tier):  # noqa: ANN001
        limits = SchedulerLimits(seqs, budget, 1024, max_loras, max_plans_in_flight=2)
        spec = SpeculativeConfig("ngram", 2, 1, 2) if speculate else None
        self.core = SchedulerCore(limits, make_policy(policy), model="m", speculative=spec)
        for i, role in enumerate(cluster):
            self.configs[f"w{i}"] = dict(
                num_blocks=blocks, block_size=BS, role=role, redis_tier=redis_tier, kv_layout="L"
            )
            self._join(f"w{i}")

    def _join(self, wid: str) -> None:
        self.core.add_worker(wid, **self.configs[wid])
        self.fakes[wid] = FakeWorker()

    def _pulled(self, pulls: list[tuple[str, KvPull]]) -> None:
        for dst, pull in pulls:
            self.sources[pull.transfer_id] = self.core.workers[pull.src_worker]
            self.pulls.append((dst, pull))

    def _after(self) -> None:
        """As the service does after each event: release the drained workers."""
        for wid in list(self.core.workers):
            if self.core.drained(wid):
                self._leave(wid)

    def _leave(self, wid: str) -> None:
        self.core.remove_worker(wid)
        del self.fakes[wid]
        self.pulls = [(d, p) for d, p in self.pulls if d != wid]
        self.loads = [(w, ld) for w, ld in self.loads if w != wid]

    # -- rules ----------------------------------------------------------------------------------

    @rule(
        n=st.integers(1, 3),
        prefix=st.integers(0, len(PREFIXES)),
        tail=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=9),
        max_tokens=st.integers(1, 12),
        priority=st.integers(0, 2),
        adapter=st.sampled_from(ADAPTERS),
        redis_blocks=st.integers(0, 4),
        logprobs=st.booleans(),
    )
    def arrive(self, n, prefix, tail, max_tokens, priority, adapter, redis_blocks, logprobs):  # noqa: ANN001
        """``n`` requests with the same prompt (a prefix or none, then ``tail``)."""
        prompt = (PREFIXES[prefix] if prefix < len(PREFIXES) else []) + tail
        # prompt logprobs: the whole prompt is computed (no prefix hits, no tier loads)
        params = SamplingParams(
            max_tokens=max_tokens, prompt_logprobs=1 if logprobs and prefix == 1 else None
        )
        for _ in range(n):
            req = TokenizedRequest(f"r{self.next_id}", "", prompt, params, priority=priority)
            req.lora = adapter
            self.next_id += 1
            self.core.add_request(req, priority, redis_prefix_blocks=redis_blocks)

    @rule(which=st.integers(0, 50))
    def abort(self, which: int) -> None:
        live = sorted(self.core.requests)
        if live:
            assert self.core.abort(live[which % len(live)])
        self._after()

    @rule(w=st.integers(0, 2))
    def plan(self, w: int) -> None:
        """A plan for worker ``w`` (on top of one in flight, if there is one)."""
        wid = f"w{w}"
        ws = self.core.workers.get(wid)
        if ws is None or not ws.can_plan():
            return
        plan, loads = self.core.schedule(ws)
        self.loads += [(wid, ld) for ld in loads]
        if plan is not None:
            self.fakes[wid].receive(plan)
            for s in plan.seqs:  # the worker's table, rebuilt from differences, is ours
                assert s.block_table == self.core.requests[s.request_id].blocks

    @rule(w=st.integers(0, 2), seed=st.integers(0, 2**16), fail=st.integers(0, 11))
    def step(self, w: int, seed: int, fail: int) -> None:
        """Worker ``w`` runs its oldest plan (planned now if none is in flight) and reports
        it: sequences finish at random or at their length; some steps fail."""
        wid = f"w{w}"
        fake = self.fakes.get(wid)
        if fake is None:
            return
        if not fake.flight:
            self.plan(w)
            if not fake.flight:
                return
        result = fake.run(random.Random(seed), stop_chance=0.15)
        result.worker_id = wid
        if fail == 0 and not result.error:  # the worker reports an error
            result = StepResult(wid, result.step_id, [], [], [], error="boom")
            fake.tokens.record(result)
        if result.error:
            fake.flight.clear()  # the service voids every plan in flight with it
        self._pulled(self.core.on_result(result).pulls)
        self._after()

    @rule(which=st.integers(0, 50), ok=st.integers(0, 3))
    def transfer_done(self, which: int, ok: int) -> None:
        if not self.pulls:
            return
        dst, pull = self.pulls.pop(which % len(self.pulls))
        self.core.on_transfer_done(KvTransferDone(pull.transfer_id, pull.request_id, dst, ok > 0))
        self._after()

    @rule(which=st.integers(0, 50), loaded=st.integers(0, 4))
    def load_done(self, which: int, loaded: int) -> None:
        if not self.loads:
            return
        wid, load = self.loads.pop(which % len(self.loads))
        n = min(loaded, len(load.blocks))
        self.core.on_load_done(KvLoadDone(load.load_id, load.request_id, wid, n))
        self._after()

    @rule(now=st.integers(0, 7))
    def expire(self, now: int) -> None:
        """Now and then: every transfer and tier load still out is given up (their reports
        were lost)."""
        if now == 0:
            self.core.expire_transfers(0.0, now=float("inf"))
            self._after()

    @rule(w=st.integers(0, 2), now=st.integers(0, 5))
    def leave(self, w: int, now: int) -> None:
        """Now and then: worker ``w`` is given up (silent, or a new process with its id)."""
        if now == 0 and f"w{w}" in self.core.workers:
            self._leave(f"w{w}")
            self._after()

    @rule(w=st.integers(0, 2))
    def come_back(self, w: int) -> None:
        wid = f"w{w}"
        if wid in self.configs and wid not in self.core.workers:
            self._join(wid)

    @rule(w=st.integers(0, 2), now=st.integers(0, 5))
    def drain(self, w: int, now: int) -> None:
        if now == 0:
            self.core.set_draining(f"w{w}")
            self._after()

    @invariant()
    def blocks_and_places(self) -> None:
        if hasattr(self, "core"):
            check_invariants(self.core, self.sources)

    def teardown(self) -> None:
        """Everything finishes (workers back, nothing draining); then nothing is held."""
        if not hasattr(self, "core"):
            return
        core = self.core
        for wid in self.configs:
            if wid in core.workers and core.workers[wid].draining:
                self._leave(wid)
            if wid not in core.workers:
                self._join(wid)
        rng = random.Random(0)
        for _ in range(2000):
            held = any(ws.running or ws.in_flight or ws.to_forget for ws in core.workers.values())
            if not (core.requests or self.pulls or self.loads or held):
                break
            for wid, ws in core.workers.items():
                while ws.can_plan():
                    plan, loads = core.schedule(ws)
                    self.loads += [(wid, ld) for ld in loads]
                    if plan is None:
                        break
                    self.fakes[wid].receive(plan)
                if self.fakes[wid].flight:
                    result = self.fakes[wid].run(rng, stop_chance=0.0)
                    result.worker_id = wid
                    if result.error:
                        self.fakes[wid].flight.clear()
                    self._pulled(core.on_result(result).pulls)
            for dst, pull in self.pulls:
                core.on_transfer_done(KvTransferDone(pull.transfer_id, pull.request_id, dst, True))
            for wid, load in self.loads:
                core.on_load_done(KvLoadDone(load.load_id, load.request_id, wid, len(load.blocks)))
            self.pulls, self.loads = [], []
            check_invariants(core, self.sources)
        assert not core.requests and not len(core.waiting), "requests left unfinished"
        for ws in core.workers.values():
            assert not ws.running and not ws.in_flight and not ws.deferred_free
            assert ws.num_reserved == 0
            assert ws.bm.num_free_blocks == ws.bm.num_blocks, f"{ws.worker_id}: blocks leaked"
        assert not core.router.transfers and not core.router.loads


SchedulerMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_scheduler_invariants = SchedulerMachine.TestCase
