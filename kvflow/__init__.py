"""kvflow's Python API, with vLLM's names: ``LLM``, ``SamplingParams``, ``BeamSearchParams`` and
the output classes. ``from kvflow import LLM, SamplingParams``."""

from kvflow.llm import LLM
from kvflow.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    Logprob,
    RequestOutput,
)
from kvflow.sampling_params import BeamSearchParams, SamplingParamError, SamplingParams

__all__ = [
    "LLM",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "CompletionOutput",
    "Logprob",
    "RequestOutput",
    "SamplingParamError",
    "SamplingParams",
]
