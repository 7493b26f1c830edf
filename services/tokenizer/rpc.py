"""The tokenizer's request/reply side: /tokenize and /detokenize for the gateway (vLLM's shapes),
and decoding of token-id prompts for ``echo``. Plain functions over a Hugging Face tokenizer, so
tests run them without NATS; errors are PromptError (a 400 naming the field)."""

from __future__ import annotations

from typing import Any

from kvflow.services.tokenizer.prompts import PromptError, chat_prompt
from kvflow.shared.messages import (
    DetokenizeRequest,
    DetokenizeResult,
    TokenizeRequest,
    TokenizeResult,
)


def tokenize(tokenizer: Any, req: TokenizeRequest, max_model_len: int) -> TokenizeResult:
    """Token ids of ``req.prompt`` or of ``req.messages`` through the chat template."""
    if req.messages is not None:
        text = chat_prompt(
            tokenizer,
            req.messages,
            req.tools,
            req.add_generation_prompt,
            req.continue_final_message,
            tokenize=False,
        )
        # as vLLM: the rendered text, tokenized (the template has its own special tokens)
        ids = list(tokenizer(text, add_special_tokens=req.add_special_tokens)["input_ids"])
    elif req.prompt is not None:
        ids = list(tokenizer(req.prompt, add_special_tokens=req.add_special_tokens)["input_ids"])
    else:
        raise PromptError("either prompt or messages is required", "prompt")
    strs = tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None
    return TokenizeResult(ids, max_model_len, strs)


def detokenize(tokenizer: Any, req: DetokenizeRequest) -> DetokenizeResult:
    vocab = len(tokenizer)
    bad = [t for t in req.tokens if not 0 <= t < vocab]
    if bad:
        raise PromptError(f"token id {bad[0]} is out of range [0, {vocab})", "tokens")
    return DetokenizeResult(tokenizer.decode(req.tokens))
