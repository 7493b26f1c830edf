"""The value checks the sampling features are built from (vLLM's rules): each raises
``SamplingParamError`` naming the field at fault.

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


def check_int(name: str, v: Any, lo: int | None = None, hi: int | None = None) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise SamplingParamError(name, f"must be an integer, got {type(v).__name__}")
    lo = INT64_MIN if lo is None else lo
    hi = INT64_MAX if hi is None else hi
    if not lo <= v <= hi:
        raise SamplingParamError(name, f"must be in [{lo}, {hi}], got {v}")
    return v


def check_float(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise SamplingParamError(name, f"must be a number, got {type(v).__name__}")
    if not math.isfinite(v):
        raise SamplingParamError(name, f"must be finite, got {v}")
    return float(v)


def check_bool(name: str, v: Any) -> None:
    if not isinstance(v, bool):
        raise SamplingParamError(name, f"must be a boolean, got {type(v).__name__}")


def check_token_ids(name: str, v: Any) -> None:
    if isinstance(v, str | bytes) or not isinstance(v, Sequence):
        raise SamplingParamError(name, "must be a list of token ids")
    for t in v:
        check_int(name, t, 0, MAX_TOKEN_ID)


def check_stop(v: Any) -> None:
    values = [v] if isinstance(v, str) else v
    if isinstance(values, bytes) or not isinstance(values, Sequence):
        raise SamplingParamError("stop", "must be a string or a list of strings")
    for s in values:
        if not isinstance(s, str):
            raise SamplingParamError("stop", "must be a string or a list of strings")
        if not s:
            raise SamplingParamError("stop", "stop strings must not be empty")


def check_logit_bias(v: Any) -> None:
    if not isinstance(v, Mapping):
        raise SamplingParamError("logit_bias", "must map token ids to biases")
    for tok, bias in v.items():
        try:
            tid = int(tok)
        except (TypeError, ValueError):
            raise SamplingParamError("logit_bias", f"key {tok!r} is not a token id") from None
        if not 0 <= tid <= MAX_TOKEN_ID:
            raise SamplingParamError("logit_bias", f"token id {tid} is out of range")
        b = check_float("logit_bias", bias)
        if not -100.0 <= b <= 100.0:
            raise SamplingParamError(
                "logit_bias", f"bias {b} for token {tid} is outside [-100, 100]"
            )
