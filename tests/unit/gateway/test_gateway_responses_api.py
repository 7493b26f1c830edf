"""/v1/responses as a chat job: the conversation it becomes, what it refuses by name, and the
Response object and stream events it answers with (offline, no pipeline)."""

from __future__ import annotations

import json

import pytest

from kvflow.services.gateway.convert import parse_request
from kvflow.services.gateway.errors import APIError
from kvflow.services.gateway.responses import Outcome
from kvflow.services.gateway.responses_api import ResponsesFormat, ResponsesRequest, responses_job


def rjob(**body):
    req = parse_request(ResponsesRequest, json.dumps({"input": "hi", **body}).encode())
    return req, responses_job(req, "resp-1", "inbox", 0.0)


def test_instructions_and_input_become_the_chat_conversation() -> None:
    _, job = rjob(instructions="Be brief.", max_output_tokens=7, top_k=5, seed=3)
    gen = job.prompts[0]
    assert [(m.role, m.content) for m in gen.messages] == [("system", "Be brief."), ("user", "hi")]
    assert (gen.params.max_tokens, gen.params.top_k, gen.params.seed) == (7, 5, 3)
    assert job.include_usage and job.n == 1
    items = [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
        {"role": "user", "content": "c"},
    ]
    _, job = rjob(input=items)
    got = [(m.role, m.content) for m in job.prompts[0].messages]
    assert got == [("system", "Rules."), ("user", "a"), ("assistant", "b"), ("user", "c")]
    schema = {"type": "object", "properties": {"x": {"type": "integer"}}}
    fmt = {"format": {"type": "json_schema", "name": "n", "schema": schema, "strict": True}}
    so = rjob(text=fmt)[1].prompts[0].params.structured_output
    assert so is not None and so.param == "response_format" and json.loads(so.spec) == schema


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp-0"}, "previous_response_id"),
        ({"tools": [{"type": "web_search_preview"}]}, "tools[0].type"),
        ({"reasoning": {"effort": "low"}}, "reasoning"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"background": True}, "background"),
        ({"truncation": "auto"}, "truncation"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"temperature": -1}, "temperature"),
        ({"input": []}, "input"),
    ],
)
def test_what_cannot_be_done_is_refused_by_name(body, param) -> None:
    with pytest.raises(APIError) as e:
        rjob(**body)
    assert e.value.status == 400 and e.value.param == param
    assert e.value.message.startswith(param)


def test_response_object_and_stream_events() -> None:
    req, _ = rjob(instructions="Be brief.", max_output_tokens=2, metadata={"k": "v"})
    fmt = ResponsesFormat("resp-1", "m", created=5, include_usage=True)
    fmt.take_request(req)
    body = fmt.response([Outcome("Hi there", "length", 9, 2)], 9)
    assert body["object"] == "response" and body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    [item] = body["output"]
    assert item["type"] == "message" and item["role"] == "assistant"
    assert item["content"][0]["text"] == "Hi there"
    assert body["usage"] == {"input_tokens": 9, "output_tokens": 2, "total_tokens": 11}
    assert (body["instructions"], body["metadata"]) == ("Be brief.", {"k": "v"})

    fmt = ResponsesFormat("resp-1", "m", created=5, include_usage=True)
    fmt.take_request(req)
    events = [*fmt.opening_chunks(), *fmt.text_chunk("Hi", None), *fmt.text_chunk(" there", "stop")]
    events.append(fmt.usage_chunk(9, 2))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(10))
    assert events[6]["text"] == "Hi there"
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "Hi there"
    assert fmt.encode(events[4]).startswith(b"event: response.output_text.delta\ndata: {")
    assert fmt.done == b""
