"""Detokenizer -> gateway inbox: text deltas with their logprobs."""

from __future__ import annotations

import msgspec

from kvflow.shared.messages.base import _Msg

# detokenizer / tokenizer -> gateway inbox


class TokenLogprob(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One generated token's text and log-probability, with the top alternatives."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = []
    token_id: int = -1
    top_ids: list[int] = []  # the ids of ``top``, same order


class Delta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    text: str
    num_new_tokens: int = 0
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] = []  # for the tokens this delta covers, when asked
    # every prompt token (entry 0 has no logprob), on a request's first delta, when asked
    prompt_logprobs: list[PromptTokenLogprob] = []
    # the ids of the tokens generated since the previous delta (one with text held back or
    # without text of its own comes with the next delta sent)
    token_ids: list[int] = []
    # tool calls found in the text (``params.ToolParsing``): pieces by call index, the first
    # piece of a call with its id and name; the text they came from is not in ``text``
    tool_calls: list[ToolCallDelta] = []
    # an embedding request's one (final) delta: its vector as little-endian float32 bytes
    embedding: bytes = b""
    # the completion tokens delivered before this delta (the previous delta's
    # ``completion_tokens``): a client holding fewer missed a delta (a NATS node lost it; it is
    # published again, shared/replay.py) and holds this one until that one comes
    after_tokens: int = 0


class ToolCallDelta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """A piece of the ``index``-th tool call of a sequence: ``id`` and ``name`` on its first
    piece, ``arguments`` (JSON text) appended piece by piece (OpenAI's streamed
    ``delta.tool_calls``)."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class PromptTokenLogprob(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One prompt token's id, text and log-probability given the tokens before it (None for
    the first token), its rank, and the top alternatives as (id, text, logprob), best first."""

    token_id: int
    token: str
    logprob: float | None = None
    rank: int = 0
    top: list[tuple[int, str, float]] = []


class DeltaBatch(_Msg, tag=7):
    deltas: list[Delta]
