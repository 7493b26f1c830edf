"""Sampling features as one interface (after vLLM's sampling_params.py and logits processors):
the table of fields and processors (features.py), the shapes they are defined with (spec.py),
the value checks (checks.py) and what every layer derives from the table (derived.py)."""

from kvflow.shared.sampling.checks import (
    INT64_MAX,
    INT64_MIN,
    MAX_LOGPROBS,
    MAX_TOKEN_ID,
    SamplingParamError,
)
from kvflow.shared.sampling.derived import (
    active_processors,
    apply_processors,
    needs_token_history,
    validate_sampling,
    wire_fields,
)
from kvflow.shared.sampling.features import FIELDS, PROCESSORS
from kvflow.shared.sampling.spec import GREEDY_EPS, LogitsProcessor, RowState, SamplingField

__all__ = [
    "FIELDS",
    "GREEDY_EPS",
    "INT64_MAX",
    "INT64_MIN",
    "MAX_LOGPROBS",
    "MAX_TOKEN_ID",
    "PROCESSORS",
    "LogitsProcessor",
    "RowState",
    "SamplingField",
    "SamplingParamError",
    "active_processors",
    "apply_processors",
    "needs_token_history",
    "validate_sampling",
    "wire_fields",
]
