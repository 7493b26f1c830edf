"""The gateway's request -> Job conversion (batches, best_of, echo, structured output, limits)
and the response builders (echo, prompt logprobs, best_of choice, stream offsets); no network."""

from __future__ import annotations

import json

import pytest

from kvflow.services.gateway.convert import chat_job, completion_job, parse_request
from kvflow.services.gateway.errors import APIError
from kvflow.services.gateway.generation import full_response
from kvflow.services.gateway.protocol import ChatCompletionRequest, CompletionRequest
from kvflow.services.gateway.responses import (
    ChatFormat,
    CompletionFormat,
    Echo,
    Outcome,
    completion_logprobs,
    vllm_prompt_logprobs,
)
from kvflow.shared.config import Settings
from kvflow.shared.fan_out import expand
from kvflow.shared.messages import PromptTokenLogprob, StructuredOutput, TokenLogprob
from kvflow.shared.structured_output import JSON_OBJECT_SCHEMA

HI = [{"role": "user", "content": "hi"}]
SETTINGS = Settings.of(max_n=4, max_request_sequences=8)


def cjob(**body):
    req = parse_request(CompletionRequest, json.dumps({"prompt": "p", **body}).encode())
    return completion_job(req, "cmpl-1", "inbox", 0.0, SETTINGS)


def chjob(**body):
    req = parse_request(ChatCompletionRequest, json.dumps({"messages": HI, **body}).encode())
    return chat_job(req, "chatcmpl-1", "inbox", 0.0, SETTINGS)


def refused(fn, **body) -> APIError:
    with pytest.raises(APIError) as e:
        fn(**body)
    assert e.value.status == 400 and e.value.type == "BadRequestError"
    assert e.value.message.startswith(f"{e.value.param}: ")
    return e.value


def test_batched_prompts_and_best_of_fan_out_in_openai_order() -> None:
    job = cjob(prompt=["a", "b"], n=2, best_of=3, seed=10)
    assert [g.prompt for g in job.prompts] == ["a", "b"]
    assert (job.n, job.best_of, job.num_sequences) == (2, 3, 6)
    assert job.prompts[0].params.logprobs == 0  # best_of ranks by logprob
    kids = expand(job.prompts, job.best_of)
    assert [k.request_id for k in kids] == [f"cmpl-1-{i}" for i in range(6)]
    assert [k.prompt for k in kids] == ["a"] * 3 + ["b"] * 3
    assert [k.params.seed for k in kids] == [10, 11, 12, 10, 11, 12]
    ids = cjob(prompt=[[1, 2], [3]])
    assert [g.prompt_token_ids for g in ids.prompts] == [[1, 2], [3]]
    one = cjob()
    assert [k.request_id for k in expand(one.prompts, one.best_of)] == ["cmpl-1"]


def test_limits_and_refusals_name_the_param() -> None:
    assert refused(cjob, prompt=["a"] * 3, best_of=3).param == "prompt"  # 9 > 8 sequences
    assert refused(cjob, n=5).param == "n"  # max_n 4
    assert refused(cjob, n=3, best_of=2).param == "best_of"
    assert refused(cjob, n=1, best_of=2, stream=True).param == "best_of"
    assert refused(cjob, suffix="tail").param == "suffix"
    assert refused(cjob, max_tokens=0).param == "max_tokens"
    assert refused(cjob, logprobs=21).param == "logprobs"
    assert refused(cjob, priority=2**70).param == "priority"
    assert refused(chjob, max_completion_tokens=0).param == "max_completion_tokens"
    assert refused(chjob, max_completion_tokens=3, min_tokens=5).param == "min_tokens"
    assert refused(chjob, logprobs=True, top_logprobs=25).param == "top_logprobs"
    assert refused(chjob, top_logprobs=2).param == "top_logprobs"
    assert refused(chjob, guided_regex="a", guided_choice=["x"]).param in (
        "guided_regex",
        "guided_choice",
    )


def test_echo_and_logprobs_ask_for_prompt_logprobs() -> None:
    job = cjob(echo=True, logprobs=2)
    assert job.echo and job.logprobs
    assert (job.prompts[0].params.logprobs, job.prompts[0].params.prompt_logprobs) == (2, 2)
    plain = cjob(echo=True)
    assert plain.prompts[0].params.prompt_logprobs is None and not plain.logprobs
    vllm = chjob(prompt_logprobs=1)
    assert vllm.prompt_logprobs and vllm.prompts[0].params.prompt_logprobs == 1


@pytest.mark.parametrize(
    ("body", "kind", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "json", "response_format"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "integer"}},
                }
            },
            "json",
            "response_format",
        ),
        ({"guided_json": {"type": "string"}}, "json", "guided_json"),
        ({"guided_json": '{"type": "string"}'}, "json", "guided_json"),
        ({"guided_regex": "[0-9]+"}, "regex", "guided_regex"),
        ({"guided_choice": ["yes", "no"]}, "choice", "guided_choice"),
        ({"guided_grammar": 'root ::= "a"'}, "grammar", "guided_grammar"),
        ({"structured_outputs": {"regex": "x+"}}, "regex", "structured_outputs"),
        ({"structured_outputs": {"json": {"type": "object"}}}, "json", "structured_outputs"),
    ],
)
def test_structured_output_forms(body, kind, param) -> None:
    for job in (cjob(**body), chjob(**body)):
        so = job.prompts[0].params.structured_output
        assert isinstance(so, StructuredOutput) and (so.kind, so.param) == (kind, param)
    so = chjob(**body).prompts[0].params.structured_output
    if param == "response_format" and body["response_format"]["type"] == "json_object":
        assert so.spec == JSON_OBJECT_SCHEMA
    if kind == "choice":
        assert json.loads(so.spec) == ["yes", "no"]
    assert chjob(response_format={"type": "text"}).prompts[0].params.structured_output is None


@pytest.mark.parametrize(
    "body",
    [
        {"response_format": {"type": "json_schema"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
        {"guided_json": "not json"},
        {"guided_json": "[1, 2]"},
        {"guided_choice": []},
        {"guided_choice": ["a", ""]},
    ],
)
def test_bad_structured_output_is_400(body) -> None:
    err = refused(chjob, **body)
    assert err.param == next(iter(body))


def lp(token: str, value: float, top: list[tuple[str, float]]) -> TokenLogprob:
    return TokenLogprob(token, value, top)


PROMPT = [
    PromptTokenLogprob(5, "The"),
    PromptTokenLogprob(9, " cat", -3.0, 7, [(11, " dog", -1.0), (12, " man", -2.0)]),
    PromptTokenLogprob(3, " sat", -0.5, 1, [(3, " sat", -0.5), (4, " ran", -1.5)]),
]


def test_completion_logprobs_with_echo_exact_openai_shape() -> None:
    gen = [lp(" on", -0.1, [(" on", -0.1), (" in", -2.5)]), lp("!", -4.0, [(".", -0.2)])]
    out = completion_logprobs(gen, 0, PROMPT)
    assert out == {
        "tokens": ["The", " cat", " sat", " on", "!"],
        "token_logprobs": [None, -3.0, -0.5, -0.1, -4.0],
        "top_logprobs": [
            None,
            {" dog": -1.0, " man": -2.0, " cat": -3.0},  # the chosen token is always there
            {" sat": -0.5, " ran": -1.5},
            {" on": -0.1, " in": -2.5},
            {".": -0.2, "!": -4.0},
        ],
        "text_offset": [0, 3, 7, 11, 14],
    }
    assert completion_logprobs(None, 0, None) is None


def test_vllm_prompt_logprobs_shape() -> None:
    assert vllm_prompt_logprobs(PROMPT) == [
        None,
        {
            "9": {"logprob": -3.0, "rank": 7, "decoded_token": " cat"},
            "11": {"logprob": -1.0, "rank": 1, "decoded_token": " dog"},
            "12": {"logprob": -2.0, "rank": 2, "decoded_token": " man"},
        },
        {
            "3": {"logprob": -0.5, "rank": 1, "decoded_token": " sat"},
            "4": {"logprob": -1.5, "rank": 2, "decoded_token": " ran"},
        },
    ]


def test_echoed_full_response_and_best_of_choice() -> None:
    job = cjob(prompt=["x", "y"], n=1, best_of=2, echo=True)
    outs = [
        Outcome(" lo", "length", 3, 1, [lp(" lo", -2.0, [])], PROMPT),
        Outcome(" hi", "stop", 3, 1, [lp(" hi", -0.5, [])], PROMPT),
        Outcome(" a", "length", 4, 2, [lp(" a", -0.1, []), lp("b", -0.1, [])], None),
        Outcome(" c", "length", 4, 2, [lp(" c", -3.0, []), lp("d", -0.1, [])], None),
    ]
    fmt = CompletionFormat("cmpl-1", "m", created=1, with_logprobs=job.logprobs)
    body = full_response(job, outs, fmt, ["The cat sat", "y"])
    assert [c["index"] for c in body["choices"]] == [0, 1]
    assert [c["text"] for c in body["choices"]] == ["The cat sat hi", "y a"]
    assert all(c["logprobs"] is None for c in body["choices"])  # not asked: used for ranking
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}
    job = cjob(prompt="x", echo=True, logprobs=1)
    fmt = CompletionFormat("cmpl-1", "m", created=1, with_logprobs=True)
    body = full_response(job, outs[1:2], fmt, ["The cat sat"])
    lps = body["choices"][0]["logprobs"]
    assert lps["tokens"] == ["The", " cat", " sat", " hi"] and lps["token_logprobs"][0] is None
    assert lps["text_offset"] == [0, 3, 7, 11]


def test_stream_chunks_echo_first_and_keep_offsets() -> None:
    fmt = CompletionFormat("cmpl-1", "m", created=1, include_usage=True)
    first = fmt.text_chunk(" on", None, 0, [lp(" on", -0.1, [])], Echo("The cat sat", PROMPT))
    choice = first[0]["choices"][0]
    assert choice["text"] == "The cat sat on" and first[0]["usage"] is None
    assert choice["logprobs"]["text_offset"] == [0, 3, 7, 11]
    nxt = fmt.text_chunk("!", "stop", 0, [lp("!", -1.0, [])])[0]["choices"][0]
    assert nxt["logprobs"]["text_offset"] == [14] and nxt["finish_reason"] == "stop"
    other = fmt.text_chunk("a", None, 1, [lp("a", -1.0, [])])[0]["choices"][0]
    assert other["logprobs"]["text_offset"] == [0]  # each choice counts its own text


def test_chat_prompt_logprobs_and_logprobs_off() -> None:
    fmt = ChatFormat("c", "m", created=1, with_logprobs=False, with_prompt_logprobs=True)
    out = Outcome("hi", "stop", 3, 1, [lp("hi", -0.2, [])], PROMPT)
    body = fmt.response([out], 3)
    assert body["choices"][0]["logprobs"] is None
    assert body["prompt_logprobs"] == vllm_prompt_logprobs(PROMPT)
    chunk = ChatFormat("c", "m", created=1).text_chunk(
        "hi", None, 0, [lp("hi", -0.2, [("hi", -0.2)])]
    )
    entry = chunk[0]["choices"][0]["logprobs"]["content"][0]
    assert entry == {
        "token": "hi",
        "logprob": -0.2,
        "bytes": [104, 105],
        "top_logprobs": [{"token": "hi", "logprob": -0.2, "bytes": [104, 105]}],
    }


def test_vllm_extras_mapped_or_refused_by_name() -> None:
    job = cjob(allowed_token_ids=[5, 7], truncate_prompt_tokens=3)
    assert job.prompts[0].params.allowed_token_ids == [5, 7]
    assert job.prompts[0].truncate_prompt_tokens == 3
    assert chjob(truncate_prompt_tokens=-1).prompts[0].truncate_prompt_tokens == -1
    for field, value in (
        ("use_beam_search", True),
        ("length_penalty", 0.5),
    ):
        assert refused(cjob, **{field: value}).param == field
    cjob(use_beam_search=False, length_penalty=1.0)  # defaults are fine
    assert cjob(bad_words=["Paris", " London"]).prompts[0].params.bad_words == ["Paris", " London"]
    assert refused(cjob, bad_words=[" "]).param == "bad_words"
    both = refused(cjob, allowed_token_ids=[1], guided_regex="a")
    assert both.param == "allowed_token_ids" and "guided_regex" in both.message
    # tools: a forced call cannot also follow another output constraint
    tools = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    both = refused(chjob, tools=tools, tool_choice="required", guided_regex="a")
    assert both.param == "guided_regex" and "tool_choice" in both.message
    assert refused(chjob, tool_choice="required").param == "tool_choice"  # no tools
    assert chjob(tools=tools, tool_choice="none").prompts[0].tool_parsing is None


def test_chat_echo_and_continue_final_message_follow_vllm() -> None:
    draft = [*HI, {"role": "assistant", "content": "Hello! I"}]
    # continuing the final assistant message: the answer is that message, echoed, carried on
    job = chjob(messages=draft, add_generation_prompt=False, continue_final_message=True, echo=True)
    gen = job.prompts[0]
    assert gen.continue_final_message and not gen.add_generation_prompt
    assert job.echo and job.role == "assistant"
    fmt = ChatFormat("c", "m", created=1)
    fmt.role = job.role
    body = full_response(job, [Outcome(" am fine", "stop", 9, 2)], fmt, ["Hello! I"])
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "Hello! I am fine"}
    chunks = fmt.text_chunk(" am", None, 0, None, Echo("Hello! I"))
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"content": "Hello! I"},
        {"content": " am"},
    ]
    # a new assistant turn after a user message: nothing of the user's is echoed
    assert not chjob(echo=True).echo
    # without a generation prompt the answer takes the final message's role (vLLM's rule)
    job = chjob(add_generation_prompt=False, echo=True)
    assert job.role == "user" and job.echo
    assert "continue_final_message" in refused(chjob, continue_final_message=True).message


def test_return_tokens_as_token_ids_names_tokens_by_id() -> None:
    assert cjob(return_tokens_as_token_ids=True).tokens_as_ids
    gen = [TokenLogprob("\ufffd", -0.5, [("\ufffd", -0.5), (" a", -1.0)], 239, [239, 253])]
    fmt = CompletionFormat("cmpl-1", "m", created=1, tokens_as_ids=True)
    body = fmt.response([Outcome("x", "length", 1, 1, gen)], 1, [Echo("p", PROMPT)])
    lps = body["choices"][0]["logprobs"]
    prompt_ids = [f"token_id:{p.token_id}" for p in PROMPT]
    assert lps["tokens"] == [*prompt_ids, "token_id:239"]
    assert lps["top_logprobs"][-1] == {"token_id:239": -0.5, "token_id:253": -1.0}
    assert lps["text_offset"][-1] == sum(len(t) for t in prompt_ids)
    chat = ChatFormat("c", "m", created=1, tokens_as_ids=True).response(
        [Outcome("x", "length", 1, 1, gen)], 1
    )
    [entry] = chat["choices"][0]["logprobs"]["content"]
    assert entry["token"] == "token_id:239" and entry["bytes"] == list(b"token_id:239")
    assert [t["token"] for t in entry["top_logprobs"]] == ["token_id:239", "token_id:253"]
