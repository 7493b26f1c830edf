"""The scheduler core and a model runner in one process (no network): requests through real
planning (chunked prefill, prefix caching, preemption) and real steps."""

from __future__ import annotations

import itertools

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.services.worker.runner import ModelRunner
from kvflow.services.worker.sim_runner import SimRunner
from kvflow.shared.messages import (
    LoRARef,
    SamplingParams,
    StepPlan,
    StepResult,
    TokenizedRequest,
)

_ids = itertools.count()


def new_core(
    max_loras: int = 2, blocks: int = 64, block_size: int = 4, **limits: int
) -> SchedulerCore:
    """A scheduler core with one worker ``w`` of ``blocks`` KV blocks."""
    core = SchedulerCore(SchedulerLimits(max_loras=max_loras, **limits))
    core.add_worker("w", blocks, block_size)
    return core


def run(
    core: SchedulerCore,
    runner: ModelRunner,
    jobs: list[tuple[list[int], LoRARef | None]],
    params: SamplingParams,
) -> tuple[list[list[int]], list[StepPlan]]:
    """Every (prompt, adapter) through ``core`` and ``runner`` to its end, submitted together;
    the tokens each got, and the plans that ran."""
    ws = next(iter(core.workers.values()))
    ids = [f"r{next(_ids)}" for _ in jobs]
    for rid, (prompt, lora) in zip(ids, jobs, strict=True):
        req = TokenizedRequest(rid, "", prompt, params)
        req.lora = lora
        core.add_request(req)
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    plans = []
    for _ in range(2000):
        plan, _ = core.schedule(ws)
        if plan is None:
            break
        plans.append(plan)
        res = runner.execute(plan)
        assert res.error is None, res.error
        for rid, tok in zip(res.request_ids, res.token_ids, strict=True):
            out[rid].append(tok)
        core.on_result(res)
    assert not core.requests
    return [out[rid] for rid in ids], plans


def check_alone(runner: ModelRunner, prompts: list[list[int]], want: list[list[int]], params: SamplingParams) -> None:  # fmt: skip
    """Each prompt by itself gives ``want``'s tokens."""
    for prompt, w in zip(prompts, want, strict=True):
        got, _ = run(new_core(), runner, [(prompt, None)], params)
        assert got[0] == w


def check_batched_chunked(runner: ModelRunner, prompts: list[list[int]], want: list[list[int]], params: SamplingParams) -> None:  # fmt: skip
    """All prompts in the same steps under an 8-token budget (every long prompt in several
    chunks) give ``want``."""
    core = new_core(max_num_batched_tokens=8)
    got, plans = run(core, runner, [(p, None) for p in prompts], params)
    assert got == want
    assert max(len(p.seqs) for p in plans) == len(prompts)


def check_preempted_and_prefix_hit(
    runner: ModelRunner,
    prompts: list[list[int]],
    want: list[list[int]],
    params: SamplingParams,
    blocks: int,
) -> None:
    """All prompts in a KV cache of ``blocks`` too small for them at once (preemption), then
    prompt 2 again through a prefix-cache hit: ``want`` both times."""
    core = new_core(blocks=blocks)
    got, _ = run(core, runner, [(p, None) for p in prompts], params)
    assert got == want
    assert core.stats().num_preemptions > 0
    hits = core.stats().prefix_cache_hits
    again, _ = run(core, runner, [(prompts[2], None)], params)
    assert core.stats().prefix_cache_hits > hits
    assert again[0] == want[2]


def run_core(
    core: SchedulerCore,
    runner: ModelRunner | SimRunner,
    prompts: list[list[int]],
    params: SamplingParams,
    max_steps: int = 2000,
) -> tuple[dict[str, list[int]], list[StepPlan]]:
    """Every prompt through ``core`` and ``runner`` to its end: the tokens each got, and the
    plans sent."""
    ws = next(iter(core.workers.values()))
    for i, p in enumerate(prompts):
        core.add_request(TokenizedRequest(f"r{i}", "", p, params))
    out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    plans = []
    for _ in range(max_steps):
        plan, loads = core.schedule(ws)
        assert not loads
        if plan is None:
            break
        plans.append(plan)
        res: StepResult = runner.execute(plan)
        assert res.error is None, res.error
        for rid, tok in zip(res.request_ids, res.token_ids, strict=True):
            out[rid].append(tok)
        core.on_result(res)
    assert not core.requests, "requests left unfinished"
    assert ws.bm.num_free_blocks == ws.bm.num_blocks
    return out, plans
