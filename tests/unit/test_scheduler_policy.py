"""Scheduler policy driven offline by a stand-in worker whose 'model' is a pure function of the
tokens so far: continuous batching, chunked prefill, prefix hits, preemption and aborts must not
change any sequence's output, and every block must come back."""

from __future__ import annotations

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.services.worker.block_tables import BlockTables
from kvflow.shared.messages import (
    FinishReason,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenizedRequest,
)
from kvflow.shared.sampling import needs_token_history


class FakeWorker:
    """A stand-in worker with a real paged 'KV cache': each slot holds the token computed there.
    A sequence's history is read back through its block table, and the 'sampled' token depends
    on all of it, so a wrong block, a lost token or a repeated one changes the output."""

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.slots: dict[int, int] = {}
        self.params: dict[str, tuple[int, int]] = {}  # rid -> (max_tokens, outputs so far)
        self.computed = 0
        self.history: dict[str, list[int]] = {}  # rid -> NewRequest.token_history + sampled
        self.tables = BlockTables(num_blocks=1 << 20)

    def _slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, plan: StepPlan) -> StepResult:
        self.tables.apply(plan)  # plans carry block-table differences, as the worker's
        for rid in plan.finished_request_ids:
            self.params.pop(rid, None)
        for nr in plan.new_requests:
            self.params[nr.request_id] = (nr.params.max_tokens, nr.num_output_tokens)
            if needs_token_history(nr.params):  # as the real worker: all tokens so far
                self.history[nr.request_id] = list(nr.token_history)
            else:
                assert nr.token_history == []  # sent only when sampling needs it
        rids, toks, reasons = [], [], []
        for s in plan.seqs:
            assert s.request_id in self.params, "a sequence must be announced before it runs"
            assert len(s.block_table) * self.block_size >= s.start_pos + len(s.token_ids)
            for i, t in enumerate(s.token_ids):
                self.slots[self._slot(s.block_table, s.start_pos + i)] = t
            self.computed += len(s.token_ids)
            if s.sample:
                n = s.start_pos + len(s.token_ids)
                hist = [self.slots[self._slot(s.block_table, p)] for p in range(n)]
                tok = (sum(t * (p + 1) for p, t in enumerate(hist)) * 31 + n) % 97
                if s.request_id in self.history:
                    assert self.history[s.request_id] == hist  # what penalties would see
                    self.history[s.request_id].append(tok)
                max_t, n_out = self.params[s.request_id]
                n_out += 1
                self.params[s.request_id] = (max_t, n_out)
                rids.append(s.request_id)
                toks.append(tok)
                reasons.append(FinishReason.LENGTH if n_out >= max_t else FinishReason.NONE)
        return StepResult("w", plan.step_id, rids, toks, reasons)


def run_all(
    core: SchedulerCore, worker: FakeWorker, max_steps: int = 10_000
) -> dict[str, list[int]]:
    ws = core.workers["w"]
    outputs: dict[str, list[int]] = {rid: [] for rid in core.requests}
    for _ in range(max_steps):
        plan = core.schedule(ws)[0]
        if plan is None:
            break
        res = worker.execute(plan)
        for rid, tok in zip(res.request_ids, res.token_ids, strict=True):
            outputs[rid].append(tok)
        core.on_result(res)
    return outputs


def make_core(
    num_blocks: int = 256, block_size: int = 4, **limits: int
) -> tuple[SchedulerCore, FakeWorker]:
    core = SchedulerCore(SchedulerLimits(**limits), model="m")
    core.add_worker("w", num_blocks, block_size)
    return core, FakeWorker(block_size)


def req(rid: str, prompt: list[int], max_tokens: int) -> TokenizedRequest:
    return TokenizedRequest(rid, "inbox", prompt, SamplingParams(max_tokens=max_tokens))


PROMPTS = {f"r{i}": [(i * 7 + j) % 50 for j in range(5 + i * 9)] for i in range(8)}


def reference_outputs() -> dict[str, list[int]]:
    out = {}
    for rid, p in PROMPTS.items():
        core, w = make_core()
        core.add_request(req(rid, p, 12))
        out[rid] = run_all(core, w)[rid]
    return out


def test_batching_and_chunking_do_not_change_outputs_and_free_every_block() -> None:
    ref = reference_outputs()
    core, w = make_core(max_num_batched_tokens=16, max_num_seqs=3)
    for rid, p in PROMPTS.items():
        core.add_request(req(rid, p, 12))
    assert run_all(core, w) == ref
    assert core.stats().num_free_blocks == 256
    assert core.stats().num_running == 0 and core.stats().num_waiting == 0


def test_preemption_by_recompute_keeps_outputs() -> None:
    ref = reference_outputs()
    core, w = make_core(num_blocks=24, block_size=4, max_num_batched_tokens=64)
    for rid, p in PROMPTS.items():
        core.add_request(req(rid, p, 12))
    assert run_all(core, w) == ref
    assert core.stats().num_preemptions > 0
    assert core.stats().num_free_blocks == 24


def test_penalized_requests_carry_every_token_to_the_worker() -> None:
    """Penalties and bad words look at the whole prompt and every output: NewRequest brings
    them, also after a prefix hit (the worker computes only the rest) and a preemption."""
    core, w = make_core(num_blocks=24, block_size=4, max_num_batched_tokens=64)
    penalized = SamplingParams(max_tokens=12, repetition_penalty=1.2)
    for rid, p in PROMPTS.items():
        core.add_request(TokenizedRequest(rid, "inbox", p, penalized))
    core.add_request(TokenizedRequest("hit", "inbox", PROMPTS["r3"] + [1], penalized))
    out = run_all(core, w)
    assert core.stats().num_preemptions > 0 and core.stats().prefix_cache_hits > 0
    assert all(w.history[rid][len(PROMPTS[rid]) :] == out[rid] for rid in PROMPTS)


def test_chunked_prefill_runs_alongside_decodes() -> None:
    core, w = make_core(max_num_batched_tokens=8)
    core.add_request(req("short", [1, 2, 3], 6))
    ws = core.workers["w"]
    core.on_result(w.execute(core.schedule(ws)[0]))  # prefill of the short one
    core.add_request(req("long", list(range(40)), 2))
    plan = core.schedule(ws)[0]
    assert [(s.request_id, len(s.token_ids), s.sample) for s in plan.seqs] == [
        ("short", 1, True),
        ("long", 7, False),
    ]


def test_prefix_hit_computes_only_new_tokens() -> None:
    core, w = make_core(block_size=4)
    prefix = list(range(20))
    core.add_request(req("a", prefix + [1, 2], 3))
    run_all(core, w)
    computed_before = w.computed
    core.add_request(req("b", prefix + [5, 6, 7], 1))
    ws = core.workers["w"]
    plan = core.schedule(ws)[0]
    assert plan.seqs[0].start_pos == 20 and plan.seqs[0].token_ids == [5, 6, 7]
    core.on_result(w.execute(plan))
    assert w.computed - computed_before == 3


def test_prompt_logprobs_requests_compute_their_whole_prompt() -> None:
    """Cached prefix tokens have no logits, so a request asking for prompt logprobs skips
    prefix-cache hits and computes every prompt token (vLLM does the same)."""
    core, w = make_core(block_size=4)
    prefix = list(range(20))
    core.add_request(req("a", prefix + [1, 2], 3))
    run_all(core, w)
    params = SamplingParams(max_tokens=1, prompt_logprobs=2)
    core.add_request(TokenizedRequest("b", "inbox", prefix + [5, 6, 7], params))
    plan = core.schedule(core.workers["w"])[0]
    assert plan.seqs[0].start_pos == 0 and len(plan.seqs[0].token_ids) == 23


def test_abort_frees_blocks_of_waiting_and_running() -> None:
    core, w = make_core(num_blocks=16, max_num_seqs=1)
    core.add_request(req("a", list(range(10)), 50))
    core.add_request(req("b", list(range(10)), 50))
    ws = core.workers["w"]
    core.on_result(w.execute(core.schedule(ws)[0]))
    assert core.abort("b") and core.abort("a")
    assert not core.abort("a")
    plan = core.schedule(ws)[0]
    assert plan is not None and plan.seqs == [] and plan.finished_request_ids == ["a"]
    core.on_result(w.execute(plan))
    assert core.stats().num_free_blocks == 16


def test_identical_prompts_admitted_together_share_blocks_in_the_same_step() -> None:
    core, w = make_core(block_size=4)
    prompt = list(range(1, 23))  # 5 full blocks + 2 tokens
    for rid in ("a", "b", "c"):
        core.add_request(req(rid, prompt, 5))
    ws = core.workers["w"]
    plan = core.schedule(ws)[0]
    assert [(s.request_id, s.start_pos, len(s.token_ids)) for s in plan.seqs] == [
        ("a", 0, 22),
        ("b", 20, 2),
        ("c", 20, 2),
    ]
    assert plan.seqs[1].block_table[:5] == plan.seqs[0].block_table[:5]
    core.on_result(w.execute(plan))
    outputs = run_all(core, w)
    assert outputs["a"] == outputs["b"] == outputs["c"]
    assert core.stats().num_free_blocks == 256


def test_failed_step_forgets_blocks_it_registered() -> None:
    core, w = make_core(block_size=4)
    core.add_request(req("a", list(range(1, 23)), 5))
    ws = core.workers["w"]
    plan = core.schedule(ws)[0]
    assert len(ws.bm.cached) == 5
    core.on_result(StepResult("w", plan.step_id, [], [], [], error="boom"))
    assert ws.bm.cached == {}
    assert core.stats().num_waiting == 1  # re-queued, to be recomputed
    outputs = run_all(core, w)
    assert len(outputs["a"]) == 5


def test_priority_orders_admission_then_fcfs() -> None:
    core, w = make_core(max_num_seqs=1)
    for rid, prio in (("late-low", 5), ("first", 0), ("urgent", -1), ("second", 0)):
        r = req(rid, [1, 2, 3], 1)
        core.add_request(r, priority=prio)
    ws = core.workers["w"]
    order = []
    while (plan := core.schedule(ws)[0]) is not None:
        order += [nr.request_id for nr in plan.new_requests]
        core.on_result(w.execute(plan))
    assert order == ["urgent", "first", "second", "late-low"]
