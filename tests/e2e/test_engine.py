"""Engine behaviour through the whole stack: prefix caching, chunked prefill beside running
streams, preemption under a small KV cache, seeded sampling. Outputs are compared with the same
requests on the other stack configuration, so the engine's tricks never change an answer."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.helpers.stack import (
    MODEL,
    complete,
    openai_client,
    stats,
    text_prompt_ids,
    wait_all_blocks_free,
)

pytestmark = pytest.mark.e2e


def test_shared_prefix_computes_only_new_tokens(stack, small_stack, tokenizer) -> None:
    prefix = text_prompt_ids(tokenizer, 256, seed=100)
    first = prefix + tokenizer(" Summary of the notes:")["input_ids"]
    second = prefix + tokenizer(" The last note says")["input_ids"]
    complete(stack, first, 4)
    wait_all_blocks_free(stack)
    before = stats(stack)
    out = complete(stack, second, 1)
    after = stats(stack)
    # 256 prefix tokens = 16 full blocks found in the cache; only the rest is computed
    assert after["num_computed_tokens"] - before["num_computed_tokens"] == len(second) - 256
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 16
    # the same request on a stack that never saw the prefix gives the same greedy output
    assert out == complete(small_stack, second, 1)
    assert complete(stack, second, 12) == complete(small_stack, second, 12)


def test_long_prompt_is_chunked_while_other_streams_flow(stack, small_stack, tokenizer) -> None:
    long_prompt = text_prompt_ids(tokenizer, 2000, seed=7)
    expected = complete(stack, long_prompt, 8)  # 2048-token budget: one chunk
    stamps: list[float] = []
    started = threading.Event()

    def stream(i: int) -> None:
        s = openai_client(small_stack).completions.create(
            model=MODEL,
            prompt=f"Story {i}: once",
            max_tokens=120,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        for chunk in s:
            started.set()
            if chunk.choices and chunk.choices[0].text:
                stamps.append(time.monotonic())

    with ThreadPoolExecutor(4) as ex:
        streams = [ex.submit(stream, i) for i in range(3)]
        started.wait(60)
        time.sleep(0.5)
        before = stats(small_stack)["num_computed_tokens"]
        t0 = time.monotonic()
        got = complete(small_stack, long_prompt, 8)
        t1 = time.monotonic()
        for f in streams:
            f.result()
    assert got == expected
    computed = stats(small_stack)["num_computed_tokens"] - before
    assert computed >= 2000  # the whole prompt went through the model, in 256-token steps
    # the streams received tokens while the long prompt was being prefilled in chunks
    during = [t for t in stamps if t0 < t < t1]
    assert len(during) >= 8, f"only {len(during)} tokens reached the other streams meanwhile"
    assert wait_all_blocks_free(small_stack)["num_free_blocks"] == 160


def test_preemption_keeps_outputs(stack, small_stack, tokenizer) -> None:
    prompts = [text_prompt_ids(tokenizer, 180 + 10 * i, seed=200 + i) for i in range(8)]
    with ThreadPoolExecutor(8) as ex:
        reference = list(
            ex.map(lambda p: complete(stack, p, 160, extra_body={"ignore_eos": True}), prompts)
        )
    before = stats(small_stack)["num_preemptions"]
    with ThreadPoolExecutor(8) as ex:
        got = list(
            ex.map(
                lambda p: complete(small_stack, p, 160, extra_body={"ignore_eos": True}), prompts
            )
        )
    assert stats(small_stack)["num_preemptions"] > before
    assert got == reference
    assert wait_all_blocks_free(small_stack)["num_free_blocks"] == 160


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(stack) -> None:
    # EOS is 0.61 of the first token's probability here: ignore_eos, so that 24 tokens are
    # drawn (two seeds both ending at once would make the last assertion a coin toss)
    kw = {"temperature": 0.9, "top_p": 0.95, "seed": 1234, "extra_body": {"ignore_eos": True}}
    alone = complete(stack, "Write a short poem about the sea.", 24, **kw)
    assert alone[1] == 24
    others = [f"Tell me about topic number {i}." for i in range(8)]
    with ThreadPoolExecutor(9) as ex:
        noise = [ex.submit(complete, stack, p, 24, temperature=1.0) for p in others]
        batched = ex.submit(complete, stack, "Write a short poem about the sea.", 24, **kw).result()
        for f in noise:
            f.result()
    assert batched == alone
    different_seed = complete(stack, "Write a short poem about the sea.", 24, **{**kw, "seed": 99})
    assert different_seed != alone


def test_n_choices_share_the_prompt_blocks(stack, tokenizer) -> None:
    prompt = text_prompt_ids(tokenizer, 200, seed=300)  # 12 full blocks of 16 + 8 tokens
    wait_all_blocks_free(stack)
    before = stats(stack)
    r = openai_client(stack).completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=5,
        n=3,
        temperature=1.0,
        seed=7,
        extra_body={"ignore_eos": True},
    )
    after = stats(stack)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert r.usage.prompt_tokens == 200 and r.usage.completion_tokens == 15
    # the first choice computes the prompt; the others find its 12 full blocks and compute only
    # the 8-token tail; then 4 decode steps each
    assert after["num_computed_tokens"] - before["num_computed_tokens"] == 200 + 2 * 8 + 3 * 4
    assert after["prefix_cache_hits"] - before["prefix_cache_hits"] == 24
    assert len({c.text for c in r.choices}) > 1  # seeds seed+i: different samples


def test_n_choices_stream_with_indexes(stack) -> None:
    stream = openai_client(stack).chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hi."}],
        max_tokens=6,
        n=2,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    texts, finishes, usage = {0: "", 1: ""}, {}, None
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
        usage = chunk.usage or usage
    assert set(finishes) == {0, 1}
    assert texts[0] == texts[1] and texts[0]  # greedy: both choices agree
    assert usage.completion_tokens == 2 * (usage.completion_tokens // 2)


def streamed_token_counts(base: str, prompt: str, max_tokens: int) -> tuple[str, list[int]]:
    """A streamed completion's text and the tokens each chunk carried (by its logprobs)."""
    stream = openai_client(base).completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=1,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text, counts = "", []
    for chunk in stream:
        choice = chunk.choices[0]
        text += choice.text
        if choice.logprobs and choice.logprobs.tokens:
            counts.append(len(choice.logprobs.tokens))
    return text, counts


def test_stream_interval_sends_the_same_text_in_fewer_chunks(stack, small_stack) -> None:
    """--stream-interval 3 (small_stack): the first token at once, then 3 or more tokens per
    chunk, the last one whatever is left; the text equals the default stack's (chunks of a
    token each, or more where a client reads slower than they come: the gateway merges what
    waits, so only lower bounds hold)."""
    prompt = "Write a short story about a lighthouse keeper."
    want, ones = streamed_token_counts(stack, prompt, 25)
    got, counts = streamed_token_counts(small_stack, prompt, 25)
    assert got == want and sum(counts) == sum(ones) == 25
    assert all(c >= 3 for c in counts[1:-1]), counts
    assert len(counts) <= 2 + 24 // 3
