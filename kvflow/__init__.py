"""kvflow's Python API, with vLLM's names: ``LLM``, ``SamplingParams``, ``BeamSearchParams``,
``LoRARequest`` and the output classes. ``from kvflow import LLM, SamplingParams``.

The names load on first use (PEP 562), so ``kvflow.cli`` (the ``kvflow`` command, which every
service process runs) does not pay for the Python API's imports."""

from __future__ import annotations

import importlib
from typing import Any

import kvflow.shared.openmp_env  # noqa: F401  (before anything imports torch)

_WHERE = {
    "LLM": "kvflow.llm",
    "BeamSearchOutput": "kvflow.outputs",
    "BeamSearchSequence": "kvflow.outputs",
    "ClassificationOutput": "kvflow.outputs",
    "ClassificationRequestOutput": "kvflow.outputs",
    "CompletionOutput": "kvflow.outputs",
    "EmbeddingOutput": "kvflow.outputs",
    "EmbeddingRequestOutput": "kvflow.outputs",
    "Logprob": "kvflow.outputs",
    "LoRARequest": "kvflow.lora_request",
    "RequestOutput": "kvflow.outputs",
    "ScoringOutput": "kvflow.outputs",
    "ScoringRequestOutput": "kvflow.outputs",
    "BeamSearchParams": "kvflow.sampling_params",
    "SamplingParamError": "kvflow.sampling_params",
    "SamplingParams": "kvflow.sampling_params",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module 'kvflow' has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name]), name)
    globals()[name] = value
    return value
