"""Validation of sampling parameters (vLLM's names and rules), shared by the OpenAI gateway and
any Python API built on kvflow: one function, ``validate_sampling``, that checks types and ranges
and raises ``SamplingParamError`` naming the field at fault.

Integers must also fit the wire (msgpack int64), so a client can never make a service fail to
encode a message by sending ``max_tokens: 1e30``-sized numbers."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

MAX_LOGPROBS = 20  # top alternatives per token (vLLM's default max_logprobs)
MAX_TOKEN_ID = 2**31 - 1  # no vocabulary comes near; keeps ids inside int32 everywhere
INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)


class SamplingParamError(ValueError):
    """A sampling parameter with a wrong type or value; ``param`` is its name."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param
        self.reason = message


def _int(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise SamplingParamError(name, f"must be an integer, got {type(v).__name__}")
    lo = INT64_MIN if lo is None else lo
    hi = INT64_MAX if hi is None else hi
    if not lo <= v <= hi:
        raise SamplingParamError(name, f"must be in [{lo}, {hi}], got {v}")
    return v


def _float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise SamplingParamError(name, f"must be a number, got {type(v).__name__}")
    if not math.isfinite(v):
        raise SamplingParamError(name, f"must be finite, got {v}")
    return float(v)


def _bool(name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise SamplingParamError(name, f"must be a boolean, got {type(v).__name__}")


def _token_ids(name: str, v: Any) -> None:
    if isinstance(v, str | bytes) or not isinstance(v, Sequence):
        raise SamplingParamError(name, "must be a list of token ids")
    for t in v:
        _int(name, t, 0, MAX_TOKEN_ID)


def _stop(v: Any) -> None:
    values = [v] if isinstance(v, str) else v
    if isinstance(values, bytes) or not isinstance(values, Sequence):
        raise SamplingParamError("stop", "must be a string or a list of strings")
    for s in values:
        if not isinstance(s, str):
            raise SamplingParamError("stop", "must be a string or a list of strings")
        if not s:
            raise SamplingParamError("stop", "stop strings must not be empty")


def _logit_bias(v: Any) -> None:
    if not isinstance(v, Mapping):
        raise SamplingParamError("logit_bias", "must map token ids to biases")
    for tok, bias in v.items():
        try:
            tid = int(tok)
        except (TypeError, ValueError):
            raise SamplingParamError("logit_bias", f"key {tok!r} is not a token id") from None
        if not 0 <= tid <= MAX_TOKEN_ID:
            raise SamplingParamError("logit_bias", f"token id {tid} is out of range")
        b = _float("logit_bias", bias)
        if not -100.0 <= b <= 100.0:
            raise SamplingParamError(
                "logit_bias", f"bias {b} for token {tid} is outside [-100, 100]"
            )


def validate_sampling(
    *,
    n: int = 1,
    best_of: int | None = None,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    seed: int | None = None,
    max_tokens: int | None = 16,
    min_tokens: int = 0,
    logprobs: int | None = None,
    prompt_logprobs: int | None = None,
    stop: str | Sequence[str] | None = None,
    stop_token_ids: Sequence[int] | None = None,
    logit_bias: Mapping[Any, float] | None = None,
    allowed_token_ids: Sequence[int] | None = None,
    bad_words: Sequence[str] | None = None,
    truncate_prompt_tokens: int | None = None,
    ignore_eos: bool = False,
    skip_special_tokens: bool = True,
    include_stop_str_in_output: bool = False,
    max_n: int | None = None,
    max_logprobs: int = MAX_LOGPROBS,
) -> None:
    """Check every given value as vLLM's ``SamplingParams`` does; raise ``SamplingParamError``
    naming the first field that is wrong. ``max_tokens=None`` means "up to the context limit".
    ``max_n`` (optional) bounds ``n`` and ``best_of``, a server's own limit."""
    _int("n", n, 1, max_n)
    if best_of is not None:
        _int("best_of", best_of, 1, max_n)
        if best_of < n:
            raise SamplingParamError("best_of", f"must be >= n ({n}), got {best_of}")
    if _float("temperature", temperature) < 0.0:
        raise SamplingParamError("temperature", f"must be >= 0, got {temperature}")
    if not 0.0 < _float("top_p", top_p) <= 1.0:
        raise SamplingParamError("top_p", f"must be in (0, 1], got {top_p}")
    _int("top_k", top_k, -1, MAX_TOKEN_ID)  # -1 and 0 turn it off
    if not 0.0 <= _float("min_p", min_p) <= 1.0:
        raise SamplingParamError("min_p", f"must be in [0, 1], got {min_p}")
    for name, value in (
        ("presence_penalty", presence_penalty),
        ("frequency_penalty", frequency_penalty),
    ):
        if not -2.0 <= _float(name, value) <= 2.0:
            raise SamplingParamError(name, f"must be in [-2, 2], got {value}")
    if not 0.0 < _float("repetition_penalty", repetition_penalty) <= 100.0:
        raise SamplingParamError(
            "repetition_penalty", f"must be in (0, 100], got {repetition_penalty}"
        )
    if seed is not None:
        _int("seed", seed)
    if max_tokens is not None:
        _int("max_tokens", max_tokens, 1, MAX_TOKEN_ID)
    _int("min_tokens", min_tokens, 0, MAX_TOKEN_ID)
    if max_tokens is not None and min_tokens > max_tokens:
        raise SamplingParamError(
            "min_tokens", f"must be <= max_tokens ({max_tokens}), got {min_tokens}"
        )
    if logprobs is not None:
        _int("logprobs", logprobs, 0, max_logprobs)
    if prompt_logprobs is not None:
        _int("prompt_logprobs", prompt_logprobs, 0, max_logprobs)
    if stop is not None:
        _stop(stop)
    if stop_token_ids is not None:
        _token_ids("stop_token_ids", stop_token_ids)
    if logit_bias is not None:
        _logit_bias(logit_bias)
    if allowed_token_ids is not None:
        _token_ids("allowed_token_ids", allowed_token_ids)
        if not allowed_token_ids:
            raise SamplingParamError("allowed_token_ids", "must not be empty")
    if bad_words is not None:
        if isinstance(bad_words, str) or not all(isinstance(w, str) for w in bad_words):
            raise SamplingParamError("bad_words", "must be a list of strings")
        if any(not w.strip() for w in bad_words):
            raise SamplingParamError("bad_words", "must not hold empty words")
    if truncate_prompt_tokens is not None:
        _int("truncate_prompt_tokens", truncate_prompt_tokens, -1, MAX_TOKEN_ID)
        if truncate_prompt_tokens == 0:
            raise SamplingParamError(
                "truncate_prompt_tokens", "must be -1 (the model length) or >= 1"
            )
    _bool("ignore_eos", ignore_eos)
    _bool("skip_special_tokens", skip_special_tokens)
    _bool("include_stop_str_in_output", include_stop_str_in_output)
