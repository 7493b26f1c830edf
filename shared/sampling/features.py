"""Every sampling feature, defined once: ``FIELDS`` (the request fields, in validation order)
and ``PROCESSORS`` (how the features that change logits apply to a row, in the order they run).
The HTTP bodies, the gateway's conversion, /v1/responses' extras, the Python API's
``SamplingParams``, validation, the wire mapping and the worker's host sampling all iterate over
these two lists (shared/sampling/derived.py); adding a feature is an entry here, its wire field
in shared/messages/params.py and its tests."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvflow.shared.sampling.checks import (
    MAX_TOKEN_ID,
    SamplingParamError,
    check_bool,
    check_float,
    check_int,
    check_logit_bias,
    check_stop,
    check_token_ids,
)
from kvflow.shared.sampling.processors import (
    AllowedTokens,
    BadWords,
    Grammar,
    LogitBias,
    MinTokens,
    Penalties,
)
from kvflow.shared.sampling.spec import LogitsProcessor, SamplingField

V = Mapping[str, Any]  # every value of the request, and the limits max_n and max_logprobs
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")


def _n(name: str, v: Any, values: V) -> None:
    check_int(name, v, 1, values.get("max_n"))


def _best_of(name: str, v: Any, values: V) -> None:
    _n(name, v, values)
    if v < values["n"]:
        raise SamplingParamError(name, f"must be >= n ({values['n']}), got {v}")


def _in(lo: float, hi: float, lo_open: bool = False) -> Any:
    """A number in [lo, hi] (or (lo, hi] when ``lo_open``)."""

    def check(name: str, v: Any, values: V) -> None:
        x = check_float(name, v)
        if (x <= lo if lo_open else x < lo) or x > hi:
            bounds = f"({lo:g}, {hi:g}]" if lo_open else f"[{lo:g}, {hi:g}]"
            raise SamplingParamError(name, f"must be in {bounds}, got {v}")

    return check


def _temperature(name: str, v: Any, values: V) -> None:
    if check_float(name, v) < 0.0:
        raise SamplingParamError(name, f"must be >= 0, got {v}")


def _int_in(lo: int | None = None, hi: int | None = None) -> Any:
    return lambda name, v, values: check_int(name, v, lo, hi)


def _min_tokens(name: str, v: Any, values: V) -> None:
    check_int(name, v, 0, MAX_TOKEN_ID)
    max_tokens = values["max_tokens"]
    if max_tokens is not None and v > max_tokens:
        raise SamplingParamError(name, f"must be <= max_tokens ({max_tokens}), got {v}")


def _logprobs(name: str, v: Any, values: V) -> None:
    check_int(name, v, 0, values["max_logprobs"])


def _allowed(name: str, v: Any, values: V) -> None:
    check_token_ids(name, v)
    if not v:
        raise SamplingParamError(name, "must not be empty")


def _bad_words(name: str, v: Any, values: V) -> None:
    if isinstance(v, str) or not all(isinstance(w, str) for w in v):
        raise SamplingParamError(name, "must be a list of strings")
    if any(not w.strip() for w in v):
        raise SamplingParamError(name, "must not hold empty words")


def _truncate(name: str, v: Any, values: V) -> None:
    check_int(name, v, -1, MAX_TOKEN_ID)
    if v == 0:
        raise SamplingParamError(name, "must be -1 (the model length) or >= 1")


def _one_guided(name: str, v: Any, values: V) -> None:
    given = [g for g in GUIDED if values.get(g) is not None]
    if len(given) > 1 and given[1] == name:
        raise SamplingParamError(name, f"only one of {', '.join(given)} may be set")


def _stop_list(v: Any) -> list[str]:
    return [v] if isinstance(v, str) else list(v or [])


def _ids_or_none(v: Any) -> list[int] | None:
    return list(v) if v else None


F = SamplingField
FIELDS: list[SamplingField] = [
    F("n", int, 1, _n, body_default=1, responses=False, wire=None),
    F("best_of", int | None, None, _best_of, nullable=True, body=False, wire=None),
    F(
        "temperature",
        float,
        1.0,
        _temperature,
        responses=False,
        wire=float,
    ),
    F("top_p", float, 1.0, _in(0.0, 1.0, lo_open=True), responses=False, wire=float),
    F("top_k", int, 0, _int_in(-1, MAX_TOKEN_ID), wire=lambda v: max(0, int(v))),  # -1, 0: off
    F("min_p", float, 0.0, _in(0.0, 1.0), wire=float),
    F("presence_penalty", float, 0.0, _in(-2.0, 2.0), wire=float),
    F("frequency_penalty", float, 0.0, _in(-2.0, 2.0), wire=float),
    F("repetition_penalty", float, 1.0, _in(0.0, 100.0, lo_open=True), wire=float),
    F("seed", int | None, None, _int_in(), nullable=True),
    # None: up to the model's context length (0 on the wire)
    F(
        "max_tokens",
        int | None,
        16,
        _int_in(1, MAX_TOKEN_ID),
        nullable=True,
        responses=False,
        wire=lambda v: 0 if v is None else v,
    ),
    F("min_tokens", int, 0, _min_tokens),
    F(
        "logprobs",
        int | None,
        None,
        _logprobs,
        nullable=True,
        body=False,
    ),
    F("prompt_logprobs", int | None, None, _logprobs, nullable=True, responses=False),
    F(
        "stop",
        str | list[str] | None,
        None,
        lambda n, v, vs: check_stop(v),
        nullable=True,
        wire=_stop_list,
    ),
    F(
        "stop_token_ids",
        list[int] | None,
        None,
        lambda n, v, vs: check_token_ids(n, v),
        nullable=True,
        wire=lambda v: list(v or []),
    ),
    F(
        "logit_bias",
        dict[int, float] | None,
        None,
        lambda n, v, vs: check_logit_bias(v),
        nullable=True,
        wire=lambda v: {int(k): float(b) for k, b in v.items()} if v else None,
    ),
    F("allowed_token_ids", list[int] | None, None, _allowed, nullable=True, wire=_ids_or_none),
    F("bad_words", list[str] | None, None, _bad_words, nullable=True, wire=lambda v: list(v or [])),
    # keep the prompt's last N tokens (-1: the model length); sent beside the params
    F("truncate_prompt_tokens", int | None, None, _truncate, nullable=True, wire=None),
    F("ignore_eos", bool, False, lambda n, v, vs: check_bool(n, v), body_default=False),
    F("skip_special_tokens", bool, True, lambda n, v, vs: check_bool(n, v), body_default=True),
    F(
        "include_stop_str_in_output",
        bool,
        False,
        lambda n, v, vs: check_bool(n, v),
        body_default=False,
    ),
    # structured output as vLLM's guided decoding, at most one of these; the gateway and the
    # Python API each map their constraint fields onto the wire's ``structured_output``
    F(
        "guided_json",
        str | dict[str, Any] | None,
        None,
        _one_guided,
        nullable=True,
        responses=False,
        wire=None,
    ),
    F("guided_regex", str | None, None, _one_guided, nullable=True, responses=False, wire=None),
    F(
        "guided_choice",
        list[str] | None,
        None,
        _one_guided,
        nullable=True,
        responses=False,
        wire=None,
    ),
    F("guided_grammar", str | None, None, _one_guided, nullable=True, responses=False, wire=None),
]

PROCESSORS: list[LogitsProcessor] = [
    LogitBias(),
    AllowedTokens(),
    Penalties(),
    BadWords(),
    MinTokens(),
    Grammar(),
]
