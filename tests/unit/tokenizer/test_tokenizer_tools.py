"""Chat templates with tools, with the model's real tokenizer (offline): SmolLM2's own template
has no tools, so a conversation with tools goes through kvflow's hermes template, which renders
a conversation without tools exactly as the model's own does."""

from __future__ import annotations

import json

import pytest

from kvflow.services.tokenizer.prompts import PromptError, chat_prompt, prompt_token_ids
from kvflow.services.tokenizer.rpc import tokenize
from kvflow.shared.chat_template import TOOL_TEMPLATE, read_chat_template
from kvflow.shared.messages import (
    ChatMessage,
    GenerateRequest,
    SamplingParams,
    TokenizeRequest,
    ToolCall,
    ToolSpec,
)

WEATHER = ToolSpec(
    "get_weather",
    "Current weather",
    json.dumps({"type": "object", "properties": {"city": {"type": "string"}}}),
)


def gen(**kw) -> GenerateRequest:
    return GenerateRequest(request_id="r", reply_to="inbox", params=SamplingParams(), **kw)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_the_tool_template_equals_the_models_own_without_tools(
    tokenizer, add_generation_prompt
) -> None:
    template = TOOL_TEMPLATE.read_text()
    for convo in (
        [{"role": "user", "content": "Hi"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Bye"},
        ],
    ):
        own = tokenizer.apply_chat_template(
            convo, tokenize=False, add_generation_prompt=add_generation_prompt
        )
        ours = tokenizer.apply_chat_template(
            convo,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            chat_template=template,
        )
        assert ours == own


def test_tools_are_listed_in_the_system_turn(tokenizer) -> None:
    ids = prompt_token_ids(
        tokenizer, gen(messages=[ChatMessage("user", "Weather in Paris?")], tools=[WEATHER])
    )
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert (
        "<tools>\n"
        + json.dumps(
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "description": "Current weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        )
        + "\n</tools>"
        in text
    )
    assert "<tool_call>" in text and text.endswith(
        "Weather in Paris?<|im_end|>\n<|im_start|>assistant\n"
    )
    # without tools the prompt is the model's own
    plain = prompt_token_ids(tokenizer, gen(messages=[ChatMessage("user", "Weather in Paris?")]))
    assert "<tools>" not in tokenizer.decode(plain)
    # a system message is kept, the tools after it
    ids = prompt_token_ids(
        tokenizer,
        gen(
            messages=[ChatMessage("system", "Be brief."), ChatMessage("user", "Hi")],
            tools=[WEATHER],
        ),
    )
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")


def test_calls_and_results_are_rendered_as_hermes_writes_them(tokenizer) -> None:
    convo = [
        ChatMessage("user", "Weather in Paris and Rome?"),
        ChatMessage(
            "assistant",
            "",
            tool_calls=[
                ToolCall("c1", "get_weather", '{"city": "Paris"}'),
                ToolCall("c2", "get_weather", '{"city": "Rome"}'),
            ],
        ),
        ChatMessage("tool", "22 C", tool_call_id="c1", name="get_weather"),
        ChatMessage("tool", "25 C", tool_call_id="c2", name="get_weather"),
    ]
    text = tokenizer.decode(prompt_token_ids(tokenizer, gen(messages=convo, tools=[WEATHER])))
    assert (
        "<|im_start|>assistant\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n22 C\n</tool_response>\n"
        "<tool_response>\n25 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    ) in text
    # /tokenize renders the same prompt (vLLM's /tokenize takes the tools too)
    rpc = tokenize(tokenizer, TokenizeRequest(messages=convo, tools=[WEATHER]), 8192)
    assert tokenizer.decode(rpc.tokens) == text


def test_bad_arguments_and_templates_are_named(tokenizer, tmp_path) -> None:
    convo = [
        ChatMessage("user", "x"),
        ChatMessage("assistant", "", tool_calls=[ToolCall("c1", "f", "{nope")]),
    ]
    with pytest.raises(PromptError) as e:
        chat_prompt(tokenizer, convo, [], True, False, tokenize=True)
    assert e.value.param == "messages[1].tool_calls[0].function.arguments"
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0]['content'] }}")
    assert read_chat_template(str(path)) == "{{ messages[0]['content'] }}"
    assert read_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}").startswith(
        "{%"
    )
    with pytest.raises(FileNotFoundError, match="--chat-template"):
        read_chat_template(str(tmp_path / "missing.jinja"))


def test_the_python_api_renders_the_prompt_the_http_api_does(tokenizer) -> None:
    """LLM.chat's messages and tools (OpenAI dicts, through shared.chat_template.from_openai)
    give the same token ids as a chat request's GenerateRequest in the tokenizer service."""
    from kvflow.services.gateway.convert import chat_job, parse_request
    from kvflow.services.gateway.protocol import ChatCompletionRequest
    from kvflow.shared.chat_template import from_openai, render_chat

    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Current weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3 C"},
    ]
    body = json.dumps({"messages": messages, "tools": tools}).encode()
    gen = chat_job(parse_request(ChatCompletionRequest, body), "r", "inbox", 0.0).prompts[0]
    msgs, specs = from_openai(messages, tools)
    assert render_chat(tokenizer, msgs, specs, True, False, tokenize=True) == prompt_token_ids(
        tokenizer, gen
    )
