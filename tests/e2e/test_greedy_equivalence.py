"""Greedy output through the whole pipeline equals Hugging Face transformers' greedy output on
the same model (the same GGUF file, dequantized by transformers), for 32 new tokens: alone, and
with 8 requests sharing batches."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers import hf_reference
from tests.helpers.stack import NEW_TOKENS, PROMPTS, hf_greedy_texts, wait_all_blocks_free

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def hf_greedy(hf_model, tokenizer):
    return hf_greedy_texts(hf_model, tokenizer, PROMPTS, NEW_TOKENS)


def complete(client, prompt: str):
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
    return r.choices[0].text, r.usage.completion_tokens


def test_alone_equals_hf(client, hf_greedy) -> None:
    for p in PROMPTS:
        assert complete(client, p) == hf_greedy[p], p


def test_in_a_shared_batch_equals_hf(client, hf_greedy, stack) -> None:
    extra = ["Write a haiku about rain.", "2 + 2 =", "The quick brown fox"]
    with ThreadPoolExecutor(8) as ex:
        futures = {p: ex.submit(complete, client, p) for p in PROMPTS + extra}
        results = {p: f.result() for p, f in futures.items()}
    for p in PROMPTS:
        assert results[p] == hf_greedy[p], p
    stats = wait_all_blocks_free(stack)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_repetition_penalty_equals_hf_also_after_a_prefix_hit(client, hf_model, tokenizer) -> None:
    """repetition_penalty covers every prompt token, also those this worker did not compute
    (the second request finds the prompt's full blocks in the prefix cache)."""
    prompt = (
        "Once upon a time, in a small village by the sea, there lived an old fisherman who "
        "told the same story every night to anyone who would listen. The story was"
    )
    ids = tokenizer(prompt)["input_ids"]
    (new,) = hf_reference.generate(
        hf_model, ids, max_new_tokens=24, do_sample=False, repetition_penalty=1.3, min_new_tokens=24
    )
    want = tokenizer.decode(new, skip_special_tokens=True)
    kw = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    kw["extra_body"] = {"repetition_penalty": 1.3, "ignore_eos": True}
    for _ in range(2):  # cold, then with the prefix cached
        assert client.completions.create(**kw).choices[0].text == want
    plain = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True}})
    assert plain.choices[0].text != want  # the penalty matters for this prompt
