"""The gateway's request validation and OpenAI -> GenerateRequest mapping (no network)."""

from __future__ import annotations

import json

import pytest

from kvflow.services.gateway.convert import (
    chat_job,
    completion_job,
    parse_request,
    served_model_name,
)
from kvflow.services.gateway.errors import APIError
from kvflow.services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from kvflow.services.gateway.responses import ChatFormat, CompletionFormat, Outcome
from kvflow.shared.config import Settings
from kvflow.shared.messages import ChatMessage, SamplingParams

HI = [{"role": "user", "content": "hi"}]


def chat(**body) -> ChatCompletionRequest:
    return parse_request(ChatCompletionRequest, json.dumps({"messages": HI, **body}).encode())


def completion(**body) -> CompletionRequest:
    return parse_request(CompletionRequest, json.dumps({"prompt": "p", **body}).encode())


def chat_to_generate(req, request_id, reply_to, arrival_time):
    return chat_job(req, request_id, reply_to, arrival_time).prompts[0]


def completion_to_generate(req, request_id, reply_to, arrival_time):
    return completion_job(req, request_id, reply_to, arrival_time).prompts[0]


def test_chat_defaults_follow_vllm() -> None:
    gen = chat_to_generate(chat(), "chatcmpl-1", "inbox", 12.5)
    assert gen.request_id == "chatcmpl-1" and gen.reply_to == "inbox"
    assert gen.messages == [ChatMessage("user", "hi")]
    assert gen.prompt is None and gen.prompt_token_ids is None
    assert gen.arrival_time == 12.5
    # max_tokens absent -> 0: the tokenizer fills the context
    assert gen.params == SamplingParams(max_tokens=0, temperature=1.0, top_p=1.0)


def test_completion_defaults_follow_vllm() -> None:
    gen = completion_to_generate(completion(), "cmpl-1", "inbox", 0.0)
    assert gen.prompt == "p" and gen.messages is None
    assert gen.params == SamplingParams(max_tokens=16)


def test_params_are_mapped() -> None:
    req = chat(
        temperature=0,
        top_p=0.5,
        max_tokens=7,
        stop="END",
        seed=3,
        top_k=20,
        min_p=0.1,
        ignore_eos=True,
        min_tokens=2,
        stop_token_ids=[5, 6],
        skip_special_tokens=False,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        user="someone",
        n=1,
    )
    p = chat_to_generate(req, "r", "i", 0).params
    assert (p.temperature, p.top_p, p.max_tokens, p.stop, p.seed) == (0.0, 0.5, 7, ["END"], 3)
    assert (p.top_k, p.min_p, p.ignore_eos, p.min_tokens) == (20, 0.1, True, 2)
    assert (p.stop_token_ids, p.skip_special_tokens, p.repetition_penalty) == ([5, 6], False, 1.2)
    assert (p.presence_penalty, p.frequency_penalty) == (0.5, -0.5)


def test_stop_list_top_k_off_and_max_completion_tokens_wins() -> None:
    p = chat_to_generate(
        chat(stop=["a", "b"], top_k=-1, max_tokens=5, max_completion_tokens=9), "r", "i", 0
    ).params
    assert p.stop == ["a", "b"] and p.top_k == 0 and p.max_tokens == 9


def test_explicit_nulls_mean_defaults() -> None:
    p = completion_to_generate(
        completion(temperature=None, top_p=None, max_tokens=None, stop=None), "r", "i", 0
    ).params
    assert p == SamplingParams(max_tokens=16)


def test_content_parts_and_roles() -> None:
    req = chat(
        messages=[
            {"role": "developer", "content": "be brief"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None},
        ]
    )
    assert chat_to_generate(req, "r", "i", 0).messages == [
        ChatMessage("system", "be brief"),
        ChatMessage("user", "a\nb"),
        ChatMessage("assistant", ""),
    ]


@pytest.mark.parametrize(
    ("prompt", "text", "ids"),
    [("x", "x", None), (["x"], "x", None), ([1, 2], None, [1, 2]), ([[3, 4]], None, [3, 4])],
)
def test_prompt_forms(prompt, text, ids) -> None:
    gen = completion_to_generate(completion(prompt=prompt), "r", "i", 0)
    assert (gen.prompt, gen.prompt_token_ids) == (text, ids)


@pytest.mark.parametrize("prompt", ["", [], [-1], ["a", ""], [[1], []], [2**31], [[1], [-2]]])
def test_bad_prompts_are_refused(prompt) -> None:
    with pytest.raises(APIError) as e:
        completion_to_generate(completion(prompt=prompt), "r", "i", 0)
    assert e.value.status == 400 and e.value.param == "prompt"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": "not a list"}, "messages"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
        ({"max_tokens": "ten"}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_k": -2}, "top_k"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"stop": 3}, "stop"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stream": "maybe"}, "stream"),
        ({"seed": "x"}, "seed"),
        ({"min_p": 2}, "min_p"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
    ],
)
def test_bad_values_name_the_param(body, param) -> None:
    with pytest.raises(APIError) as e:
        req = parse_request(ChatCompletionRequest, json.dumps({"messages": HI, **body}).encode())
        chat_job(req, "r", "i", 0, Settings())
    assert e.value.status == 400 and e.value.type == "BadRequestError"
    assert e.value.param == param, e.value.message
    assert e.value.message.startswith(param)


@pytest.mark.parametrize("raw", [b"{not json", b"", b"\xff\xfe", b"[1, 2]", b'"text"'])
def test_invalid_json_and_non_objects_are_400(raw) -> None:
    with pytest.raises(APIError) as e:
        parse_request(CompletionRequest, raw)
    assert e.value.status == 400 and e.value.message


def test_missing_prompt_is_400_naming_it() -> None:
    with pytest.raises(APIError) as e:
        parse_request(CompletionRequest, b"{}")
    assert e.value.param == "prompt"


def test_unknown_fields_are_ignored() -> None:
    assert chat(logit_bias={"1": 2}, parallel_tool_calls=False).messages[0].content == "hi"


def test_model_check() -> None:
    """The base model's name (or none) and --lora-modules names resolve without the bus; an
    unknown name is a 404 naming ``model`` (with LoRA off nothing is asked of the scheduler)."""
    import asyncio

    from kvflow.services.gateway.lora import GatewayLoras
    from kvflow.shared.messages import LoRARef

    off = GatewayLoras(Settings.of(), "m")
    on = GatewayLoras(Settings.of(enable_lora=True, lora_modules="sql=/a"), "m")

    class NoBus:  # no scheduler answers: the cache decides
        async def request(self, *a, **k):
            raise TimeoutError

    def resolve(loras: GatewayLoras, name: str | None):
        return asyncio.run(loras.resolve(NoBus(), name))

    assert resolve(off, "m") == ("m", None)
    assert resolve(off, None) == ("m", None) and resolve(off, "") == ("m", None)
    assert resolve(on, "sql") == ("sql", LoRARef("sql", 1, "/a"))
    for loras, name in ((off, "other"), (off, "sql"), (on, "other")):
        with pytest.raises(APIError) as e:
            resolve(loras, name)
        assert e.value.status == 404 and e.value.type == "NotFoundError"
        assert e.value.param == "model" and e.value.body()["error"]["code"] == 404


def test_served_model_name(tmp_path) -> None:
    assert served_model_name(Settings.of(served_model_name="alias")) == "alias"
    assert served_model_name(Settings()) == "SmolLM2-135M-Instruct"
    # the gateway's machine may lack the model file: the name still follows the setting
    assert served_model_name(Settings.of(model="/nowhere/SmolLM2-360M.Q8_0.gguf")) == "SmolLM2-360M"
    assert served_model_name(Settings.of(model="/nowhere/my-model")) == "my-model"


def test_response_shapes() -> None:
    out = Outcome("hello", "length", 3, 2)
    full = ChatFormat("chatcmpl-x", "m", created=1).response([out], 3)
    assert full["object"] == "chat.completion"
    assert full["choices"][0]["message"] == {"role": "assistant", "content": "hello"}
    assert full["usage"] == {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    fmt = ChatFormat("chatcmpl-x", "m", include_usage=True, created=1)
    assert fmt.opening_chunks()[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    last = fmt.text_chunk("!", "stop")
    assert [c["choices"][0]["delta"] for c in last] == [{"content": "!"}, {}]
    assert last[-1]["choices"][0]["finish_reason"] == "stop" and last[-1]["usage"] is None
    assert fmt.usage_chunk(3, 2)["choices"] == []
    text = CompletionFormat("cmpl-x", "m", created=1)
    assert text.response([out], 3)["choices"][0]["text"] == "hello"
    assert text.text_chunk("", None) == []
    assert "usage" not in text.text_chunk("a", None)[0]
