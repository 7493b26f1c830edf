"""A pooling request's input as the served model takes it (the tokenizer service's side of
shared/models/tasks.py): the task checked against what the model is served for, the pooling
filled in (the model's own where the request left it to the model; the head's row for classify
and score), and for an encoder the text, or a cross-encoder's text pair, tokenized the way its
tokenizer joins them ([CLS] a [SEP] b [SEP], token type 1 from b on), truncated only when
``truncate_prompt_tokens`` asks (the tokenizer's own truncation, which keeps the special
tokens)."""

from __future__ import annotations

from typing import Any

import msgspec

from kvflow.services.tokenizer.prompts import PromptError, prompt_token_ids, truncate
from kvflow.shared.messages import GenerateRequest, PoolingParams
from kvflow.shared.models.tasks import ServedTask

_SERVED_BY = {
    "generate": ("generate",),
    "embed": ("embed", "generate"),  # a decoder's pooled hidden states too
    "classify": ("classify", "score"),
    "score": ("score",),  # a text pair through a cross-encoder (cosine is the gateway's)
}
_WHAT = {
    "generate": "text generation",
    "embed": "embeddings",
    "classify": "classification",
    "score": "scoring a text pair",
}


def check_task(served: ServedTask, task: str) -> None:
    """PromptError (400) when the model is not served for ``task`` (a pooling task, or
    "generate")."""
    if served.task not in _SERVED_BY[task]:
        raise PromptError(
            f"{_WHAT[task]} is not served by this model: it is served for --task "
            f"{served.task}; {_WHAT[task]} needs a model served for --task "
            f"{' or '.join(_SERVED_BY[task])}",
            None,
        )


def pooling_input(
    tokenizer: Any, req: GenerateRequest, served: ServedTask, max_model_len: int
) -> tuple[list[int], PoolingParams]:
    """The input's token ids and its completed PoolingParams (``req.pooling`` is set)."""
    p = req.pooling
    assert p is not None
    check_task(served, p.task)
    kind = p.pooling_type or served.pooling_type
    if p.task != "embed":
        kind = served.head_pooling()
    if not served.encoder:
        if req.prompt_pair is not None:
            raise PromptError("a text pair needs a cross-encoder", None)
        ids = truncate(prompt_token_ids(tokenizer, req), req.truncate_prompt_tokens, max_model_len)
        return ids, msgspec.structs.replace(p, pooling_type=kind)
    ids, pair_start = _encoder_ids(tokenizer, req, max_model_len)
    return ids, msgspec.structs.replace(
        p, pooling_type=kind, bidirectional=True, pair_start=pair_start
    )


def _encoder_ids(tokenizer: Any, req: GenerateRequest, max_model_len: int) -> tuple[list[int], int]:
    """An encoder's input: token ids (given, or the text / text pair through the tokenizer)
    and where the second text starts (0: one text)."""
    keep = req.truncate_prompt_tokens
    if keep == -1:
        keep = max_model_len
    if req.prompt_token_ids is not None or req.messages is not None:
        if req.prompt_pair is not None:
            raise PromptError("a text pair is given as two texts", None)
        ids = prompt_token_ids(tokenizer, req)
        pair_start = req.pooling.pair_start if req.pooling is not None else 0
        return (ids[:keep] if keep else ids), pair_start  # as given (LLM prepares its own)
    if req.prompt is None:
        raise PromptError("the input is empty", None)
    kw: dict[str, Any] = {"truncation": True, "max_length": keep} if keep else {}
    enc = tokenizer(req.prompt, req.prompt_pair, **kw)
    ids = list(enc["input_ids"])
    types = enc.get("token_type_ids")
    pair_start = 0
    if req.prompt_pair is not None and types is not None and 1 in types:
        pair_start = list(types).index(1)
    return ids, pair_start
