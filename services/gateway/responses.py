"""OpenAI response and stream-chunk shapes for chat and completions (pure builders).

Chat and completions differ only in these shapes, so the serving loop is written once against
``Format`` and each endpoint supplies its own. Bodies are encoded with msgspec (faster than the
stdlib ``json`` on the per-token path). Completions' ``text_offset`` counts characters of the
token strings before each token, from the start of the choice's text (the prompt's when echoed),
as vLLM does; a stream keeps counting across chunks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import msgspec

from kvflow.shared.fan_out import cumulative_logprob
from kvflow.shared.messages import Delta, PromptTokenLogprob, TokenLogprob, ToolCallDelta
from kvflow.shared.request_streams import join_tool_calls

DONE = b"data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


@dataclass
class Outcome:
    """A finished sequence, for the non-streamed response."""

    text: str
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    logprobs: list[TokenLogprob] | None = None  # None: not asked for
    prompt_logprobs: list[PromptTokenLogprob] | None = None
    tool_calls: list[ToolCallDelta] = field(default_factory=list)  # one per call, joined

    @property
    def cumulative_logprob(self) -> float:
        """Sum of the sampled tokens' logprobs (best_of ranks choices by it)."""
        return cumulative_logprob(self.logprobs)


@dataclass
class Echo:
    """What a completion choice starts with when ``echo`` is set."""

    text: str
    logprobs: list[PromptTokenLogprob] | None = None  # with ``logprobs``: every prompt token


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def outcome_of(deltas: list[Delta]) -> Outcome:
    """Join a sequence's deltas; counts come from the final delta."""
    last = deltas[-1]
    lps = [lp for d in deltas for lp in d.logprobs]
    plps = next((d.prompt_logprobs for d in deltas if d.prompt_logprobs), None)
    return Outcome(
        "".join(d.text for d in deltas),
        last.finish_reason,
        last.prompt_tokens,
        last.completion_tokens,
        lps or None,
        plps,
        join_tool_calls([t for d in deltas for t in d.tool_calls]),
    )


def _bytes(s: str) -> list[int]:
    return list(s.encode("utf-8"))


def _shown(text: str, token_id: int, as_ids: bool) -> str:
    """A token as a logprobs entry names it: its text, or (vLLM's
    ``return_tokens_as_token_ids``, for tokens that are not valid UTF-8 alone) ``token_id:N``."""
    return f"token_id:{token_id}" if as_ids else text


def _tops(lp: TokenLogprob, as_ids: bool) -> list[tuple[str, float]]:
    if not as_ids:
        return lp.top
    return [(_shown(t, i, True), v) for (t, v), i in zip(lp.top, lp.top_ids, strict=True)]


def chat_logprobs(lps: list[TokenLogprob] | None, as_ids: bool = False) -> dict[str, Any] | None:
    """OpenAI chat shape: ``{"content": [{token, logprob, bytes, top_logprobs: [...]}]}``."""
    if lps is None:
        return None
    content = []
    for lp in lps:
        token = _shown(lp.token, lp.token_id, as_ids)
        content.append(
            {
                "token": token,
                "logprob": lp.logprob,
                "bytes": _bytes(token),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": _bytes(t)} for t, v in _tops(lp, as_ids)
                ],
            }
        )
    return {"content": content}


def completion_logprobs(
    lps: list[TokenLogprob] | None,
    offset: int = 0,
    prompt: list[PromptTokenLogprob] | None = None,
    as_ids: bool = False,
) -> dict[str, Any] | None:
    """OpenAI completions shape: parallel lists of tokens, their logprobs, the top alternatives
    as {token: logprob} (with the chosen token, so up to logprobs + 1 entries), and each token's
    character offset. ``prompt`` (echo): the prompt's tokens come first, the first one with
    null logprob and null alternatives."""
    if lps is None and prompt is None:
        return None
    tokens: list[str] = []
    token_lps: list[float | None] = []
    tops: list[dict[str, float] | None] = []
    for i, p in enumerate(prompt or []):
        token = _shown(p.token, p.token_id, as_ids)
        tokens.append(token)
        if i == 0 or p.logprob is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(p.logprob)
        top = {_shown(text, tid, as_ids): v for tid, text, v in p.top}
        top.setdefault(token, p.logprob)
        tops.append(top)
    for lp in lps or []:
        token = _shown(lp.token, lp.token_id, as_ids)
        tokens.append(token)
        token_lps.append(lp.logprob)
        top = dict(_tops(lp, as_ids))
        top.setdefault(token, lp.logprob)
        tops.append(top)
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": tokens,
        "token_logprobs": token_lps,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def vllm_prompt_logprobs(prompt: list[PromptTokenLogprob] | None) -> list[Any] | None:
    """vLLM's ``prompt_logprobs``: per prompt token, {token id: {logprob, rank, decoded_token}}
    for the token itself and the top alternatives; null for the first token."""
    if prompt is None:
        return None
    out: list[Any] = []
    for i, p in enumerate(prompt):
        if i == 0 or p.logprob is None:
            out.append(None)
            continue
        entry = {str(p.token_id): {"logprob": p.logprob, "rank": p.rank, "decoded_token": p.token}}
        for rank, (tid, text, v) in enumerate(p.top, start=1):
            entry.setdefault(str(tid), {"logprob": v, "rank": rank, "decoded_token": text})
        out.append(entry)
    return out


def tool_call_json(call: ToolCallDelta, streamed: bool = False) -> dict[str, Any]:
    """OpenAI's ``tool_calls`` entry; a stream's pieces carry ``index``, and ``id``, ``type``
    and the name only on a call's first piece."""
    fn: dict[str, Any] = {"arguments": call.arguments}
    if call.name is not None:
        fn = {"name": call.name, **fn}
    out: dict[str, Any] = {"index": call.index} if streamed else {}
    if call.id is not None:
        out |= {"id": call.id, "type": "function"}
    return out | {"function": fn}


@dataclass
class Format:
    """Shapes shared by both endpoints; subclasses fill in the choice contents."""

    request_id: str
    model: str
    include_usage: bool = False
    created: int = field(default_factory=lambda: int(time.time()))
    object_stream: str = ""
    object_full: str = ""
    with_logprobs: bool = True  # False: logprobs were computed only to rank best_of choices
    with_prompt_logprobs: bool = False  # vLLM's prompt_logprobs extra
    role: str = "assistant"  # chat: the answer's role
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name ``token_id:N``
    done: bytes = DONE  # what ends a stream

    def take_request(self, req: Any) -> None:
        """Keep what the shapes need from the validated request body (none here)."""

    def encode(self, chunk: dict[str, Any]) -> bytes:
        """One stream event on the wire."""
        return sse(chunk)

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
        echo: Echo | None = None,
        prompt_lps: list[PromptTokenLogprob] | None = None,
        tool_calls: list[ToolCallDelta] | None = None,
    ) -> list[dict[str, Any]]:
        """Chunks for one delta of choice ``index``; a choice's first delta brings its ``echo``
        and (vLLM's extra) ``prompt_lps``; chat deltas may bring ``tool_calls`` pieces."""
        raise NotImplementedError

    def response(
        self, outs: list[Outcome], prompt_tokens: int, echoes: list[Echo | None] | None = None
    ) -> dict[str, Any]:
        """The whole response: choice ``i`` is ``outs[i]``; ``prompt_tokens`` counts every
        prompt once."""
        echoes = echoes or [None] * len(outs)
        return {
            "id": self.request_id,
            "object": self.object_full,
            "created": self.created,
            "model": self.model,
            "choices": [
                self._full_choice(out, i, echo)
                for i, (out, echo) in enumerate(zip(outs, echoes, strict=True))
            ],
            "usage": usage(prompt_tokens, sum(o.completion_tokens for o in outs)),
        }

    def _full_choice(self, out: Outcome, index: int, echo: Echo | None) -> dict[str, Any]:
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
            "logprobs": chat_logprobs(lps, self.tokens_as_ids) if self.with_logprobs else None,
            "finish_reason": finish_reason,
        }

    def opening_chunks(self, index: int = 0) -> list[dict[str, Any]]:
        return [self._chunk([self._choice({"role": self.role, "content": ""}, None, index)])]

    def text_chunk(
        self,
        text: str,
        finish_reason: str | None,
        index: int = 0,
        lps: list[TokenLogprob] | None = None,
        echo: Echo | None = None,
        prompt_lps: list[PromptTokenLogprob] | None = None,
        tool_calls: list[ToolCallDelta] | None = None,
    ) -> list[dict[str, Any]]:
        """Content, then tool call pieces, then (as OpenAI) the finish reason in its own chunk
        with an empty delta. A choice's ``echo`` (vLLM's chat echo: the final message's
        content) comes first, in its own chunk."""
        chunks = []
        if echo is not None and echo.text:
            chunks.append(self._chunk([self._choice({"content": echo.text}, None, index)]))
        if text or (lps and not tool_calls):
            chunks.append(self._chunk([self._choice({"content": text}, None, index, lps)]))
        if tool_calls:
            calls = [tool_call_json(t, streamed=True) for t in join_tool_calls(tool_calls)]
            lps = None if text else lps
            chunks.append(self._chunk([self._choice({"tool_calls": calls}, None, index, lps)]))
        if finish_reason is not None:
            chunks.append(self._chunk([self._choice({}, finish_reason, index)]))
        return chunks

    def response(
        self, outs: list[Outcome], prompt_tokens: int, echoes: list[Echo | None] | None = None
    ) -> dict[str, Any]:
        out = super().response(outs, prompt_tokens, echoes)
        if self.with_prompt_logprobs:
            out["prompt_logprobs"] = vllm_prompt_logprobs(outs[0].prompt_logprobs)
        return out

    def _full_choice(self, out: Outcome, index: int, echo: Echo | None) -> dict[str, Any]:
        message: dict[str, Any] = {
            "role": self.role,
            "content": (echo.text if echo else "") + out.text,
        }
        if out.tool_calls:  # as OpenAI: no content is null, not ""
            message["content"] = message["content"] or None
            message["tool_calls"] = [tool_call_json(t) for t in out.tool_calls]
        return {
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(out.logprobs or [], self.tokens_as_ids)
            if self.with_logprobs
            else None,
            "finish_reason": out.finish_reason,
        }


@dataclass
class CompletionFormat(Format):
    object_stream: str = "text_completion"
    object_full: str = "text_completion"
    # per choice index: characters of token strings already sent (stream text_offset)
    _offsets: dict[int, int] = field(default_factory=dict)

    def _logprobs(
        self, index: int, lps: list[TokenLogprob] | None, echo: Echo | None
    ) -> dict[str, Any] | None:
        if not self.with_logprobs:
            return None
        prompt = echo.logprobs if echo is not None else None
        out = completion_logprobs(lps, self._offsets.get(index, 0), prompt, self.tokens_as_ids)
        if out is not None:
            self._offsets[index] = self._offsets.get(index, 0) + sum(len(t) for t in out["tokens"])
        return out

    def text_chunk(
        self,
        text: str,
        finish_reason: str | None,
        index: int = 0,
        lps: list[TokenLogprob] | None = None,
        echo: Echo | None = None,
        prompt_lps: list[PromptTokenLogprob] | None = None,
        tool_calls: list[ToolCallDelta] | None = None,  # chat only: completions have no tools
    ) -> list[dict[str, Any]]:
        if echo is not None:
            text = echo.text + text
        if not text and finish_reason is None and not lps:
            return []
        choice: dict[str, Any] = {
            "index": index,
            "text": text,
            "logprobs": self._logprobs(index, lps, echo),
            "finish_reason": finish_reason,
        }
        if prompt_lps is not None and self.with_prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(prompt_lps)
        return [self._chunk([choice])]

    def _full_choice(self, out: Outcome, index: int, echo: Echo | None) -> dict[str, Any]:
        prompt = echo.logprobs if echo is not None else None
        choice: dict[str, Any] = {
            "index": index,
            "text": (echo.text if echo is not None else "") + out.text,
            "logprobs": completion_logprobs(out.logprobs or [], 0, prompt, self.tokens_as_ids)
            if self.with_logprobs
            else None,
            "finish_reason": out.finish_reason,
        }
        if self.with_prompt_logprobs:
            choice["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_logprobs)
        return choice
