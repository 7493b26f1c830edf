"""A mixture-of-experts block over a step's flat tokens (shared/models/families/moe.py): the
router's top-k, then each expert's gated MLP over the tokens routed to it, the tokens grouped by
expert so that each expert projection is one GEMM over its tokens (never one per token), and
each token's expert outputs summed with the router's weights in its top-k order.

The GEMMs are the caller's (``rows_linear``): the CPU path passes its batch-invariant row layout
(each expert's tokens go through the GEMM as single rows in calibrated tiles, so a token's
result does not depend on which other tokens share its expert in the step), the device path a
plain GEMM. Grouping needs the per-expert counts on the host (one sync per MoE layer), so a
device step with MoE layers runs eagerly, not as a CUDA graph.
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
    t, k = x.shape[0], m.top_k
    weights, ids = route(linear(x, m.router), k, m.renormalize)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # slots (token * k + j) grouped by expert
    load = torch.bincount(flat, minlength=m.num_experts)
    out = x.new_empty(t * k, x.shape[1])
    start = 0
    for e, n in enumerate(load.tolist()):
        if not n:
            continue
        slots = order[start : start + n]
        start += n
        xe = x.index_select(0, slots // k)
        out.index_copy_(0, slots, rows_linear(act(rows_linear(xe, m.gate_up[e])), m.down[e]))
    out = out.view(t, k, -1) * weights.to(out.dtype).unsqueeze(-1)
    y = out[:, 0].contiguous()
    for j in range(1, k):  # each token's experts in its top-k order
        y = y + out[:, j]
    if m.shared_gate_up is not None:
        shared = linear(act(linear(x, m.shared_gate_up)), m.shared_down)
        y = y + torch.sigmoid(linear(x, m.shared_gate)) * shared
    return y, load
