"""OpenAI tool calling -> what the pipeline carries: the tools for the chat template, how the
detokenizer finds calls in the text (``ToolParsing``) and, for "required" and a named function,
the grammar that makes the text a call (as vLLM: a JSON schema over the tools' parameters, so
the arguments always validate). Pure functions, unit tested without a server."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from kvflow.services.gateway.errors import APIError
from kvflow.services.gateway.protocol import ChatMessageIn, ChatTool, NamedToolChoice, ToolChoice
from kvflow.shared.config import Settings
from kvflow.shared.messages import ChatMessage, StructuredOutput, ToolCall, ToolParsing, ToolSpec

# OpenAI's rule for function names
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# a function that declares no parameters takes an empty object
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def _bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", "BadRequestError", param)


@dataclass
class ToolSetup:
    """A request's tools as the pipeline takes them."""

    specs: list[ToolSpec] = field(default_factory=list)
    parsing: ToolParsing | None = None
    constraint: StructuredOutput | None = None  # the grammar of a forced call


def check_tools(tools: list[ChatTool]) -> list[ToolSpec]:
    specs: list[ToolSpec] = []
    seen: set[str] = set()
    for i, tool in enumerate(tools):
        fn = tool.function
        if not NAME.match(fn.name):
            raise _bad(
                f"tools[{i}].function.name",
                f"{fn.name!r} must be 1 to 64 letters, digits, underscores or dashes",
            )
        if fn.name in seen:
            raise _bad(f"tools[{i}].function.name", f"{fn.name!r} is declared twice")
        seen.add(fn.name)
        params = None
        if fn.parameters is not None:
            param = f"tools[{i}].function.parameters"
            try:
                jsonschema.validators.validator_for(fn.parameters).check_schema(fn.parameters)
            except jsonschema.SchemaError as e:
                raise _bad(param, f"is not a valid JSON schema: {e.message}") from None
            except RecursionError:
                raise _bad(param, "is nested too deeply") from None
            if fn.parameters.get("type", "object") != "object":
                raise _bad(param, "must describe an object (the call's arguments)")
            params = json.dumps(fn.parameters, ensure_ascii=False)
        specs.append(ToolSpec(fn.name, fn.description, params))
    return specs


def _parameters(spec: ToolSpec) -> dict[str, Any]:
    return json.loads(spec.parameters) if spec.parameters is not None else NO_PARAMETERS


def required_schema(specs: list[ToolSpec], parallel: bool) -> dict[str, Any]:
    """vLLM's schema for tool_choice "required": a JSON array of one or more
    ``{"name": ..., "parameters": ...}``, each element one of the tools (at most one element
    when parallel calls are off)."""
    items = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [s.name]},
                "parameters": _parameters(s),
            },
            "required": ["name", "parameters"],
        }
        for s in specs
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def _grammar(schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput("json", json.dumps(schema, ensure_ascii=False), "tool_choice")


def tool_setup(
    tools: list[ChatTool] | None,
    choice: ToolChoice | None,
    parallel: bool | None,
    settings: Settings | None,
) -> ToolSetup:
    """Check ``tools`` and ``tool_choice`` (400s naming the field) and say how the request
    runs. ``tool_choice`` defaults to "auto" with tools and "none" without, as OpenAI's."""
    if not tools:
        if choice not in (None, "none"):
            raise _bad("tool_choice", "needs tools: send the functions the model may call")
        return ToolSetup()
    specs = check_tools(tools)
    choice = "auto" if choice is None else choice
    if choice == "none":
        return ToolSetup(specs)
    if choice == "auto":
        gw = settings.gateway if settings is not None else None
        if gw is not None and not gw.enable_auto_tool_choice:
            raise _bad(
                "tool_choice",
                '"auto" tool choice needs the server started with --enable-auto-tool-choice '
                '(send tool_choice "required", a named function or "none")',
            )
        parser = gw.tool_call_parser if gw is not None else "hermes"
        return ToolSetup(specs, ToolParsing("auto", parser=parser))
    if choice == "required":
        schema = required_schema(specs, parallel is not False)
        return ToolSetup(specs, ToolParsing("required"), _grammar(schema))
    assert isinstance(choice, NamedToolChoice)
    name = choice.function.name
    spec = next((s for s in specs if s.name == name), None)
    if spec is None:
        known = ", ".join(s.name for s in specs)
        raise _bad("tool_choice", f"names the function {name!r}, which is not in tools ({known})")
    return ToolSetup(specs, ToolParsing("named", name=name), _grammar(_parameters(spec)))


def _arguments(value: str | dict[str, Any], param: str) -> str:
    if isinstance(value, dict):
        return json.dumps(value, ensure_ascii=False)
    try:
        parsed = json.loads(value)
    except ValueError:
        raise _bad(param, "must be JSON text of the call's arguments") from None
    if not isinstance(parsed, dict):
        raise _bad(param, "must be a JSON object")
    return value


def chat_messages(messages: list[ChatMessageIn]) -> list[ChatMessage]:
    """The conversation as the tokenizer's chat template takes it ("developer" is OpenAI's new
    name for "system"). An assistant's ``tool_calls`` are checked (arguments JSON objects) and
    every ``tool`` message must answer an earlier call by its ``tool_call_id``."""
    out: list[ChatMessage] = []
    calls: dict[str, str] = {}  # call id -> function name
    for i, m in enumerate(messages):
        role = "system" if m.role == "developer" else m.role
        msg = ChatMessage(role, m.text())
        if m.tool_calls:
            if m.role != "assistant":
                raise _bad(f"messages[{i}].tool_calls", "only assistant messages make calls")
            for j, c in enumerate(m.tool_calls):
                param = f"messages[{i}].tool_calls[{j}].function.arguments"
                msg.tool_calls.append(
                    ToolCall(c.id, c.function.name, _arguments(c.function.arguments, param))
                )
                calls[c.id] = c.function.name
        if m.role == "tool":
            if m.tool_call_id is None:
                raise _bad(f"messages[{i}].tool_call_id", "a tool message must name its call")
            if m.tool_call_id not in calls:
                raise _bad(
                    f"messages[{i}].tool_call_id",
                    f"{m.tool_call_id!r} answers no tool call of an earlier assistant message",
                )
            msg.tool_call_id = m.tool_call_id
            msg.name = calls[m.tool_call_id]
        out.append(msg)
    return out
