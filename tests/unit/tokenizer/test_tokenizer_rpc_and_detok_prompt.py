"""The tokenizer's /tokenize and /detokenize logic and the detokenizer's prompt logprobs, with the
model's real tokenizer (offline)."""

from __future__ import annotations

import pytest

from kvflow.services.detokenizer.state import DetokState
from kvflow.services.tokenizer.prompts import PromptError, prompt_token_ids
from kvflow.services.tokenizer.rpc import detokenize, tokenize
from kvflow.shared.messages import (
    ChatMessage,
    DetokenizeRequest,
    FinishReason,
    GenerateRequest,
    PromptLogprobs,
    SamplingParams,
    TokenizeRequest,
)


def test_tokenize_prompt_and_chat_like_generation(tokenizer) -> None:
    res = tokenize(tokenizer, TokenizeRequest(prompt="Hello world", return_token_strs=True), 99)
    assert res.tokens == tokenizer("Hello world")["input_ids"] and res.max_model_len == 99
    assert res.token_strs == tokenizer.convert_ids_to_tokens(res.tokens)
    msgs = [ChatMessage("system", "be brief"), ChatMessage("user", "hi")]
    chat = tokenize(tokenizer, TokenizeRequest(messages=msgs, add_special_tokens=False), 99)
    gen = GenerateRequest("r", "i", SamplingParams(), messages=msgs)
    assert chat.tokens == prompt_token_ids(tokenizer, gen)  # what generation would count
    assert chat.token_strs is None
    no_prompt = tokenize(tokenizer, TokenizeRequest(messages=msgs, add_generation_prompt=False), 9)
    assert len(no_prompt.tokens) < len(chat.tokens)


def test_detokenize_and_its_errors(tokenizer) -> None:
    ids = tokenizer("Ünïcödé 🙂 text")["input_ids"]
    assert detokenize(tokenizer, DetokenizeRequest(ids)).prompt == "Ünïcödé 🙂 text"
    with pytest.raises(PromptError) as e:
        detokenize(tokenizer, DetokenizeRequest([1, len(tokenizer)]))
    assert e.value.param == "tokens"
    with pytest.raises(PromptError) as e:
        tokenize(tokenizer, TokenizeRequest(messages=[]), 9)
    assert e.value.param == "messages"
    with pytest.raises(PromptError):
        tokenize(tokenizer, TokenizeRequest(), 9)


def test_prompt_logprobs_become_token_strings_on_the_first_delta(tokenizer) -> None:
    prompt = tokenizer("The cat sat")["input_ids"]
    assert len(prompt) == 3
    st = DetokState("r", "inbox", SamplingParams(prompt_logprobs=1), len(prompt))
    st.first_prompt_token = prompt[0]
    backend = tokenizer.backend_tokenizer
    # two pieces (chunked prefill), one of them sent twice (a recomputed prompt)
    piece2 = PromptLogprobs("r", 2, [prompt[2]], [-0.5], [1], [[prompt[2]]], [[-0.5]])
    st.add_prompt_logprobs(
        backend, PromptLogprobs("r", 1, [prompt[1]], [-3.0], [4], [[5]], [[-1.0]])
    )
    st.add_prompt_logprobs(backend, piece2)
    st.add_prompt_logprobs(backend, piece2)
    first, _ = st.add_token(backend, tokenizer(" on")["input_ids"][0], FinishReason.NONE)
    got = first.prompt_logprobs
    assert [p.token for p in got] == ["The", " cat", " sat"]
    assert [p.logprob for p in got] == [None, -3.0, -0.5]
    assert [p.rank for p in got] == [0, 4, 1]
    assert got[1].top == [(5, tokenizer.decode([5]), -1.0)]
    second, _ = st.add_token(backend, tokenizer(" the")["input_ids"][0], FinishReason.LENGTH)
    assert second.prompt_logprobs == []  # sent once
    plain = DetokState("q", "inbox", SamplingParams(), 3)
    assert plain.add_token(backend, 5, FinishReason.NONE)[0].prompt_logprobs == []
