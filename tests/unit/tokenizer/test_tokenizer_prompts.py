"""Prompt tokenization and vLLM's length rules, with the model's real tokenizer (offline)."""

from __future__ import annotations

import pytest

from kvflow.services.tokenizer.prompts import PromptError, check_length, prompt_token_ids
from kvflow.shared.messages import ChatMessage, GenerateRequest, SamplingParams


def gen(**kw) -> GenerateRequest:
    return GenerateRequest(request_id="r", reply_to="inbox", params=SamplingParams(), **kw)


def test_chat_uses_the_models_template(tokenizer) -> None:
    ids = prompt_token_ids(tokenizer, gen(messages=[ChatMessage("user", "What is 2+2?")]))
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n")
    assert text.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_text_prompt_and_token_ids(tokenizer) -> None:
    ids = prompt_token_ids(tokenizer, gen(prompt="The capital of France is"))
    assert tokenizer.decode(ids) == "The capital of France is"
    assert prompt_token_ids(tokenizer, gen(prompt_token_ids=ids)) == ids
    with pytest.raises(PromptError) as e:
        prompt_token_ids(tokenizer, gen(prompt_token_ids=[1, 10**9]))
    assert e.value.param == "prompt"


def test_length_rules() -> None:
    p = check_length([1, 2, 3], SamplingParams(max_tokens=0), max_model_len=10)
    assert p.max_tokens == 7
    assert check_length([1, 2, 3], SamplingParams(max_tokens=7), 10).max_tokens == 7
    with pytest.raises(PromptError) as e:
        check_length([1, 2, 3], SamplingParams(max_tokens=8), 10)
    assert e.value.param == "max_tokens" and "maximum context length is 10" in str(e.value)
    with pytest.raises(PromptError):
        check_length(list(range(10)), SamplingParams(), 10)
    with pytest.raises(PromptError):
        check_length([], SamplingParams(), 10)


def test_truncate_keeps_the_last_tokens() -> None:
    from kvflow.services.tokenizer.prompts import truncate

    assert truncate([1, 2, 3, 4], 2, 100) == [3, 4]
    assert truncate([1, 2, 3], 5, 100) == [1, 2, 3] and truncate([1, 2], None, 100) == [1, 2]
    assert truncate(list(range(10)), -1, 4) == [6, 7, 8, 9]  # -1: the model's length


def test_continue_final_message_leaves_the_answer_open(tokenizer) -> None:
    convo = [ChatMessage("user", "Say hi"), ChatMessage("assistant", "Hello! I")]
    ids = prompt_token_ids(
        tokenizer, gen(messages=convo, add_generation_prompt=False, continue_final_message=True)
    )
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\nHello! I")
    closed = prompt_token_ids(tokenizer, gen(messages=convo, add_generation_prompt=False))
    assert tokenizer.decode(closed).endswith("<|im_start|>assistant\nHello! I<|im_end|>\n")


def test_bad_words_are_banned_at_the_start_and_after_a_space(tokenizer) -> None:
    from kvflow.services.tokenizer.prompts import bad_words_token_ids

    words = bad_words_token_ids(tokenizer, ["Paris", " hello world"])
    enc = lambda s: tokenizer.encode(s, add_special_tokens=False)  # noqa: E731
    assert enc("Paris") in words and enc(" Paris") in words
    assert enc("hello world") in words and enc(" hello world") in words
    with pytest.raises(PromptError) as e:
        bad_words_token_ids(tokenizer, [""])
    assert e.value.param == "bad_words"
