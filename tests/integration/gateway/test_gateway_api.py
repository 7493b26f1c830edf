"""The gateway over a real nats-server and a real uvicorn server, with a small stand-in for the
pipeline (tokenizer + scheduler + detokenizer) on the same NATS: the official openai SDK for
the happy paths, raw httpx for errors, disconnects and health."""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import uvicorn

from kvflow.services.gateway.app import create_app
from kvflow.shared.config import Settings
from kvflow.shared.infra import free_port
from tests.helpers.gateway import MODEL, StandIn

pytestmark = pytest.mark.integration
TIMEOUT_S = 1.5  # the gateway's request_timeout in this module


@pytest.fixture(scope="module")
def stand_in(nats_url) -> Iterator[StandIn]:
    s = StandIn(nats_url)
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def base(nats_url, stand_in) -> Iterator[str]:
    port = free_port()
    settings = Settings.of(
        nats_url=nats_url, port=port, served_model_name=MODEL, request_timeout=TIMEOUT_S
    )
    config = uvicorn.Config(
        create_app(settings), host="127.0.0.1", port=port, log_level="warning", log_config=None
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "gateway did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def client(base) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=10)


def wait_abort(stand_in: StandIn, request_id: str, timeout: float = 1.0) -> None:
    """Within 1 s, so well before the request timeout (1.5 s) could have caused it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if stand_in.aborts.get(timeout=0.1) == request_id:
                return
        except queue.Empty:
            pass
    raise AssertionError(f"no Abort for {request_id}")


def sse_events(lines: Iterator[str]) -> Iterator[str]:
    for line in lines:
        if line.startswith("data: "):
            yield line[len("data: ") :]


def test_models(base) -> None:
    data = httpx.get(f"{base}/v1/models").json()["data"]
    assert [(m["id"], m["object"], m["owned_by"]) for m in data] == [(MODEL, "model", "kvflow")]


def test_models_retrieve_gives_one_card_or_a_404_naming_the_models(client, base) -> None:
    """The openai SDK's ``models.retrieve`` (GET /v1/models/{id}; ids may hold slashes)."""
    card = client.models.retrieve(MODEL)
    assert (card.id, card.object, card.owned_by) == (MODEL, "model", "kvflow")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("org/no-such-model")
    err = e.value.body
    assert err["type"] == "NotFoundError" and err["param"] == "model"
    assert f"`{MODEL}`" in err["message"] and "`org/no-such-model`" in err["message"]
    assert httpx.get(f"{base}/v1/models/org/no-such-model").status_code == 404


def test_streamed_chat_with_usage(client, stand_in) -> None:
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "s"}, {"role": "user", "content": "a b c"}],
        max_tokens=4,
        temperature=0.5,
        stop=["\n"],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "t0 t1 t2 t3 "
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and finishes.count("length") == 1
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (3, 4, 7)
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    sent = stand_in.requests[chunks[0].id]
    assert [m.role for m in sent.messages] == ["system", "user"]
    assert (sent.params.max_tokens, sent.params.temperature, sent.params.stop) == (4, 0.5, ["\n"])


def test_non_streamed_completion_with_usage(client, stand_in) -> None:
    out = client.completions.create(model=MODEL, prompt="one two", max_tokens=3, temperature=0)
    assert out.id.startswith("cmpl-") and out.object == "text_completion"
    assert out.choices[0].text == "t0 t1 t2 " and out.choices[0].finish_reason == "length"
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        2,
        3,
        5,
    )
    assert stand_in.requests[out.id].prompt == "one two"


def test_completion_defaults_and_streamed_completion(client, stand_in) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=[1, 2, 3], stream=True, stream_options={"include_usage": True}
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "".join(
        f"t{i} " for i in range(16)
    )
    assert chunks[-1].usage.completion_tokens == 16
    sent = stand_in.requests[chunks[0].id]
    assert sent.prompt_token_ids == [1, 2, 3] and sent.params.max_tokens == 16


def test_non_streamed_chat_with_content_parts(client, stand_in) -> None:
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": [{"type": "text", "text": "x y"}]}],
        max_completion_tokens=2,
    )
    assert out.choices[0].message.content == "t0 t1 " and out.choices[0].message.role == "assistant"
    assert out.usage.total_tokens == 4
    sent = stand_in.requests[out.id]
    assert sent.messages[0].content == "x y" and sent.params.max_tokens == 2


def test_concurrent_streams_get_their_own_deltas(client) -> None:
    def one(n: int) -> str:
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "q"}], max_tokens=n, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    with ThreadPoolExecutor(8) as ex:
        texts = list(ex.map(one, range(1, 9)))
    assert texts == ["".join(f"t{i} " for i in range(n)) for n in range(1, 9)]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": "not a list"}, "messages"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 17}, "n"),
    ],
)
def test_bad_values_are_400_naming_the_param(base, body, param) -> None:
    payload = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **body}
    r = httpx.post(f"{base}/v1/chat/completions", json=payload)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert (err["type"], err["param"], err["code"]) == ("BadRequestError", param, 400)


def test_invalid_json_is_400(base) -> None:
    r = httpx.post(
        f"{base}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_unknown_model_is_404(base, client) -> None:
    r = httpx.post(f"{base}/v1/completions", json={"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x")


def test_unknown_route_is_openai_shaped(base) -> None:
    r = httpx.get(f"{base}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "NotFoundError"


@pytest.mark.parametrize("stream", [False, True])
def test_request_error_is_relayed_with_its_status(base, client, stream) -> None:
    r = httpx.post(
        f"{base}/v1/chat/completions",
        json={
            "model": MODEL,
            "messages": [{"role": "user", "content": "[error429]"}],
            "stream": stream,
        },
    )
    assert r.status_code == 429 and r.headers["retry-after"]
    assert r.json()["error"] == {
        "message": "queue full",
        "type": "RateLimitError",
        "param": None,
        "code": 429,
    }
    with pytest.raises(openai.RateLimitError):
        client.completions.create(model=MODEL, prompt="[error429]", stream=stream)


def test_failure_after_stream_started_is_an_error_event(base) -> None:
    body = {"model": MODEL, "prompt": "[fail]", "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = list(sse_events(r.iter_lines()))
    assert json.loads(events[0])["choices"][0]["text"] == "t0 "
    assert json.loads(events[-2])["error"]["code"] == 500
    assert events[-1] == "[DONE]"
    r = httpx.post(f"{base}/v1/completions", json={**body, "stream": False})
    assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"


@pytest.mark.parametrize("prompt", ["[slow]", "[stall]"])
def test_client_disconnect_mid_stream_aborts(base, stand_in, prompt) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "stream": True}
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body) as r:
        events = sse_events(r.iter_lines())
        request_id = json.loads(next(events))["id"]  # the role chunk
        assert json.loads(next(events))["choices"][0]["delta"]["content"] == "t0 "
    wait_abort(stand_in, request_id)


def test_client_disconnect_before_the_answer_aborts(base, stand_in) -> None:
    body = {"model": MODEL, "prompt": "[slow]"}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{base}/v1/completions", json=body, timeout=0.3)
    (request_id,) = [
        rid
        for rid, r in stand_in.requests.items()
        if r.prompt == "[slow]" and rid.startswith("cmpl")
    ]
    wait_abort(stand_in, request_id)


def test_request_timeout_is_504_and_aborts(base, stand_in) -> None:
    started = time.monotonic()
    r = httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "[hang]"})
    elapsed = time.monotonic() - started
    assert r.status_code == 504 and r.json()["error"]["type"] == "TimeoutError"
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 1
    (request_id,) = [rid for rid, q in stand_in.requests.items() if q.prompt == "[hang]"]
    wait_abort(stand_in, request_id)


def test_health_and_stats_follow_the_scheduler(base, stand_in) -> None:
    stand_in.scheduler(False)
    r = httpx.get(f"{base}/health")
    assert r.status_code == 503 and "scheduler" in r.json()["error"]["message"]
    assert httpx.get(f"{base}/stats").status_code == 503
    stand_in.scheduler(True, num_workers=0)
    r = httpx.get(f"{base}/health")
    assert r.status_code == 503 and "workers" in r.json()["error"]["message"]
    stand_in.scheduler(True, num_workers=1)
    for service in ("tokenizer", "detokenizer"):  # each of them is needed to serve
        stand_in.pings(service, False)
        r = httpx.get(f"{base}/health")
        assert r.status_code == 503 and f"no {service} is ready" in r.json()["error"]["message"]
        stand_in.pings(service, True)
    r = httpx.get(f"{base}/health")
    assert r.status_code == 200 and r.json()["status"] == "ok" and r.json()["num_workers"] == 1
    stats = httpx.get(f"{base}/stats").json()
    assert stats["num_free_blocks"] == stats["num_total_blocks"] == 100
    assert stats["gateway_open_requests"] == 0  # every finished/aborted request was released
    assert httpx.get(f"{base}/v1/models").json()["data"][0]["max_model_len"] == 2048
