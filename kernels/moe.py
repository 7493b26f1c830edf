"""A mixture-of-experts block over a step's flat tokens (shared/models/families/moe.py): the
router's top-k, then each expert's gated MLP over the tokens routed to it, the tokens grouped by
expert so that each expert projection is one GEMM over its tokens (never one per token), and
each token's expert outputs summed with the router's weights in its top-k order.

On the CPU path the expert GEMMs are the caller's (``rows_linear``), with its batch-invariant
row layout: each expert's tokens go through the GEMM as single rows in calibrated tiles, so a
token's result does not depend on which other tokens share its expert in the step; the
per-expert counts come to the host once per layer for that loop. On the device path the experts
are stacked (``MoEWeights.stack``) and run as two grouped launches for all experts
(kernels/triton_moe.py, vLLM's ``fused_moe`` design). Steps with MoE layers run eagerly, not as
CUDA graphs (the expert-load count and the CPU loop are data dependent).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class MoEWeights:
    """One MoE layer's weights: the router [E, H], each expert's fused gate | up [2I, H] and
    down [H, I] (tensors or any ``kernels.reference.Weight``), and an optional shared expert
    with its gate [1, H] (Qwen2-MoE)."""

    router: Any
    gate_up: list[Any]
    down: list[Any]
    top_k: int
    renormalize: bool
    shared_gate_up: Any = None
    shared_down: Any = None
    shared_gate: Any = None
    # the device path's experts stacked [E, 2I, H] and [E, H, I] (``gate_up`` and ``down``
    # are then views of them) for kernels/triton_moe.py; None: one GEMM per expert
    gate_up_stacked: torch.Tensor | None = None
    down_stacked: torch.Tensor | None = None

    def stack(self) -> bool:
        """Stack dense experts for the grouped kernel (the per-expert lists become views);
        False when some expert is not a plain tensor (quantized)."""
        if not all(isinstance(w, torch.Tensor) for w in (*self.gate_up, *self.down)):
            return False
        self.gate_up_stacked = torch.stack(self.gate_up)
        self.down_stacked = torch.stack(self.down)
        self.gate_up = list(self.gate_up_stacked.unbind(0))
        self.down = list(self.down_stacked.unbind(0))
        return True

    @property
    def num_experts(self) -> int:
        return len(self.gate_up)


def route(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k]): softmax in fp32, the k
    largest in descending order, rescaled to sum to 1 when ``renormalize``."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def moe_block(
    x: torch.Tensor,
    m: MoEWeights,
    linear: Callable[[torch.Tensor, Any], torch.Tensor],
    rows_linear: Callable[[torch.Tensor, Any], torch.Tensor],
    act: Callable[[torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """The block's output [T, H] for ``x`` [T, H], and the tokens each expert took [E] (the
    step's expert load). ``linear``: a GEMM over the step's rows (router, shared expert);
    ``rows_linear``: a GEMM over a gathered set of rows (an expert's tokens); ``act``: the
    gated activation of a fused gate | up output."""
    weights, ids = route(linear(x, m.router), m.top_k, m.renormalize)
    flat = ids.reshape(-1)
    load = torch.bincount(flat, minlength=m.num_experts)
    if m.gate_up_stacked is not None:  # the device path: two grouped launches, no host sync
        from kvflow.kernels.triton_moe import expert_slots

        y = sum_slots(expert_slots(x, weights, ids, m.gate_up_stacked, m.down_stacked, act))
    else:
        y = _per_expert(x, weights, flat, load, m, rows_linear, act)
    if m.shared_gate_up is not None:
        shared = linear(act(linear(x, m.shared_gate_up)), m.shared_down)
        y = y + torch.sigmoid(linear(x, m.shared_gate)) * shared
    return y, load


def _per_expert(
    x: torch.Tensor,
    weights: torch.Tensor,
    flat: torch.Tensor,
    load: torch.Tensor,
    m: MoEWeights,
    rows_linear: Callable[[torch.Tensor, Any], torch.Tensor],
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """The routed experts one GEMM per expert projection over its tokens (the counts come to
    the host): each token's k outputs times their weights, summed in its top-k order."""
    t, k = x.shape[0], m.top_k
    order = torch.argsort(flat, stable=True)  # slots (token * k + j) grouped by expert
    out = x.new_empty(t * k, x.shape[1])
    start = 0
    for e, n in enumerate(load.tolist()):
        if not n:
            continue
        slots = order[start : start + n]
        start += n
        xe = x.index_select(0, slots // k)
        out.index_copy_(0, slots, rows_linear(act(rows_linear(xe, m.gate_up[e])), m.down[e]))
    return sum_slots(out.view(t, k, -1) * weights.to(out.dtype).unsqueeze(-1))


def sum_slots(out: torch.Tensor) -> torch.Tensor:
    """[T, k, H] weighted expert outputs -> [T, H]: each token's k summed in its top-k order
    (the same order on both paths, whatever the batch)."""
    y = out[:, 0].contiguous()
    for j in range(1, out.shape[1]):
        y = y + out[:, j]
    return y
