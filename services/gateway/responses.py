"""OpenAI response and stream-chunk shapes for chat and completions (pure builders).

Chat and completions differ only in these shapes, so the serving loop is written once against
``Format`` and each endpoint supplies its own. Bodies are encoded with msgspec (faster than the
stdlib ``json`` on the per-token path)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from shared.messages import Delta, TokenLogprob

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


@dataclass
class Outcome:
    """A finished request, for the non-streamed response."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None  # None: not asked for


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def outcome_of(deltas: list[Delta]) -> Outcome:
    """Join a request's deltas; counts come from the final delta."""
    last = deltas[-1]
    lps = [lp for d in deltas for lp in d.logprobs]
    return Outcome(
        "".join(d.text for d in deltas),
        last.finish_reason,
        last.prompt_tokens,
        last.completion_tokens,
        lps or None,
    )


def _bytes(s: str) -> list[int]:
    return list(s.encode("utf-8"))


def chat_logprobs(lps: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """OpenAI chat shape: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``."""
    if not lps:
        return None
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": _bytes(lp.token),
                "top_logprobs": [{"token": t, "logprob": v, "bytes": _bytes(t)} for t, v in lp.top],
            }
            for lp in lps
        ]
    }


def completion_logprobs(lps: list[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
    """OpenAI completions shape: parallel lists of tokens, their logprobs, the top
    alternatives as {token: logprob}, and each token's character offset in the text."""
    if not lps:
        return None
    offsets = []
    for lp in lps:
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in lps],
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [dict(lp.top) for lp in lps],
        "text_offset": offsets,
    }


@dataclass
class Format:
    """Shapes shared by both endpoints; subclasses fill in the choice contents."""

    request_id: str
    model: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    object_stream: str = ""
    object_full: str = ""

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.request_id,
            "object": self.object_stream,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.include_usage:
            out["usage"] = None  # as OpenAI: null on every chunk but the last
        return out

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        out = self._chunk([])
        out["usage"] = usage(prompt_tokens, completion_tokens)
        return out

    def opening_chunks(self, index: int = 0) -> list[dict[str, Any]]:
        return []

    def text_chunk(
        self,
        text: str,
        finish_reason: str | None,
        index: int = 0,
        lps: list[TokenLogprob] | None = None,
    ) -> list[dict[str, Any]]:
        raise NotImplementedError

    def response(self, outs: list[Outcome]) -> dict[str, Any]:
        """The whole response: one choice per outcome; the prompt is counted once."""
        return {
            "id": self.request_id,
            "object": self.object_full,
            "created": self.created,
            "model": self.model,
            "choices": [self._full_choice(out, i) for i, out in enumerate(outs)],
            "usage": usage(outs[0].prompt_tokens, sum(o.completion_tokens for o in outs)),
        }

    def _full_choice(self, out: Outcome, index: int) -> dict[str, Any]:
        raise NotImplementedError


@dataclass
class ChatFormat(Format):
    object_stream: str = "chat.completion.chunk"
    object_full: str = "chat.completion"

    def _choice(
        self,
        delta: dict[str, Any],
        finish_reason: str | None,
        index: int,
        lps: list[TokenLogprob] | None = None,
    ) -> dict[str, Any]:
        return {
            "index": index,
            "delta": delta,
            "logprobs": chat_logprobs(lps),
            "finish_reason": finish_reason,
        }

    def opening_chunks(self, index: int = 0) -> list[dict[str, Any]]:
        return [self._chunk([self._choice({"role": "assistant", "content": ""}, None, index)])]

    def text_chunk(
        self,
        text: str,
        finish_reason: str | None,
        index: int = 0,
        lps: list[TokenLogprob] | None = None,
    ) -> list[dict[str, Any]]:
        """Content, then (as OpenAI) the finish reason in its own chunk with an empty delta."""
        chunks = []
        if text or lps:
            chunks.append(self._chunk([self._choice({"content": text}, None, index, lps)]))
        if finish_reason is not None:
            chunks.append(self._chunk([self._choice({}, finish_reason, index)]))
        return chunks

    def _full_choice(self, out: Outcome, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": chat_logprobs(out.logprobs),
            "finish_reason": out.finish_reason,
        }


@dataclass
class CompletionFormat(Format):
    object_stream: str = "text_completion"
    object_full: str = "text_completion"

    def text_chunk(
        self,
        text: str,
        finish_reason: str | None,
        index: int = 0,
        lps: list[TokenLogprob] | None = None,
    ) -> list[dict[str, Any]]:
        if not text and finish_reason is None and not lps:
            return []
        choice = {
            "index": index,
            "text": text,
            "logprobs": completion_logprobs(lps),
            "finish_reason": finish_reason,
        }
        return [self._chunk([choice])]

    def _full_choice(self, out: Outcome, index: int) -> dict[str, Any]:
        return {
            "index": index,
            "text": out.text,
            "logprobs": completion_logprobs(out.logprobs),
            "finish_reason": out.finish_reason,
        }
