"""Pooling models against transformers, through the real tokenizer-side preparation
(services/tokenizer/pooling_inputs.py), scheduler core and runner in one process: tiny random
BERT, RoBERTa and XLM-RoBERTa checkpoints that transformers builds here (embedding models,
classifiers with three labels, a one-label cross-encoder), with the real all-MiniLM-L6-v2
against sentence-transformers' ``encode``.

The checkpoints are large enough for every feature to matter: GELU, post-LayerNorm, biases,
token types (a BERT pair's second text), RoBERTa's positions that start after its padding index,
inputs of different lengths in one step."""

from __future__ import annotations

from array import array
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoTokenizer,
)

from kvflow.services.tokenizer.pooling_inputs import pooling_input
from kvflow.services.worker.runner import ModelRunner
from kvflow.shared.messages import GenerateRequest, PoolingParams, SamplingParams, TokenizedRequest
from kvflow.shared.model_config import load_config
from kvflow.shared.model_source import ModelSource
from kvflow.shared.models.config import ModelConfigError
from kvflow.shared.models.tasks import served_task
from tests.helpers.engine import new_core
from tests.helpers.pooling import QUERY, TEXTS, minilm_dir, tiny


@pytest.fixture(scope="module")
def minilm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return minilm_dir(tmp_path_factory.mktemp("minilm"))


def pooled(
    path: Path,
    task: str,
    jobs: list[tuple[str, str | None]],
    pooling: str = "",
    budget: int = 2048,
) -> list[torch.Tensor]:
    """Each (text, pair) as the pipeline computes it for ``task``: prepared as the tokenizer
    service prepares it (``pooling``: the request's pooling type, '' for the model's), planned
    by the scheduler core under a ``budget`` of tokens per step, run by a runner; all
    submitted together."""
    src = ModelSource("hf", path, path.name)
    cfg = load_config(src)
    served = served_task(cfg, path)
    tok = AutoTokenizer.from_pretrained(path)
    runner = ModelRunner.create(src, 16, 256, worker_id="w")
    core = new_core(blocks=256, block_size=16, max_num_batched_tokens=budget)
    for i, (text, pair) in enumerate(jobs):
        req = GenerateRequest(f"r{i}", "", SamplingParams(max_tokens=1), text, prompt_pair=pair,
                              pooling=PoolingParams(pooling, True, task))  # fmt: skip
        ids, params = pooling_input(tok, req, served, cfg.max_position_embeddings)
        t = TokenizedRequest(f"r{i}", "", ids, SamplingParams(max_tokens=1))
        t.pooling = params
        core.add_request(t)
    ws = next(iter(core.workers.values()))
    got: dict[str, torch.Tensor] = {}
    for _ in range(100):
        plan, _ = core.schedule(ws)
        if plan is None:
            break
        res = runner.execute(plan)
        assert res.error is None, res.error
        for e in res.embeddings:
            got[e.request_id] = torch.tensor(array("f", e.data).tolist())
        core.on_result(res)
    assert not core.requests
    return [got[f"r{i}"] for i in range(len(jobs))]


def hf_inputs(path: Path, text: str, pair: str | None, one_type: bool) -> dict[str, torch.Tensor]:
    enc = AutoTokenizer.from_pretrained(path)(text, pair, return_tensors="pt")
    if one_type:  # RoBERTa has one token type: its tokenizers give none
        enc["token_type_ids"] = torch.zeros_like(enc["input_ids"])
    return dict(enc)


def test_minilm_equals_sentence_transformers(minilm: Path) -> None:
    from sentence_transformers import SentenceTransformer

    ref = SentenceTransformer(str(minilm), device="cpu").encode(TEXTS, convert_to_tensor=True)
    got = pooled(minilm, "embed", [(t, None) for t in TEXTS])
    for g, r in zip(got, ref, strict=True):
        assert torch.cosine_similarity(g, r.float(), dim=0) >= 0.99999
        assert abs(g.norm().item() - 1.0) < 1e-5  # its Normalize module: unit vectors


def test_minilm_task_and_limits(minilm: Path) -> None:
    cfg = load_config(ModelSource("hf", minilm, "m"))
    served = served_task(cfg, minilm)
    assert (served.task, served.pooling_type, served.encoder) == ("embed", "MEAN", True)
    assert cfg.max_position_embeddings == 256  # sentence-transformers' max_seq_length
    with pytest.raises(ModelConfigError, match="encoder"):
        served_task(cfg, minilm, "generate")
    with pytest.raises(ModelConfigError, match="classification head"):
        served_task(cfg, minilm, "classify")


@pytest.mark.parametrize("pooling", ["MEAN", "CLS"])
def test_bert_embeddings_equal_transformers(minilm: Path, tmp_path: Path, pooling: str) -> None:
    model = tiny("bert", minilm, tmp_path)
    (tmp_path / "modules.json").write_text("[]")  # a plain BertModel: CLS unless asked
    jobs = [(t, None) for t in TEXTS]
    src = ModelSource("hf", tmp_path, "tiny")
    served = served_task(load_config(src), tmp_path, "auto", pooling)
    assert served.task == "embed"
    got = pooled(tmp_path, "embed", jobs, pooling)
    for (text, _), g in zip(jobs, got, strict=True):
        with torch.no_grad():
            h = model(**hf_inputs(tmp_path, text, None, False)).last_hidden_state[0]
        want = h.mean(0) if pooling == "MEAN" else h[0]
        want = torch.nn.functional.normalize(want, dim=0)
        torch.testing.assert_close(g, want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kind", ["bert", "roberta", "xlm-roberta"])
def test_classifier_probabilities_equal_transformers(minilm: Path, tmp_path: Path, kind: str) -> None:  # fmt: skip
    model = tiny(kind, minilm, tmp_path, labels=3)
    cfg = load_config(ModelSource("hf", tmp_path, "tiny"))
    served = served_task(cfg, tmp_path)
    assert served.task == "classify" and served.labels == ("class-0", "class-1", "class-2")
    got = pooled(tmp_path, "classify", [(t, None) for t in TEXTS])
    for text, g in zip(TEXTS, got, strict=True):
        with torch.no_grad():
            logits = model(**hf_inputs(tmp_path, text, None, kind != "bert")).logits[0]
        torch.testing.assert_close(g, torch.softmax(logits, 0), atol=1e-5, rtol=1e-4)
    assert max(g.max().item() - g.min().item() for g in got) > 0.05  # the head decides


@pytest.mark.parametrize("kind", ["bert", "roberta"])
def test_cross_encoder_scores_equal_transformers(minilm: Path, tmp_path: Path, kind: str) -> None:
    model = tiny(kind, minilm, tmp_path, labels=1)
    cfg = load_config(ModelSource("hf", tmp_path, "tiny"))
    assert served_task(cfg, tmp_path).task == "score"
    jobs = [(QUERY, t) for t in TEXTS]
    got = pooled(tmp_path, "score", jobs)
    want = []
    for q, d in jobs:
        with torch.no_grad():
            want.append(torch.sigmoid(model(**hf_inputs(tmp_path, q, d, kind != "bert")).logits[0]))
    torch.testing.assert_close(torch.cat(got), torch.cat(want), atol=1e-5, rtol=1e-4)
    if kind == "bert":  # the pair's token types change the score
        enc = hf_inputs(tmp_path, QUERY, TEXTS[1], False)
        enc["token_type_ids"] = torch.zeros_like(enc["input_ids"])
        with torch.no_grad():
            untyped = torch.sigmoid(model(**enc).logits[0])
        assert abs(untyped.item() - got[1].item()) > 1e-4


def test_vectors_do_not_depend_on_the_batch(minilm: Path) -> None:
    """The same input alone and among 24 others of other lengths: the same bytes."""
    alone = pooled(minilm, "embed", [(TEXTS[1], None)])[0]
    crowd = [(f"{TEXTS[i % 4]} {'x ' * i}", None) for i in range(24)]
    mixed = pooled(minilm, "embed", crowd[:9] + [(TEXTS[1], None)] + crowd[9:])[9]
    assert torch.equal(alone, mixed)


def test_an_input_longer_than_the_budget_runs_whole(minilm: Path) -> None:
    """A token budget under the input's length: the encoder's input is never split (it runs
    alone in its step) and its vector is the same."""
    text = " ".join(TEXTS * 4)
    want = pooled(minilm, "embed", [(text, None)])[0]
    got = pooled(minilm, "embed", [(TEXTS[0], None), (text, None)], budget=32)[1]
    assert torch.equal(want, got)
