"""The two shapes a sampling feature is defined with: ``SamplingField`` (one request field: its
type, default, validation, HTTP body and wire mapping) and ``LogitsProcessor`` (how a feature
changes a step's logits rows on the host, after vLLM's logits processors). The gateway, the
Python API and the worker iterate over the table in features.py instead of naming fields."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from kvflow.shared.messages import SamplingParams as WireParams

GREEDY_EPS = 1e-5  # temperatures below this are greedy (vLLM's rule)

# (field name, value, every value of the request + the limits ``max_n``, ``max_logprobs``)
Check = Callable[[str, Any, Mapping[str, Any]], None]


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class SamplingField:
    """One sampling parameter. ``default`` is the Python API's (and validation's); ``None``
    values skip ``check`` when ``nullable``. ``body``: whether the HTTP bodies declare it (as
    ``type | None`` defaulting to ``body_default``; an unset field means ``default``);
    ``responses``: whether /v1/responses accepts it among its extras. ``wire``: maps the value
    onto the wire ``SamplingParams`` field of the same name (None: not on the wire)."""

    name: str
    type: Any
    default: Any
    check: Check | None = None
    nullable: bool = False
    body: bool = True
    body_default: Any = None
    responses: bool = True
    wire: Callable[[Any], Any] | None = _same

    def validate(self, value: Any, values: Mapping[str, Any]) -> None:
        """Raise ``SamplingParamError`` naming this field if ``value`` is wrong."""
        if self.check is not None and not (self.nullable and value is None):
            self.check(self.name, value, values)

    def from_body(self, value: Any) -> Any:
        """The value an HTTP body's field stands for (unset: the default)."""
        return self.default if value is None else value


class RowState(Protocol):
    """What a processor may read of a request's state on the worker (runner.RequestState)."""

    params: WireParams
    num_output_tokens: int
    eos_token_ids: frozenset[int]
    stop_token_ids: frozenset[int]
    prompt_tokens: list[int]  # kept only when the params need token history
    output_tokens: list[int]
    guide: Any  # the grammar matcher (structured output), or None
    guide_failed: bool
    # decided once per request from its parameters (derived.active_processors)
    processors: tuple[LogitsProcessor, ...]
    draw: Any  # and for the draw (services/worker/sampler.py DrawRow)
    # what processors derive from the token history, kept between steps (processors.py
    # TokenHistory; None until a processor first needs it)
    history_memo: Any


class LogitsProcessor:
    """A feature's change to the logits of the rows that sample this step, in place where the
    logits are (fp32, [rows, vocab]; the GPU on the device path). Rows are independent, so
    processors run one after another over the batch. ``needs_history``: reads the prompt and
    output tokens so far (the scheduler then sends them, ``NewRequest.token_history``)."""

    needs_history: bool = False

    def active(self, p: WireParams) -> bool:
        """Whether the request's parameters turn this feature on."""
        raise NotImplementedError

    def applies(self, st: RowState) -> bool:
        """Whether it changes this row this step (default: whenever it is on)."""
        return self.active(st.params)

    def apply_row(self, logits: torch.Tensor, row: int, st: RowState) -> None:
        """Change one row in place."""
        raise NotImplementedError

    def apply(self, logits: torch.Tensor, states: Sequence[RowState]) -> None:
        """Change every row it applies to (override for a batched implementation)."""
        for row, st in enumerate(states):
            if self.applies(st):
                self.apply_row(logits, row, st)
