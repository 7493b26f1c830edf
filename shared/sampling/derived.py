"""What every layer derives from the feature table (features.py): validation, the wire mapping,
whether a request needs its token history, and the worker's logits processing."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from kvflow.shared.sampling.checks import MAX_LOGPROBS
from kvflow.shared.sampling.features import FIELDS, PROCESSORS
from kvflow.shared.sampling.spec import LogitsProcessor, RowState

if TYPE_CHECKING:
    import torch

    from kvflow.shared.messages import SamplingParams as WireParams

FIELD_NAMES = frozenset(f.name for f in FIELDS)


def validate_sampling(
    *, max_n: int | None = None, max_logprobs: int = MAX_LOGPROBS, **given: Any
) -> None:
    """Check every value as vLLM's ``SamplingParams`` does (fields not given take their
    defaults); raise ``SamplingParamError`` naming the first field that is wrong.
    ``max_tokens=None`` means "up to the context limit"; ``max_n`` (optional) bounds ``n`` and
    ``best_of``, a server's own limit."""
    unknown = given.keys() - FIELD_NAMES
    if unknown:
        raise TypeError(f"unknown sampling parameters: {', '.join(sorted(unknown))}")
    values = {f.name: given.get(f.name, f.default) for f in FIELDS}
    context = values | {"max_n": max_n, "max_logprobs": max_logprobs}
    for f in FIELDS:
        f.validate(values[f.name], context)


def wire_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    """The wire ``SamplingParams`` keyword arguments for validated values (fields not given
    take their defaults); the caller adds ``structured_output``."""
    return {f.name: f.wire(values.get(f.name, f.default)) for f in FIELDS if f.wire is not None}


def needs_token_history(p: WireParams) -> bool:
    """Whether sampling looks at the tokens so far (penalties, bad words): the worker is then
    given the request's prompt and outputs (``NewRequest.token_history``)."""
    return any(pr.needs_history and pr.active(p) for pr in PROCESSORS)


def active_processors(p: WireParams) -> tuple[LogitsProcessor, ...]:
    """The processors a request's parameters turn on, in the table's order (the worker asks
    once per request, not once per step)."""
    return tuple(pr for pr in PROCESSORS if pr.active(p))


def apply_processors(logits: torch.Tensor, states: Sequence[RowState]) -> None:
    """Every feature's change to the sampling rows (row i is ``states[i]``), in place where the
    logits are, in the table's order; only the processors some row turned on run. The batched draw
    (services/worker/sampler.py) comes after."""
    on = {pr for st in states for pr in st.processors}
    for pr in PROCESSORS:
        if pr in on:
            pr.apply(logits, states)
