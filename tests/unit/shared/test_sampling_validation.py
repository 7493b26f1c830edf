"""kvflow.shared.sampling.validate_sampling: vLLM's ranges and types, each error naming its field."""

from __future__ import annotations

import pytest

from kvflow.shared.sampling import SamplingParamError, validate_sampling


def test_defaults_and_edges_are_valid() -> None:
    validate_sampling()
    validate_sampling(
        n=4,
        best_of=4,
        temperature=0.0,
        top_p=1.0,
        top_k=-1,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=0.01,
        seed=-(2**63),
        max_tokens=None,
        min_tokens=5,
        logprobs=20,
        prompt_logprobs=0,
        stop=["a", "bc"],
        stop_token_ids=[0, 5],
        logit_bias={"7": -100, 8: 100.0},
        max_n=4,
    )
    validate_sampling(temperature=7.5, top_k=0, stop="x", max_tokens=3, min_tokens=3)


@pytest.mark.parametrize(
    ("kwargs", "param", "words"),
    [
        ({"n": 0}, "n", "[1,"),
        ({"n": 5, "max_n": 4}, "n", "4]"),
        ({"n": True}, "n", "integer"),
        ({"n": 2, "best_of": 1}, "best_of", ">= n"),
        ({"best_of": 17, "max_n": 16}, "best_of", "16]"),
        ({"temperature": -0.5}, "temperature", ">= 0"),
        ({"temperature": float("nan")}, "temperature", "finite"),
        ({"temperature": "hot"}, "temperature", "number"),
        ({"top_p": 0.0}, "top_p", "(0, 1]"),
        ({"top_p": 1.01}, "top_p", "(0, 1]"),
        ({"top_k": -2}, "top_k", "[-1,"),
        ({"top_k": 1.5}, "top_k", "integer"),
        ({"min_p": -0.1}, "min_p", "[0, 1]"),
        ({"presence_penalty": 2.5}, "presence_penalty", "[-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty", "[-2, 2]"),
        ({"repetition_penalty": 0}, "repetition_penalty", "(0, 100]"),
        ({"seed": 2**64}, "seed", "in ["),
        ({"max_tokens": 0}, "max_tokens", "[1,"),
        ({"max_tokens": 2**40}, "max_tokens", "[1,"),
        ({"min_tokens": -1}, "min_tokens", "[0,"),
        ({"max_tokens": 3, "min_tokens": 4}, "min_tokens", "<= max_tokens"),
        ({"logprobs": 21}, "logprobs", "20]"),
        ({"logprobs": -1}, "logprobs", "[0,"),
        ({"prompt_logprobs": 30}, "prompt_logprobs", "20]"),
        ({"stop": ["ok", ""]}, "stop", "empty"),
        ({"stop": [3]}, "stop", "strings"),
        ({"stop": 3}, "stop", "strings"),
        ({"stop_token_ids": [-1]}, "stop_token_ids", "in ["),
        ({"stop_token_ids": "12"}, "stop_token_ids", "list"),
        ({"logit_bias": {"x": 1}}, "logit_bias", "not a token id"),
        ({"logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ({"logit_bias": {-5: 1}}, "logit_bias", "out of range"),
        ({"logit_bias": [1]}, "logit_bias", "map"),
        ({"ignore_eos": "yes"}, "ignore_eos", "boolean"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "empty"),
        ({"allowed_token_ids": [2**31]}, "allowed_token_ids", "in ["),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens", ">= 1"),
        ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens", "[-1,"),
    ],
)
def test_each_bad_value_names_its_field(kwargs, param, words) -> None:
    with pytest.raises(SamplingParamError) as e:
        validate_sampling(**kwargs)
    assert e.value.param == param
    assert str(e.value).startswith(f"{param}: ")
    assert words in e.value.reason, e.value.reason
    assert isinstance(e.value, ValueError)
