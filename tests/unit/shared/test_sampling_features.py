"""The sampling feature table (shared/sampling): every layer derives its fields from it, and the
processors say which features need token history."""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
import torch

from kvflow import SamplingParams as PySamplingParams
from kvflow.services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from kvflow.services.gateway.responses_api import EXTRAS
from kvflow.services.worker.runner import RequestState
from kvflow.shared.messages import SamplingParams
from kvflow.shared.sampling import (
    FIELDS,
    PROCESSORS,
    SamplingParamError,
    apply_processors,
    needs_token_history,
    validate_sampling,
    wire_fields,
)
from kvflow.shared.sampling.processors import (
    AllowedTokens,
    BadWords,
    LogitBias,
    MinTokens,
    Penalties,
)


def _state(**params) -> RequestState:
    p = SamplingParams(**params)
    return RequestState(p, 3, 0, frozenset([1]), frozenset([2]), needs_token_history(p), [5], [])


def test_every_layer_declares_the_table_fields() -> None:
    names = [f.name for f in FIELDS]
    assert len(names) == len(set(names))
    py = {f.name: f.default for f in dataclasses.fields(PySamplingParams)}
    assert py == {f.name: f.default for f in FIELDS}
    for body in (ChatCompletionRequest, CompletionRequest):
        declared = body.model_fields
        for f in FIELDS:
            if f.body:
                assert f.name in declared, f.name
                assert declared[f.name].default == f.body_default
    assert {f.name for f in FIELDS if f.body and f.responses} <= EXTRAS
    wire = set(SamplingParams.__struct_fields__)
    assert {f.name for f in FIELDS if f.wire is not None} <= wire


def test_wire_fields_of_the_defaults_are_the_wire_defaults() -> None:
    assert SamplingParams(**wire_fields({})) == SamplingParams()
    p = SamplingParams(**wire_fields({"stop": "x", "top_k": -1, "max_tokens": None}))
    assert (p.stop, p.top_k, p.max_tokens) == (["x"], 0, 0)
    assert msgspec.msgpack.encode(SamplingParams(**wire_fields({}))) == msgspec.msgpack.encode(
        SamplingParams()
    )


def test_unknown_fields_are_refused() -> None:
    with pytest.raises(TypeError):
        validate_sampling(not_a_field=1)
    with pytest.raises(SamplingParamError) as e:
        validate_sampling(guided_regex="a", guided_choice=["x"])
    assert e.value.param == "guided_choice"


def test_history_comes_from_the_processors() -> None:
    assert {type(p) for p in PROCESSORS if p.needs_history} == {Penalties, BadWords}
    assert not needs_token_history(SamplingParams())
    assert needs_token_history(SamplingParams(frequency_penalty=0.1))
    assert needs_token_history(SamplingParams(bad_words_token_ids=[[3]]))


def test_processors_run_in_table_order_on_their_rows_only() -> None:
    assert [type(p) for p in PROCESSORS][:5] == [
        LogitBias,
        AllowedTokens,
        Penalties,
        BadWords,
        MinTokens,
    ]
    logits = torch.zeros(3, 8)
    states = [
        _state(logit_bias={4: 2.0}, allowed_token_ids=[4, 6]),
        _state(repetition_penalty=2.0, min_tokens=2),
        _state(),
    ]
    apply_processors(logits, states)
    finite = [torch.isfinite(logits[r]).nonzero().flatten().tolist() for r in range(3)]
    assert finite[0] == [4, 6] and logits[0, 4] == 2.0
    assert finite[1] == [0, 3, 4, 5, 6, 7]  # eos 1 and stop 2 held back
    assert torch.equal(logits[2], torch.zeros(8))
