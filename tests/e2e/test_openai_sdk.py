"""The official openai SDK against a stack started like `kvflow serve`."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers.stack import wait_all_blocks_free

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"


def test_models_lists_the_served_model(client) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_streamed_chat_completion(client, stack) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Name three colors."}],
        max_tokens=24,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [
        c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
    ]
    assert text.strip(), "the stream carried text"
    assert finishes in (["length"], ["stop"])
    usage = chunks[-1].usage
    assert usage is not None and usage.completion_tokens <= 24 and usage.prompt_tokens > 10
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    if finishes == ["length"]:
        assert usage.completion_tokens == 24
    assert (
        wait_all_blocks_free(stack)["num_free_blocks"]
        == wait_all_blocks_free(stack)["num_total_blocks"]
    )


def test_non_streamed_completion(client) -> None:
    out = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert out.choices[0].text
    assert out.choices[0].finish_reason in ("length", "stop")
    assert out.usage.prompt_tokens == 5
    assert out.usage.completion_tokens <= 8


def test_eight_concurrent_streams_finish_with_usage(client, stack) -> None:
    def one(i: int):
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Count from {i} to {i + 10}."}],
            max_tokens=10 + i,
            temperature=0.7,
            top_p=0.9,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = list(stream)
        fin = [
            c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason
        ]
        return i, fin, chunks[-1].usage

    with ThreadPoolExecutor(8) as ex:
        results = list(ex.map(one, range(8)))
    for i, fin, usage in results:
        assert len(fin) == 1 and fin[0] in ("length", "stop")
        assert usage is not None and 1 <= usage.completion_tokens <= 10 + i
        if fin[0] == "length":
            assert usage.completion_tokens == 10 + i
    stats = wait_all_blocks_free(stack)
    assert stats["num_free_blocks"] == stats["num_total_blocks"] > 0


def test_stop_string_ends_the_text(client) -> None:
    base = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0
    )
    text = base.choices[0].text
    assert len(text) > 4
    stop = text[2:4]
    out = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0, stop=[stop]
    )
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[: text.index(stop)]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": MODEL, "messages": "not a list"}, 400, "messages"),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "temperature": -1},
            400,
            "temperature",
        ),
        (
            {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"},
            400,
            "max_tokens",
        ),
        ({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}, 404, None),
        ({"model": MODEL, "messages": [{"role": "user", "content": "word " * 3000}]}, 400, None),
    ],
)
def test_bad_requests_get_openai_errors(stack, body, status, param) -> None:
    r = httpx.post(f"{stack}/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param


def test_invalid_json_then_still_serving(stack, client) -> None:
    r = httpx.post(
        f"{stack}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 400 and r.json()["error"]["message"]
    out = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    assert out.usage.completion_tokens >= 1


def test_completion_logprobs_shape_and_greedy_consistency(client) -> None:
    out = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset[0] == 0 and lp.text_offset[1] == len(lp.tokens[0])
    for tok, tok_lp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3 and tok_lp <= 0
        best = max(top.values())
        assert tok_lp == pytest.approx(best)  # greedy picks the most likely token
        assert top[tok] == pytest.approx(tok_lp)


def test_chat_logprobs_stream_and_logit_bias(client, tokenizer) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say yes."}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        stream=True,
    )
    entries = [
        e
        for c in stream
        if c.choices and c.choices[0].logprobs
        for e in c.choices[0].logprobs.content
    ]
    assert len(entries) == 4
    assert all(len(e.top_logprobs) == 2 and e.bytes == list(e.token.encode()) for e in entries)
    # a +100 bias on one token makes greedy output nothing else
    target = tokenizer(" banana")["input_ids"]
    assert len(target) == 1
    out = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logit_bias={str(target[0]): 100}
    )
    assert out.choices[0].text == " banana" * 3
    r = httpx.post(
        f"{client.base_url}completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 2, "logit_bias": {"999999": 5}},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"


def test_metrics_use_vllm_names(client, stack) -> None:
    client.completions.create(model=MODEL, prompt="Hello there", max_tokens=3, temperature=0)
    text = httpx.get(f"{stack}/metrics", timeout=10).text
    for name in (
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:num_preemptions_total",
    ):
        assert f"\n{name}{{" in text, name
    count = [
        ln for ln in text.splitlines() if ln.startswith("vllm:e2e_request_latency_seconds_count")
    ]
    assert float(count[0].split()[-1]) >= 1
    assert 'finished_reason="length"' in text
