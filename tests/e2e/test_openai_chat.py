"""/v1/chat/completions through the official openai SDK: roles and content parts, token limits,
logprobs shapes, and structured output (json_object, json_schema validated with jsonschema,
vLLM's guided_* extras), streamed and not."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colors": {
            "type": "array",
            "items": {"type": "string", "enum": ["red", "green", "blue"]},
            "maxItems": 3,
        },
        "member": {"type": "boolean"},
    },
    "required": ["name", "age", "colors", "member"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person called Ann as JSON."}]


def test_chat_object_field_by_field_with_roles_and_parts(client, stack) -> None:
    messages = [
        {"role": "system", "content": "You answer in one word."},
        {
            "role": "user",
            "content": [{"type": "text", "text": "Say"}, {"type": "text", "text": "hi"}],
        },
        {"role": "assistant", "content": "Hi"},
        {"role": "user", "content": "Again"},
    ]
    out = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=4, temperature=0, user="u-1"
    )
    d = out.model_dump()
    assert d["id"].startswith("chatcmpl-") and d["object"] == "chat.completion"
    assert d["model"] == MODEL and isinstance(d["created"], int)
    [choice] = d["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None
    assert choice["message"]["role"] == "assistant" and isinstance(
        choice["message"]["content"], str
    )
    assert choice["finish_reason"] in ("stop", "length")
    assert d["usage"]["completion_tokens"] <= 4
    # the prompt is the chat template over every message (parts joined with a newline)
    parts_joined = [*messages[:1], {"role": "user", "content": "Say\nhi"}, *messages[2:]]
    tok = httpx.post(
        f"{stack}/tokenize", json={"model": MODEL, "messages": parts_joined}, timeout=30
    )
    assert tok.json()["count"] == d["usage"]["prompt_tokens"]


def test_max_tokens_and_max_completion_tokens(client) -> None:
    kw = {"model": MODEL, "messages": ASK, "temperature": 0, "extra_body": {"ignore_eos": True}}
    assert client.chat.completions.create(max_tokens=3, **kw).usage.completion_tokens == 3
    out = client.chat.completions.create(max_tokens=3, max_completion_tokens=5, **kw)
    assert out.usage.completion_tokens == 5 and out.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(max_completion_tokens=0, **kw)
    assert e.value.body["param"] == "max_completion_tokens"


def test_stream_usage_only_at_the_end_or_on_every_chunk(client) -> None:
    kw = {"model": MODEL, "messages": ASK, "max_tokens": 5, "temperature": 0, "stream": True}
    kw["extra_body"] = {"ignore_eos": True}
    chunks = list(client.chat.completions.create(stream_options={"include_usage": True}, **kw))
    assert all(c.usage is None for c in chunks[:-1]) and chunks[-1].usage.completion_tokens == 5
    every = list(
        client.chat.completions.create(
            stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw
        )
    )
    counts = [c.usage.completion_tokens for c in every if c.choices and c.choices[0].delta.content]
    assert counts == sorted(counts) and counts[-1] == 5 and len(counts) >= 4
    assert every[-1].usage.completion_tokens == 5 and every[-1].choices == []
    assert not any(c.usage for c in client.chat.completions.create(**kw))


def test_continue_final_message_with_echo_streamed_and_not(client, stack) -> None:
    """vLLM's extras: the template leaves the assistant's draft open, the answer carries it on
    (greedy: token for token what a completion of the same rendered prompt gives), and echo
    puts the draft first."""
    draft = [*ASK, {"role": "assistant", "content": '{"name": "Ann", "age":'}]
    extra = {"add_generation_prompt": False, "continue_final_message": True, "echo": True}
    kw = {"model": MODEL, "messages": draft, "max_tokens": 6, "temperature": 0}
    out = client.chat.completions.create(extra_body=extra, **kw)
    content = out.choices[0].message.content
    assert out.choices[0].message.role == "assistant"
    assert content.startswith(draft[-1]["content"])
    rendered = httpx.post(
        f"{stack}/tokenize",
        json={
            "model": MODEL,
            "messages": draft,
            "add_generation_prompt": False,
            "continue_final_message": True,
        },
        timeout=30,
    ).json()
    assert rendered["count"] == out.usage.prompt_tokens
    plain = client.completions.create(
        model=MODEL, prompt=rendered["tokens"], max_tokens=6, temperature=0
    )
    assert content == draft[-1]["content"] + plain.choices[0].text
    streamed = list(client.chat.completions.create(stream=True, extra_body=extra, **kw))
    deltas = [c.choices[0].delta.content for c in streamed if c.choices and c.choices[0].delta]
    assert deltas[:2] == ["", draft[-1]["content"]]  # the role chunk, then the echo
    assert "".join(d or "" for d in deltas) == content
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(extra_body={"continue_final_message": True}, **kw)
    assert e.value.body["param"] == "continue_final_message"


def test_chat_logprobs_non_streamed_shape(client) -> None:
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(e.token for e in content) == out.choices[0].message.content
    for e in content:
        assert e.bytes == list(e.token.encode()) and e.logprob <= 0
        assert len(e.top_logprobs) == 3
        values = [t.logprob for t in e.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert e.top_logprobs[0].token == e.token and values[0] == pytest.approx(e.logprob)


def test_json_schema_output_validates(client) -> None:
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON, "strict": True},
    }
    out = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=120, temperature=0, response_format=fmt
    )
    assert out.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.choices[0].message.content), PERSON)
    stream = client.chat.completions.create(  # sampled and streamed: still valid
        model=MODEL,
        messages=ASK,
        max_tokens=120,
        temperature=1.0,
        seed=1,
        response_format=fmt,
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop"]
    jsonschema.validate(json.loads(text), PERSON)


def test_json_object_and_vllm_guided_extras(client) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "What is 2+2? Answer in JSON."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
    )
    assert out.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(out.choices[0].message.content), dict)
    choice = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Is the sky green?"}],
        max_tokens=10,
        extra_body={"guided_choice": ["yes", "no", "maybe not"]},
    )
    assert choice.choices[0].message.content in ("yes", "no", "maybe not")
    regex = client.completions.create(
        model=MODEL,
        prompt="A phone number:",
        max_tokens=20,
        temperature=0.8,
        n=3,
        extra_body={"guided_regex": r"\(\d{3}\) \d{3}-\d{4}"},
    )
    for c in regex.choices:
        assert re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", c.text) and c.finish_reason == "stop"
    nested = client.completions.create(
        model=MODEL,
        prompt="Ann's age:",
        max_tokens=20,
        extra_body={
            "structured_outputs": {"json": {"type": "integer", "minimum": 1, "maximum": 99}}
        },
    )
    assert 1 <= json.loads(nested.choices[0].text) <= 99


def test_bad_schemas_and_conflicts_are_400(client) -> None:
    cases = [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"extra_body": {"guided_regex": "(("}}, "guided_regex"),
        ({"extra_body": {"guided_grammar": "root ::= "}}, "guided_grammar"),
        ({"extra_body": {"guided_choice": ["a"], "guided_regex": "b"}}, "guided_choice"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=5, **extra)
        assert e.value.body["param"] == param, (extra, e.value.body)


def test_guided_output_survives_preemption(stack, small_stack, tokenizer) -> None:
    """On the small stack (160 KV blocks) seven guided requests do not fit at once: some are
    preempted and recomputed, and their grammar state is rebuilt by replaying the tokens they
    had generated. Outputs equal the unpreempted run's and stay in the language."""
    from tests.helpers.stack import complete, stats, text_prompt_ids

    pattern = r"(\d\d, ){15}\d\d"  # about 50 tokens
    # 7 x 330 prompt tokens take 147 of the 160 blocks; their outputs need about 25 more
    prompts = [text_prompt_ids(tokenizer, 330, seed=400 + i) for i in range(7)]
    guided = {"extra_body": {"guided_regex": pattern}}
    with ThreadPoolExecutor(7) as ex:
        reference = list(ex.map(lambda p: complete(stack, p, 200, **guided), prompts))
    before = stats(small_stack)["num_preemptions"]
    with ThreadPoolExecutor(7) as ex:
        got = list(ex.map(lambda p: complete(small_stack, p, 200, **guided), prompts))
    assert stats(small_stack)["num_preemptions"] > before
    assert got == reference
    for text, _ in got:
        assert re.fullmatch(pattern, text), text
