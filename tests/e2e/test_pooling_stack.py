"""Pooling models served by `kvflow serve` as a user runs them: sentence-transformers'
all-MiniLM-L6-v2 (from its PyPI package) through the official openai SDK's embeddings call,
equal to sentence-transformers' ``encode`` alone and 256 inputs in one call, /v1/score and
/v1/rerank as cosine similarities of its embeddings; a tiny random BERT cross-encoder made by
transformers here, whose /score, /rerank and /classify over plain HTTP equal transformers'
sigmoid of its logit; and the 400s a request for a task the model is not served for gets."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from tests.helpers.pooling import QUERY, TEXTS, minilm_dir, tiny
from tests.helpers.stack import openai_client, running_stack, wait_all_blocks_free

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return minilm_dir(tmp_path_factory.mktemp("minilm"))


@pytest.fixture(scope="module")
def minilm_stack(minilm: Path):
    with running_stack("minilm", "--model", str(minilm)) as base:
        yield base


@pytest.fixture(scope="module")
def cross_encoder(minilm: Path, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("cross-encoder")
    model = tiny("bert", minilm, path, labels=1)
    return path, model


@pytest.fixture(scope="module")
def cross_stack(cross_encoder):
    path, _ = cross_encoder
    with running_stack("cross-encoder", "--model", str(path)) as base:
        yield base


def st_vectors(path: Path, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(path), device="cpu").encode(texts, convert_to_tensor=True)


def test_openai_sdk_embeddings_equal_sentence_transformers(minilm, minilm_stack) -> None:
    client = openai_client(minilm_stack)
    out = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS)
    assert out.model == "all-MiniLM-L6-v2" and len(out.data) == len(TEXTS)
    ref = st_vectors(minilm, TEXTS)
    for d, r in zip(out.data, ref, strict=True):
        got = torch.tensor(d.embedding)
        assert len(d.embedding) == 384
        assert torch.cosine_similarity(got, r.float(), dim=0) >= 0.99999
    wait_all_blocks_free(minilm_stack)


def test_256_inputs_in_one_call(minilm, minilm_stack) -> None:
    texts = [f"{TEXTS[i % len(TEXTS)]} number {i}" * (1 + i % 5) for i in range(256)]
    out = openai_client(minilm_stack).embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    ref = st_vectors(minilm, texts)
    cos = [
        torch.cosine_similarity(torch.tensor(d.embedding), r.float(), dim=0).item()
        for d, r in zip(out.data, ref, strict=True)
    ]
    assert [d.index for d in out.data] == list(range(256))
    assert min(cos) >= 0.99999
    wait_all_blocks_free(minilm_stack)


def test_long_inputs_are_refused_or_truncated_as_asked(minilm, minilm_stack) -> None:
    long = " ".join(TEXTS * 20)  # ~600 tokens: over sentence-transformers' 256
    body = {"model": "all-MiniLM-L6-v2", "input": long}
    r = httpx.post(f"{minilm_stack}/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400 and "256" in r.json()["error"]["message"]
    r = httpx.post(
        f"{minilm_stack}/v1/embeddings", json=body | {"truncate_prompt_tokens": -1}, timeout=60
    )
    assert r.status_code == 200, r.text
    got = torch.tensor(r.json()["data"][0]["embedding"])
    ref = st_vectors(minilm, [long])[0]  # sentence-transformers truncates to 256 tokens too
    assert torch.cosine_similarity(got, ref.float(), dim=0) >= 0.99999
    assert r.json()["usage"]["prompt_tokens"] == 256


def test_score_and_rerank_are_cosines_of_embeddings(minilm, minilm_stack) -> None:
    ref = st_vectors(minilm, [QUERY, *TEXTS])
    want = [torch.cosine_similarity(ref[0], r, dim=0).item() for r in ref[1:]]
    body = {"model": "all-MiniLM-L6-v2", "text_1": QUERY, "text_2": TEXTS}
    r = httpx.post(f"{minilm_stack}/v1/score", json=body, timeout=60)
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in r.json()["data"]]
    assert [d["index"] for d in r.json()["data"]] == list(range(len(TEXTS)))
    assert scores == pytest.approx(want, abs=1e-5)
    body = {"model": "all-MiniLM-L6-v2", "query": QUERY, "documents": TEXTS, "top_n": 2}
    r = httpx.post(f"{minilm_stack}/v1/rerank", json=body, timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    order = sorted(range(len(TEXTS)), key=lambda i: -want[i])[:2]
    assert [x["index"] for x in results] == order
    assert [x["document"]["text"] for x in results] == [TEXTS[i] for i in order]


def test_other_tasks_get_a_400_naming_the_task(minilm_stack) -> None:
    chat = {"model": "all-MiniLM-L6-v2", "messages": [{"role": "user", "content": "hi"}]}
    r = httpx.post(f"{minilm_stack}/v1/chat/completions", json=chat, timeout=60)
    assert r.status_code == 400 and "embed" in r.json()["error"]["message"]
    r = httpx.post(
        f"{minilm_stack}/classify", json={"model": "all-MiniLM-L6-v2", "input": "hi"}, timeout=60
    )
    assert r.status_code == 400 and "embed" in r.json()["error"]["message"]


def test_cross_encoder_scores_equal_transformers(cross_encoder, cross_stack) -> None:
    path, model = cross_encoder
    tok = AutoTokenizer.from_pretrained(path)
    want = []
    for doc in TEXTS:
        with torch.no_grad():
            want.append(torch.sigmoid(model(**tok(QUERY, doc, return_tensors="pt")).logits)[0, 0])
    name = path.name
    r = httpx.post(
        f"{cross_stack}/score", json={"model": name, "text_1": QUERY, "text_2": TEXTS}, timeout=60
    )
    assert r.status_code == 200, r.text
    scores = [d["score"] for d in r.json()["data"]]
    assert scores == pytest.approx([w.item() for w in want], abs=1e-5)
    body = {"model": name, "query": QUERY, "documents": TEXTS, "return_documents": False}
    r = httpx.post(f"{cross_stack}/v2/rerank", json=body, timeout=60)
    assert r.status_code == 200, r.text
    results = r.json()["results"]
    assert [x["index"] for x in results] == sorted(range(len(TEXTS)), key=lambda i: -scores[i])
    assert [x["relevance_score"] for x in results] == sorted(scores, reverse=True)
    assert all("document" not in x for x in results)
    r = httpx.post(f"{cross_stack}/classify", json={"model": name, "input": TEXTS}, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    assert [d["num_classes"] for d in data] == [1] * len(TEXTS)
    assert [d["label"] for d in data] == ["class-0"] * len(TEXTS)
    r = httpx.post(f"{cross_stack}/v1/embeddings", json={"model": name, "input": "hi"}, timeout=60)
    assert r.status_code == 400 and "score" in r.json()["error"]["message"]
    wait_all_blocks_free(cross_stack)
