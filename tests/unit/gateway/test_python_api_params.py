"""kvflow.SamplingParams / BeamSearchParams: vLLM's names and defaults, a ValueError naming the
field for a bad value -- from the same validation code as the OpenAI gateway -- and the mapping
onto the pipeline's parameters."""

from __future__ import annotations

import pytest

from kvflow import BeamSearchParams, SamplingParams
from kvflow.llm import _prompt_list
from kvflow.services.gateway.convert import completion_job
from kvflow.services.gateway.errors import APIError
from kvflow.services.gateway.protocol import CompletionRequest

BAD = [
    ("temperature", -0.5),
    ("top_p", 0.0),
    ("top_k", -2),
    ("min_p", 1.5),
    ("presence_penalty", 3.0),
    ("repetition_penalty", 0.0),
    ("max_tokens", 0),
    ("logprobs", 21),
    ("stop", [""]),
    ("stop_token_ids", [-1]),
    ("n", 0),
]


@pytest.mark.parametrize(("field", "value"), BAD)
def test_a_bad_value_names_its_field_in_python_and_over_http(field: str, value) -> None:
    with pytest.raises(ValueError) as py:
        SamplingParams(**{field: value})
    assert py.value.param == field
    req = CompletionRequest(model="m", prompt="x", **{field: value})
    with pytest.raises(APIError) as http:
        completion_job(req, "r", "inbox", 0.0)
    assert http.value.param == field and http.value.status == 400


def test_vllm_names_and_defaults() -> None:
    sp = SamplingParams(temperature=0.7, top_p=0.95)
    assert (sp.n, sp.max_tokens, sp.top_k, sp.seed, sp.logprobs) == (1, 16, 0, None, None)
    with pytest.raises(TypeError):
        SamplingParams(not_a_field=1)
    with pytest.raises(ValueError, match="best_of"):
        SamplingParams(n=3, best_of=2)
    with pytest.raises(ValueError, match="guided_regex"):
        SamplingParams(guided_json={"type": "object"}, guided_regex="a+")


def test_mapping_onto_the_pipeline_parameters() -> None:
    sp = SamplingParams(stop="END", top_k=-1, seed=7, max_tokens=None, logit_bias={5: 2})
    wire = sp.to_wire()
    assert wire.stop == ["END"] and wire.top_k == 0 and wire.seed == 7
    assert wire.max_tokens == 0  # up to the context limit
    assert wire.logit_bias == {5: 2.0} and wire.logprobs is None
    assert sp.to_wire(want_logprobs=True).logprobs == 0  # best_of ranks by cumulative logprob
    assert SamplingParams(guided_choice=["yes", "no"]).to_wire().structured_output.kind == "choice"


def test_beam_search_params() -> None:
    assert BeamSearchParams(beam_width=4, max_tokens=8).length_penalty == 1.0
    for kw, field in (
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": 11}, "beam_width"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"temperature": 0.5}, "temperature"),
    ):
        args = {"beam_width": 2, "max_tokens": 4, **kw}
        with pytest.raises(ValueError) as e:
            BeamSearchParams(**args)
        assert e.value.param == field


def test_prompt_forms() -> None:
    assert _prompt_list("a") == ["a"]
    assert _prompt_list([1, 2, 3]) == [[1, 2, 3]]  # one prompt of token ids
    assert _prompt_list(["a", "b"]) == ["a", "b"]
    assert _prompt_list([[1], [2, 3]]) == [[1], [2, 3]]
    assert _prompt_list({"prompt_token_ids": [4]}) == [{"prompt_token_ids": [4]}]
    with pytest.raises(ValueError):
        _prompt_list([])
