"""Tool calling at the edge, offline: tools and tool_choice -> what the pipeline carries (the
template's tools, the detokenizer's parsing, the forced call's grammar), the 400s naming the
field, conversations with calls and results, and the chat and Responses shapes of the calls."""

from __future__ import annotations

import json

import jsonschema
import pytest

from kvflow.services.gateway.convert import chat_job, parse_request
from kvflow.services.gateway.errors import APIError
from kvflow.services.gateway.protocol import ChatCompletionRequest
from kvflow.services.gateway.responses import ChatFormat, Outcome, outcome_of
from kvflow.services.gateway.responses_api import ResponsesFormat, ResponsesRequest, responses_job
from kvflow.shared.config import Settings
from kvflow.shared.messages import Delta, ToolCallDelta, ToolParsing
from kvflow.shared.request_streams import join_tool_calls, merge_delta

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
    "required": ["city"],
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "now", "description": "the time"}},
]
USER = [{"role": "user", "content": "Weather in Paris?"}]


def chjob(settings: Settings | None = None, **body):
    data = {"messages": USER, **body}
    req = parse_request(ChatCompletionRequest, json.dumps(data).encode())
    return chat_job(req, "chatcmpl-1", "inbox", 0.0, settings)


def refused(settings: Settings | None = None, **body) -> APIError:
    with pytest.raises(APIError) as e:
        chjob(settings, **body)
    assert e.value.status == 400
    return e.value


def test_auto_is_the_default_with_tools_and_parses_with_the_configured_parser() -> None:
    gen = chjob(tools=TOOLS).prompts[0]
    assert gen.tool_parsing == ToolParsing("auto", parser="hermes")
    assert gen.params.structured_output is None  # the model chooses: nothing forced
    assert [t.name for t in gen.tools] == ["get_weather", "now"]
    assert json.loads(gen.tools[0].parameters) == WEATHER and gen.tools[1].parameters is None
    assert gen.tools[1].description == "the time"
    s = Settings.of(tool_call_parser="llama3_json")
    assert chjob(s, tools=TOOLS).prompts[0].tool_parsing == ToolParsing("auto", "llama3_json")
    none = chjob(tools=TOOLS, tool_choice="none").prompts[0]
    assert none.tool_parsing is None and len(none.tools) == 2  # still shown to the template
    plain = chjob().prompts[0]
    assert plain.tool_parsing is None and plain.tools == []


def test_auto_can_be_switched_off_as_vllm_without_the_flag() -> None:
    off = Settings.of(enable_auto_tool_choice=False)
    e = refused(off, tools=TOOLS)
    assert e.param == "tool_choice" and "--enable-auto-tool-choice" in e.message
    assert (
        chjob(off, tools=TOOLS, tool_choice="required").prompts[0].tool_parsing.mode == "required"
    )


def required_instances(schema: dict) -> None:
    v = jsonschema.Draft202012Validator(schema)
    assert v.is_valid([{"name": "get_weather", "parameters": {"city": "Paris"}}])
    assert v.is_valid([{"name": "now", "parameters": {}}, {"name": "now", "parameters": {}}])
    assert not v.is_valid([])  # at least one call
    assert not v.is_valid([{"name": "get_weather", "parameters": {}}])  # city is required
    assert not v.is_valid([{"name": "other", "parameters": {}}])
    assert not v.is_valid([{"name": "get_weather", "parameters": {"city": "P", "unit": "k"}}])


def test_required_forces_a_json_array_of_calls_to_the_given_tools() -> None:
    gen = chjob(tools=TOOLS, tool_choice="required").prompts[0]
    so = gen.params.structured_output
    assert gen.tool_parsing == ToolParsing("required")
    assert so is not None and so.kind == "json" and so.param == "tool_choice"
    schema = json.loads(so.spec)
    required_instances(schema)
    assert "maxItems" not in schema
    one = json.loads(
        chjob(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        .prompts[0]
        .params.structured_output.spec
    )
    assert one["maxItems"] == 1


def test_a_named_function_forces_its_arguments() -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    gen = chjob(tools=TOOLS, tool_choice=choice).prompts[0]
    assert gen.tool_parsing == ToolParsing("named", name="get_weather")
    assert json.loads(gen.params.structured_output.spec) == WEATHER
    choice = {"type": "function", "function": {"name": "now"}}  # no parameters: an empty object
    spec = json.loads(
        chjob(tools=TOOLS, tool_choice=choice).prompts[0].params.structured_output.spec
    )
    assert spec == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}},
            "tool_choice",
        ),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools[1].function.name"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
            "tools[0].function.parameters",
        ),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"type": "string"}},
                    }
                ]
            },
            "tools[0].function.parameters",
        ),
        ({"tools": [{"type": "code_interpreter"}]}, "tools"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "response_format",
        ),
        (
            {"tools": TOOLS, "tool_choice": "required", "allowed_token_ids": [1, 2]},
            "allowed_token_ids",
        ),
    ],
)
def test_bad_tools_are_400s_naming_the_field(body, param) -> None:
    assert refused(**body).param == param


def call(cid: str, name: str = "get_weather", args: object = '{"city": "Paris"}') -> dict:
    return {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}


def test_a_conversation_with_calls_and_results() -> None:
    convo = [
        *USER,
        {"role": "assistant", "content": None, "tool_calls": [call("c1"), call("c2", "now", {})]},
        {"role": "tool", "tool_call_id": "c1", "content": "22 C"},
        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
    ]
    msgs = chjob(messages=convo, tools=TOOLS).prompts[0].messages
    assert msgs[1].role == "assistant" and msgs[1].content == ""
    assert [(c.id, c.name, json.loads(c.arguments)) for c in msgs[1].tool_calls] == [
        ("c1", "get_weather", {"city": "Paris"}),
        ("c2", "now", {}),
    ]
    assert [(m.role, m.tool_call_id, m.name, m.content) for m in msgs[2:]] == [
        ("tool", "c1", "get_weather", "22 C"),
        ("tool", "c2", "now", "noon"),
    ]


@pytest.mark.parametrize(
    ("convo", "param"),
    [
        ([*USER, {"role": "tool", "content": "x"}], "messages[1].tool_call_id"),
        (
            [*USER, {"role": "tool", "tool_call_id": "c9", "content": "x"}],
            "messages[1].tool_call_id",
        ),
        (
            # the result comes before its call
            [
                {"role": "tool", "tool_call_id": "c1", "content": "x"},
                {"role": "assistant", "tool_calls": [call("c1")]},
            ],
            "messages[0].tool_call_id",
        ),
        (
            [*USER, {"role": "assistant", "tool_calls": [call("c1", args="{not json")]}],
            "messages[1].tool_calls[0].function.arguments",
        ),
        (
            [*USER, {"role": "assistant", "tool_calls": [call("c1", args="[1]")]}],
            "messages[1].tool_calls[0].function.arguments",
        ),
        ([{"role": "user", "content": "x", "tool_calls": [call("c1")]}], "messages[0].tool_calls"),
    ],
)
def test_bad_conversations_are_400s_naming_the_message(convo, param) -> None:
    assert refused(messages=convo, tools=TOOLS).param == param


def piece(i: int, args: str = "", cid: str | None = None, name: str | None = None) -> ToolCallDelta:
    return ToolCallDelta(i, cid, name, args)


PIECES = [
    piece(0, "", "call-a", "get_weather"),
    piece(0, '{"city": '),
    piece(0, '"Paris"}'),
    piece(1, "{}", "call-b", "now"),
]


def test_pieces_join_per_call_and_merge_across_deltas() -> None:
    joined = join_tool_calls(PIECES)
    assert joined == [piece(0, '{"city": "Paris"}', "call-a", "get_weather"), PIECES[3]]
    first = Delta("r", "Sure.", 1, tool_calls=PIECES[:2])
    merge_delta(first, Delta("r", "", 1, tool_calls=PIECES[2:]))
    assert first.tool_calls == joined and first.text == "Sure."


def test_chat_chunks_and_message_carry_the_calls() -> None:
    fmt = ChatFormat("chatcmpl-1", "m")
    chunks = fmt.text_chunk("Let me check.", None, 0, tool_calls=PIECES[:2])
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"content": "Let me check."},
        {
            "tool_calls": [
                {
                    "index": 0,
                    "id": "call-a",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": '},
                }
            ]
        },
    ]
    chunks = fmt.text_chunk("", "tool_calls", 0, tool_calls=PIECES[2:])
    assert chunks[0]["choices"][0]["delta"]["tool_calls"][0] == {
        "index": 0,
        "function": {"arguments": '"Paris"}'},
    }
    assert chunks[-1]["choices"][0] == {
        "index": 0,
        "delta": {},
        "logprobs": None,
        "finish_reason": "tool_calls",
    }
    out = outcome_of(
        [
            Delta("r", "", 3, tool_calls=PIECES[:3]),
            Delta("r", "", 1, "tool_calls", tool_calls=PIECES[3:]),
        ]
    )
    msg = fmt.response([out], 5)["choices"][0]["message"]
    assert msg["content"] is None  # as OpenAI: null, not ""
    assert msg["tool_calls"] == [
        {
            "id": "call-a",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
        },
        {"id": "call-b", "type": "function", "function": {"name": "now", "arguments": "{}"}},
    ]
    plain = fmt.response([Outcome("hi", "stop", 5, 1)], 5)["choices"][0]["message"]
    assert plain == {"role": "assistant", "content": "hi"}


def rjob(**body):
    req = parse_request(ResponsesRequest, json.dumps({"input": "hi", **body}).encode())
    return req, responses_job(req, "resp-1", "inbox", 0.0)


RTOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER, "strict": True}]


def test_responses_function_tools_and_items_become_the_chat_request() -> None:
    items = [
        {"role": "user", "content": "Weather?"},
        {
            "type": "function_call",
            "call_id": "c1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "c1", "output": "22 C"},
    ]
    _, job = rjob(
        input=items, tools=RTOOLS, tool_choice={"type": "function", "name": "get_weather"}
    )
    gen = job.prompts[0]
    assert gen.tool_parsing == ToolParsing("named", name="get_weather")
    assert [(m.role, m.tool_call_id) for m in gen.messages] == [
        ("user", None),
        ("assistant", None),
        ("tool", "c1"),
    ]
    assert gen.messages[1].tool_calls[0].name == "get_weather"
    with pytest.raises(APIError) as e:
        rjob(tools=[{"type": "function", "name": "bad name"}])
    assert e.value.param == "tools[0].name"
    with pytest.raises(APIError) as e:
        rjob(input=[{"type": "function_call_output", "call_id": "zz", "output": "x"}], tools=RTOOLS)
    assert e.value.param == "input[0].tool_call_id"


def test_responses_stream_and_object_have_function_call_items() -> None:
    req, _ = rjob(tools=RTOOLS)
    fmt = ResponsesFormat("resp-1", "m")
    fmt.take_request(req)
    events = fmt.opening_chunks()
    events += fmt.text_chunk("", None, tool_calls=PIECES[:2])
    events += fmt.text_chunk("", "tool_calls", tool_calls=PIECES[2:3])
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    added, done = events[2]["item"], events[-1]["item"]
    assert (added["type"], added["call_id"], added["name"], added["arguments"]) == (
        "function_call",
        "call-a",
        "get_weather",
        "",
    )
    assert done["arguments"] == '{"city": "Paris"}' and done["status"] == "completed"
    assert events[-2]["arguments"] == '{"city": "Paris"}'
    final = fmt.usage_chunk(5, 4)["response"]
    assert [o["type"] for o in final["output"]] == ["function_call"]
    assert final["tools"] == RTOOLS
    full = fmt.response([outcome_of([Delta("r", "ok", 4, "tool_calls", tool_calls=PIECES)])], 5)
    assert [(o["type"], o.get("name")) for o in full["output"]] == [
        ("message", None),
        ("function_call", "get_weather"),
        ("function_call", "now"),
    ]
    assert full["output"][1]["id"] != full["output"][2]["id"]


def test_a_response_cut_at_the_token_limit_marks_only_the_cut_call_incomplete() -> None:
    """Before: every item of an incomplete response was marked incomplete, whole calls too."""
    req, _ = rjob(tools=RTOOLS)
    fmt = ResponsesFormat("resp-1", "m")
    fmt.take_request(req)
    cut = piece(1, '{"tz": "Eur', "call-b", "now")  # the second call, cut mid-arguments
    events = fmt.text_chunk("Let me check.", None, tool_calls=PIECES[:3])
    events += fmt.text_chunk("", "length", tool_calls=[cut])
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["type"], i["status"]) for i in done] == [
        ("message", "completed"),  # the text ended when the calls began
        ("function_call", "completed"),
        ("function_call", "incomplete"),
    ]
    final = fmt.usage_chunk(5, 9)
    assert final["type"] == "response.incomplete"
    assert [o["status"] for o in final["response"]["output"]] == [
        "completed",
        "completed",
        "incomplete",
    ]
    whole = outcome_of([Delta("r", "", 9, "length", tool_calls=PIECES)])  # both calls whole
    full = fmt.response([whole], 5)
    assert full["status"] == "incomplete"
    assert [o["status"] for o in full["output"]] == ["completed", "completed"]
    text_only = fmt.response([outcome_of([Delta("r", "cut", 9, "length")])], 5)
    assert [o["status"] for o in text_only["output"]] == ["incomplete"]  # the text was cut


def test_the_documented_schemas_take_the_call_shapes() -> None:
    from kvflow.services.gateway.schemas import ChatCompletionResponse, ResponsesResponse

    out = outcome_of([Delta("r", "", 4, "tool_calls", tool_calls=PIECES)])
    ChatCompletionResponse.model_validate(ChatFormat("chatcmpl-1", "m").response([out], 5))
    req, _ = rjob(tools=RTOOLS)
    fmt = ResponsesFormat("resp-1", "m")
    fmt.take_request(req)
    ResponsesResponse.model_validate(fmt.response([out], 5))


def test_parallel_tool_calls_false_answers_only_the_first_call() -> None:
    from kvflow.services.gateway.generation import full_response

    assert not chjob(tools=TOOLS).first_tool_call_only
    job = chjob(tools=TOOLS, parallel_tool_calls=False)
    assert job.first_tool_call_only
    out = outcome_of([Delta("r", "", 4, "tool_calls", tool_calls=PIECES)])
    [choice] = full_response(job, [out], ChatFormat("chatcmpl-1", "m"), None)["choices"]
    assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
    assert choice["finish_reason"] == "tool_calls"
