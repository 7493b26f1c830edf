"""Pooling models' pure logic, no network: ``--task`` resolution against what a checkpoint has
(shared/models/tasks.py), the encoder family's config (shared/models/families/bert.py), the
tokenizer's preparation of an input and a text pair (services/tokenizer/pooling_inputs.py), what
``PoolState.finish`` makes of a pooled vector per task, and the planner never splitting an
encoder's input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvflow.services.scheduler.core import SchedulerCore
from kvflow.services.scheduler.limits import SchedulerLimits
from kvflow.services.tokenizer.pooling_inputs import check_task, pooling_input
from kvflow.services.tokenizer.prompts import PromptError
from kvflow.services.worker.pooling import PoolState
from kvflow.shared.messages import (
    GenerateRequest,
    PooledOutput,
    PoolingParams,
    SamplingParams,
    StepResult,
    TokenizedRequest,
)
from kvflow.shared.models.config import ModelConfigError
from kvflow.shared.models.registry import family, hf_config
from kvflow.shared.models.tasks import ServedTask, served_task, st_pooling, task_error

BERT = {
    "architectures": ["BertModel"],
    "model_type": "bert",
    "vocab_size": 100,
    "hidden_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "hidden_act": "gelu",
    "max_position_embeddings": 64,
    "type_vocab_size": 2,
    "layer_norm_eps": 1e-12,
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "position_embedding_type": "absolute",
}


def test_bert_config_is_an_encoder_with_no_head() -> None:
    cfg = hf_config(BERT, strict=True)
    fam = family(cfg.family)
    assert (cfg.family, fam.kind, fam.bidirectional, cfg.norm_kind, cfg.norm_layout) == (
        "bert",
        "encoder",
        True,
        "layer",
        "post",
    )
    assert (cfg.num_labels, cfg.classifier, cfg.position_offset) == (0, "", 0)


def test_roberta_positions_start_after_the_padding_index() -> None:
    raw = BERT | {"architectures": ["XLMRobertaForSequenceClassification"],
                  "model_type": "xlm-roberta", "pad_token_id": 1, "max_position_embeddings": 66,
                  "type_vocab_size": 1, "id2label": {"0": "neg", "1": "pos"}}  # fmt: skip
    cfg = hf_config(raw, strict=True)
    assert (cfg.family, cfg.position_offset, cfg.max_position_embeddings) == ("roberta", 2, 64)
    assert (cfg.classifier, cfg.num_labels) == ("roberta", 2)
    assert served_task(cfg, None) == ServedTask("classify", "CLS", ("LABEL_0", "LABEL_1"), True)


def test_what_an_encoder_cannot_be_is_refused() -> None:
    for key, value in (("is_decoder", True), ("position_embedding_type", "relative_key")):
        with pytest.raises(ModelConfigError, match=key):
            hf_config(BERT | {key: value})


def test_task_resolution(tmp_path: Path) -> None:
    enc = hf_config(BERT)
    cross = hf_config(BERT | {"architectures": ["BertForSequenceClassification"],
                              "id2label": {"0": "relevant"}})  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps({"id2label": {"0": "relevant"}}))
    assert served_task(enc, None).task == "embed"
    assert served_task(enc, None).pooling_type == "CLS"  # vLLM's default for BERT
    assert served_task(cross, tmp_path) == ServedTask("score", "CLS", ("relevant",), True)
    assert served_task(cross, tmp_path, "classify").task == "classify"
    assert served_task(cross, tmp_path, "embed").task == "embed"  # its base model's states
    with pytest.raises(ModelConfigError, match="cross-encoder"):
        served_task(hf_config(BERT | {"architectures": ["BertForSequenceClassification"]}),
                    None, "score")  # fmt: skip
    with pytest.raises(ModelConfigError, match="reward"):
        served_task(enc, None, "reward")
    with pytest.raises(ModelConfigError, match="--task must be"):
        served_task(enc, None, "summarize")


def test_sentence_transformers_pooling(tmp_path: Path) -> None:
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]))  # fmt: skip
    for key, kind in (("pooling_mode_mean_tokens", "MEAN"), ("pooling_mode_cls_token", "CLS"),
                      ("pooling_mode_lasttoken", "LAST")):  # fmt: skip
        (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({key: True}))
        assert st_pooling(tmp_path) == kind
        assert served_task(hf_config(BERT), tmp_path).pooling_type == kind
        assert served_task(hf_config(BERT), tmp_path, "auto", "LAST").pooling_type == "LAST"
    (tmp_path / "1_Pooling" / "config.json").write_text('{"pooling_mode_max_tokens": true}')
    with pytest.raises(ModelConfigError, match="max_tokens"):
        st_pooling(tmp_path)


def test_task_errors_name_the_task() -> None:
    assert task_error("embed", "embed", "/v1/embeddings") is None
    assert task_error("generate", "embed", "/v1/embeddings") is None  # a decoder's states
    assert task_error("embed", "score", "/score") is None  # cosine of embeddings
    msg = task_error("generate", "score", "/score")
    assert msg is not None and "--task generate" in msg and "score" in msg
    with pytest.raises(PromptError, match="served for --task embed"):
        check_task(ServedTask("embed", "MEAN", encoder=True), "generate")
    with pytest.raises(PromptError, match="cross-encoder|score"):
        check_task(ServedTask("embed", "MEAN", encoder=True), "score")
    check_task(ServedTask("score", "CLS", ("x",), True), "classify")


class _PairTokenizer:
    """BERT's way with a pair: [CLS] a [SEP] b [SEP], token type 1 from b on."""

    def __call__(self, text: str, pair: str | None = None, **kw: object) -> dict:
        a = [ord(c) for c in text]
        ids, types = [1, *a, 2], [0] * (len(a) + 2)
        if pair is not None:
            b = [ord(c) for c in pair]
            ids, types = ids + [*b, 2], types + [1] * (len(b) + 1)
        if kw.get("truncation"):
            n = int(kw["max_length"])  # type: ignore[call-overload]
            ids, types = ids[: n - 1] + [2], types[:n]
        return {"input_ids": ids, "token_type_ids": types}

    def __len__(self) -> int:
        return 1000


def _req(text: str, pair: str | None, task: str, keep: int | None = None) -> GenerateRequest:
    r = GenerateRequest("r", "", SamplingParams(max_tokens=1), text, truncate_prompt_tokens=keep)
    r.prompt_pair, r.pooling = pair, PoolingParams("", True, task)
    return r


def test_an_encoder_pair_gets_its_token_types_and_the_heads_pooling() -> None:
    served = ServedTask("score", "MEAN", ("s",), True)
    ids, p = pooling_input(_PairTokenizer(), _req("ab", "xyz", "score"), served, 64)
    assert ids == [1, 97, 98, 2, 120, 121, 122, 2]
    assert (p.pair_start, p.bidirectional, p.pooling_type, p.task) == (4, True, "CLS", "score")
    ids, p = pooling_input(_PairTokenizer(), _req("abcdef", None, "classify", 4), served, 64)
    assert ids == [1, 97, 98, 2] and p.pair_start == 0  # the tokenizer's own truncation
    embed = ServedTask("embed", "MEAN", (), True)
    _, p = pooling_input(_PairTokenizer(), _req("ab", None, "embed"), embed, 64)
    assert p.pooling_type == "MEAN"  # the model's pooling where the request leaves it


def test_a_decoder_keeps_the_last_tokens_and_refuses_pairs() -> None:
    served = ServedTask("generate", "LAST")
    ids, p = pooling_input(_PairTokenizer(), _req("abcdef", None, "embed", 3), served, 64)
    assert ids == [101, 102, 2] and not p.bidirectional and p.pooling_type == "LAST"
    with pytest.raises(PromptError, match="cross-encoder"):
        pooling_input(_PairTokenizer(), _req("a", "b", "score"), ServedTask("score", "LAST", ("x",)), 64)  # fmt: skip


@pytest.mark.parametrize(
    ("task", "labels", "act", "want"),
    [
        ("classify", 3, "sigmoid", lambda z: torch.softmax(z, 0)),
        ("classify", 1, "sigmoid", torch.sigmoid),
        ("score", 1, "sigmoid", torch.sigmoid),
        ("score", 1, "identity", lambda z: z),
    ],
)
def test_finish_per_task(task: str, labels: int, act: str, want) -> None:  # noqa: ANN001
    head = torch.nn.Linear(4, labels)
    st = PoolState(PoolingParams("CLS", True, task), 3)
    st.add(torch.tensor([[1.0, -2.0, 0.5, 3.0]]))
    with torch.no_grad():
        got = st.finish(lambda v: head(v), act)
        torch.testing.assert_close(got, want(head(torch.tensor([1.0, -2.0, 0.5, 3.0]))))


def test_embed_finish_normalizes_and_needs_no_head() -> None:
    st = PoolState(PoolingParams("MEAN", True, "embed"), 2)
    st.add(torch.tensor([[3.0, 0.0], [3.0, 8.0]]))
    torch.testing.assert_close(st.finish(), torch.tensor([0.6, 0.8]))
    with pytest.raises(ValueError, match="classification head"):
        st = PoolState(PoolingParams("CLS", True, "classify"), 1)
        st.add(torch.ones(1, 2))
        st.finish()


def _encoder_request(rid: str, n: int) -> TokenizedRequest:
    r = TokenizedRequest(rid, "", list(range(1, n + 1)), SamplingParams(max_tokens=1))
    r.pooling = PoolingParams("CLS", True, "embed", bidirectional=True)
    return r


def test_the_planner_never_splits_an_encoders_input() -> None:
    core = SchedulerCore(SchedulerLimits(max_num_batched_tokens=32))
    core.add_worker("w", 64, 4)
    ws = core.workers["w"]
    for rid, n in (("a", 20), ("b", 20), ("c", 50)):
        core.add_request(_encoder_request(rid, n))
    steps = []
    while (plan := core.schedule(ws)[0]) is not None:
        if plan.seqs:  # (the last plan only tells the worker what finished)
            steps.append([(s.request_id, s.start_pos, len(s.token_ids)) for s in plan.seqs])
        done = [PooledOutput(s.request_id, b"\0\0\0\0", 1) for s in plan.seqs]
        core.on_result(StepResult("w", plan.step_id, [], [], [], sum(len(s.token_ids) for s in plan.seqs),
                                  embeddings=done, epoch=plan.epoch))  # fmt: skip
    # a (20) fits; b (20) would need 8 more than the 12 left: it waits for the next step;
    # c (50) is over the whole budget: it runs alone, whole
    assert steps == [[("a", 0, 20)], [("b", 0, 20)], [("c", 0, 50)]]
    assert not core.requests
