"""ModelRunner on a tiny random-weight Llama against HF's own forward / greedy generate: prefill,
chunked prefill, decode, several sequences in a batch with shuffled block tables, and bitwise
batch invariance of the logits."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaForCausalLM

from kvflow.kernels.batch_invariance import GemmRows
from kvflow.services.worker.model_loader import load_weights
from kvflow.services.worker.runner import ModelRunner
from kvflow.shared.messages import FinishReason, NewRequest, SamplingParams, ScheduledSeq, StepPlan
from kvflow.shared.model_config import load_config
from kvflow.shared.model_source import ModelSource
from kvflow.shared.sampling import needs_token_history
from tests.helpers.logits_spy import capture_logits
from tests.helpers.tiny_llama import BLOCK, NUM_BLOCKS, PROMPTS, make_runner


def hf_greedy(hf: LlamaForCausalLM, prompt: list[int], n: int) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


class Driver:
    """A minimal scheduler: fixed shuffled block tables, optional 2-chunk prefill."""

    def __init__(self, runner: ModelRunner, prompts: list[list[int]], seed: int = 0) -> None:
        self.runner, self.step = runner, 0
        free = list(range(NUM_BLOCKS))
        random.Random(seed).shuffle(free)
        self.tables, self.tokens, self.done = {}, {}, {}
        for i, p in enumerate(prompts):
            self.tables[f"r{i}"] = [free.pop() for _ in range(12)]  # room for 48 tokens
            self.tokens[f"r{i}"] = list(p)
        self.prompt_len = {r: len(t) for r, t in self.tokens.items()}

    def run(
        self, max_tokens: int, split: bool = False, params: list[SamplingParams] | None = None
    ) -> dict[str, list[int]]:
        greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        params = params or [greedy] * len(self.tokens)
        new = [
            NewRequest(r, p, len(t), token_history=list(t) if needs_token_history(p) else [])
            for (r, t), p in zip(self.tokens.items(), params, strict=True)
        ]
        computed = dict.fromkeys(self.tokens, 0)
        while len(self.done) < len(self.tokens):
            seqs = []
            for r, toks in self.tokens.items():
                if r in self.done:
                    continue
                end = len(toks)
                if split and computed[r] == 0 and end > 2:
                    end = end // 2  # chunked prefill: first half now, the rest next step
                chunk = toks[computed[r] : end]
                seqs.append(ScheduledSeq(r, chunk, computed[r], self.tables[r], end == len(toks)))
                computed[r] = end
            res = self.runner.execute(StepPlan(self.step, seqs, new))
            assert res.error is None, res.error
            assert res.num_computed_tokens == sum(len(s.token_ids) for s in seqs)
            new, self.step = [], self.step + 1
            for r, tok, fr in zip(res.request_ids, res.token_ids, res.finish_reasons, strict=True):
                self.tokens[r].append(tok)
                if fr != FinishReason.NONE:
                    assert fr == FinishReason.LENGTH
                    self.done[r] = True
        return {r: t[self.prompt_len[r] :] for r, t in self.tokens.items()}


@pytest.mark.parametrize("split", [False, True])
def test_logits_match_hf_forward(tiny_llama: LlamaForCausalLM, split: bool) -> None:
    """Prefill (whole or in 2 chunks) and decode logits, batched with other sequences, equal
    HF's full-sequence forward at every sampled position."""
    runner = make_runner(tiny_llama)
    rows = capture_logits(runner, "r0")
    out = Driver(runner, PROMPTS, seed=5).run(6, split=split)["r0"]
    full = torch.tensor([PROMPTS[0] + out[:-1]])
    with torch.no_grad():
        ref = tiny_llama(full).logits[0, len(PROMPTS[0]) - 1 :]
    torch.testing.assert_close(torch.stack(rows), ref, rtol=1e-4, atol=1e-4)
    assert out == ref.argmax(-1).tolist()
    want = sum(len(p) + 5 for p in PROMPTS)  # prompts, then 5 decode inputs each
    assert runner.total_computed_tokens == want


@pytest.mark.parametrize("split", [False, True])
def test_greedy_matches_hf_one_at_a_time_and_batched(
    tiny_llama: LlamaForCausalLM, split: bool
) -> None:
    n = 12
    want = {f"r{i}": hf_greedy(tiny_llama, p, n) for i, p in enumerate(PROMPTS)}
    batched = Driver(make_runner(tiny_llama), PROMPTS, seed=1).run(n, split=split)
    assert batched == want
    for i, p in enumerate(PROMPTS):
        alone = Driver(make_runner(tiny_llama), [p], seed=i + 2).run(n, split=split)
        assert alone["r0"] == want[f"r{i}"]


def test_logits_bitwise_batch_invariant(tiny_llama: LlamaForCausalLM) -> None:
    """A sequence's logits do not change by one bit when other sequences share its steps."""
    captured: dict[int, list[torch.Tensor]] = {}

    def run(prompts: list[list[int]], key: int) -> None:
        runner = make_runner(tiny_llama, gemm_rows=GemmRows(4, 4, True))
        captured[key] = capture_logits(runner, "r0")
        Driver(runner, prompts, seed=key).run(8)

    run([PROMPTS[3]], 0)
    run([PROMPTS[3], PROMPTS[0], PROMPTS[1], PROMPTS[2], [9] * 30], 1)  # 5 > tile rows
    assert len(captured[0]) == len(captured[1]) == 8
    for a, b in zip(captured[0], captured[1], strict=True):
        assert torch.equal(a, b)


def test_seeded_sampling_and_penalties_are_batch_independent(
    tiny_llama: LlamaForCausalLM,
) -> None:
    hot = SamplingParams(max_tokens=10, temperature=1.5, top_p=0.95, seed=7, ignore_eos=True)
    pen = SamplingParams(
        max_tokens=10,
        temperature=1.0,
        seed=3,
        ignore_eos=True,
        repetition_penalty=1.3,
        presence_penalty=0.5,
        frequency_penalty=0.5,
    )
    alone = Driver(make_runner(tiny_llama), PROMPTS[:2], seed=0).run(10, params=[hot, pen])
    others = [SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)] * 2
    mixed = Driver(make_runner(tiny_llama), PROMPTS, seed=9).run(10, params=[hot, pen, *others])
    assert mixed["r0"] == alone["r0"] and mixed["r1"] == alone["r1"]
    greedy = Driver(make_runner(tiny_llama), PROMPTS[:1], seed=0).run(10)["r0"]
    assert alone["r0"] != greedy  # really sampled
    # the penalised request never repeats a token when penalties are this strong
    strong = SamplingParams(max_tokens=10, temperature=0, presence_penalty=100.0, ignore_eos=True)
    once = Driver(make_runner(tiny_llama), PROMPTS[1:2], seed=0).run(10, params=[strong])["r0"]
    assert len(set(once)) == len(once) == 10


def test_finish_reasons_and_errors(tiny_llama: LlamaForCausalLM) -> None:
    runner = make_runner(tiny_llama)
    greedy_first = hf_greedy(tiny_llama, PROMPTS[1], 1)[0]
    stop = SamplingParams(max_tokens=5, temperature=0.0, stop_token_ids=[greedy_first])
    held = SamplingParams(
        max_tokens=5, temperature=0.0, stop_token_ids=[greedy_first], min_tokens=2
    )
    plan = StepPlan(
        0,
        [ScheduledSeq("s", PROMPTS[1], 0, [0, 1]), ScheduledSeq("m", PROMPTS[1], 0, [2, 3])],
        [NewRequest("s", stop, 5), NewRequest("m", held, 5)],
    )
    res = runner.execute(plan)
    assert res.token_ids[0] == greedy_first and res.finish_reasons[0] == FinishReason.STOP
    assert res.token_ids[1] != greedy_first and res.finish_reasons[1] == FinishReason.NONE
    one = SamplingParams(max_tokens=1, temperature=0.0)
    res = runner.execute(
        StepPlan(1, [ScheduledSeq("o", [3, 4], 0, [4])], [NewRequest("o", one, 2)])
    )
    assert res.finish_reasons == [FinishReason.LENGTH]
    # an unknown request and a too-short block table give an error result, not an exception
    bad = runner.execute(StepPlan(2, [ScheduledSeq("x", [1, 2, 3, 4, 5], 0, [5])]))
    assert bad.error and bad.request_ids == []
    ok = runner.execute(StepPlan(3, [ScheduledSeq("s", [greedy_first], 5, [0, 1])], [], ["m", "o"]))
    assert ok.error is None and set(runner.requests) == {"s"}


def test_hf_directory_source_sharded(tiny_llama: LlamaForCausalLM, tmp_path) -> None:
    """A local HF directory (sharded safetensors + index) loads to the same config and weights,
    and a runner built from it generates like HF."""
    tiny_llama.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    src = ModelSource("hf", tmp_path, "tiny")
    cfg = load_config(src)
    assert cfg == make_runner(tiny_llama).config
    weights = load_weights(src, cfg)
    state = tiny_llama.state_dict()
    assert set(weights) == set(state)
    assert all(torch.equal(weights[k], state[k]) for k in state)
    runner = ModelRunner.create(src, block_size=BLOCK, num_blocks=NUM_BLOCKS)
    out = Driver(runner, PROMPTS[:1]).run(4)["r0"]
    assert out == hf_greedy(tiny_llama, PROMPTS[0], 4)


def _prefill(runner: ModelRunner, rid: str, prompt: list[int], params: SamplingParams):
    plan = StepPlan(
        step_id=1,
        seqs=[ScheduledSeq(rid, prompt, 0, list(range(-(-len(prompt) // BLOCK))))],
        new_requests=[NewRequest(rid, params, len(prompt))],
    )
    return runner.execute(plan)


def test_logprobs_are_the_raw_distribution_and_logit_bias_applies(tiny_llama) -> None:
    prompt = PROMPTS[0]
    with torch.no_grad():
        ref = torch.log_softmax(tiny_llama(torch.tensor([prompt])).logits[0, -1].float(), -1)
    runner = make_runner(tiny_llama)
    res = _prefill(runner, "a", prompt, SamplingParams(max_tokens=4, temperature=0, logprobs=3))
    lp = res.logprobs[0]
    tok = res.token_ids[0]
    assert tok == int(ref.argmax())
    assert lp.logprob == pytest.approx(float(ref[tok]), abs=1e-4)
    assert lp.top_ids == ref.topk(3).indices.tolist()
    assert lp.top_logprobs == pytest.approx(ref.topk(3).values.tolist(), abs=1e-4)
    # a strong bias on the least likely token makes greedy pick it; logprobs stay raw
    worst = int(ref.argmin())
    runner = make_runner(tiny_llama)
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=0, logit_bias={worst: 1000.0})
    res = _prefill(runner, "b", prompt, params)
    assert res.token_ids == [worst]
    assert res.logprobs[0].logprob == pytest.approx(float(ref[worst]), abs=1e-4)
    assert res.logprobs[0].top_ids == []
    # nobody asked: no logprobs column at all
    runner = make_runner(tiny_llama)
    assert _prefill(runner, "c", prompt, SamplingParams(max_tokens=4, temperature=0)).logprobs == []


def test_penalties_see_the_whole_prompt_when_a_prefix_was_computed_elsewhere(tiny_llama) -> None:
    """A prefix-cache hit (or KV from a prefill worker) means this worker computes only the end
    of the prompt; repetition_penalty still covers every prompt token (NewRequest's
    token_history), so greedy output equals HF's generate with the same penalty."""
    prompt = PROMPTS[3]
    ref = tiny_llama.generate(
        torch.tensor([prompt]),
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        repetition_penalty=1.5,
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    runner = make_runner(tiny_llama)
    tables = list(range(8))
    first = SamplingParams(max_tokens=1, temperature=0)  # another request fills blocks 0-3
    runner.execute(
        StepPlan(0, [ScheduledSeq("a", prompt[:16], 0, tables[:4])], [NewRequest("a", first, 16)])
    )
    params = SamplingParams(max_tokens=6, temperature=0, repetition_penalty=1.5, ignore_eos=True)
    new = [NewRequest("b", params, len(prompt), token_history=list(prompt))]
    out = runner.execute(StepPlan(1, [ScheduledSeq("b", prompt[16:], 16, tables)], new)).token_ids
    while len(out) < 6:
        seq = ScheduledSeq("b", [out[-1]], len(prompt) + len(out) - 1, tables)
        out += runner.execute(StepPlan(len(out) + 1, [seq])).token_ids
    assert out == ref
    plain = Driver(make_runner(tiny_llama), [prompt]).run(6)["r0"]
    assert plain != ref  # the penalty changed the output: the comparison above has teeth


def test_a_bf16_kv_cache_holds_bf16_and_stays_close_to_hf(tiny_llama: LlamaForCausalLM) -> None:
    """``--kv-cache-dtype bfloat16`` on the CPU path with fp32 weights: K and V are stored as
    bf16 (read back into fp32 arithmetic), so the logits move by about bf16's rounding and no
    more; the default cache stays exact."""
    errs = {}
    for kv_dtype in ("bfloat16", "auto"):
        runner = make_runner(tiny_llama, kv_cache_dtype=kv_dtype)
        want = torch.bfloat16 if kv_dtype == "bfloat16" else torch.float32
        assert all(k.dtype == v.dtype == want for k, v in runner.kv_caches)
        rows = capture_logits(runner, "r0")
        out = Driver(runner, PROMPTS, seed=5).run(6)["r0"]
        full = torch.tensor([PROMPTS[0] + out[:-1]])
        with torch.no_grad():
            ref = tiny_llama(full).logits[0, len(PROMPTS[0]) - 1 :]
        errs[kv_dtype] = ((torch.stack(rows) - ref).norm() / ref.norm()).item()
        assert out == ref.argmax(-1).tolist()
    assert errs["auto"] < 1e-5
    assert 1e-5 < errs["bfloat16"] < 1e-2  # K and V lose ~0.2 % each
