"""The API's other endpoints and its guards on the real stack: /tokenize, /detokenize, /models,
/version; client disconnects (streamed and not) freeing KV blocks; request deadlines ending with
an error; body size limits; API keys (401) and per-key rate limits (429) with the stack's own
Redis."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.helpers.faults import kvflow_keys
from tests.helpers.stack import GUARDED_KEY, wait_all_blocks_free

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
AUTH = {"Authorization": f"Bearer {GUARDED_KEY}"}


def stats(base: str) -> dict:
    return httpx.get(f"{base}/stats", timeout=10).json()


def test_tokenize_detokenize_models_version(stack, tokenizer) -> None:
    r = httpx.post(
        f"{stack}/tokenize",
        json={"model": MODEL, "prompt": "Hello world", "return_token_strs": True},
        timeout=30,
    ).json()
    ids = tokenizer("Hello world")["input_ids"]
    assert r == {
        "count": len(ids),
        "max_model_len": 2048,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids),
    }
    back = httpx.post(f"{stack}/detokenize", json={"model": MODEL, "tokens": ids}, timeout=30)
    assert back.json() == {"prompt": "Hello world"}
    bad = httpx.post(f"{stack}/detokenize", json={"tokens": [1, 10**9]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    other = httpx.post(f"{stack}/tokenize", json={"model": "gpt-4", "prompt": "x"}, timeout=30)
    assert other.status_code == 404 and other.json()["error"]["param"] == "model"
    [card] = httpx.get(f"{stack}/v1/models", timeout=10).json()["data"]
    assert (card["id"], card["object"], card["owned_by"], card["max_model_len"]) == (
        MODEL,
        "model",
        "kvflow",
        2048,
    )
    assert httpx.get(f"{stack}/version", timeout=10).json()["version"]


def test_a_prompt_over_the_bus_limit_is_refused_by_kvflow_not_by_nats(stack, client) -> None:
    """A 2 MB prompt (NATS's max_payload is 1 MiB) travels the bus as a large message and is
    refused for what it is: longer than the model's context (400), not a bus error (503); the
    same prompt as token ids too. Before shared/large_messages.py: 503 'maximum payload
    exceeded', which the openai SDK retries."""
    prompt = "hello " * 350_000  # 2.1 MB
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    assert "2048" in e.value.body["message"] and "context" in e.value.body["message"], e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt=[1000] * 300_000, max_tokens=4)
    assert "2048" in e.value.body["message"], e.value.body
    # 10 MB, under the 16 MiB --max-body-bytes: refused for its length too, never a bus error
    big = httpx.post(
        f"{stack}/v1/completions",
        json={"model": MODEL, "prompt": "hello " * 1_700_000, "max_tokens": 4},
        timeout=300,
    )
    assert big.status_code in (400, 413) and "2048" in big.json()["error"]["message"], big.text
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2)  # the stack goes on
    assert r.usage.completion_tokens == 2


def test_disconnect_mid_stream_frees_the_blocks(stack) -> None:
    before = stats(stack)
    body = {
        "model": MODEL,
        "prompt": "Tell me a very long story.",
        "max_tokens": 1500,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", f"{stack}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break  # leaving the block closes the connection mid-stream
    after = wait_all_blocks_free(stack)
    assert after["num_free_blocks"] == after["num_total_blocks"]
    assert after["num_running"] == 0 and after["gateway_open_requests"] == 0
    assert after["gateway_aborts"] == before["gateway_aborts"] + 1
    # the sequence stopped early: far fewer tokens computed than its 1,500-token budget
    assert after["num_computed_tokens"] - before["num_computed_tokens"] < 500


def test_disconnect_before_a_plain_answer_frees_the_blocks(stack) -> None:
    before = stats(stack)
    body = {"model": MODEL, "prompt": "Write an essay.", "max_tokens": 1500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):  # the client gives up and closes the connection
        httpx.post(f"{stack}/v1/completions", json=body, timeout=httpx.Timeout(60, read=2))
    after = wait_all_blocks_free(stack, timeout=20)
    assert after["num_free_blocks"] == after["num_total_blocks"] and after["num_running"] == 0
    assert after["gateway_aborts"] == before["gateway_aborts"] + 1
    assert after["num_computed_tokens"] - before["num_computed_tokens"] < 1000


def test_deadline_ends_streams_and_plain_requests_with_an_error(guarded_stack) -> None:
    base, _ = guarded_stack  # --request-timeout 5
    body = {
        "model": MODEL,
        "prompt": "Count to a million:",
        "max_tokens": 1900,
        "ignore_eos": True,
    }
    with httpx.stream(
        "POST", f"{base}/v1/completions", json={**body, "stream": True}, headers=AUTH, timeout=60
    ) as r:
        assert r.status_code == 200
        data = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    err = json.loads(data[-2])["error"]
    assert (err["type"], err["code"]) == ("TimeoutError", 504) and "timed out" in err["message"]
    assert all("choices" in json.loads(d) for d in data[:-2])  # text chunks until then
    plain = httpx.post(f"{base}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert plain.status_code == 504 and plain.json()["error"]["type"] == "TimeoutError"
    after = wait_all_blocks_free(base, timeout=20)
    assert after["num_free_blocks"] == after["num_total_blocks"] and after["num_running"] == 0


def test_body_limits(guarded_stack) -> None:
    base, _ = guarded_stack  # --max-body-bytes 65536
    big = {"model": MODEL, "prompt": "x" * 70_000, "max_tokens": 1}
    r = httpx.post(f"{base}/v1/completions", json=big, headers=AUTH, timeout=30)
    assert r.status_code == 413
    assert set(r.json()["error"]) == {"message", "type", "param", "code"}

    def chunks():  # no Content-Length: counted while it arrives
        yield b'{"prompt": "'
        for _ in range(20):
            yield b"y" * 5000
        yield b'"}'

    r = httpx.post(f"{base}/v1/completions", content=chunks(), headers=AUTH, timeout=30)
    assert r.status_code == 413 and "65536" in r.json()["error"]["message"]


def test_api_keys_401_and_rate_limits_429(guarded_stack) -> None:
    base, redis_url = guarded_stack
    kw = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    anon = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as e:
        anon.completions.create(**kw)
    assert e.value.status_code == 401 and e.value.body["type"] == "AuthenticationError"
    r = httpx.post(f"{base}/v1/chat/completions", json={"messages": []}, timeout=10)
    assert r.status_code == 401  # no key: refused before the body is even read
    for path in ("/health", "/metrics", "/version"):
        assert httpx.get(f"{base}{path}", timeout=10).status_code == 200, path
    static = openai.OpenAI(base_url=f"{base}/v1", api_key=GUARDED_KEY, max_retries=0)
    assert static.completions.create(**kw).choices
    key = kvflow_keys("guarded", redis_url, "add", "e2e-user", "--rpm", "2", "--tpm", "100000")
    user = openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0)
    codes = []
    for _ in range(5):
        try:
            user.completions.create(**kw)
            codes.append(200)
        except openai.RateLimitError as err:
            codes.append(429)
            limited = err
    # 2 per one-minute window (a new window may begin in between: at most two more)
    assert codes[:2] == [200, 200] and 429 in codes and codes.count(200) <= 4, codes
    assert limited.body["type"] == "RateLimitError"
    assert 1 <= int(limited.response.headers["retry-after"]) <= 60
    listing = kvflow_keys("guarded", redis_url, "list").splitlines()
    row = next(line.split() for line in listing if line.startswith("e2e-user"))
    assert row[1:4] == ["2", "100000", str(codes.count(200))]  # rpm, tpm, requests served
