"""The OpenAI request bodies the gateway accepts (chat and completions), as pydantic models.

Validation happens here, at the edge, so a bad value is answered with a 400 naming the field
before anything is published; the services behind trust what they receive. Unknown fields are
ignored, as OpenAI clients send fields kvflow does not implement (``user``, ``parallel_tool_calls``...)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

MAX_N = 16  # choices per request; each is a sequence sharing the prompt's KV blocks
MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default max_logprobs)


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Body):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM's; accepted, not implemented


class TextPart(_Body):
    """One part of a message's content; only text parts are served (no vision models)."""

    type: Literal["text"]
    text: str


class ChatMessageIn(_Body):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined by newlines, as vLLM does)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "\n".join(p.text for p in self.content)


class SamplingBody(_Body):
    """Fields shared by chat and completions: OpenAI's, then vLLM's extras."""

    model: str | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    n: int | None = 1
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(None, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = True
    include_stop_str_in_output: bool | None = False
    repetition_penalty: float | None = Field(None, gt=0.0)
    logit_bias: dict[int, float] | None = None
    priority: int | None = 0  # vLLM extra: lower values are scheduled first

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        for tok, bias in (v or {}).items():
            if tok < 0:
                raise ValueError(f"token id {tok} in logit_bias is negative")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias {bias} for token {tok} is outside [-100, 100]")
        return v

    @field_validator("n")
    @classmethod
    def _choices(cls, v: int | None) -> int | None:
        if v is not None and not 1 <= v <= MAX_N:
            raise ValueError(f"n must be between 1 and {MAX_N}")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_not_empty(cls, v: str | list[str] | None) -> str | list[str] | None:
        values = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in values):
            raise ValueError("stop strings must not be empty")
        return v

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingBody):
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _top_needs_logprobs(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs to be true")
        return v

    def logprobs_count(self) -> int | None:
        """How many top alternatives per token (None: no logprobs at all)."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingBody):
    # A string, or a list of one string, or token ids (or a list of one list of token ids).
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = None

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("echo is not supported")
        return v

    def logprobs_count(self) -> int | None:
        return self.logprobs

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise ValueError("suffix is not supported")
        return v
