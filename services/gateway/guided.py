"""Structured-output fields of a request -> one ``StructuredOutput`` for the worker: OpenAI's
``response_format`` (``json_object``, ``json_schema``), vLLM's ``guided_json`` /
``guided_regex`` / ``guided_choice`` / ``guided_grammar`` and its newer ``structured_outputs``.
Only the shape is checked here; the tokenizer service compiles the constraint (a bad schema or
regex is a 400 from there, naming the field it came from)."""

from __future__ import annotations

import json
from typing import Any

from kvflow.services.gateway.errors import APIError
from kvflow.services.gateway.protocol import SamplingBody
from kvflow.shared.messages import StructuredOutput
from kvflow.shared.structured_output import JSON_OBJECT_SCHEMA


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", "BadRequestError", param)


def _json_spec(value: dict[str, Any] | str, param: str) -> str:
    """A JSON schema as text (a string must itself be a JSON object)."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as e:
            raise _bad(param, f"is not valid JSON: {e}") from None
        if not isinstance(parsed, dict):
            raise _bad(param, "must be a JSON schema object")
        return value
    return json.dumps(value, ensure_ascii=False)


def _choice_spec(value: list[str], param: str) -> str:
    if not value or not all(value):
        raise _bad(param, "must be a non-empty list of non-empty strings")
    return json.dumps(value, ensure_ascii=False)


def _candidates(req: SamplingBody) -> list[StructuredOutput]:
    found: list[StructuredOutput] = []
    rf = req.response_format
    if rf is not None and rf.type == "json_object":
        found.append(StructuredOutput("json", JSON_OBJECT_SCHEMA, "response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.json_schema is None:
            raise _bad("response_format", "json_schema.schema is required for type json_schema")
        spec = _json_spec(rf.json_schema.json_schema, "response_format")
        found.append(StructuredOutput("json", spec, "response_format"))
    if req.guided_json is not None:
        found.append(
            StructuredOutput("json", _json_spec(req.guided_json, "guided_json"), "guided_json")
        )
    if req.guided_regex is not None:
        found.append(StructuredOutput("regex", req.guided_regex, "guided_regex"))
    if req.guided_choice is not None:
        spec = _choice_spec(req.guided_choice, "guided_choice")
        found.append(StructuredOutput("choice", spec, "guided_choice"))
    if req.guided_grammar is not None:
        found.append(StructuredOutput("grammar", req.guided_grammar, "guided_grammar"))
    so = req.structured_outputs
    if so is not None:
        p = "structured_outputs"
        if so.json_ is not None:
            found.append(StructuredOutput("json", _json_spec(so.json_, p), p))
        if so.regex is not None:
            found.append(StructuredOutput("regex", so.regex, p))
        if so.choice is not None:
            found.append(StructuredOutput("choice", _choice_spec(so.choice, p), p))
        if so.grammar is not None:
            found.append(StructuredOutput("grammar", so.grammar, p))
        if so.json_object:
            found.append(StructuredOutput("json", JSON_OBJECT_SCHEMA, p))
    return found


def structured_output(req: SamplingBody) -> StructuredOutput | None:
    """The request's one constraint, or None; more than one is a 400."""
    found = _candidates(req)
    if len(found) > 1:
        names = sorted({f.param for f in found})
        raise _bad(
            found[1].param, f"only one output constraint per request (got {', '.join(names)})"
        )
    return found[0] if found else None
