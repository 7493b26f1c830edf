"""/v1/responses through the official openai SDK (client.responses.create): the same greedy text
as /v1/chat/completions on the same conversation, streamed as typed events, structured output,
and refusals by name."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

pytestmark = pytest.mark.e2e
MODEL = "SmolLM2-135M-Instruct"


def test_same_text_as_chat_and_the_response_object(client) -> None:
    kw = {"model": MODEL, "temperature": 0}
    chat = client.chat.completions.create(
        messages=[
            {"role": "system", "content": "Answer in one sentence."},
            {"role": "user", "content": "What is the capital of France?"},
        ],
        max_tokens=12,
        **kw,
    )
    r = client.responses.create(
        instructions="Answer in one sentence.",
        input="What is the capital of France?",
        max_output_tokens=12,
        metadata={"team": "search"},
        **kw,
    )
    assert r.object == "response" and r.model == MODEL
    assert r.output_text == chat.choices[0].message.content
    assert r.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    [item] = r.output
    assert item.type == "message" and item.role == "assistant"
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.usage.output_tokens == chat.usage.completion_tokens
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.metadata == {"team": "search"} and r.instructions == "Answer in one sentence."


def test_stream_events_in_order_with_the_same_text(client) -> None:
    kw = {"model": MODEL, "input": "Name three colors.", "max_output_tokens": 10, "temperature": 0}
    whole = client.responses.create(**kw)
    events = list(client.responses.create(stream=True, **kw))
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        f"response.{whole.status}",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text == events[-1].response.output_text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


def test_json_schema_text_format_validates(client) -> None:
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}, "rank": {"type": "integer"}},
        "required": ["city", "rank"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=MODEL,
        input="Give a city and its rank as JSON.",
        max_output_tokens=60,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(r.output_text), schema)


def test_refusals_name_the_field(client) -> None:
    for extra, param in (
        ({"previous_response_id": "resp-123"}, "previous_response_id"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
    ):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=MODEL, input="hi", **extra)
        assert e.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=MODEL, input="word " * 3000, max_output_tokens=4)
    assert e.value.body["param"] == "input"  # too long for the model: named as the client knows it
