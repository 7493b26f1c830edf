"""Per-request incremental detokenization with stop strings: plain logic, tested offline.

Text is decoded token by token with ``tokenizers.decoders.DecodeStream`` (which holds back
incomplete UTF-8). Text that could be the start of a stop string is held back until it either
completes the stop string (the request ends there, the stop string itself is not sent unless
asked) or stops being a possible start (then it is sent).

A request with ``tool_parsing`` has the text it would send go through its tool-call parser
(services/detokenizer/tool_parsers): content stays ``Delta.text``, calls become
``Delta.tool_calls``; the final delta flushes the parser and may say "tool_calls"."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from tokenizers.decoders import DecodeStream

from kvflow.services.detokenizer.tool_parsers import GuardedParser, make_parser
from kvflow.services.detokenizer.tool_parsers.guard import count_error
from kvflow.shared.messages import (
    Delta,
    FinishReason,
    PromptLogprobs,
    PromptTokenLogprob,
    SampleLogprobs,
    SamplingParams,
    TokenLogprob,
    ToolParsing,
)
from kvflow.shared.request_streams import merge_delta

log = logging.getLogger("kvflow.detokenizer")


@dataclass
class DetokState:
    request_id: str
    reply_to: str
    params: SamplingParams
    prompt_tokens: int
    stream: DecodeStream = field(init=False)
    # the text not sent yet, after the last characters sent that ``_find_stop`` looks back
    # over (the longest stop string's length - 1): what came before is dropped once sent, so a
    # token costs the same at the end of a long output as at its start
    text: str = ""
    sent: int = 0  # characters of ``text`` already sent
    keep: int = field(init=False, default=0)  # sent characters kept: longest stop string - 1
    completion_tokens: int = 0
    delivered_tokens: int = 0  # ``completion_tokens`` of the last delta sent
    held: Delta | None = None  # what ``release`` kept back, merged: sent with the next delta
    finished: bool = False
    first_prompt_token: int = -1  # kept when prompt logprobs are asked (it has no logprob)
    # prompt logprobs by position, sent with the request's first delta
    prompt_lps: dict[int, PromptTokenLogprob] = field(default_factory=dict)
    prompt_lps_sent: bool = False
    return_token_ids: bool = False  # the client reads the deltas' token ids (else left out)
    final_only: bool = False  # the client reads only the whole output: first and final deltas
    tool_parsing: ToolParsing | None = None
    tools: GuardedParser | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.stream = DecodeStream(skip_special_tokens=self.params.skip_special_tokens)
        self.keep = max([len(s) - 1 for s in self.params.stop if s], default=0)
        if self.tool_parsing is not None:
            try:
                self.tools = GuardedParser(make_parser(self.tool_parsing), self.request_id)
            except ValueError:
                log.exception(
                    "request %s: no tool-call parsing, its text is content", self.request_id
                )
                count_error()

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs is not None and not self.prompt_lps_sent

    def add_prompt_logprobs(self, tokenizer: Any, piece: PromptLogprobs) -> None:
        """Keep one worker piece (a recomputed prompt sends the same positions again)."""
        if not self.wants_prompt_logprobs:
            return
        for i, tok in enumerate(piece.token_ids):
            tops = (
                list(zip(piece.top_ids[i], piece.top_logprobs[i], strict=True))
                if piece.top_ids
                else []
            )
            self.prompt_lps[piece.start + i] = PromptTokenLogprob(
                token_id=tok,
                token=token_text(tokenizer, tok),
                logprob=piece.logprobs[i],
                rank=piece.ranks[i],
                top=[(t, token_text(tokenizer, t), v) for t, v in tops],
            )

    def _take_prompt_logprobs(self, tokenizer: Any) -> list[PromptTokenLogprob]:
        """Every prompt position, the first without a logprob (sent once)."""
        self.prompt_lps_sent = True
        first = PromptTokenLogprob(
            self.first_prompt_token, token_text(tokenizer, self.first_prompt_token)
        )
        rest = [
            self.prompt_lps.get(pos, PromptTokenLogprob(-1, ""))
            for pos in range(1, self.prompt_tokens)
        ]
        self.prompt_lps = {}
        return [first, *rest]

    def add_token(
        self,
        tokenizer: Any,
        token_id: int,
        reason: FinishReason,
        logprobs: SampleLogprobs | None = None,
    ) -> tuple[Delta, bool]:
        """Take one sampled token and the worker's finish reason. Returns the delta to send and
        whether this detokenizer ended the request by a stop string (the scheduler must be
        told)."""
        self.completion_tokens += 1
        lps = [token_logprob(tokenizer, token_id, logprobs)] if logprobs is not None else []
        piece = self.stream.step(tokenizer, token_id)
        if piece:
            self.text += piece
        finish: FinishReason = reason
        by_stop_string = False
        end = len(self.text)
        stops = self.params.stop
        if stops:
            hit = self._find_stop()
            if hit is not None:
                end = hit
                finish, by_stop_string = FinishReason.STOP, True
            elif finish == FinishReason.NONE:
                end = len(self.text) - self._held_back()
        out = self.text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        self.finished = finish != FinishReason.NONE
        if self.finished:
            self.text = self.text[:end]
        elif self.sent > self.keep:
            cut = self.sent - self.keep
            self.text, self.sent = self.text[cut:], self.keep
        delta = self._delta(out, finish, token_id)
        if self.tools is not None:
            self._parse_tools(delta, finish)
        delta.logprobs = lps
        if self.wants_prompt_logprobs:
            delta.prompt_logprobs = self._take_prompt_logprobs(tokenizer)
        return delta, by_stop_string and reason == FinishReason.NONE

    def _find_stop(self) -> int | None:
        """End of the text to keep if a stop string occurs in the unsent text (searching a
        stop string's length back, since it may straddle what was held back)."""
        best: int | None = None
        for s in self.params.stop:
            if not s:
                continue
            start = max(0, self.sent - len(s) + 1)
            i = self.text.find(s, start)
            if i >= 0:
                cut = i + len(s) if self.params.include_stop_str_in_output else i
                best = cut if best is None else min(best, cut)
        return best

    def _held_back(self) -> int:
        """Length of the longest suffix of the unsent text that is a proper prefix of a stop
        string."""
        unsent = self.text[self.sent :]
        hold = 0
        for s in self.params.stop:
            for k in range(min(len(s) - 1, len(unsent)), hold, -1):
                if unsent.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def _delta(self, text: str, finish: FinishReason, token_id: int) -> Delta:
        return Delta(
            request_id=self.request_id,
            text=text,
            num_new_tokens=1,
            finish_reason=finish.openai(),
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            token_ids=[token_id] if self.return_token_ids else [],
            after_tokens=self.completion_tokens - 1,
        )

    def release(self, delta: Delta, stream_interval: int = 1) -> Delta | None:
        """What goes to the client now: ``delta`` after what was held back before it (merged
        into one delta), or None while it is held. Held: a delta with nothing to tell (a token
        whose text is not decided yet: part of a UTF-8 character, a possible stop string) and,
        with ``stream_interval`` N > 1 (vLLM's ``--stream-interval``), every delta after the
        first sent until N tokens have come since the last one sent; with ``final_only``,
        every delta after the first sent. The final delta always goes."""
        if self.held is not None:
            merge_delta(self.held, delta)
            delta = self.held
        telling = (
            delta.text
            or delta.finish_reason
            or delta.logprobs
            or delta.prompt_logprobs
            or delta.tool_calls
        )
        early = self.delivered_tokens > 0 and (
            self.final_only or self.completion_tokens - self.delivered_tokens < stream_interval
        )
        if not self.finished and (not telling or early):
            self.held = delta
            return None
        self.held = None
        self.delivered_tokens = self.completion_tokens
        return delta

    def _parse_tools(self, delta: Delta, finish: FinishReason) -> None:
        """The delta's text through the tool-call parser (flushed on the final delta)."""
        assert self.tools is not None and self.tool_parsing is not None
        content, calls = self.tools.feed(delta.text)
        if finish != FinishReason.NONE:
            rest, more = self.tools.finish()
            content, calls = content + rest, calls + more
            delta.finish_reason = tool_finish_reason(
                self.tool_parsing.mode, self.tools.tools_called, finish
            )
        delta.text, delta.tool_calls = content, calls


def tool_finish_reason(mode: str, called: bool, finish: FinishReason) -> str | None:
    """vLLM's rule: "tool_calls" when "auto" found calls or a "required" sequence ended by
    stopping; otherwise (a named function, a sequence cut by length) the reason as it is."""
    if mode == "auto" and called and finish in (FinishReason.STOP, FinishReason.LENGTH):
        return "tool_calls"
    if mode == "required" and finish == FinishReason.STOP:
        return "tool_calls"
    return finish.openai()


def token_logprob(tokenizer: Any, token_id: int, lp: SampleLogprobs) -> TokenLogprob:
    """The sampled token's own text (special tokens included, as OpenAI shows them) with its
    log-probability and the top alternatives."""

    top = [(token_text(tokenizer, t), v) for t, v in zip(lp.top_ids, lp.top_logprobs, strict=True)]
    return TokenLogprob(
        token_text(tokenizer, token_id), lp.logprob, top, token_id, list(lp.top_ids)
    )


def token_text(tokenizer: Any, token_id: int) -> str:
    """One token's own text, special tokens included (as OpenAI shows them)."""
    return tokenizer.decode([token_id], skip_special_tokens=False)
