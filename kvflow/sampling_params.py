"""``SamplingParams`` and ``BeamSearchParams`` with vLLM's field names, defaults and validation.

``SamplingParams``' fields are the sampling feature table's (shared/sampling/features.py), and
validation is the same ``validate_sampling`` the OpenAI gateway runs, so the Python API and HTTP
accept and refuse the same values; a bad value raises a ``ValueError`` (``SamplingParamError``)
naming the field.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvflow.shared.messages import SamplingParams as WireParams
from kvflow.shared.messages import StructuredOutput
from kvflow.shared.sampling import FIELDS, SamplingParamError, validate_sampling, wire_fields

__all__ = ["BeamSearchParams", "SamplingParams", "SamplingParamError"]


class _SamplingParamsBase:
    """The methods of ``SamplingParams``; its fields come from the feature table."""

    def __post_init__(self) -> None:
        validate_sampling(**self._values())

    def _values(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in FIELDS}

    def _structured(self) -> StructuredOutput | None:
        v = self._values()
        if v["guided_json"] is not None:
            spec = v["guided_json"]
            return StructuredOutput(
                "json", spec if isinstance(spec, str) else json.dumps(spec), "guided_json"
            )
        if v["guided_regex"] is not None:
            return StructuredOutput("regex", str(v["guided_regex"]), "guided_regex")
        if v["guided_choice"] is not None:
            choice = json.dumps(list(v["guided_choice"]))  # type: ignore[call-overload]
            return StructuredOutput("choice", choice, "guided_choice")
        if v["guided_grammar"] is not None:
            return StructuredOutput("grammar", str(v["guided_grammar"]), "guided_grammar")
        return None

    def to_wire(self, want_logprobs: bool = False) -> WireParams:
        """The pipeline's parameters of the request (its ``n`` or ``best_of`` sequences, with
        their seeds, come from shared/fan_out.py); ``want_logprobs`` asks for the sampled
        token's logprob even if the caller did not (best_of ranks by it)."""
        values = self._values()
        if values["seed"] is not None:
            values["seed"] = int(values["seed"])  # type: ignore[call-overload]
        if values["logprobs"] is None and want_logprobs:
            values["logprobs"] = 0
        return WireParams(**wire_fields(values), structured_output=self._structured())


SamplingParams = dataclasses.make_dataclass(
    "SamplingParams",
    [(f.name, f.type, dataclasses.field(default=f.default)) for f in FIELDS],
    bases=(_SamplingParamsBase,),
    namespace={"__doc__": "vLLM's ``SamplingParams``: one field per sampling feature field."},
)
SamplingParams.__module__ = __name__


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


# Prompts as ``LLM`` takes them: a string, token ids, or vLLM's TextPrompt / TokensPrompt dicts
Prompt = str | list[int] | dict[str, Any]


def _prompt_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str | dict):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]  # one prompt as token ids
    if not prompts:
        raise ValueError("no prompts")
    return prompts


def prompt_cache_salt(prompt: Prompt) -> str | None:
    """A dict prompt's ``"cache_salt"`` (vLLM's): a non-empty string, as over HTTP."""
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("cache_salt: must be a non-empty string if provided")
    return salt
