"""Turning a GenerateRequest into prompt token ids, with the checks vLLM makes. Pure logic over a
Hugging Face tokenizer, so tests run it without NATS."""

from __future__ import annotations

from typing import Any

import msgspec

from kvflow.shared.chat_template import ChatTemplateError, render_chat
from kvflow.shared.messages import GenerateRequest, RequestError, SamplingParams


class PromptError(ValueError):
    def __init__(self, message: str, param: str | None = None, code: int = 400) -> None:
        super().__init__(message)
        self.param = param
        self.code = code

    def to_message(self, request_id: str) -> RequestError:
        return RequestError(request_id, str(self), "BadRequestError", self.param, self.code)


def chat_prompt(*args: Any, **kw: Any) -> Any:
    """``shared.chat_template.render_chat`` with its errors as a PromptError (a 400)."""
    try:
        return render_chat(*args, **kw)
    except ChatTemplateError as e:
        raise PromptError(str(e), e.param) from e


def prompt_token_ids(tokenizer: Any, req: GenerateRequest) -> list[int]:
    """Token ids of the request's prompt: chat messages through the model's chat template, a
    text prompt through the tokenizer, or token ids as given."""
    if req.messages is not None:
        return chat_prompt(
            tokenizer,
            req.messages,
            req.tools,
            req.add_generation_prompt,
            req.continue_final_message,
            tokenize=True,
        )
    if req.prompt_token_ids is not None:
        vocab = len(tokenizer)
        bad = [t for t in req.prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise PromptError(f"token id {bad[0]} is out of range [0, {vocab})", "prompt")
        return list(req.prompt_token_ids)
    if req.prompt is None:
        raise PromptError("either prompt or messages is required", "prompt")
    return list(tokenizer(req.prompt)["input_ids"])


def check_length(ids: list[int], params: SamplingParams, max_model_len: int) -> SamplingParams:
    """vLLM's length rules: the prompt must be non-empty and leave room for one token; an unset
    max_tokens (0) means up to the context limit; an explicit one that does not fit is an
    error."""
    n = len(ids)
    if n == 0:
        raise PromptError("the prompt is empty", "prompt")
    if n >= max_model_len:
        raise PromptError(
            f"This model's maximum context length is {max_model_len} tokens. However, your "
            f"prompt has {n} tokens. Please reduce the length of the prompt.",
            "messages",
        )
    room = max_model_len - n
    if params.max_tokens <= 0:
        return msgspec.structs.replace(params, max_tokens=room)
    if params.max_tokens > room:
        raise PromptError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} "
            "for the completion). Please reduce the length of the prompt or max_tokens.",
            "max_tokens",
        )
    return params


def check_logit_bias(params: SamplingParams, vocab_size: int) -> None:
    """Every biased (or allowed) token must exist in the vocabulary (vLLM answers 400 too)."""
    for tok in params.logit_bias or {}:
        if not 0 <= tok < vocab_size:
            raise PromptError(
                f"token id {tok} in logit_bias is out of vocabulary [0, {vocab_size})", "logit_bias"
            )
    for tok in params.allowed_token_ids or []:
        if not 0 <= tok < vocab_size:
            raise PromptError(
                f"token id {tok} in allowed_token_ids is out of vocabulary [0, {vocab_size})",
                "allowed_token_ids",
            )


def bad_words_token_ids(tokenizer: Any, words: list[str]) -> list[list[int]]:
    """vLLM's tokenization of ``bad_words``: each word as it would start the text and, when the
    leading space makes a different first token of the same length, as it would follow a
    space (so the word is banned at the start and in the middle of the text)."""
    out: list[list[int]] = []
    for word in words:
        bare = tokenizer.encode(word.lstrip(), add_special_tokens=False)
        if not bare:
            raise PromptError(f"bad word {word!r} has no tokens", "bad_words")
        out.append(bare)
        spaced = tokenizer.encode(" " + word.lstrip(), add_special_tokens=False)
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return out


def truncate(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's ``truncate_prompt_tokens``: only the prompt's last ``keep`` tokens (-1: as many
    as the model's length)."""
    if keep == -1:
        keep = max_model_len
    return ids[-keep:] if keep and len(ids) > keep else ids
