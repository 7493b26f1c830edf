"""Tool-call parsing in the detokenizer (DetokState with a request's ToolParsing), fed the token
ids of model outputs with the model's real tokenizer (offline), as the service sends them; and
the service passing a request's tool_parsing on and sending deltas that carry only calls."""

from __future__ import annotations

import asyncio
import json

from kvflow.services.detokenizer.service import DetokenizerService
from kvflow.services.detokenizer.state import DetokState
from kvflow.shared.config import Settings
from kvflow.shared.messages import (
    DeltaBatch,
    FinishReason,
    SampleLogprobs,
    SamplingParams,
    StepResult,
    TokenizedRequest,
    ToolParsing,
)

N = FinishReason.NONE
HERMES = ToolParsing("auto", parser="hermes")
ARGS = '{"city": "Paris \\"é\\" 🙂", "days": [1, 2]}'
CALL = f'<tool_call>\n{{"name": "get_weather", "arguments": {ARGS}}}\n</tool_call>'


def feed(
    tokenizer,
    text: str,
    tp: ToolParsing | None,
    last: FinishReason,
    eos: bool = False,
    params: SamplingParams | None = None,
    logprobs: bool = False,
):
    """Feed the text's tokens (and EOS) to a DetokState; returns the deltas the service would
    send, every token id they carry, and the state."""
    ids = tokenizer(text)["input_ids"] + ([tokenizer.eos_token_id] if eos else [])
    p = params or SamplingParams()
    st = DetokState("r", "inbox", p, prompt_tokens=5, tool_parsing=tp, return_token_ids=True)
    sent, sent_ids = [], []
    for i, t in enumerate(ids):
        lp = SampleLogprobs(-0.5, [t], [-0.5]) if logprobs else None
        d, _ = st.add_token(tokenizer.backend_tokenizer, t, last if i == len(ids) - 1 else N, lp)
        ready = st.release(d)  # what the service sends
        if ready is not None:
            sent.append(ready)
            sent_ids += ready.token_ids
        if st.finished:
            break
    return sent, sent_ids, ids, st


def calls_of(deltas) -> list[tuple[str, str, str]]:
    """(id, name, arguments) per call, joined as the gateway joins them."""
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for piece in d.tool_calls:
            if piece.index not in calls:
                assert piece.id and piece.name
                calls[piece.index] = [piece.id, piece.name, ""]
            else:
                assert piece.id is None and piece.name is None
            calls[piece.index][2] += piece.arguments
    return [tuple(c) for _, c in sorted(calls.items())]


def test_hermes_call_becomes_tool_calls_with_content_before_it(tokenizer) -> None:
    text = "I will check the weather.\n" + CALL
    sent, sent_ids, ids, _ = feed(tokenizer, text, HERMES, FinishReason.STOP, eos=True)
    assert "".join(d.text for d in sent) == "I will check the weather.\n"
    assert not any("<tool" in d.text or "{" in d.text for d in sent)
    ((cid, name, args),) = calls_of(sent)
    assert cid.startswith("chatcmpl-tool-") and name == "get_weather" and args == ARGS
    assert json.loads(args) == {"city": 'Paris "é" 🙂', "days": [1, 2]}
    # the arguments streamed over several deltas, the name before them
    assert sum(1 for d in sent if d.tool_calls) > 3
    assert sent[-1].finish_reason == "tool_calls"
    assert all(d.finish_reason is None for d in sent[:-1])
    assert sent_ids == ids  # every token id reaches exactly one sent delta
    assert sent[-1].completion_tokens == len(ids)


def test_two_hermes_calls_and_length_cut_still_say_tool_calls(tokenizer) -> None:
    text = CALL + "\n" + '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    sent, _, _, _ = feed(tokenizer, text, HERMES, FinishReason.LENGTH)
    assert "".join(d.text for d in sent) == ""
    assert [(n, a) for _, n, a in calls_of(sent)] == [("get_weather", ARGS), ("f", "{}")]
    assert sent[-1].finish_reason == "tool_calls"  # vLLM: calls parsed under "auto"


def test_hermes_without_calls_is_content_and_keeps_the_finish_reason(tokenizer) -> None:
    text = "No tools needed: 2 < 3 and a <tool_ is not a call."
    sent, sent_ids, ids, _ = feed(tokenizer, text, HERMES, FinishReason.STOP, eos=True)
    assert "".join(d.text for d in sent) == text
    assert calls_of(sent) == [] and sent[-1].finish_reason == "stop"
    assert sent_ids == ids


def test_malformed_hermes_call_is_content(tokenizer) -> None:
    text = "<tool_call>\nnot json at all\n</tool_call>"
    sent, _, _, _ = feed(tokenizer, text, HERMES, FinishReason.STOP, eos=True)
    assert "".join(d.text for d in sent) == text
    assert calls_of(sent) == [] and sent[-1].finish_reason == "stop"


def test_stop_string_cuts_the_text_before_the_parser_sees_it(tokenizer) -> None:
    params = SamplingParams(stop=["</tool_call>"])
    sent, _, _, st = feed(
        tokenizer, "Sure.\n" + CALL + "\nmore text", HERMES, FinishReason.LENGTH, params=params
    )
    assert st.finished and "".join(d.text for d in sent) == "Sure.\n"
    assert [(n, a) for _, n, a in calls_of(sent)] == [("get_weather", ARGS)]
    assert sent[-1].finish_reason == "tool_calls"


def test_logprobs_and_token_ids_still_cover_every_token(tokenizer) -> None:
    sent, sent_ids, ids, _ = feed(
        tokenizer, "Hm. " + CALL, HERMES, FinishReason.STOP, logprobs=True
    )
    assert [lp.token_id for d in sent for lp in d.logprobs] == ids
    assert sent_ids == ids


def test_named_sends_the_call_with_the_first_token_and_keeps_length(tokenizer) -> None:
    tp = ToolParsing("named", name="get_weather")
    text = '{"city": "Par'  # max_tokens cut the arguments
    sent, sent_ids, ids, _ = feed(tokenizer, text, tp, FinishReason.LENGTH)
    first = sent[0].tool_calls[0]
    assert first.name == "get_weather" and sent[0].token_ids == [ids[0]]
    assert calls_of(sent)[0][1:] == ("get_weather", text)
    assert "".join(d.text for d in sent) == "" and sent[-1].finish_reason == "length"
    assert sent_ids == ids
    sent, _, _, _ = feed(tokenizer, '{"city": "Paris"}', tp, FinishReason.STOP, eos=True)
    assert calls_of(sent)[0][2] == '{"city": "Paris"}' and sent[-1].finish_reason == "stop"


def test_required_says_tool_calls_on_stop_and_length_on_length(tokenizer) -> None:
    tp = ToolParsing("required")
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    sent, _, _, _ = feed(tokenizer, text, tp, FinishReason.STOP, eos=True)
    assert [(n, a) for _, n, a in calls_of(sent)] == [("f", '{"a": 1}'), ("g", "{}")]
    assert sent[-1].finish_reason == "tool_calls" and "".join(d.text for d in sent) == ""
    sent, _, _, _ = feed(tokenizer, text[:34], tp, FinishReason.LENGTH)
    assert [(n, a) for _, n, a in calls_of(sent)] == [("f", '{"a":')]
    assert sent[-1].finish_reason == "length"


def test_a_failing_parser_falls_back_to_content(tokenizer) -> None:
    st = DetokState("r", "inbox", SamplingParams(), prompt_tokens=1, tool_parsing=HERMES)
    assert st.tools is not None

    def boom(text: str):
        raise RuntimeError("parser bug")

    backend = tokenizer.backend_tokenizer
    ids = tokenizer("Hello there <tool_call>{")["input_ids"]
    out = ""
    for i, t in enumerate(ids):
        if i == len(ids) - 2:
            st.tools.parser.feed = boom  # type: ignore[method-assign]
        d, _ = st.add_token(backend, t, FinishReason.STOP if i == len(ids) - 1 else N)
        out += d.text
        assert not d.tool_calls
    assert out == "Hello there <tool_call>{" and d.finish_reason == "stop"


def test_unknown_parser_sends_text_as_content(tokenizer) -> None:
    tp = ToolParsing("auto", parser="no_such_parser")
    sent, _, _, st = feed(tokenizer, "<tool_call>{}", tp, FinishReason.STOP)
    assert st.tools is None and "".join(d.text for d in sent) == "<tool_call>{}"


class _Bus:
    def __init__(self) -> None:
        self.published: list[tuple[str, object]] = []

    async def publish(self, subject: str, msg: object) -> None:
        self.published.append((subject, msg))


def test_service_passes_tool_parsing_on_and_sends_call_only_deltas(tokenizer) -> None:
    svc = DetokenizerService(Settings(), tokenizer)
    svc.bus = _Bus()  # type: ignore[assignment]
    tp = ToolParsing("named", name="f")
    req = TokenizedRequest("r1", "inbox.1", [1, 2, 3], SamplingParams(), tool_parsing=tp)
    ids = tokenizer('{"a": 1}')["input_ids"]

    async def go() -> None:
        await svc._register(req)
        for i, t in enumerate(ids):
            last = FinishReason.STOP if i == len(ids) - 1 else N
            await svc._on_result(StepResult(i, "w", ["r1"], [t], [int(last)]))

    asyncio.run(go())
    deltas = [d for _, b in svc.bus.published if isinstance(b, DeltaBatch) for d in b.deltas]
    assert len(deltas) == len(ids)  # each token's delta went out, though none has text
    assert calls_of(deltas) == [(deltas[0].tool_calls[0].id, "f", '{"a": 1}')]
    assert deltas[-1].finish_reason == "stop"
