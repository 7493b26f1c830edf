"""Embeddings at the edges, offline: the gateway's body -> pipeline requests for every input
form and its 400s naming the field, float and base64 encodings of the worker's float32 bytes,
the route through the app with an in-memory bus (the vectors, usage, metrics, errors), the
tokenizer's length rule and the detokenizer passing a vector on as the final delta."""

from __future__ import annotations

import asyncio
import base64
import struct
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvflow.services.detokenizer.service import DetokenizerService
from kvflow.services.gateway.app import create_app
from kvflow.services.gateway.errors import APIError
from kvflow.services.gateway.routes.embeddings import (
    EmbeddingRequest,
    embedding_inputs,
    embedding_item,
    embedding_requests,
)
from kvflow.services.tokenizer.prompts import PromptError
from kvflow.services.tokenizer.service import check_embedding_length
from kvflow.shared.config import Settings
from kvflow.shared.messages import (
    Delta,
    DeltaBatch,
    GenerateRequest,
    PooledOutput,
    PoolingParams,
    RequestError,
    SamplingParams,
    StepResult,
    TokenizedRequest,
)
from tests.helpers.gateway import FakeBus

VEC = struct.pack("<3f", 0.6, 0.0, -0.8)


def body(**kw: Any) -> EmbeddingRequest:
    return EmbeddingRequest.model_validate(kw)


@pytest.mark.parametrize(
    "inp, want",
    [
        ("hello", [("hello", None)]),
        (["a", "b c"], [("a", None), ("b c", None)]),
        ([1, 2, 3], [(None, [1, 2, 3])]),
        ([[1], [2, 3]], [(None, [1]), (None, [2, 3])]),
    ],
)
def test_every_input_form(inp: Any, want: list) -> None:
    assert embedding_inputs(body(input=inp)) == want


@pytest.mark.parametrize(
    "inp", ["", [], [""], ["a", ""], [[]], [[1], []], [-1], [[2**31]], [[0, 2**40]]]
)
def test_bad_inputs_are_400s_naming_input(inp: Any) -> None:
    with pytest.raises(APIError) as e:
        embedding_inputs(body(input=inp))
    assert e.value.status == 400 and e.value.param == "input"


def test_requests_carry_the_pooling_and_refuse_dimensions() -> None:
    settings = Settings.of(pooling_type="MEAN", max_request_sequences=3)
    gens = embedding_requests(body(input=["a", "b"]), "embd-1", "inbox", settings, "salt")
    assert [g.request_id for g in gens] == ["embd-1-0", "embd-1-1"]
    assert [g.prompt for g in gens] == ["a", "b"]
    assert all(g.pooling == PoolingParams("MEAN", True) and g.cache_salt == "salt" for g in gens)
    off = embedding_requests(body(input="a", normalize=False), "x", "i", settings, None)
    assert off[0].pooling == PoolingParams("MEAN", False)
    kept = embedding_requests(
        body(input=[5, 6], truncate_prompt_tokens=1), "x", "i", settings, None
    )
    assert kept[0].truncate_prompt_tokens == 1 and kept[0].prompt_token_ids == [5, 6]
    for kw, param in [
        ({"input": "a", "dimensions": 576}, "dimensions"),
        ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"input": "a", "truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
        ({"input": ["a"] * 4}, "input"),  # over --max-request-sequences
    ]:
        with pytest.raises(APIError) as e:
            embedding_requests(body(**kw), "x", "i", settings, None)
        assert e.value.status == 400 and e.value.param == param


def test_float_and_base64_are_the_same_float32_values() -> None:
    d = Delta("r", "", finish_reason="stop", prompt_tokens=2, embedding=VEC)
    floats = embedding_item(d, 4, "float")
    assert floats["index"] == 4 and floats["object"] == "embedding"
    assert floats["embedding"] == list(struct.unpack("<3f", VEC))
    b64 = embedding_item(d, 0, "base64")["embedding"]
    assert base64.b64decode(b64) == VEC  # what the openai SDK decodes with numpy '<f4'


class EmbeddingBus(FakeBus):
    """Answers each GenerateRequest with a vector (or a 400 for the prompt "too long")."""

    async def publish(self, subject: str, msg: Any, headers: Any = None) -> None:
        self.published.append((subject, msg))
        if not isinstance(msg, GenerateRequest):
            return
        if msg.prompt == "too long":
            reply: Any = RequestError(msg.request_id, "too long", "BadRequestError", "input")
        else:
            n = len(msg.prompt or "") or len(msg.prompt_token_ids or [])
            reply = DeltaBatch([Delta(msg.request_id, "", 0, "stop", n, embedding=VEC)])
        loop = asyncio.get_running_loop()
        loop.call_soon(lambda: asyncio.ensure_future(self.handlers[msg.reply_to](reply, None)))


def test_the_route_answers_in_openai_shape_and_counts_metrics() -> None:
    bus = EmbeddingBus()
    with TestClient(create_app(Settings.of(api_key="k"), bus)) as http:
        auth = {"Authorization": "Bearer k"}
        assert http.post("/v1/embeddings", json={"input": "x"}).status_code == 401
        r = http.post("/v1/embeddings", json={"input": ["ab", "cde"]}, headers=auth)
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["object"] == "list" and out["model"] == "SmolLM2-135M-Instruct"
        assert [e["index"] for e in out["data"]] == [0, 1]
        assert out["data"][1]["embedding"] == pytest.approx([0.6, 0.0, -0.8])
        assert out["usage"] == {"prompt_tokens": 5, "total_tokens": 5}
        r = http.post(
            "/v1/embeddings", json={"input": [[1, 2]], "encoding_format": "base64"}, headers=auth
        )
        assert base64.b64decode(r.json()["data"][0]["embedding"]) == VEC
        r = http.post("/v1/embeddings", json={"input": ["a", "too long"]}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "input"
        r = http.post("/v1/embeddings", json={"input": "a", "model": "other"}, headers=auth)
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        r = http.post("/v1/embeddings", json={"input": "a", "encoding_format": "f"}, headers=auth)
        assert r.status_code == 400 and r.json()["error"]["param"] == "encoding_format"
        metrics = http.get("/metrics?scope=local").text
    assert 'vllm:request_success_total{finished_reason="stop",model_name=' in metrics
    success = [ln for ln in metrics.splitlines() if ln.startswith("vllm:request_success_total")]
    assert sum(float(ln.rsplit(" ", 1)[1]) for ln in success) == 4  # three vectors + "a" of 400
    prompt = [ln for ln in metrics.splitlines() if ln.startswith("vllm:prompt_tokens_total")]
    assert float(prompt[0].rsplit(" ", 1)[1]) == 5 + 2 + 1
    aborts = [m.request_id for _, m in bus.published if type(m).__name__ == "Abort"]
    assert len(aborts) == 1 and aborts[0].endswith("-1")  # the refused one, not its sibling


def test_an_input_may_fill_the_context_but_not_more() -> None:
    p = SamplingParams(max_tokens=1)
    assert check_embedding_length([1] * 8, p, 8) is p
    for ids in ([], [1] * 9):
        with pytest.raises(PromptError) as e:
            check_embedding_length(ids, p, 8)
        assert e.value.param == "input"


class _Bus:
    def __init__(self) -> None:
        self.published: list[tuple[str, Any]] = []

    async def publish(self, subject: str, msg: Any, headers: Any = None) -> None:
        self.published.append((subject, msg))


def test_detokenizer_passes_the_vector_on_once_even_before_registration(tokenizer) -> None:
    svc = DetokenizerService(Settings(), tokenizer)
    svc.bus = _Bus()  # type: ignore[assignment]
    pooling = PoolingParams("LAST")
    early = TokenizedRequest("e1", "inbox.1", [1, 2, 3], SamplingParams(), pooling=pooling)
    late = TokenizedRequest("e2", "inbox.2", [4, 5], SamplingParams(), pooling=pooling)

    async def go() -> None:
        await svc._register(late)
        vectors = [PooledOutput("e1", VEC, 3), PooledOutput("e2", VEC, 3)]
        await svc._on_result(StepResult("w", 1, [], [], [], embeddings=vectors))
        await svc._register(early)  # its vector came first (a race on the bus)
        again = StepResult("w", 2, [], [], [], embeddings=[PooledOutput("e2", VEC, 3)])
        await svc._on_result(again)  # a re-run step's vector: not sent twice

    asyncio.run(go())
    sent = [(s, d) for s, b in svc.bus.published if isinstance(b, DeltaBatch) for d in b.deltas]
    assert [(s, d.request_id, d.prompt_tokens, d.finish_reason) for s, d in sent] == [
        ("inbox.2", "e2", 2, "stop"),
        ("inbox.1", "e1", 3, "stop"),
    ]
    assert all(d.embedding == VEC and d.text == "" for _, d in sent)
    assert svc.embeds == {} and svc.early_embeds == {} and svc.states == {}
