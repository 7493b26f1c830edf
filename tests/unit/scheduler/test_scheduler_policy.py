"""Scheduler policy driven offline by a stand-in worker whose 'model' is a pure function of the
tokens so far: continuous batching, chunked prefill, prefix hits, preemption and aborts must not
change any sequence's output, and every block must come back."""

from __future__ import annotations

from kvflow.shared.messages import (
    SamplingParams,
    StepResult,
    TokenizedRequest,
)
from tests.helpers.scheduler import PROMPTS, make_core, reference_outputs, req, run_all


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
