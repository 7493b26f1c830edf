"""``SamplingParams`` and ``BeamSearchParams`` with vLLM's field names, defaults and validation.

Validation is shared/sampling.py's ``validate_sampling``, the same code the OpenAI gateway runs,
so the Python API and HTTP accept and refuse the same values; a bad value raises a
``ValueError`` (``SamplingParamError``) naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from shared.messages import SamplingParams as WireParams
from shared.messages import StructuredOutput
from shared.sampling import SamplingParamError, validate_sampling

__all__ = ["BeamSearchParams", "SamplingParams", "SamplingParamError"]


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    # structured output, as vLLM's guided decoding: at most one of these
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    def __post_init__(self) -> None:
        validate_sampling(
            n=self.n,
            best_of=self.best_of,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            max_tokens=self.max_tokens,
            min_tokens=self.min_tokens,
            logprobs=self.logprobs,
            prompt_logprobs=self.prompt_logprobs,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            logit_bias=self.logit_bias,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens,
            ignore_eos=self.ignore_eos,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
        )
        guided = [
            name
            for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
            if getattr(self, name) is not None
        ]
        if len(guided) > 1:
            raise SamplingParamError(guided[1], f"only one of {', '.join(guided)} may be set")

    def _structured(self) -> StructuredOutput | None:
        if self.guided_json is not None:
            spec = self.guided_json
            return StructuredOutput(
                "json", spec if isinstance(spec, str) else json.dumps(spec), "guided_json"
            )
        if self.guided_regex is not None:
            return StructuredOutput("regex", self.guided_regex, "guided_regex")
        if self.guided_choice is not None:
            return StructuredOutput("choice", json.dumps(list(self.guided_choice)), "guided_choice")
        if self.guided_grammar is not None:
            return StructuredOutput("grammar", self.guided_grammar, "guided_grammar")
        return None

    def to_wire(self, seed_offset: int = 0, want_logprobs: bool = False) -> WireParams:
        """The pipeline's parameters for one of the ``n`` (or ``best_of``) sequences: seeded
        requests give sequence i the seed ``seed + i`` (as the gateway does); ``want_logprobs``
        asks for the sampled token's logprob even if the caller did not (best_of ranks by it)."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        logprobs = self.logprobs if self.logprobs is not None else (0 if want_logprobs else None)
        return WireParams(
            max_tokens=self.max_tokens if self.max_tokens is not None else 0,
            temperature=float(self.temperature),
            top_p=float(self.top_p),
            top_k=max(0, int(self.top_k)),
            min_p=float(self.min_p),
            seed=None if self.seed is None else self.seed + seed_offset,
            stop=stop,
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            repetition_penalty=float(self.repetition_penalty),
            logprobs=logprobs,
            logit_bias={int(k): float(v) for k, v in self.logit_bias.items()}
            if self.logit_bias
            else None,
            prompt_logprobs=self.prompt_logprobs,
            structured_output=self._structured(),
            allowed_token_ids=list(self.allowed_token_ids) if self.allowed_token_ids else None,
            bad_words=list(self.bad_words or []),
        )


@dataclass
class BeamSearchParams:
    """vLLM's ``BeamSearchParams``: ``beam_width`` beams, up to ``max_tokens`` new tokens."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int):
            raise SamplingParamError("beam_width", "must be an integer")
        if not 1 <= self.beam_width <= 10:  # 2 * beam_width logprobs per step, at most 20
            raise SamplingParamError("beam_width", f"must be in [1, 10], got {self.beam_width}")
        validate_sampling(max_tokens=self.max_tokens, ignore_eos=self.ignore_eos)
        if self.temperature != 0.0:
            raise SamplingParamError("temperature", "beam search is deterministic: use 0")
        if not isinstance(self.length_penalty, int | float) or isinstance(
            self.length_penalty, bool
        ):
            raise SamplingParamError("length_penalty", "must be a number")


def as_list(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    """One SamplingParams per prompt (vLLM accepts one for all, or one each)."""
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"{len(params)} sampling_params for {n} prompts: give one, or one each")
    return params
