"""Multi-LoRA in Triton: Punica-style gather GEMMs for a batch whose token rows each use their own
LoRA adapter (or none), all adapters' weights stacked in slots.

Same functions as ``reference.lora_shrink`` and ``reference.lora_expand``:

* ``lora_shrink``: ``y[t] = x[t] @ a[slots[t]].T`` ([T, K] -> [T, R], the down projection A);
* ``lora_expand``: ``out[t] += v[t] @ b[slots[t]].T`` ([T, R] added into [T, N], the up
  projection B).

Both tile the rows in blocks of ``BLOCK_M``. A program loops over the S adapter slots and, for
each slot that at least one row of its block uses, runs a tensor-core GEMM of the block (rows of
other slots masked to zero) against that adapter's weights. A block whose rows share one adapter
(a prefill) is then a single GEMM, and a decode batch that mixes adapters reads each adapter it
uses once per block. Rows with a negative slot (no adapter, or CUDA-graph padding) get zeros
from shrink and are left untouched by expand. Launches are sized from shapes alone and nothing
waits on the device, so both run under CUDA-graph capture.

Shrink reduces over K (hidden or intermediate size) into few outputs (the rank), so a decode-
sized batch has very few output tiles: it splits K over more programs (``split_k``), each writing
an fp32 partial, summed by one torch reduction (deterministic: no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# enough programs to spread a decode batch's shrink over an H100's 132 SMs, and at least this
# many K elements per split (fewer would make the partials' traffic rival the weights')
_SHRINK_TARGET_PROGRAMS = 128
_SHRINK_MIN_K_PER_SPLIT = 256


@triton.jit
def _lora_shrink_kernel(
    X,  # [T, K]
    A,  # [S, R, K]
    Slots,  # [T]
    Y,  # [SPLIT_K, T, R] fp32 partials, or [T, R] in x's dtype when there is one split
    T,
    S,
    stride_xt,
    stride_as,
    stride_ar,
    stride_ys,
    stride_yt,
    K: tl.constexpr,
    R: tl.constexpr,
    K_PER_SPLIT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    pid_k = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    slots = tl.load(Slots + rows, mask=row_ok, other=-1).to(tl.int32)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < R
    offs_k = pid_k * K_PER_SPLIT + tl.arange(0, BLOCK_K)
    x_rows = X + rows.to(tl.int64)[:, None] * stride_xt
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for s in range(0, S):
        use = slots == s
        if tl.max(use.to(tl.int32), 0) > 0:  # some row of the block has adapter s
            a_cols = A + s * stride_as + r[None, :] * stride_ar  # [1, BLOCK_R]
            for k0 in range(0, K_PER_SPLIT, BLOCK_K):
                k = k0 + offs_k
                k_ok = k < K
                # rows of other adapters load zeros, so they add nothing to their acc rows
                xt = tl.load(x_rows + k[None, :], mask=use[:, None] & k_ok[None, :], other=0.0)
                at = tl.load(a_cols + k[:, None], mask=k_ok[:, None] & r_ok[None, :], other=0.0)
                acc = tl.dot(xt, at.to(xt.dtype), acc, input_precision=PRECISION)
    y = Y + pid_k * stride_ys + rows.to(tl.int64)[:, None] * stride_yt + r[None, :]
    tl.store(y, acc.to(Y.dtype.element_ty), mask=row_ok[:, None] & r_ok[None, :])


@triton.jit
def _lora_expand_kernel(
    V,  # [T, R]
    B,  # [S, N, R]
    Slots,  # [T]
    Out,  # [T, N], row stride >= N
    T,
    S,
    stride_vt,
    stride_bs,
    stride_bn,
    stride_ot,
    N: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    PRECISION: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    slots = tl.load(Slots + rows, mask=row_ok, other=-1).to(tl.int32)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    offs_r = tl.arange(0, BLOCK_R)
    v_rows = V + rows.to(tl.int64)[:, None] * stride_vt
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(0, S):
        use = slots == s
        if tl.max(use.to(tl.int32), 0) > 0:  # some row of the block has adapter s
            b_cols = B + s * stride_bs + n[None, :] * stride_bn  # [1, BLOCK_N]
            for r0 in range(0, R, BLOCK_R):  # one pass when R <= BLOCK_R
                r = r0 + offs_r
                r_ok = r < R
                vt = tl.load(v_rows + r[None, :], mask=use[:, None] & r_ok[None, :], other=0.0)
                bt = tl.load(b_cols + r[:, None], mask=r_ok[:, None] & n_ok[None, :], other=0.0)
                acc = tl.dot(vt, bt.to(vt.dtype), acc, input_precision=PRECISION)
    live = row_ok & (slots >= 0) & (slots < S)  # rows without an adapter: not even rewritten
    mask = live[:, None] & n_ok[None, :]
    o_ptr = Out + rows.to(tl.int64)[:, None] * stride_ot + n[None, :]
    o = tl.load(o_ptr, mask=mask, other=0.0)
    tl.store(o_ptr, (o.to(tl.float32) + acc).to(Out.dtype.element_ty), mask=mask)


def _block_m(t: int) -> int:
    """Row tile: 16 (tl.dot's minimum) for decode-sized batches, up to 64 for prefills."""
    return min(64, max(16, triton.next_power_of_2(t)))


def _block(n: int, cap: int) -> int:
    """A power-of-two tile of at least 16 (tl.dot's minimum) covering ``n``, at most ``cap``."""
    return min(cap, max(16, triton.next_power_of_2(n)))


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs would otherwise go through TF32 on the GPU; bf16/fp16 ignore it
    return "ieee" if dtype == torch.float32 else "tf32"


def default_split_k(t: int, r: int, k: int) -> int:
    """K splits for ``lora_shrink`` of ``t`` rows, rank ``r``, input size ``k``: enough programs
    to fill the GPU when the output has few tiles, each split at least a few hundred K."""
    tiles = triton.cdiv(t, _block_m(t)) * triton.cdiv(r, _block(r, 64))
    return max(1, min(triton.cdiv(_SHRINK_TARGET_PROGRAMS, tiles), k // _SHRINK_MIN_K_PER_SPLIT))


def lora_shrink(
    x: torch.Tensor, a: torch.Tensor, slots: torch.Tensor, split_k: int | None = None
) -> torch.Tensor:
    """Each row of ``x`` [T, K] through its adapter's down projection ``a`` [S, R, K]: row t of
    the [T, R] result is ``x[t] @ a[slots[t]].T`` (fp32 accumulation, x's dtype), zeros where
    ``slots[t] < 0``. ``slots`` [T] int32 or int64, each < S. ``split_k``: programs sharing
    the K reduction (None: ``default_split_k``; rounded so each split gets whole K tiles)."""
    t, k = x.shape
    s, r, ka = a.shape
    assert ka == k and slots.shape == (t,), (x.shape, a.shape, slots.shape)
    if x.stride(1) != 1:
        x = x.contiguous()
    if a.stride(2) != 1:
        a = a.contiguous()
    if t == 0 or s == 0 or r == 0:
        return torch.zeros(t, r, dtype=x.dtype, device=x.device)
    block_m, block_r = _block_m(t), _block(r, 64)
    block_k = _block(k, 128 if block_m == 16 else 64)
    if split_k is None:
        split_k = default_split_k(t, r, k)
    k_per_split = triton.cdiv(triton.cdiv(k, max(1, split_k)), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    if split_k == 1:
        y = torch.empty(t, r, dtype=x.dtype, device=x.device)
        stride_ys = 0
    else:
        y = torch.empty(split_k, t, r, dtype=torch.float32, device=x.device)
        stride_ys = y.stride(0)
    _lora_shrink_kernel[(triton.cdiv(t, block_m), triton.cdiv(r, block_r), split_k)](
        x,
        a,
        slots,
        y,
        t,
        s,
        x.stride(0),
        a.stride(0),
        a.stride(1),
        stride_ys,
        y.stride(-2),
        K=k,
        R=r,
        K_PER_SPLIT=k_per_split,
        BLOCK_M=block_m,
        BLOCK_R=block_r,
        BLOCK_K=block_k,
        PRECISION=_precision(x.dtype),
        num_warps=4,
    )
    if split_k == 1:
        return y
    return y.sum(0).to(x.dtype)


def lora_expand(v: torch.Tensor, b: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    """In place, ``out[t] += v[t] @ b[slots[t]].T`` for the rows with ``slots[t] >= 0``
    (``v`` [T, R], ``b`` [S, N, R] stacked up projections, ``out`` [T, N] with unit column
    stride and any row stride, e.g. a column slice of a wider output); the other rows of ``out``
    are not written. Accumulates in fp32 and adds into ``out``'s dtype."""
    t, r = v.shape
    s, n, rb = b.shape
    assert rb == r and slots.shape == (t,) and out.shape == (t, n), (v.shape, b.shape, out.shape)
    assert out.stride(1) == 1 or n == 1, "out needs unit column stride"
    if v.stride(1) != 1:
        v = v.contiguous()
    if b.stride(2) != 1:
        b = b.contiguous()
    if t == 0 or s == 0 or n == 0 or r == 0:
        return
    block_m, block_n, block_r = _block_m(t), _block(n, 64), _block(r, 64)
    _lora_expand_kernel[(triton.cdiv(t, block_m), triton.cdiv(n, block_n))](
        v,
        b,
        slots,
        out,
        t,
        s,
        v.stride(0),
        b.stride(0),
        b.stride(1),
        out.stride(0),
        N=n,
        R=r,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        PRECISION=_precision(v.dtype),
        num_warps=4,
    )
