"""The gateway's pooling routes offline: /score's pairing rules and 400s, the pipeline requests
a cross-encoder and an embedding model get (text pairs; distinct texts embedded once and
scored by cosine), /rerank's order, top_n and documents, /classify's labels, the 400 a route
gets from a model served for another task, the tokenizer's ModelInfo asked once, and the
routes through the app with an in-memory bus (answers matching the documented schemas)."""

from __future__ import annotations

import asyncio
import math
import struct
from typing import Any

import pytest
from fastapi.testclient import TestClient

from kvflow.services.gateway.app import create_app
from kvflow.services.gateway.errors import APIError
from kvflow.services.gateway.routes.classify import (
    ClassificationRequest,
    classification_inputs,
    classification_item,
    classification_requests,
)
from kvflow.services.gateway.routes.common import check_task
from kvflow.services.gateway.routes.embeddings import EmbeddingRequest, embedding_requests
from kvflow.services.gateway.routes.pooling import PoolingInput
from kvflow.services.gateway.routes.score import (
    RerankRequest,
    ScoreRequest,
    cosine,
    pair_scoring,
    rerank_pairs,
    rerank_response,
    score_pairs,
)
from kvflow.services.gateway.schemas import ClassificationResponse, RerankResponse, ScoreResponse
from kvflow.services.gateway.state import GatewayState
from kvflow.shared.config import Settings
from kvflow.shared.messages import (
    Delta,
    DeltaBatch,
    GenerateRequest,
    ModelInfo,
    ModelInfoRequest,
    PoolingParams,
)
from tests.helpers.gateway import FakeBus

SETTINGS = Settings.of(max_request_sequences=4)


def f32(*values: float) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def delta(*values: float, tokens: int = 3) -> Delta:
    return Delta("r", "", 0, "stop", tokens, embedding=f32(*values))


def bad_param(fn: Any, *args: Any) -> str | None:
    with pytest.raises(APIError) as e:
        fn(*args)
    assert e.value.status == 400 and e.value.type == "BadRequestError"
    return e.value.param


# /score's pairs


@pytest.mark.parametrize(
    "t1, t2, want",
    [
        ("q", "d", [("q", "d")]),
        ("q", ["a", "b"], [("q", "a"), ("q", "b")]),
        (["q"], ["a", "b"], [("q", "a"), ("q", "b")]),
        (["x", "y"], ["a", "b"], [("x", "a"), ("y", "b")]),
        (["x"], "a", [("x", "a")]),
    ],
)
def test_pairs_are_1_to_1_1_to_n_or_n_to_n(t1: Any, t2: Any, want: list) -> None:
    assert score_pairs(t1, t2) == want


@pytest.mark.parametrize(
    "t1, t2, param",
    [
        ([], "a", "text_1"),
        ("q", [], "text_2"),
        (["x", "y"], ["a"], "text_2"),
        (["x", "y"], "a", "text_2"),
    ],
)
def test_other_pairings_are_400s_naming_the_field(t1: Any, t2: Any, param: str) -> None:
    assert bad_param(score_pairs, t1, t2) == param


def test_score_body_reads_vllms_newer_names_and_rerank_needs_documents() -> None:
    req = ScoreRequest.model_validate({"queries": "q", "documents": ["a"], "extra": 1})
    assert (req.text_1, req.text_2) == ("q", ["a"])
    rerank = RerankRequest.model_validate({"query": "q", "documents": ["a", "b"]})
    assert rerank_pairs(rerank) == [("q", "a"), ("q", "b")]
    assert (rerank.top_n, rerank.return_documents) == (0, True)
    empty = RerankRequest.model_validate({"query": "q", "documents": []})
    assert bad_param(rerank_pairs, empty) == "documents"


# scoring by a cross-encoder or by the cosine of embeddings


def score(served: str, pairs: list[tuple[str, str]], param: str = "text_2") -> Any:
    return pair_scoring(served, "/score", pairs, "s-1", "inbox", SETTINGS, "salt", 5, param)


def test_a_cross_encoder_reads_each_pair_as_one_input() -> None:
    scoring = score("score", [("q", "a"), ("q", "b")])
    gens = scoring.requests
    assert [g.request_id for g in gens] == ["s-1-0", "s-1-1"]
    assert [(g.prompt, g.prompt_pair) for g in gens] == [("q", "a"), ("q", "b")]
    assert all(g.pooling == PoolingParams("", task="score") for g in gens)
    assert all(g.truncate_prompt_tokens == 5 and g.cache_salt == "salt" for g in gens)
    assert all(g.params.max_tokens == 1 and g.reply_to == "inbox" for g in gens)
    assert scoring.scores([delta(0.25), delta(0.75)]) == [0.25, 0.75]


def test_an_embedding_model_embeds_each_text_once_and_scores_by_cosine() -> None:
    scoring = score("embed", [("q", "a"), ("q", "b"), ("a", "a")])
    gens = scoring.requests
    assert [(g.prompt, g.prompt_pair) for g in gens] == [("q", None), ("a", None), ("b", None)]
    assert all(g.pooling == PoolingParams("", True, task="embed") for g in gens)
    vectors = [delta(1.0, 0.0), delta(0.6, 0.8), delta(0.0, -2.0)]
    got = scoring.scores(vectors)
    assert got == pytest.approx([0.6, 0.0, 1.0])
    assert cosine([0.0, 0.0], [1.0, 0.0]) == 0.0
    assert cosine([3.0, 4.0], [4.0, 3.0]) == pytest.approx(24 / 25)


def test_the_sequence_limit_counts_pipeline_requests() -> None:
    four = [("q", d) for d in "abcd"]
    assert len(score("score", four).requests) == 4  # one per pair
    assert bad_param(score, "embed", four, "documents") == "documents"  # q + 4 texts
    assert len(score("embed", [("q", d) for d in "abc"]).requests) == 4
    assert len(score("embed", [("q", "a")] * 9).requests) == 2  # repeats embedded once


@pytest.mark.parametrize("served", ["generate", "classify"])
def test_score_on_another_task_is_a_400_naming_it(served: str) -> None:
    with pytest.raises(APIError) as e:
        score(served, [("q", "a")])
    assert e.value.status == 400 and f"--task {served}" in e.value.message
    assert "/score" in e.value.message and "score or embed" in e.value.message


# /rerank's answer


def test_rerank_orders_by_score_with_ties_in_request_order() -> None:
    docs = ["a", "b", "c", "d"]
    out = rerank_response("rerank-1", "m", docs, [0.1, 0.9, 0.5, 0.9], 12)
    assert [r["index"] for r in out["results"]] == [1, 3, 2, 0]
    assert out["results"][0] == {"index": 1, "document": {"text": "b"}, "relevance_score": 0.9}
    assert out["usage"] == {"total_tokens": 12} and out["id"] == "rerank-1"
    top = rerank_response("r", "m", docs, [0.1, 0.9, 0.5, 0.9], 12, top_n=2)
    assert [r["index"] for r in top["results"]] == [1, 3]
    bare = rerank_response("r", "m", docs, [0.1, 0.9, 0.5, 0.9], 12, -1, False)
    assert len(bare["results"]) == 4 and all("document" not in r for r in bare["results"])
    RerankResponse.model_validate(out)
    RerankResponse.model_validate(bare)


# /classify


def test_classify_names_the_most_probable_class() -> None:
    item = classification_item([0.2, 0.7, 0.1], 3, ["neg", "pos", "neutral"])
    assert item == {
        "index": 3,
        "label": "pos",
        "probs": [0.2, 0.7, 0.1],
        "num_classes": 3,
        "object": "classification",
    }
    assert classification_item([0.1, 0.9], 0, [])["label"] == "LABEL_1"


def test_classify_requests_and_their_task() -> None:
    req = ClassificationRequest.model_validate({"input": ["a", "b"]})
    inputs = classification_inputs(req)
    assert inputs == [PoolingInput("a"), PoolingInput("b")]
    for served in ("classify", "score"):
        gens = classification_requests(served, "/classify", inputs, None, "c", "i", SETTINGS, None)
        assert [g.pooling for g in gens] == [PoolingParams("", task="classify")] * 2
    for served in ("embed", "generate"):
        with pytest.raises(APIError) as e:
            classification_requests(served, "/classify", inputs, None, "c", "i", SETTINGS, None)
        assert e.value.status == 400 and f"--task {served}" in e.value.message
    many = ClassificationRequest.model_validate({"input": ["x"] * 5})
    with pytest.raises(APIError) as e:
        classification_requests(
            "classify", "/classify", classification_inputs(many), None, "c", "i", SETTINGS, None
        )
    assert e.value.param == "input"
    empty = ClassificationRequest.model_validate({"input": []})
    assert bad_param(classification_inputs, empty) == "input"


# task gating and ModelInfo


def test_embeddings_send_task_embed_and_routes_check_the_served_task() -> None:
    gens = embedding_requests(EmbeddingRequest(input="a"), "e", "i", SETTINGS, None)
    assert gens[0].pooling is not None and gens[0].pooling.task == "embed"
    check_task("generate", "embed", "/v1/embeddings")  # a decoder's pooled states
    check_task("embed", "embed", "/v1/embeddings")
    with pytest.raises(APIError) as e:
        check_task("embed", "generate", "/v1/chat/completions")
    assert e.value.status == 400 and "--task embed" in e.value.message
    assert "/v1/chat/completions" in e.value.message


class InfoBus(FakeBus):
    """Answers ModelInfoRequest with ``info`` (None: no tokenizer answers); GenerateRequests
    with a pooled output fitting their task: a vector from the text, probabilities, a score."""

    def __init__(self, info: ModelInfo | None) -> None:
        super().__init__()
        self.info = info
        self.asked = 0

    async def request(self, subject: str, msg: Any, timeout: float = 2.0) -> Any:
        if isinstance(msg, ModelInfoRequest) and self.info is not None:
            self.asked += 1
            return self.info
        raise TimeoutError("nats: timeout")

    async def publish(self, subject: str, msg: Any, headers: Any = None) -> None:
        self.published.append((subject, msg))
        if not isinstance(msg, GenerateRequest) or msg.pooling is None:
            return await super().publish(subject, msg, headers)
        text = msg.prompt or ""
        if msg.pooling.task == "score":
            out = f32(len(text + (msg.prompt_pair or "")) / 10)
        elif msg.pooling.task == "classify":
            out = f32(0.25, 0.75)
        else:
            out = f32(float(len(text)), 1.0)
        reply = DeltaBatch([Delta(msg.request_id, "", 0, "stop", len(text), embedding=out)])
        loop = asyncio.get_running_loop()
        loop.call_soon(lambda: asyncio.ensure_future(self.handlers[msg.reply_to](reply, None)))


def test_model_info_is_asked_once_and_served_task_falls_back() -> None:
    async def go() -> None:
        bus = InfoBus(ModelInfo("score", 512, ["yes"]))
        state = GatewayState(Settings(), bus)  # type: ignore[arg-type]
        assert (await state.model_info()).labels == ["yes"]
        assert await state.served_task() == "score"
        assert bus.asked == 1
        silent = GatewayState(Settings(), InfoBus(None))  # type: ignore[arg-type]
        assert await silent.served_task() is None  # the tokenizer checks the task itself
        with pytest.raises(APIError) as e:
            await silent.model_info()
        assert e.value.status == 503
        told = GatewayState(Settings.of(task="embed"), InfoBus(None))  # type: ignore[arg-type]
        assert await told.served_task() == "embed"

    asyncio.run(go())


def serve(info: ModelInfo) -> tuple[TestClient, InfoBus]:
    bus = InfoBus(info)
    return TestClient(create_app(Settings.of(served_model_name="m"), bus)), bus


def test_a_cross_encoders_routes_answer_in_vllms_shapes() -> None:
    http, bus = serve(ModelInfo("score", 512, ["class-0"]))
    with http:
        r = http.post("/v1/score", json={"model": "m", "text_1": "q", "text_2": ["ab", "abcd"]})
        assert r.status_code == 200, r.text
        out = ScoreResponse.model_validate(r.json())
        assert [d.score for d in out.data] == pytest.approx([0.3, 0.5])
        assert out.usage.prompt_tokens == 2 and out.id.startswith("score-")
        body = {"query": "q", "documents": ["ab", "abcd", "a"], "top_n": 2}
        r = http.post("/v2/rerank", json=body)
        assert r.status_code == 200, r.text
        ranked = RerankResponse.model_validate(r.json())
        assert [x.index for x in ranked.results] == [1, 0]
        r = http.post("/classify", json={"input": ["a", "b"]})
        assert r.status_code == 200, r.text
        classes = ClassificationResponse.model_validate(r.json())
        assert [d.label for d in classes.data] == ["LABEL_1", "LABEL_1"]  # one name for two
        r = http.post("/v1/embeddings", json={"input": "a"})
        assert r.status_code == 400 and "--task score" in r.json()["error"]["message"]
        r = http.post("/v1/completions", json={"prompt": "a"})
        assert r.status_code == 400 and "--task score" in r.json()["error"]["message"]
        r = http.post("/score", json={"text_1": ["a", "b"], "text_2": ["c"]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "text_2"
    assert bus.asked == 1


def test_an_embedding_models_scores_are_cosines_and_other_routes_400() -> None:
    http, _ = serve(ModelInfo("embed", 512))
    with http:
        r = http.post("/score", json={"text_1": "abc", "text_2": ["abc", "", "a"]})
        assert r.status_code == 200, r.text
        norm = math.hypot(3.0, 1.0) * math.hypot(1.0, 1.0)
        want = [1.0, 1 / math.hypot(3.0, 1.0), 4.0 / norm]
        assert [d["score"] for d in r.json()["data"]] == pytest.approx(want)
        r = http.post("/v1/rerank", json={"query": "abc", "documents": ["a", "abc"]})
        results = r.json()["results"]
        assert [x["index"] for x in results] == [1, 0] and results[0]["document"]["text"] == "abc"
        for path, body in [
            ("/v1/classify", {"input": "a"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/responses", {"input": "hi"}),
        ]:
            r = http.post(path, json=body)
            assert r.status_code == 400 and "--task embed" in r.json()["error"]["message"], path
        assert http.post("/v1/embeddings", json={"input": "a"}).status_code == 200


def test_a_decoder_serves_embeddings_but_not_scores() -> None:
    http, _ = serve(ModelInfo("generate", 512))
    with http:
        assert http.post("/v1/embeddings", json={"input": "a"}).status_code == 200
        r = http.post("/v1/score", json={"text_1": "a", "text_2": "b"})
        assert r.status_code == 400 and "--task generate" in r.json()["error"]["message"]
        r = http.post("/rerank", json={"query": "a", "documents": []})
        assert r.status_code == 400 and r.json()["error"]["param"] == "documents"
        assert http.post("/v1/completions", json={"prompt": "a"}).status_code == 200
