"""/v1/completions through the official openai SDK, parameter by parameter, streamed and not,
with the response shapes checked field by field (logprobs and echo included)."""

from __future__ import annotations

import math

import httpx
import openai
import pytest

from tests.helpers.stack import openai_client

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
PROMPT = "The capital of France is"


def tokenize(base: str, text: str) -> list[int]:
    return httpx.post(f"{base}/tokenize", json={"prompt": text}, timeout=30).json()["tokens"]


def test_completion_object_field_by_field(client) -> None:
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0, user="user-1234"
    )
    d = out.model_dump()
    assert set(d) >= {"id", "object", "created", "model", "choices", "usage"}
    assert d["id"].startswith("cmpl-") and d["object"] == "text_completion"
    assert d["model"] == MODEL and isinstance(d["created"], int)
    [choice] = d["choices"]
    assert (choice["index"], choice["logprobs"]) == (0, None)
    assert choice["finish_reason"] in ("length", "stop") and choice["text"]
    assert d["usage"]["prompt_tokens"] == 5
    assert d["usage"]["total_tokens"] == 5 + d["usage"]["completion_tokens"]


def test_batched_prompts_and_n_index_like_openai(client, stack) -> None:
    second = tokenize(stack, "One, two, three,")
    kw = {"model": MODEL, "max_tokens": 4, "temperature": 0, "extra_body": {"ignore_eos": True}}
    out = client.completions.create(prompt=[PROMPT, "Hello, my name is"], n=2, **kw)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    alone = [
        client.completions.create(prompt=p, **kw).choices[0] for p in (PROMPT, "Hello, my name is")
    ]
    assert [c.text for c in out.choices] == [alone[0].text] * 2 + [alone[1].text] * 2
    assert out.usage.prompt_tokens == 5 + 5  # each prompt once, not once per choice
    assert out.usage.completion_tokens == 4 * 4
    ids = client.completions.create(
        model=MODEL, prompt=[tokenize(stack, PROMPT), second], max_tokens=3, temperature=0
    )
    assert [c.index for c in ids.choices] == [0, 1]
    assert (
        ids.choices[0].text
        == client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
        .choices[0]
        .text
    )
    assert ids.usage.prompt_tokens == 5 + len(second)


def test_batched_stream_with_usage(client) -> None:
    stream = client.completions.create(
        model=MODEL,
        prompt=["Red, green,", "Monday, Tuesday,"],
        max_tokens=5,
        temperature=0,
        n=2,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    for c in chunks[:-1]:
        assert c.usage is None and len(c.choices) == 1
        ch = c.choices[0]
        texts[ch.index] = texts.get(ch.index, "") + ch.text
        if ch.finish_reason:
            finishes[ch.index] = ch.finish_reason
    assert sorted(texts) == [0, 1, 2, 3] and finishes == dict.fromkeys(range(4), "length")
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: equal choices per prompt
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20


def test_best_of_returns_the_highest_cumulative_logprob(client) -> None:
    kw = {"model": MODEL, "prompt": "My favourite animal is", "max_tokens": 6, "seed": 42}
    kw |= {"temperature": 1.0, "logprobs": 0}
    all3 = client.completions.create(n=3, best_of=3, **kw)  # sequences seeded 42, 43, 44
    sums = [sum(c.logprobs.token_logprobs) for c in all3.choices]
    best = client.completions.create(n=1, best_of=3, **kw)
    assert [c.index for c in best.choices] == [0]
    assert best.choices[0].text == all3.choices[max(range(3), key=lambda i: sums[i])].text
    two = client.completions.create(n=2, best_of=3, **kw)
    order = sorted(range(3), key=lambda i: sums[i], reverse=True)
    assert [c.text for c in two.choices] == [all3.choices[i].text for i in order[:2]]
    # logprobs computed only to rank the sequences are not returned
    plain = client.completions.create(n=1, best_of=2, **{**kw, "logprobs": None})
    assert plain.choices[0].logprobs is None
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(n=1, best_of=2, stream=True, **kw)
    assert e.value.body["param"] == "best_of"


def check_completion_logprobs(lp, k: int, first_null: bool) -> None:
    n = len(lp.tokens)
    assert len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    offset = 0
    for i, (tok, tlp, top, off) in enumerate(
        zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset, strict=True)
    ):
        assert off == offset
        offset += len(tok)
        if first_null and i == 0:
            assert tlp is None and top is None
            continue
        assert tlp <= 0 and top[tok] == pytest.approx(tlp)
        assert k <= len(top) <= k + 1  # the top k, plus the chosen token when not among them
        assert max(top.values()) >= tlp


def test_echo_with_logprobs_exact_shape_and_values(client, stack) -> None:
    out = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=2
    )
    c = out.choices[0]
    assert c.text.startswith(PROMPT) and len(c.text) > len(PROMPT)
    lp = c.logprobs
    check_completion_logprobs(lp, 2, first_null=True)
    assert "".join(lp.tokens[:5]) == PROMPT and len(lp.tokens) == 5 + out.usage.completion_tokens
    assert "".join(lp.tokens[5:]) == c.text[len(PROMPT) :]
    # the prompt logprob of " Paris" after the prompt is the sampled logprob of " Paris"
    plain = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1
    ).choices[0]
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPT + plain.text, max_tokens=1, temperature=0, echo=True, logprobs=1
    ).choices[0]
    assert echoed.logprobs.tokens[5] == plain.text
    assert echoed.logprobs.token_logprobs[5] == pytest.approx(
        plain.logprobs.token_logprobs[0], abs=1e-3
    )
    # echo without logprobs: text only; a token-id prompt echoes its decoded text
    bare = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, echo=True)
    assert bare.choices[0].text.startswith(PROMPT) and bare.choices[0].logprobs is None
    ids = client.completions.create(
        model=MODEL, prompt=tokenize(stack, PROMPT), max_tokens=2, temperature=0, echo=True
    )
    assert ids.choices[0].text.startswith(PROMPT)


def test_streamed_echo_and_logprobs(client) -> None:
    stream = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1, stream=True
    )
    chunks = [c for c in stream if c.choices]
    first = chunks[0].choices[0]
    assert first.text.startswith(PROMPT)
    assert first.logprobs.token_logprobs[0] is None and first.logprobs.tokens[0] == "The"
    tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    text = "".join(c.choices[0].text for c in chunks)
    full = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, echo=True, logprobs=1
    ).choices[0]
    assert text == full.text and tokens == full.logprobs.tokens


def test_prompt_logprobs_across_chunked_prefill_match(stack, small_stack, tokenizer) -> None:
    """A 600-token prompt runs in one chunk on `stack` and in three on `small_stack` (256-token
    steps): the same prompt logprobs, the first one null, vLLM's prompt_logprobs shape too."""
    words = " ".join(f"item {i} is {['red', 'blue', 'green'][i % 3]}," for i in range(120))
    ids = tokenizer(words)["input_ids"][:600]
    kw = {"model": MODEL, "prompt": ids, "max_tokens": 1, "temperature": 0, "echo": True}
    kw |= {"logprobs": 1, "extra_body": {"prompt_logprobs": 1}}
    one = openai_client(stack).completions.create(**kw).choices[0]
    chunked = openai_client(small_stack).completions.create(**kw).choices[0]
    a, b = one.logprobs.token_logprobs[:600], chunked.logprobs.token_logprobs[:600]
    assert a[0] is None and b[0] is None
    assert all(x is not None and math.isfinite(x) for x in a[1:])
    assert b[1:] == pytest.approx(a[1:], abs=2e-3)
    vllm = one.model_extra["prompt_logprobs"]
    assert vllm[0] is None and len(vllm) == 600
    entry = vllm[1][str(ids[1])]
    assert entry["logprob"] == pytest.approx(a[1], abs=1e-5) and entry["rank"] >= 1
    assert entry["decoded_token"] == one.logprobs.tokens[1]


def test_stop_token_ids_seed_and_penalties(client, stack) -> None:
    base = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, logprobs=0
    ).choices[0]
    third = base.logprobs.tokens[2]
    [tid] = tokenize(stack, third)  # one token
    stopped = client.completions.create(
        model=MODEL,
        prompt="1, 2, 3, 4,",
        max_tokens=8,
        temperature=0,
        extra_body={"stop_token_ids": [tid]},
    ).choices[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == "".join(base.logprobs.tokens[:3])  # the stop token is kept (vLLM)
    listed = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=8, temperature=0, stop=[third, "zzz"]
    ).choices[0]
    assert listed.finish_reason == "stop" and listed.text == "".join(base.logprobs.tokens[:2])
    kw = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12, "temperature": 1.0}
    a = client.completions.create(seed=7, **kw).choices[0].text
    assert a == client.completions.create(seed=7, **kw).choices[0].text
    others = {client.completions.create(seed=s, **kw).choices[0].text for s in (8, 9, 10)}
    assert others - {a}
    rep = {"model": MODEL, "prompt": "Repeat after me: hello hello hello", "temperature": 0}
    free = client.completions.create(max_tokens=6, **rep).choices[0].text
    assert free == " hello" * 6
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        text = client.completions.create(max_tokens=6, **penalty, **rep).choices[0].text
        assert text.count(" hello") == 1, (penalty, text)  # generated once, then penalised


def test_suffix_and_bad_values_are_refused_by_name(client) -> None:
    cases = [
        ({"suffix": "tail"}, "suffix"),
        ({"n": 17}, "n"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"logprobs": 21}, "logprobs"),
        ({"max_tokens": 5000}, "max_tokens"),  # prompt + max_tokens > max_model_len (2048)
        ({"temperature": -1}, "temperature"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[1, 2], [99999999]]}, "prompt"),
    ]
    for extra, param in cases:
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, **extra}
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**body)
        assert e.value.body["param"] == param, (extra, e.value.body)
        assert e.value.body["message"] and e.value.body["type"] == "BadRequestError"


def test_allowed_token_ids_and_truncate_prompt_tokens(client, stack) -> None:
    allowed = tokenize(stack, " yes no maybe")
    out = client.completions.create(
        model=MODEL,
        prompt="Question: is the sky blue? Answer:",
        max_tokens=6,
        temperature=1.0,
        seed=3,
        logprobs=0,
        extra_body={"allowed_token_ids": allowed, "ignore_eos": True},
    )
    tokens = out.choices[0].logprobs.tokens
    assert len(tokens) == 6 and all(tokenize(stack, t)[0] in allowed for t in tokens), tokens
    long = "one two three four five six seven eight nine ten"
    cut = client.completions.create(
        model=MODEL,
        prompt=long,
        max_tokens=3,
        temperature=0,
        extra_body={"truncate_prompt_tokens": 4},
    )
    assert cut.usage.prompt_tokens == 4
    tail = client.completions.create(
        model=MODEL, prompt=tokenize(stack, long)[-4:], max_tokens=3, temperature=0
    )
    assert cut.choices[0].text == tail.choices[0].text
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(
            model=MODEL, prompt="x", max_tokens=2, extra_body={"allowed_token_ids": [10**8]}
        )
    assert e.value.body["param"] == "allowed_token_ids"


def test_return_tokens_as_token_ids_streamed_and_not(client, tokenizer) -> None:
    """vLLM's extra: logprobs entries name tokens ``token_id:N`` (same ids as the text, greedy),
    echoed prompt tokens included; the text itself is unchanged."""
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "logprobs": 2}
    plain = client.completions.create(extra_body={"ignore_eos": True}, **kw).choices[0]
    extra = {"return_tokens_as_token_ids": True, "ignore_eos": True}
    by_id = client.completions.create(echo=True, extra_body=extra, **kw).choices[0]
    assert by_id.text == PROMPT + plain.text
    tokens = by_id.logprobs.tokens
    assert all(t.startswith("token_id:") for t in tokens)
    ids = [int(t.removeprefix("token_id:")) for t in tokens]
    assert tokenizer.decode(ids) == by_id.text
    assert [tokenizer.decode([i]) for i in ids[-5:]] == plain.logprobs.tokens
    assert all(k.startswith("token_id:") for top in by_id.logprobs.top_logprobs[1:] for k in top)
    streamed = client.completions.create(stream=True, extra_body=extra, **kw)
    seen = [
        t
        for c in streamed
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert seen == tokens[-5:]


def test_bad_words_are_never_generated(client, tokenizer) -> None:
    """vLLM's bad_words: the word's tokens (with and without a leading space) never appear as
    a sequence in the output; greedy output otherwise takes the next best token."""
    kw = {"model": MODEL, "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "logprobs": 0}
    extra = {"return_tokens_as_token_ids": True, "ignore_eos": True}
    plain = client.completions.create(extra_body=extra, **kw).choices[0]
    assert "Paris" in plain.text  # the word the model wants to say
    banned = client.completions.create(extra_body={**extra, "bad_words": ["Paris"]}, **kw)
    out = banned.choices[0]
    assert "Paris" not in out.text
    ids = [int(t.removeprefix("token_id:")) for t in out.logprobs.tokens]
    for word in ("Paris", " Paris"):
        seq = tokenizer.encode(word, add_special_tokens=False)
        assert not any(ids[i : i + len(seq)] == seq for i in range(len(ids)))
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(extra_body={"bad_words": [""]}, **kw)
    assert e.value.body["param"] == "bad_words"
