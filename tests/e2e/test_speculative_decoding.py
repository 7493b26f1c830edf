"""Speculative decoding (n-gram drafts) on the whole stack through the openai SDK: greedy output
equals Hugging Face's, alone and in a shared batch, on text the model quotes (drafts accepted)
and free-form text; vLLM's spec_decode counters move; every block is free afterwards; sampling,
logprobs, n > 1, stop strings and penalties still work; a bad config is refused at start."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.helpers.stack import (
    hf_greedy_texts,
    openai_client,
    running_stack,
    wait_all_blocks_free,
)

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
NEW_TOKENS = 48
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
        "prompt_lookup_min": 2}  # fmt: skip

QUOTING = [
    "Here is a list:\n1. apple\n2. banana\n3. cherry\n4. grape\n5. lemon\n\n"
    "The same list again:\n1. apple\n2.",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n",
]
PROSE = ["Once upon a time, in a small village by the sea,", "The capital of France is"]


@pytest.fixture(scope="module")
def spec_stack():
    args = ["--max-model-len", "2048", "--speculative-config", json.dumps(SPEC)]
    with running_stack("speculative", *args) as base:
        yield base


@pytest.fixture(scope="module")
def hf_texts(hf_model, tokenizer) -> dict[str, tuple[str, int]]:
    return hf_greedy_texts(hf_model, tokenizer, QUOTING + PROSE, NEW_TOKENS)


def _complete(client, prompt: str) -> tuple[str, int]:
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
    return r.choices[0].text, r.usage.completion_tokens


def _spec_counters(base: str) -> dict[str, float]:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("vllm:spec_decode"):
                key = s.name + (f"[{s.labels['position']}]" if "position" in s.labels else "")
                out[key] = out.get(key, 0.0) + s.value
    return out


def test_greedy_equals_hf_alone_and_drafts_are_accepted(spec_stack, hf_texts) -> None:
    client = openai_client(spec_stack)
    before = _spec_counters(spec_stack)
    for p in QUOTING + PROSE:
        assert _complete(client, p) == hf_texts[p], p
    after = _spec_counters(spec_stack)
    drafts = after["vllm:spec_decode_num_draft_tokens_total"]
    accepted = after["vllm:spec_decode_num_accepted_tokens_total"]
    assert after["vllm:spec_decode_num_drafts_total"] > before.get(
        "vllm:spec_decode_num_drafts_total", 0
    )
    assert 0 < accepted <= drafts
    assert after["vllm:spec_decode_num_accepted_tokens_per_pos_total[0]"] > 0
    per_pos = [after[f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]"] for i in range(4)]
    assert per_pos == sorted(per_pos, reverse=True)  # a later draft only after the earlier
    assert sum(per_pos) == accepted
    stats = wait_all_blocks_free(spec_stack)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_greedy_equals_hf_in_a_shared_batch(spec_stack, hf_texts) -> None:
    client = openai_client(spec_stack)
    extra = ["Write a haiku about rain.", "2 + 2 =", "The quick brown fox"]
    with ThreadPoolExecutor(8) as ex:
        futures = {p: ex.submit(_complete, client, p) for p in QUOTING + PROSE + extra}
        results = {p: f.result() for p, f in futures.items()}
    for p in QUOTING + PROSE:
        assert results[p] == hf_texts[p], p
    stats = wait_all_blocks_free(spec_stack)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_seeded_sampling_speculates_and_keeps_its_text(spec_stack, stack) -> None:
    """A seeded sampled request speculates (drafts verified, some accepted) and its text is
    the stack's without speculation: each token's draw depends on the seed and its position,
    not on how many rows a step verified or rejected."""
    kw = {"max_tokens": 24, "temperature": 0.3, "seed": 7, "extra_body": {"ignore_eos": True}}
    before = _spec_counters(spec_stack)
    got = [
        openai_client(spec_stack).completions.create(model=MODEL, prompt=p, **kw).choices[0].text
        for p in QUOTING
    ]
    after = _spec_counters(spec_stack)
    plain = [
        openai_client(stack).completions.create(model=MODEL, prompt=p, **kw).choices[0].text
        for p in QUOTING
    ]
    assert got == plain
    accepted = "vllm:spec_decode_num_accepted_tokens_total"
    assert after[accepted] > before.get(accepted, 0)


def test_other_features_keep_working(spec_stack) -> None:
    client = openai_client(spec_stack)
    prompt = QUOTING[0]
    # sampled, unseeded: speculates, and every token is there
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0.8, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 24 and r.choices[0].finish_reason == "length"
    # logprobs: one per token, every token
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == r.usage.completion_tokens == 20
    assert all(len(t) >= 1 for t in lp.top_logprobs)
    # stop strings end inside a step that returned several tokens
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=30, temperature=0)
    text = plain.choices[0].text
    cut = text.find("4.")
    assert cut > 0, text
    r = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=30, temperature=0, stop=["4."]
    )
    assert r.choices[0].text == text[:cut] and r.choices[0].finish_reason == "stop"
    # max_tokens exact, n > 1, penalties (decoded without drafts)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=7, temperature=0, n=3)
    assert [c.text for c in r.choices] == [r.choices[0].text] * 3
    assert r.usage.completion_tokens == 21
    r = client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=16,
        temperature=0,
        frequency_penalty=1.0,
        extra_body={"ignore_eos": True},
    )
    assert r.usage.completion_tokens == 16
    # structured output (decoded one token a step: the grammar's state is per position)
    schema = {
        "type": "object",
        "properties": {"fruit": {"type": "string"}},
        "required": ["fruit"],
    }
    r = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a fruit as JSON."}],
        max_tokens=40,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "f", "schema": schema}},
    )
    assert isinstance(json.loads(r.choices[0].message.content)["fruit"], str)
    # streamed chat: the chunks add up to the non-streamed text
    msgs = [{"role": "user", "content": "Repeat exactly: red, green, blue, red, green, blue."}]
    whole = (
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=32, temperature=0)
        .choices[0]
        .message.content
    )
    stream = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=32, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole
    stats = wait_all_blocks_free(spec_stack)
    assert stats["num_free_blocks"] == stats["num_total_blocks"]


@pytest.mark.parametrize("ranks", [1, 2], ids=["one-rank", "tensor-parallel-2"])
def test_a_draft_model_keeps_greedy_output(model_src, hf_texts, ranks: int) -> None:
    """The served model's own first 10 layers as a draft model in the worker (its own paged
    KV cache): greedy text equals HF's, its drafts are verified and counted, blocks come back.
    Over 2 ranks every rank runs the whole draft model (the same proposals everywhere)."""
    draft = {"method": "draft_model", "model": str(model_src.path), "num_speculative_tokens": 3,
             "num_draft_layers": 10}  # fmt: skip
    args = ["--max-model-len", "2048", "--speculative-config", json.dumps(draft)]
    args += ["--tensor-parallel-size", str(ranks)]
    with running_stack(f"speculative-draft-{ranks}", *args) as base:
        client = openai_client(base)
        with ThreadPoolExecutor(4) as ex:
            futures = {p: ex.submit(_complete, client, p) for p in QUOTING + PROSE}
            for p, f in futures.items():
                assert f.result() == hf_texts[p], p
        counters = _spec_counters(base)
        assert counters["vllm:spec_decode_num_draft_tokens_total"] > 0
        assert counters["vllm:spec_decode_num_accepted_tokens_total"] > 0
        stats = wait_all_blocks_free(base)
        assert stats["num_free_blocks"] == stats["num_total_blocks"]


def test_a_config_kvflow_cannot_serve_is_refused_at_start() -> None:
    bad = json.dumps({"method": "eagle", "model": "/m", "num_speculative_tokens": 4})
    with pytest.raises(RuntimeError, match="'eagle' is not served"):
        with running_stack("speculative-bad", "--speculative-config", bad):
            pass
