"""ModelRunner on a tiny random Llama: guided decoding (xgrammar over a made-up vocabulary),
its replay after a migration, and prompt logprobs across chunked prefill against HF's forward."""

from __future__ import annotations

import re

import pytest
import torch
import xgrammar as xgr
from transformers import LlamaConfig, LlamaForCausalLM

from kvflow.services.worker.runner import ModelRunner
from kvflow.shared.messages import (
    FinishReason,
    NewRequest,
    SamplingParams,
    ScheduledSeq,
    StepPlan,
    StructuredOutput,
)
from kvflow.shared.models.config import ModelConfig
from kvflow.shared.structured_output import GrammarCompiler

BLOCK = 4
EOS = 127
# token i's text: digits, then letters, then filler that no grammar below accepts
VOCAB = [str(i) for i in range(10)] + [chr(ord("a") + i) for i in range(26)]
VOCAB += [f"<{i}>" for i in range(len(VOCAB), 127)] + ["</s>"]
TEXT_TO_ID = {t: i for i, t in enumerate(VOCAB)}


@pytest.fixture(scope="module")
def tiny() -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    torch.manual_seed(1)
    cfg = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        eos_token_id=EOS,
    )
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.mul_(10.0) if p.dim() == 2 else p.add_(torch.randn_like(p) * 0.1)
    config = ModelConfig(
        vocab_size=128,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=96,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_parameters["rope_theta"],
        max_position_embeddings=256,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_ids=(EOS,),
    )
    weights = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    return config, weights, hf


def runner(tiny, **kw) -> ModelRunner:
    config, weights, _ = tiny
    r = ModelRunner.from_weights(config, weights, BLOCK, 64, **kw)
    info = xgr.TokenizerInfo(VOCAB, xgr.VocabType.RAW, vocab_size=128, stop_token_ids=[EOS])
    r.grammar_compiler = GrammarCompiler(info)
    return r


def run(
    r: ModelRunner,
    rid: str,
    tokens: list[int],
    prompt_len: int,
    params: SamplingParams,
    chunk: int = 1000,
    resumed: int = 0,
) -> tuple[list[int], int, list]:
    """Drive one request to its end; returns (output tokens, last finish reason, StepResults)."""
    table = list(range(0, 60))
    new = [NewRequest(rid, params, prompt_len, num_output_tokens=resumed)]
    done, out, results, step = 0, [], [], 0
    tokens = list(tokens)
    while True:
        end = min(len(tokens), done + chunk)
        seq = ScheduledSeq(rid, tokens[done:end], done, table, end == len(tokens))
        res = r.execute(StepPlan(step, [seq], new))
        assert res.error is None, res.error
        results.append(res)
        new, step, done = [], step + 1, end
        if not res.request_ids:
            continue
        tok, reason = res.token_ids[0], res.finish_reasons[0]
        out.append(tok)
        tokens.append(tok)
        if reason != FinishReason.NONE:
            return out, reason, results


def text(ids: list[int]) -> str:
    return "".join(VOCAB[i] for i in ids if i != EOS)


REGEX = r"[a-c]{3}[0-9]{4}x"
GUIDED = SamplingParams(
    max_tokens=30, temperature=0.0, structured_output=StructuredOutput("regex", REGEX)
)


def test_guided_output_matches_the_regex_and_stops(tiny) -> None:
    free, _, _ = run(
        runner(tiny), "f", [40, 41, 42, 43, 44], 5, SamplingParams(max_tokens=8, temperature=0)
    )
    assert not re.fullmatch(REGEX, text(free))  # unguided, the model writes something else
    out, reason, _ = run(runner(tiny), "g", [40, 41, 42, 43, 44], 5, GUIDED)
    assert re.fullmatch(REGEX, text(out)), text(out)
    assert out[-1] == EOS and reason == FinishReason.STOP and len(out) == 9
    # sampled (not greedy) and seeded: still inside the language
    hot = SamplingParams(
        max_tokens=30, temperature=1.5, seed=3, structured_output=StructuredOutput("regex", REGEX)
    )
    out, reason, _ = run(runner(tiny), "h", [7, 8, 9], 3, hot)
    assert re.fullmatch(REGEX, text(out)) and reason == FinishReason.STOP


def test_guided_request_resumed_elsewhere_replays_its_tokens(tiny) -> None:
    prompt = [40, 41, 42, 43, 44]
    whole, _, _ = run(runner(tiny), "a", prompt, 5, GUIDED)
    for k in (1, 4, 6):  # resumed after k tokens, on a fresh worker, prefill in chunks of 3
        rest, reason, _ = run(runner(tiny), "a", prompt + whole[:k], 5, GUIDED, chunk=3, resumed=k)
        assert whole[:k] + rest == whole, k
        assert reason == FinishReason.STOP


def test_bad_grammar_ends_the_request_not_the_worker(tiny) -> None:
    r = runner(tiny)
    bad = SamplingParams(
        max_tokens=5, temperature=0, structured_output=StructuredOutput("regex", "((")
    )
    out, reason, _ = run(r, "b", [1, 2, 3], 3, bad)
    assert reason == FinishReason.ERROR and len(out) == 1
    ok, reason, _ = run(r, "c", [1, 2, 3], 3, SamplingParams(max_tokens=3, temperature=0))
    assert len(ok) == 3 and reason == FinishReason.LENGTH


@pytest.mark.parametrize("chunk", [100, 4, 3])
def test_prompt_logprobs_match_hf_across_chunks(tiny, chunk: int) -> None:
    _, _, hf = tiny
    prompt = [5, 17, 99, 3, 42, 8, 64, 21, 77, 1, 33]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    _, _, results = run(runner(tiny), "p", prompt, len(prompt), params, chunk=chunk)
    pieces = [p for res in results for p in res.prompt_logprobs]
    got = {}
    for piece in pieces:
        assert piece.request_id == "p"
        for i, tok in enumerate(piece.token_ids):
            got[piece.start + i] = (
                tok,
                piece.logprobs[i],
                piece.ranks[i],
                piece.top_ids[i],
                piece.top_logprobs[i],
            )
    assert sorted(got) == list(range(1, len(prompt)))  # every prompt token but the first, once
    assert sum(len(p.token_ids) for p in pieces) == len(prompt) - 1
    for pos, (tok, lp, rank, top_ids, top_lps) in got.items():
        row = ref[pos - 1]
        assert tok == prompt[pos]
        assert lp == pytest.approx(float(row[tok]), abs=1e-4)
        assert rank == int((row > row[tok]).sum()) + 1
        assert top_ids == row.topk(3).indices.tolist()
        assert top_lps == pytest.approx(row.topk(3).values.tolist(), abs=1e-4)
    # only the step that ran the prompt's chunks carries them; decode steps do not
    assert results[-1].prompt_logprobs == []


def test_no_prompt_rows_unless_asked(tiny) -> None:
    r = runner(tiny)
    counts: list[int] = []
    forward = r.model.forward

    def spy(ids, pos, batch, caches):
        counts.append(int(batch.sample_rows.numel()))
        return forward(ids, pos, batch, caches)

    r.model.forward = spy
    run(r, "n", [5, 6, 7, 8, 9, 10], 6, SamplingParams(max_tokens=2, temperature=0), chunk=4)
    assert counts == [0, 1, 1]  # chunk 1 samples nothing, then the prompt's end, then decode
    counts.clear()
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=0)
    run(r, "y", [5, 6, 7, 8, 9, 10], 6, params, chunk=4)
    assert counts == [4, 1 + 1, 1]  # rows 0-3, then row 4 beside the sampled row 5


def test_allowed_token_ids_restrict_sampling(tiny) -> None:
    allowed = [3, 40, 41, 90]
    for temperature, seed in ((0.0, None), (1.5, 1), (1.5, 2)):
        params = SamplingParams(
            max_tokens=12,
            temperature=temperature,
            seed=seed,
            allowed_token_ids=allowed,
            ignore_eos=True,
        )
        out, _, _ = run(runner(tiny), "a", [5, 6, 7], 3, params)
        assert len(out) == 12 and set(out) <= set(allowed), out
    free, _, _ = run(
        runner(tiny), "b", [5, 6, 7], 3, SamplingParams(max_tokens=12, temperature=1.5, seed=1)
    )
    assert not set(free) <= set(allowed)
