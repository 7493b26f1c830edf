"""Speculative decoding through the real scheduler core and model runner (no network): greedy
output with n-gram drafts equals output without them (and Hugging Face's), alone, batched and
under preemption; every block is free afterwards; the sampled distribution is the target's
(chi-square); drafts never cause a preemption."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import LlamaForCausalLM

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.services.worker.sim_runner import SimRunner
from kvflow.shared.messages import (
    NewRequest,
    SamplingParams,
    ScheduledSeq,
    StepPlan,
    TokenizedRequest,
)
from kvflow.shared.speculative import SpeculativeConfig
from tests.helpers.engine import run_core
from tests.helpers.tiny_llama import make_runner

NGRAM = SpeculativeConfig("ngram", num_speculative_tokens=4, prompt_lookup_min=1,
                          prompt_lookup_max=3)  # fmt: skip


def _steps_of(plans: list[StepPlan], rid: str) -> int:
    return sum(any(s.request_id == rid for s in p.seqs) for p in plans)


def hf_argmax(hf: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    """HF's greedy tokens, EOS included (as ``ignore_eos`` generates them; HF's generate with
    min_new_tokens would forbid EOS instead)."""
    toks = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            toks.append(int(hf(torch.tensor([toks])).logits[0, -1].argmax()))
    return toks[len(prompt) :]


def _core(spec: SpeculativeConfig | None, blocks: int, block_size: int, **limits) -> SchedulerCore:
    core = SchedulerCore(SchedulerLimits(**limits), speculative=spec)
    core.add_worker("w", blocks, block_size)
    return core


# prompts that repeat themselves (lookups find continuations) and one that does not
PROMPTS = [
    [5, 17, 99, 3, 42, 8, 5, 17, 99, 3, 42, 8, 5, 17],
    [120, 6, 6, 90, 12, 120, 6, 6, 90],
    [7, 11, 7, 11, 7],
    [11, 22, 33, 44, 55, 66, 77, 88, 99, 100, 101],
]


@pytest.mark.parametrize("batched", [False, True])
def test_greedy_equals_hf_and_plain_decoding(tiny_llama: LlamaForCausalLM, batched: bool) -> None:
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    groups = [PROMPTS] if batched else [[p] for p in PROMPTS]
    for group in groups:
        runner = make_runner(tiny_llama, worker_id="w")
        plain, plain_plans = run_core(_core(None, 64, 4), runner, group, greedy)
        core = _core(NGRAM, 64, 4)
        spec, plans = run_core(core, make_runner(tiny_llama, worker_id="w"), group, greedy)
        assert spec == plain
        for i, p in enumerate(group):
            assert spec[f"r{i}"] == hf_argmax(tiny_llama, p, 24)
        assert core.speculator is not None
        stats = core.speculator.stats
        assert stats.num_draft_tokens == sum(s.num_draft for plan in plans for s in plan.seqs)
        if group is PROMPTS or group == [PROMPTS[2]]:  # [2] outputs runs (4, 4, 4, 4)
            assert stats.num_accepted_tokens > 0  # the lookups paid off: fewer steps
            assert _steps_of(plans, "r2" if batched else "r0") < _steps_of(
                plain_plans, "r2" if batched else "r0"
            )


def test_preemption_and_chunked_prefill_keep_greedy_output(tiny_llama: LlamaForCausalLM) -> None:
    """16 KV blocks of 4 tokens for 4 sequences of up to 54 tokens: preemptions happen, drafts
    are dropped before anything is preempted for them, and blocks all come back."""
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    lim = {"max_num_batched_tokens": 8, "max_model_len": 128}
    plain, _ = run_core(
        _core(None, 16, 4, **lim), make_runner(tiny_llama, worker_id="w"), PROMPTS, greedy
    )
    core = _core(NGRAM, 16, 4, **lim)
    spec, plans = run_core(core, make_runner(tiny_llama, worker_id="w"), PROMPTS, greedy)
    assert spec == plain
    assert core.workers["w"].num_preemptions > 0
    assert any(s.num_draft for plan in plans for s in plan.seqs)
    assert all(sum(len(s.token_ids) for s in plan.seqs) <= 8 for plan in plans)


def test_max_tokens_and_model_length_bound_the_drafts(tiny_llama: LlamaForCausalLM) -> None:
    for max_tokens in (1, 2, 5, 9):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        out, plans = run_core(
            _core(NGRAM, 64, 4), make_runner(tiny_llama, worker_id="w"), PROMPTS, params
        )
        assert all(len(v) == max_tokens for v in out.values())
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    runner = make_runner(tiny_llama, worker_id="w", max_model_len=20)
    out, plans = run_core(_core(NGRAM, 64, 4, max_model_len=20), runner, [PROMPTS[0]], params)
    assert len(PROMPTS[0]) + len(out["r0"]) == 20  # the model length, exactly
    assert max(s.start_pos + len(s.token_ids) for p in plans for s in p.seqs) <= 20


def test_simulated_worker_speculates_the_same_way() -> None:
    vocab, eos = list(range(100, 1100)), [2]
    greedy = SamplingParams(max_tokens=30, temperature=0.0)
    prompts = [[(i * 7 + j) % 13 + 100 for j in range(9 + i)] for i in range(6)]

    def sim() -> SimRunner:
        return SimRunner(vocab, eos, 4, 48, 512, worker_id="w")

    lim = {"max_num_batched_tokens": 16}
    plain, _ = run_core(_core(None, 48, 4, **lim), sim(), prompts, greedy)
    spec, plans = run_core(_core(NGRAM, 48, 4, **lim), sim(), prompts, greedy)
    assert spec == plain
    assert any(s.num_draft for plan in plans for s in plan.seqs)


def test_sampled_tokens_keep_the_target_distribution(tiny_llama: LlamaForCausalLM) -> None:
    """One verification step with draft d, repeated: the first token follows p(. | prompt)
    and, when it equals d, the second follows p(. | prompt, d); chi-square at 0.1 %."""
    torch.manual_seed(1234)
    temp = 1.5
    prompt = [5, 17, 99, 3, 42, 8]
    with torch.no_grad():
        p0 = torch.softmax(tiny_llama(torch.tensor([prompt])).logits[0, -1].double() / temp, -1)
        d = int(p0.argmax())
        p1 = torch.softmax(
            tiny_llama(torch.tensor([[*prompt, d]])).logits[0, -1].double() / temp, -1
        )
    runner = make_runner(tiny_llama, worker_id="w")
    params = SamplingParams(max_tokens=10_000, temperature=temp)
    n_req, table = 500, [0, 1, 2]  # every request writes the same K/V into the same slots
    rids = [f"s{i}" for i in range(n_req)]
    new = [NewRequest(r, params, len(prompt)) for r in rids]
    head = ScheduledSeq("s0", prompt[:-1], 0, table, sample=False)
    assert runner.execute(StepPlan(0, [head], new)).error is None
    firsts, seconds = [], []
    for step in range(1, 9):
        seqs = [ScheduledSeq(r, [prompt[-1], d], len(prompt) - 1, table, num_draft=1) for r in rids]
        res = runner.execute(StepPlan(step, seqs))
        assert res.error is None, res.error
        got: dict[str, list[int]] = {}
        for rid, tok in zip(res.request_ids, res.token_ids, strict=True):
            got.setdefault(rid, []).append(tok)
        for toks in got.values():
            firsts.append(toks[0])
            assert (len(toks) == 2) == (toks[0] == d)  # a second token exactly when accepted
            if len(toks) == 2:
                seconds.append(toks[1])
    assert _chi2_ok(firsts, p0) and _chi2_ok(seconds, p1)
    assert 100 < len(seconds) < len(firsts)


def _chi2_ok(samples: list[int], p: torch.Tensor) -> bool:
    """Pearson's chi-square of ``samples`` against ``p`` (bins with expected count < 5 pooled)
    below the 99.9 % quantile (Wilson-Hilferty approximation)."""
    n = len(samples)
    counts = torch.bincount(torch.tensor(samples), minlength=len(p)).double()
    expected = p * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    df = int(keep.sum()) - 1
    z = 3.09  # 99.9 %
    q = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat < q


def _draft_of(hf: LlamaForCausalLM, layers: int):  # noqa: ANN202
    """The tiny model's first ``layers`` layers, loaded as the worker loads a draft."""
    from dataclasses import replace

    from kvflow.services.worker.model_setup import CpuPathSpec, DeviceSpec, load_model

    cfg = make_runner(hf).config
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    spec = CpuPathSpec(batch_invariant=False)
    return load_model(None, DeviceSpec(), spec, replace(cfg, num_layers=layers), weights)


@pytest.mark.parametrize("layers", [2, 1])
def test_draft_model_keeps_greedy_output(tiny_llama: LlamaForCausalLM, layers: int) -> None:
    """A draft model in the worker (the target itself, or its first layer): greedy output
    equals plain decoding's, alone and batched, under chunked prefill and preemption; the
    whole-model draft is accepted (nearly) always."""
    greedy = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    draft = SpeculativeConfig("draft_model", 3, model="tiny")
    lim = {"max_num_batched_tokens": 12, "max_model_len": 128}
    plain, _ = run_core(
        _core(None, 20, 4, **lim), make_runner(tiny_llama, worker_id="w"), PROMPTS, greedy
    )
    core = _core(draft, 20, 4, **lim)
    runner = make_runner(tiny_llama, worker_id="w", draft=_draft_of(tiny_llama, layers))
    spec, plans = run_core(core, runner, PROMPTS, greedy)
    assert spec == plain
    assert core.workers["w"].num_preemptions > 0
    assert any(s.num_propose for p in plans for s in p.seqs)
    assert not any(s.num_draft for p in plans for s in p.seqs)  # the worker makes them
    stats = core.speculator.stats
    assert stats.num_draft_tokens > 0
    if layers == 2:  # the target as its own draft
        assert stats.num_accepted_tokens >= 0.9 * stats.num_draft_tokens
    for i, p in enumerate(PROMPTS):
        alone, _ = run_core(
            _core(draft, 64, 4),
            make_runner(tiny_llama, worker_id="w", draft=_draft_of(tiny_llama, layers)),
            [p],
            greedy,
        )
        assert alone["r0"] == plain[f"r{i}"]


def test_prefix_cache_hits_on_blocks_filled_by_accepted_drafts(
    tiny_llama: LlamaForCausalLM,
) -> None:
    """A follow-up whose prompt is the first request's prompt and output hits the blocks the
    first filled (many through accepted drafts) and generates what plain decoding does."""
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    core = _core(NGRAM, 64, 4)
    runner = make_runner(tiny_llama, worker_id="w")
    first, _ = run_core(core, runner, [PROMPTS[2]], greedy)
    assert core.speculator is not None and core.speculator.stats.num_accepted_tokens > 0
    follow = PROMPTS[2] + first["r0"]
    second, _ = run_core(core, runner, [follow], greedy)
    assert core.workers["w"].bm.prefix_hits >= (len(follow) - 1) // 4
    plain, _ = run_core(
        _core(None, 64, 4), make_runner(tiny_llama, worker_id="w"), [follow], greedy
    )
    assert second == plain


def test_disaggregated_decode_workers_speculate() -> None:
    """A prefill worker and a decode worker (simulated, K/V copied slot by slot): drafts are
    proposed on the decode worker only and the output equals the run without speculation."""
    from kvflow.shared.messages import KvTransferDone

    vocab, eos = list(range(100, 1100)), [2]
    prompts = [[(i * 7 + j) % 5 + 100 for j in range(9 + i)] for i in range(4)]
    greedy = SamplingParams(max_tokens=20, temperature=0.0)

    def run(spec: SpeculativeConfig | None) -> tuple[dict[str, list[int]], dict[str, int]]:
        limits = SchedulerLimits(max_num_batched_tokens=16, max_model_len=512)
        core = SchedulerCore(limits, model="m", speculative=spec)
        sims = {}
        for wid, role in (("p", "prefill"), ("d", "decode")):
            core.add_worker(wid, 64, 4, role=role, kv_address=f"kv.{wid}")
            sims[wid] = SimRunner(vocab, eos, 4, 64, 512, worker_id=wid)
        for i, p in enumerate(prompts):
            core.add_request(TokenizedRequest(f"r{i}", "", p, greedy))
        out: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        drafted = {"p": 0, "d": 0}
        for _ in range(500):
            pulls, ran = [], False
            for wid, ws in core.workers.items():
                plan, _loads = core.schedule(ws)
                if plan is None:
                    continue
                ran = True
                drafted[wid] += sum(s.num_draft for s in plan.seqs)
                res = sims[wid].execute(plan)
                for rid, tok in zip(res.request_ids, res.token_ids, strict=True):
                    out[rid].append(tok)
                pulls += core.on_result(res).pulls
            for dst, pull in pulls:
                src, dsim = sims[pull.src_worker], sims[dst]
                for sb, db in zip(pull.src_blocks, pull.dst_blocks, strict=True):
                    s_, d_ = slice(sb * 4, sb * 4 + 4), slice(db * 4, db * 4 + 4)
                    dsim._k[d_], dsim._v[d_] = src._k[s_], src._v[s_]
                core.on_transfer_done(
                    KvTransferDone(pull.transfer_id, pull.request_id, dst, True, num_bytes=1)
                )
            if not ran and not pulls:
                break
        assert not core.requests
        assert all(w.bm.num_free_blocks == w.bm.num_blocks for w in core.workers.values())
        return out, drafted

    plain, _ = run(None)
    spec, drafted = run(NGRAM)
    assert spec == plain
    assert drafted["d"] > 0 and drafted["p"] == 0
