"""Async scheduling (two plans in flight per worker): the scheduler plans step N+1 while N runs,
with a placeholder for each token N samples, and the worker fills them in (StepTokens).

A deterministic fake worker (its next token depends on the last token and its position only, so
batching, chunking and recompute never change it) runs the plans; the same workloads through
one plan at a time and through two give the same tokens, nothing is streamed past a request's
end, and every block comes back."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.services.scheduler.worker_state import WorkerState
from kvflow.services.worker.block_tables import BlockTables
from kvflow.services.worker.placeholders import PlaceholderError, StepTokens
from kvflow.shared.messages import (
    PLACEHOLDER,
    FinishReason,
    SamplingParams,
    ScheduledSeq,
    StepPlan,
    StepResult,
    TokenizedRequest,
)
from kvflow.shared.speculative import SpeculativeConfig

EOS = 3
VOCAB = 40


def next_token(last: int, pos: int) -> int:
    return (last * 17 + pos * 5 + 11) % VOCAB


@dataclass
class FakeWorker:
    """Runs plans in order like a worker: fills placeholders, samples ``next_token``, ends
    requests on EOS or max_tokens, and never sees a placeholder it cannot fill."""

    worker_id: str = "w"
    tokens: StepTokens = field(default_factory=StepTokens)
    tables: BlockTables = field(default_factory=lambda: BlockTables(num_blocks=1 << 20))
    outputs: dict[str, list[int]] = field(default_factory=dict)  # what a client is streamed
    ended: set[str] = field(default_factory=set)
    counts: dict[str, int] = field(default_factory=dict)
    params: dict[str, SamplingParams] = field(default_factory=dict)

    def run(self, plan: StepPlan) -> StepResult:
        self.tokens.fill(plan)
        self.tables.apply(plan)  # a difference that does not apply raises
        for s in plan.seqs:  # the whole table covers the chunk
            assert len(s.block_table) * 4 >= s.start_pos + len(s.token_ids)
        for rid in plan.finished_request_ids:
            self.counts.pop(rid, None)
        for r in plan.new_requests:
            self.counts[r.request_id] = r.num_output_tokens
            self.params[r.request_id] = r.params
        ids, toks, reasons = [], [], []
        for s in plan.seqs:
            assert PLACEHOLDER not in s.token_ids
            if not s.sample:
                continue
            tok = next_token(s.token_ids[-1], s.start_pos + len(s.token_ids))
            self.counts[s.request_id] += 1
            p = self.params[s.request_id]
            reason = FinishReason.NONE
            if tok == EOS and not p.ignore_eos:
                reason = FinishReason.STOP
            elif self.counts[s.request_id] >= p.max_tokens:
                reason = FinishReason.LENGTH
            ids.append(s.request_id)
            toks.append(tok)
            reasons.append(int(reason))
            # the client side: tokens after a request's end would be a leak
            assert s.request_id not in self.ended, f"a token after the end of {s.request_id}"
            self.outputs.setdefault(s.request_id, []).append(tok)
            if reason != FinishReason.NONE:
                self.ended.add(s.request_id)
        result = StepResult(self.worker_id, plan.step_id, ids, toks, reasons)
        self.tokens.record(result)
        return result


@dataclass
class Workload:
    prompts: list[list[int]]
    max_tokens: list[int]
    ignore_eos: list[bool]
    num_blocks: int
    budget: int
    max_num_seqs: int


def _core(w: Workload, in_flight: int, speculative: SpeculativeConfig | None = None):
    limits = SchedulerLimits(
        max_num_seqs=w.max_num_seqs,
        max_num_batched_tokens=w.budget,
        max_plans_in_flight=in_flight,
    )
    core = SchedulerCore(limits, speculative=speculative)
    ws = core.add_worker("w", w.num_blocks, 4)
    return core, ws


def _drive(
    core: SchedulerCore, ws: WorkerState, worker: FakeWorker, abort_at: dict[int, str] | None = None
) -> int:
    """Plan while the worker state allows, run the oldest plan, apply its result; until every
    request ended. Returns the number of steps."""
    flight: deque[StepPlan] = deque()
    steps = 0
    while core.requests or flight:
        while ws.can_plan():
            plan, _ = core.schedule(ws)
            if plan is None:
                break
            flight.append(plan)
        assert flight, "requests left and nothing to run"
        plan = flight.popleft()
        core.on_result(worker.run(plan))
        steps += 1
        if abort_at and steps in abort_at:
            core.abort(abort_at[steps])
        assert steps < 5000
    # the last plans may be a forget-only plan: nothing of any request is left anywhere
    return steps


def _run(w: Workload, in_flight: int, abort_at: dict[int, str] | None = None):
    core, ws = _core(w, in_flight)
    seqs = {}
    for i, (prompt, mt, ie) in enumerate(zip(w.prompts, w.max_tokens, w.ignore_eos, strict=True)):
        params = SamplingParams(max_tokens=mt, temperature=0.0, ignore_eos=ie)
        seqs[f"r{i}"] = core.add_request(TokenizedRequest(f"r{i}", "", prompt, params))
    worker = FakeWorker()
    steps = _drive(core, ws, worker, abort_at)
    assert not ws.in_flight and not ws.deferred_free and not ws.running
    assert ws.bm.num_free_blocks == ws.bm.num_blocks  # every block came back
    out = {rid: s.token_ids[s.prompt_len :] for rid, s in seqs.items()}
    return out, worker, steps


workloads = st.builds(
    Workload,
    prompts=st.lists(
        st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=40), min_size=1, max_size=8
    ).map(lambda ps: ps),
    max_tokens=st.lists(st.integers(1, 20), min_size=8, max_size=8),
    ignore_eos=st.lists(st.booleans(), min_size=8, max_size=8),
    num_blocks=st.integers(16, 48),
    budget=st.integers(6, 64),
    max_num_seqs=st.integers(1, 8),
).map(
    lambda w: Workload(
        w.prompts,
        w.max_tokens[: len(w.prompts)],
        w.ignore_eos[: len(w.prompts)],
        w.num_blocks,
        w.budget,
        w.max_num_seqs,
    )
)


@settings(max_examples=60, deadline=None)
@given(workloads)
def test_two_plans_in_flight_give_the_tokens_of_one(w: Workload) -> None:
    sync, sync_worker, sync_steps = _run(w, 1)
    ahead, ahead_worker, _ = _run(w, 2)
    assert ahead == sync
    # what the worker streamed is exactly what the scheduler kept: nothing after an end
    assert ahead_worker.outputs == {rid: t for rid, t in ahead.items() if t}
    assert sync_worker.outputs == ahead_worker.outputs
    assert sync_steps > 0


@settings(max_examples=30, deadline=None)
@given(workloads, st.integers(1, 12), st.integers(0, 7))
def test_an_abort_between_the_plans_in_flight_loses_nothing_else(
    w: Workload, at: int, which: int
) -> None:
    victim = f"r{which % len(w.prompts)}"
    sync, _, _ = _run(w, 1)
    ahead, _, _ = _run(w, 2, abort_at={at: victim})  # blocks all back: checked in _run
    for rid, toks in sync.items():
        if rid != victim:
            assert ahead[rid] == toks
        else:
            assert toks[: len(ahead[rid])] == ahead[rid]


def _two(core: SchedulerCore, ws: WorkerState) -> tuple[StepPlan, StepPlan | None]:
    first, _ = core.schedule(ws)
    second, _ = core.schedule(ws) if ws.can_plan() else (None, [])
    return first, second


def test_a_decode_is_planned_on_top_of_the_token_in_flight() -> None:
    w = Workload([[1, 2, 3, 4, 5]], [8], [True], 16, 64, 4)
    core, ws = _core(w, 2)
    core.add_request(TokenizedRequest("r", "", [1, 2, 3, 4, 5], SamplingParams(max_tokens=8)))
    first, second = _two(core, ws)
    assert [s.token_ids for s in first.seqs] == [[1, 2, 3, 4, 5]] and first.seqs[0].sample
    assert second is not None
    [s] = second.seqs
    assert (s.token_ids, s.start_pos, s.sample) == ([PLACEHOLDER], 5, True)
    assert not second.new_requests  # announced in the first plan
    assert not ws.can_plan()  # two in flight
    core.on_result(StepResult("w", first.step_id, ["r"], [9], [0]))
    core.on_result(StepResult("w", second.step_id, ["r"], [10], [0]))
    seq = core.requests["r"]
    assert seq.token_ids == [1, 2, 3, 4, 5, 9, 10] and seq.num_computed == 6


def test_a_chunked_prompt_plans_its_next_chunk_ahead_with_known_tokens() -> None:
    prompt = list(range(20))
    w = Workload([prompt], [4], [True], 16, 8, 4)
    core, ws = _core(w, 2)
    core.add_request(TokenizedRequest("r", "", prompt, SamplingParams(max_tokens=4)))
    first, second = _two(core, ws)
    assert first.seqs[0].token_ids == prompt[:8] and not first.seqs[0].sample
    assert second is not None and second.seqs[0].token_ids == prompt[8:16]
    assert second.seqs[0].start_pos == 8 and not second.seqs[0].sample


def test_nothing_is_planned_past_max_tokens_or_ahead_of_speculation() -> None:
    w = Workload([[1, 2, 3]], [1], [True], 16, 64, 4)
    core, ws = _core(w, 2)
    core.add_request(TokenizedRequest("r", "", [1, 2, 3], SamplingParams(max_tokens=1)))
    first, second = _two(core, ws)
    assert first is not None and second is None  # its one token is the one in flight
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    core, ws = _core(Workload([[1]], [8], [True], 16, 64, 4), 2, speculative=spec)
    core.add_request(TokenizedRequest("r", "", [1, 2, 1, 2], SamplingParams(max_tokens=8)))
    first, second = _two(core, ws)
    assert first is not None and second is None  # drafts need the token in flight


def test_a_request_ended_in_flight_keeps_its_blocks_until_the_plan_after_is_back() -> None:
    w = Workload([[1, 2, 3, 4]], [8], [True], 16, 64, 4)
    core, ws = _core(w, 2)
    core.add_request(TokenizedRequest("r", "", [1, 2, 3, 4], SamplingParams(max_tokens=8)))
    first, second = _two(core, ws)
    assert second is not None
    free = ws.bm.num_free_blocks
    outcome = core.on_result(StepResult("w", first.step_id, ["r"], [EOS], [1]))
    assert [s.request_id for s, _ in outcome.finished] == ["r"]
    assert ws.bm.num_free_blocks == free  # the second plan still writes them
    core.on_result(StepResult("w", second.step_id, [], [], []))  # the worker dropped it
    assert ws.bm.num_free_blocks == ws.bm.num_blocks


def test_no_preemption_ahead_of_results_and_the_next_plan_waits_for_them() -> None:
    # two sequences fill all 4 blocks; the next token of each needs a fifth
    w = Workload([[1] * 8, [2] * 8], [8, 8], [True, True], 4, 64, 4)
    core, ws = _core(w, 2)
    for i, prompt in enumerate(w.prompts):
        core.add_request(TokenizedRequest(f"r{i}", "", prompt, SamplingParams(max_tokens=8)))
    first, second = _two(core, ws)
    assert len(first.seqs) == 2
    assert second is None and ws.must_sync and not ws.can_plan()
    assert ws.num_preemptions == 0
    core.on_result(StepResult("w", first.step_id, ["r0", "r1"], [5, 6], [0, 0]))
    assert ws.can_plan()  # nothing in flight: the next plan may preempt
    plan, _ = core.schedule(ws)
    assert plan is not None and ws.num_preemptions == 1


def test_a_failed_step_voids_both_plans_and_returns_every_block() -> None:
    w = Workload([[1, 2, 3, 4, 5]], [8], [True], 16, 64, 4)
    core, ws = _core(w, 2)
    core.add_request(TokenizedRequest("r", "", [1, 2, 3, 4, 5], SamplingParams(max_tokens=8)))
    first, second = _two(core, ws)
    assert second is not None
    core.on_result(StepResult("w", first.step_id, [], [], [], error="boom"))
    assert not ws.in_flight and ws.bm.num_free_blocks == ws.bm.num_blocks
    assert core.requests["r"].status.value == "waiting"
    # a late result of the voided plan is not applied
    core.on_result(StepResult("w", second.step_id, ["r"], [7], [0]))
    assert core.requests["r"].token_ids == [1, 2, 3, 4, 5]


def _seq(rid: str, tokens: list[int], start: int = 0) -> ScheduledSeq:
    return ScheduledSeq(rid, tokens, start, [0, 1])


def test_the_worker_fills_placeholders_drops_ended_requests_and_never_guesses() -> None:
    tokens = StepTokens()
    tokens.record(StepResult("w", 1, ["a", "b"], [7, 8], [0, int(FinishReason.STOP)]))
    plan = StepPlan(2, [_seq("a", [PLACEHOLDER], 5), _seq("b", [PLACEHOLDER], 9), _seq("c", [4])])
    tokens.fill(plan)
    assert [(s.request_id, s.token_ids) for s in plan.seqs] == [("a", [7]), ("c", [4])]
    # only the step just before counts
    tokens.record(StepResult("w", 2, ["c"], [1], [0]))
    with pytest.raises(PlaceholderError, match="request a"):
        tokens.fill(StepPlan(3, [_seq("a", [PLACEHOLDER], 6)]))
    # a failed step leaves nothing to fill in
    tokens.record(StepResult("w", 3, ["a"], [2], [0]))
    tokens.record(StepResult("w", 4, [], [], [], error="boom"))
    with pytest.raises(PlaceholderError):
        tokens.fill(StepPlan(5, [_seq("a", [PLACEHOLDER], 7)]))


def test_a_worker_restarted_mid_pipeline_gets_full_state_and_the_same_tokens() -> None:
    """Two plans in flight when the worker's process is replaced (the service removes it and
    it joins again): the new process gets every request announced with whole block tables,
    late results of the old process's plans change nothing, and the tokens equal a run
    without the restart."""
    w = Workload(
        [[1, 2, 3, 4, 5, 6, 7], [9, 8, 7], list(range(20))], [12, 9, 15], [True] * 3, 32, 16, 4
    )
    want, _, _ = _run(w, 1)
    core, ws = _core(w, 2)
    seqs = {}
    for i, prompt in enumerate(w.prompts):
        params = SamplingParams(max_tokens=w.max_tokens[i], temperature=0.0, ignore_eos=True)
        seqs[f"r{i}"] = core.add_request(TokenizedRequest(f"r{i}", "", prompt, params))
    old = FakeWorker()
    for _ in range(4):  # a few steps, two plans in flight
        first, second = _two(core, ws)
        core.on_result(old.run(first))
        if second is not None:
            core.on_result(old.run(second))
    in_flight = [core.schedule(ws)[0], core.schedule(ws)[0]]
    assert all(p is not None for p in in_flight) and len(ws.in_flight) == 2
    moved = core.remove_worker("w")  # a new process has its id
    assert {s.request_id for s in moved} == set(seqs) - {
        r for r, s in seqs.items() if s.status.value == "finished"
    }
    ws = core.add_worker("w", w.num_blocks, 4)
    for late in in_flight:  # the old process still answers: nothing of it is applied
        assert core.on_result(old.run(late)).finished == []
    new = FakeWorker()
    plan, _ = core.schedule(ws)
    assert {r.request_id for r in plan.new_requests} == {s.request_id for s in plan.seqs}
    assert all(s.block_table_from == -1 for s in plan.seqs)  # whole tables, nothing assumed
    core.on_result(new.run(plan))
    _drive(core, ws, new)
    assert {rid: s.token_ids[s.prompt_len :] for rid, s in seqs.items()} == want
    assert ws.bm.num_free_blocks == ws.bm.num_blocks
