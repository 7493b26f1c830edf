"""Mixture-of-experts GEMMs in Triton, vLLM's ``fused_moe`` design: the step's (token, k) slots
sorted by expert and each expert's run padded to the row tile (``align``), so every row tile
belongs to one expert; one launch per projection then multiplies each tile by its expert's
weight tile (``grouped_gemm``). Experts with no token get no tile; nothing waits on the host
(the padded length is bounded by shapes), so the launches could run under CUDA-graph capture.

The same function as ``kernels.moe.moe_block``'s expert part: ``expert_slots`` returns, for
each token, its k experts' ``weight * down(act(gate_up(x)))``, which ``moe_block`` sums in the
token's top-k order as on the CPU path (``kernels.moe.sum_slots``; this module imports nothing
of kernels/moe.py, which dispatches to it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_gemm_kernel(
    A,  # [rows, K]: the input rows (tokens, or slots when A_PER_SLOT)
    B,  # [E, N, K] stacked expert weights
    C,  # [slots, N] out, one row per (token, k) slot
    SortedSlots,  # [P] slot ids grouped by expert, padded with num_slots
    BlockExpert,  # [P / BLOCK_M] each row tile's expert (E: an unused tile)
    Weights,  # [slots] fp32 router weights (read when MUL_WEIGHT)
    num_slots,
    num_experts,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    N: tl.constexpr,
    K: tl.constexpr,
    TOP_K: tl.constexpr,
    A_PER_SLOT: tl.constexpr,
    MUL_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(BlockExpert + pid_m)
    if e < num_experts:
        slots = tl.load(SortedSlots + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        live = slots < num_slots
        rows = slots if A_PER_SLOT else slots // TOP_K
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        offs_k = tl.arange(0, BLOCK_K)
        a_rows = A + rows.to(tl.int64)[:, None] * stride_am
        b_cols = B + e.to(tl.int64) * stride_be + n[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + offs_k
            k_ok = k < K
            at = tl.load(a_rows + k[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
            bt = tl.load(b_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            acc = tl.dot(at, bt.to(at.dtype), acc, input_precision=PRECISION)
        if MUL_WEIGHT:
            w = tl.load(Weights + slots, mask=live, other=0.0)
            acc = acc * w[:, None]
        c = C + slots.to(tl.int64)[:, None] * stride_cm + n[None, :]
        tl.store(c, acc.to(C.dtype.element_ty), mask=live[:, None] & n_ok[None, :])


def block_m(num_slots: int) -> int:
    """The row tile: 16 (tl.dot's minimum) for decode-sized steps, up to 64 for prefills."""
    return min(64, max(16, triton.next_power_of_2(max(1, num_slots))))


def align(ids: torch.Tensor, num_experts: int, bm: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's ``moe_align_block_size`` in torch ops on the device: the slots (``token * k +
    j`` of ``ids`` [T, k]) grouped by expert, each expert's run padded to a multiple of ``bm``
    with the out-of-range slot id ``T * k``; and each ``bm``-row tile's expert (``num_experts``
    for the unused tiles at the end). The padded length is the bound ``T * k + E * (bm - 1)``
    rounded up to ``bm``, so no count comes back to the host."""
    flat = ids.reshape(-1)
    slots = flat.numel()
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + bm - 1) // bm * bm
    ends = torch.cumsum(padded, 0)
    starts = ends - padded
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    first = torch.cumsum(counts, 0) - counts  # each expert's first position in ``order``
    dest = starts[expert] + torch.arange(slots, device=ids.device) - first[expert]
    length = triton.cdiv(slots + num_experts * (bm - 1), bm) * bm
    sorted_slots = torch.full((length,), slots, dtype=torch.int32, device=ids.device)
    sorted_slots[dest] = order.to(torch.int32)
    tile_starts = torch.arange(0, length, bm, device=ids.device)
    block_expert = torch.searchsorted(ends, tile_starts, right=True).to(torch.int32)
    return sorted_slots, block_expert


def grouped_gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    sorted_slots: torch.Tensor,
    block_expert: torch.Tensor,
    num_slots: int,
    top_k: int,
    bm: int,
    a_per_slot: bool,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """[num_slots, N]: row ``s`` is ``a[row] @ b[expert(s)].T`` (``row`` the slot itself when
    ``a_per_slot``, else its token ``s // top_k``), times ``weights[s]`` when given; fp32
    accumulation, ``a``'s dtype."""
    e, n, k = b.shape
    if a.stride(1) != 1:
        a = a.contiguous()
    out = torch.zeros(num_slots, n, dtype=a.dtype, device=a.device)
    if num_slots == 0:
        return out
    block_n = min(64, max(16, triton.next_power_of_2(n)))
    block_k = min(64, max(16, triton.next_power_of_2(k)))
    w = weights if weights is not None else out  # not read without MUL_WEIGHT
    _grouped_gemm_kernel[(block_expert.numel(), triton.cdiv(n, block_n))](
        a,
        b,
        out,
        sorted_slots,
        block_expert,
        w,
        num_slots,
        e,
        a.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        N=n,
        K=k,
        TOP_K=top_k,
        A_PER_SLOT=a_per_slot,
        MUL_WEIGHT=weights is not None,
        BLOCK_M=bm,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        num_warps=4,
    )
    return out


def expert_slots(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    act: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """Each token's routed experts: ``x`` [T, H], router ``weights`` and ``ids`` [T, k],
    stacked ``gate_up`` [E, 2I, H] and ``down`` [E, H, I]; returns [T, k, H], slot j of token t
    being ``weights[t, j] * down(act(gate_up(x[t])))`` of its j-th expert."""
    t, top_k = ids.shape
    slots = t * top_k
    bm = block_m(slots)
    sorted_slots, block_expert = align(ids, gate_up.shape[0], bm)
    h = grouped_gemm(x, gate_up, sorted_slots, block_expert, slots, top_k, bm, False)
    h = act(h)
    w = weights.reshape(-1).to(torch.float32).contiguous()
    out = grouped_gemm(h, down, sorted_slots, block_expert, slots, top_k, bm, True, w)
    return out.view(t, top_k, -1)
