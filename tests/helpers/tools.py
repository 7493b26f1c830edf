"""Tool definitions and a one-shot tool-calling conversation, for the whole-stack tests."""

from __future__ import annotations

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "description": "The city name"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
}


TIME = {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": WEATHER,
        },
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "The time now", "parameters": TIME},
    },
]


def one_shot(city: str) -> list[dict]:
    """An earlier question answered with a call, then the new question."""
    call = {
        "id": "call-0",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    return [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "user", "content": f"What is the weather in {city}?"},
    ]
