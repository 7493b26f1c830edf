"""shared/beam_search.py against Hugging Face's own beam search (``generate(num_beams=...,
do_sample=False)``) on a tiny random Llama, with ``expand`` running the same HF model: the same
logits, so any difference is a difference in the search rules (candidates, EOS, length penalty,
early stopping)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import LlamaForCausalLM

from kvflow.shared.beam_search import beam_search, score
from tests.helpers.tiny_llama import PROMPTS

EOS = 127


def hf_expand(model: LlamaForCausalLM):
    async def expand(seqs: list[list[int]], k: int) -> list[list[tuple[int, float]]]:
        out = []
        with torch.no_grad():
            for s in seqs:
                logits = model(torch.tensor([s])).logits[0, -1].float()
                lp = torch.log_softmax(logits, -1)
                v, i = lp.topk(k)
                out.append(list(zip(i.tolist(), v.tolist(), strict=True)))
        return out

    return expand


def hf_beams(
    model: LlamaForCausalLM, prompt: list[int], width: int, n_new: int, **kw
) -> list[list[int]]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=n_new,
            pad_token_id=0,
            eos_token_id=kw.pop("eos", EOS),
            **kw,
        )
    rows = [r[len(prompt) :].tolist() for r in out]
    return [r[: r.index(EOS) + 1] if EOS in r else r for r in rows]


@pytest.mark.parametrize("width", [2, 4])
@pytest.mark.parametrize("prompt_index", [0, 1, 3])
def test_same_beams_as_hugging_face(tiny_llama, width: int, prompt_index: int) -> None:
    prompt = PROMPTS[prompt_index]
    ours = asyncio.run(beam_search(prompt, hf_expand(tiny_llama), width, 6, [EOS]))
    assert [b.tokens for b in ours] == hf_beams(tiny_llama, prompt, width, 6)
    assert [b.score for b in ours] == sorted((b.score for b in ours), reverse=True)
    for b in ours:
        assert b.cum_logprob == pytest.approx(sum(b.logprobs))
        assert b.score == pytest.approx(score(b.cum_logprob, len(b.tokens), 1.0))


@pytest.mark.parametrize("eos_rank", [0, 1, 2, 5])
@pytest.mark.parametrize("length_penalty", [0.5, 2.0])
@pytest.mark.parametrize("width", [2, 3])
def test_eos_hypotheses_length_penalty_and_early_stop_like_hugging_face(
    tiny_llama,
    eos_rank: int,
    length_penalty: float,
    width: int,
) -> None:
    """A token the model likes (ranked ``eos_rank`` after the prompt) made the EOS: beams end
    early, EOS candidates outside the best ``width`` must not finish, hypotheses compete by
    length-normalised score, and the search may stop early -- all as HF does."""
    for prompt in PROMPTS:
        with torch.no_grad():
            logits = tiny_llama(torch.tensor([prompt])).logits[0, -1]
            eos = int(logits.topk(eos_rank + 1).indices[eos_rank])
        ours = asyncio.run(
            beam_search(prompt, hf_expand(tiny_llama), width, 10, [eos], length_penalty)
        )
        theirs = hf_beams(tiny_llama, prompt, width, 10, eos=eos, length_penalty=length_penalty)
        theirs = [r[: r.index(eos) + 1] if eos in r else r for r in theirs]
        assert [b.tokens for b in ours] == theirs, (prompt, eos)


def test_rejects_bad_arguments() -> None:
    async def expand(seqs, k):
        return [[(1, -0.1)] for _ in seqs]

    with pytest.raises(ValueError):
        asyncio.run(beam_search([1], expand, 0, 4))
    with pytest.raises(ValueError):
        asyncio.run(beam_search([1], expand, 2, 0))
