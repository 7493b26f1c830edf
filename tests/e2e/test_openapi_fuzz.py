"""schemathesis against /openapi.json of a live stack: requests generated from the documented
schemas (a bounded number per operation) must never get a 5xx, must answer in time, and the
answers must match the documented status codes, content types and response schemas. The stack
serves a normal request afterwards.

Generation is capped so the run stays short: ``max_tokens`` / ``max_completion_tokens`` are
required and at most 4, ``n`` / ``best_of`` at most 2 (a copy of the document is changed, not
the server); /v1/embeddings is fuzzed like the rest (its valid inputs: short strings and
token-id lists inside the vocabulary)."""

from __future__ import annotations

import copy
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

from tests.helpers.stack import openai_client

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"
EXAMPLES = 20  # per operation
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]


def capped(doc: dict[str, Any]) -> dict[str, Any]:
    doc = copy.deepcopy(doc)
    schemas = doc["components"]["schemas"]
    small = {"type": "integer", "minimum": 1, "maximum": 4}
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        props["max_tokens"] = small
        props["n"] = {"type": "integer", "minimum": 1, "maximum": 2}
        schemas[name].setdefault("required", []).append("max_tokens")
        if "max_completion_tokens" in props:
            props["max_completion_tokens"] = small
        if "best_of" in props:
            props["best_of"] = {"type": "integer", "minimum": 1, "maximum": 2}
    responses = schemas["ResponsesRequest"]
    responses["properties"]["max_output_tokens"] = small
    responses.setdefault("required", []).append("max_output_tokens")
    return doc


def narrowed(doc: dict[str, Any]) -> dict[str, Any]:
    """Sampling fields kept inside their valid ranges, so most requests reach the model (the
    plain document mostly tests validation)."""
    doc = capped(doc)
    schemas = doc["components"]["schemas"]

    def num(lo: float, hi: float, kind: str = "number") -> dict[str, Any]:
        return {"type": kind, "minimum": lo, "maximum": hi}

    token = num(0, 49151, "integer")
    ranges = {
        "temperature": num(0, 2),
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": num(-1, 50, "integer"),
        "min_p": num(0, 1),
        "presence_penalty": num(-2, 2),
        "frequency_penalty": num(-2, 2),
        "repetition_penalty": num(0.5, 2),
        "min_tokens": num(0, 1, "integer"),
        "seed": num(0, 2**31, "integer"),
        "priority": num(-5, 5, "integer"),
        "prompt_logprobs": num(0, 5, "integer"),
        "top_logprobs": num(0, 5, "integer"),
        "stop_token_ids": {"type": "array", "items": token, "maxItems": 3},
        "stop": {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 2},
        "allowed_token_ids": {"type": "array", "items": token, "minItems": 1, "maxItems": 5},
        "truncate_prompt_tokens": num(1, 50, "integer"),
    }
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        props.update(ranges)
        refused = ("suffix", "use_beam_search", "length_penalty", "tools")
        unchecked = ("logit_bias", "model", "guided_grammar", "guided_regex")
        for name in (*refused, *unchecked):
            props.pop(name, None)
    schemas["CompletionRequest"]["properties"].update(
        {
            "logprobs": num(0, 5, "integer"),
            "prompt": {
                "anyOf": [
                    {"type": "string", "minLength": 1},
                    {"type": "array", "items": token, "minItems": 1, "maxItems": 8},
                    {
                        "type": "array",
                        "items": {"type": "string", "minLength": 1},
                        "minItems": 1,
                        "maxItems": 3,
                    },
                ]
            },
        }
    )
    schemas["CompletionRequest"]["properties"]["best_of"] = num(2, 2, "integer")
    embedding = schemas["EmbeddingRequest"]["properties"]
    embedding.pop("dimensions")  # always refused: no matryoshka model is served
    embedding["truncate_prompt_tokens"] = num(1, 50, "integer")
    embedding["input"] = {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "items": token, "minItems": 1, "maxItems": 8},
            {
                "type": "array",
                "items": {"type": "array", "items": token, "minItems": 1, "maxItems": 8},
                "minItems": 1,
                "maxItems": 4,
            },
            {
                "type": "array",
                "items": {"type": "string", "minLength": 1},
                "minItems": 1,
                "maxItems": 4,
            },
        ]
    }
    return doc


def operations(doc: dict[str, Any]) -> list[Any]:
    api = schemathesis.openapi.from_dict(doc)
    return [result.ok() for result in api.get_all_operations()]


def fuzz(stack: str, doc: dict[str, Any]) -> None:
    """Each operation as a plain hypothesis test (schemathesis' pytest plugin needs the schema
    at collection time; this one comes from a stack a fixture starts)."""
    ops = operations(doc)
    assert len(ops) >= 10
    assert any(op.path == "/v1/embeddings" for op in ops)
    for op in ops:

        @given(case=op.as_strategy())
        @settings(
            max_examples=EXAMPLES,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            derandomize=True,
            database=None,
        )
        def run(case: Any) -> None:
            case.call_and_validate(base_url=stack, timeout=60, checks=CHECKS)

        run()


def test_documented_api_never_fails(stack) -> None:
    doc = httpx.get(f"{stack}/openapi.json", timeout=10).json()
    fuzz(stack, capped(doc))


def test_valid_requests_are_served_as_documented(stack) -> None:
    doc = httpx.get(f"{stack}/openapi.json", timeout=10).json()
    fuzz(stack, narrowed(doc))


def test_openapi_carries_the_request_models(stack) -> None:
    doc = httpx.get(f"{stack}/openapi.json", timeout=10).json()
    body = doc["paths"]["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/CompletionRequest"}
    props = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    for field in ("prompt", "best_of", "echo", "logprobs", "suffix", "response_format", "seed"):
        assert field in props, field
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    for field in ("messages", "max_completion_tokens", "top_logprobs", "stream_options"):
        assert field in chat, field
    ok = doc["paths"]["/v1/chat/completions"]["post"]["responses"]["200"]["content"]
    assert ok["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionResponse"
    }
    assert "text/event-stream" in ok
    assert set(doc["paths"]) >= {"/tokenize", "/detokenize", "/version", "/v1/models"}
    embeddings = doc["paths"]["/v1/embeddings"]["post"]
    body = embeddings["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/EmbeddingRequest"}
    props = doc["components"]["schemas"]["EmbeddingRequest"]["properties"]
    for field in ("input", "model", "encoding_format", "dimensions", "truncate_prompt_tokens"):
        assert field in props, field
    ok = embeddings["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok == {"$ref": "#/components/schemas/EmbeddingResponse"}


def test_still_serving_after_the_fuzzing(stack) -> None:
    out = openai_client(stack).completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0
    )
    assert out.usage.completion_tokens >= 1 and out.choices[0].finish_reason in ("length", "stop")
