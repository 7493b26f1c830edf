"""Tool calling through the official openai SDK against the default stack: "required" and a
named function (forced by the grammar: the arguments always validate against the tool's
schema), "auto" with the hermes parser, a whole round trip (call -> result -> answer), the
Responses API's function_call items, and the 400s.

SmolLM2-135M does not call tools on its own from a plain question under "auto"; the "auto" tests
show it one earlier call in the conversation (user question -> assistant <tool_call>), after
which it writes a call for the new question by itself, which the hermes parser finds."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.helpers.stack import wait_all_blocks_free
from tests.helpers.tools import TIME, TOOLS, WEATHER, one_shot

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"

SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def streamed_calls(stream) -> tuple[list[dict], str, list[str]]:
    """(calls joined from the chunks' delta.tool_calls, content, finish reasons); checks that
    each call's first piece brings its id, type and name and later ones only arguments."""
    calls: dict[int, dict] = {}
    content, finishes = "", []
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        if choice.finish_reason:
            finishes.append(choice.finish_reason)
        for piece in choice.delta.tool_calls or []:
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.name
                calls[piece.index] = {"id": piece.id, "name": piece.function.name, "arguments": ""}
            else:
                assert piece.id is None and not piece.function.name
            calls[piece.index]["arguments"] += piece.function.arguments or ""
    return [calls[i] for i in sorted(calls)], content, finishes


def check_call(name: str, arguments: str) -> dict:
    args = json.loads(arguments)
    jsonschema.validate(args, SCHEMAS[name])
    return args


def ask(client, stream: bool, **kw):
    return client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=80, tools=TOOLS, stream=stream, **kw
    )


@pytest.mark.parametrize("stream", [False, True])
def test_required_gives_calls_whose_arguments_validate(client, stack, stream) -> None:
    # one call (the grammar's maxItems): with parallel calls allowed, SmolLM2 repeats the same
    # call until max_tokens
    resp = ask(client, stream, messages=ASK, tool_choice="required", parallel_tool_calls=False)
    if stream:
        calls, content, finishes = streamed_calls(resp)
        assert content == "" and finishes == ["tool_calls"]
    else:
        choice = resp.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls
        ]
    [call] = calls
    assert call["name"] == "get_weather"
    assert check_call("get_weather", call["arguments"])["city"] == "Paris"
    assert wait_all_blocks_free(stack)["num_free_blocks"] > 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_named_function_is_called_with_valid_arguments(client, stream) -> None:
    choice = {"type": "function", "function": {"name": "get_time"}}
    resp = ask(client, stream, messages=ASK, tool_choice=choice)
    if stream:
        calls, content, finishes = streamed_calls(resp)
        assert content == "" and finishes == ["stop"]  # vLLM's: a named call ends with stop
        [call] = calls
    else:
        msg = resp.choices[0].message
        [c] = msg.tool_calls
        call = {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
        assert msg.content is None and resp.choices[0].finish_reason == "stop"
    assert call["name"] == "get_time" and call["id"].startswith("chatcmpl-tool-")
    check_call("get_time", call["arguments"])


@pytest.mark.parametrize("stream", [False, True])
def test_auto_parses_the_call_the_model_writes(client, stream) -> None:
    resp = ask(client, stream, messages=one_shot("Tokyo"))  # tool_choice: auto by default
    if stream:
        calls, content, finishes = streamed_calls(resp)
    else:
        choice = resp.choices[0]
        content, finishes = choice.message.content or "", [choice.finish_reason]
        calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls or []
        ]
    assert "<tool_call>" not in content  # the call's text is not content
    assert finishes == ["tool_calls"]
    assert [c["name"] for c in calls] == ["get_weather"]
    assert json.loads(calls[0]["arguments"])["city"] == "Tokyo"
    # with tool_choice "none" the same text stays content
    none = ask(client, False, messages=one_shot("Tokyo"), tool_choice="none").choices[0]
    assert none.message.tool_calls is None and "<tool_call>" in none.message.content


def test_a_whole_round_trip(client) -> None:
    first = ask(client, False, messages=ASK, tool_choice="required", parallel_tool_calls=False)
    first = first.choices[0].message
    call = first.tool_calls[0]
    args = check_call(call.function.name, call.function.arguments)
    convo = [
        *ASK,
        first.model_dump(exclude_none=True),  # the assistant's call, as the SDK gives it back
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({**args, "temp": 21})},
    ]
    answer = ask(client, False, messages=convo, tool_choice="none").choices[0]
    assert answer.message.tool_calls is None
    assert answer.message.content and answer.finish_reason in ("stop", "length")
    # the result is in the prompt the model saw
    tokens = client.post(
        "/../tokenize",
        cast_to=object,
        body={"model": MODEL, "messages": convo, "tools": TOOLS},
    )
    text = client.post("/../detokenize", cast_to=object, body={"tokens": tokens["tokens"]})
    assert '<tool_response>\n{"city": ' in text["prompt"] and '"temp": 21}' in text["prompt"]


def test_responses_api_function_calls(client) -> None:
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]
    resp = client.responses.create(
        model=MODEL,
        input="What is the weather like in Paris today?",
        tools=tools,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=0,
    )
    [item] = resp.output
    assert item.type == "function_call" and item.name == "get_weather"
    check_call("get_weather", item.arguments)
    with client.responses.stream(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather like in Paris today?"},
            {
                "type": "function_call",
                "call_id": item.call_id,
                "name": item.name,
                "arguments": item.arguments,
            },
            {"type": "function_call_output", "call_id": item.call_id, "output": "21 degrees"},
        ],
        tools=tools,
        tool_choice="none",
        max_output_tokens=30,
        temperature=0,
    ) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_response()
    assert kinds[-1] == "response.completed" and final.output[0].type == "message"
    assert final.output_text


@pytest.mark.parametrize(
    ("kw", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 7}}}]},
            "tools[0].function.parameters",
        ),
        (
            {"messages": [*ASK, {"role": "tool", "tool_call_id": "call-x", "content": "1"}]},
            "messages[1].tool_call_id",
        ),
    ],
)
def test_bad_tool_requests_are_400s_naming_the_field(client, kw, param) -> None:
    body = {"model": MODEL, "messages": ASK, "tools": TOOLS, "max_tokens": 5, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(**body)
    assert e.value.body["param"] == param
