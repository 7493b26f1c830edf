"""The fused elementwise layers of a Llama block in Triton: RMSNorm (+ residual add), rotary
embedding, SiLU-and-multiply and GELU(tanh)-and-multiply (Gemma). Each has the signature and
semantics of its namesake in kernels/reference.py and computes in fp32 whatever the storage dtype.

All are memory bound: one program per token row (per row chunk for the gated activations) reads
each input once and writes each output once, where the unfused torch versions make several passes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# --------------------------------------------------------------------------------------------
# RMSNorm with fused residual add


@triton.jit
def _rms_norm_kernel(
    X,  # [T, N]
    Residual,  # [T, N] (unused without HAS_RESIDUAL)
    W,  # [N]
    Out,  # [T, N]
    Sum_out,  # [T, N]: x + residual (unused without HAS_RESIDUAL)
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_s,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(Residual + row * stride_r + cols, mask=mask, other=0.0)
        # round the sum to the storage dtype before normalising it, as torch's ``x + residual``
        # does: the normalised value and the carried residual are then the same numbers
        x = (x.to(tl.float32) + r.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(Sum_out + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / N
    normed = (xf * tl.rsqrt(var + eps)).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=mask, other=0.0)
    tl.store(
        Out + row * stride_o + cols,
        (normed.to(tl.float32) * w.to(tl.float32)).to(Out.dtype.element_ty),
        mask=mask,
    )


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dim of ``x`` [T, N] (weight [N]). With ``residual`` [T, N],
    normalises ``x + residual`` and returns ``(normed, x + residual)``; without, returns
    ``(normed, x)``. Output dtype is that of ``weight * x`` in torch."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if residual is not None:
        r2 = residual.reshape(-1, n)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        summed = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    else:
        r2, summed = x2, out  # placeholders the kernel never touches
    if rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(rows,)](
            x2,
            r2,
            weight,
            out,
            summed,
            eps,
            x2.stride(0),
            r2.stride(0),
            out.stride(0),
            summed.stride(0),
            N=n,
            BLOCK=block,
            HAS_RESIDUAL=residual is not None,
            num_warps=min(max(block // 256, 1), 16),
        )
    out = out.view(x.shape)
    if residual is None:
        return out, x
    return out, summed.view(x.shape)


# --------------------------------------------------------------------------------------------
# SiLU and multiply


@triton.jit
def _silu_and_mul_kernel(
    X,  # [T, 2 * N]: gate | up
    Out,  # [T, N]
    stride_x,
    stride_o,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(Out + row * stride_o + cols, y.to(Out.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :N]) * x[..., N:]`` for x [..., 2N] -> [..., N] (fused gate/up output)."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    if x2.shape[0] and n:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2,
            out,
            x2.stride(0),
            out.stride(0),
            N=n,
            BLOCK=block,
            num_warps=4 if block >= 512 else 1,
        )
    return out.view(*x.shape[:-1], n)


# --------------------------------------------------------------------------------------------
# GELU (tanh approximation) and multiply


@triton.jit
def _gelu_tanh_and_mul_kernel(
    X,  # [T, 2 * N]: gate | up
    Out,  # [T, N]
    stride_x,
    stride_o,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    # 0.5 g (1 + tanh(y)) == g / (1 + exp(-2y)): one exp, as in reference.gelu_tanh_and_mul
    y2 = 1.5957691216057308 * (gate + 0.044715 * (gate * gate * gate))  # 2 sqrt(2 / pi) (...)
    y = gate / (1.0 + tl.exp(-y2)) * up
    tl.store(Out + row * stride_o + cols, y.to(Out.dtype.element_ty), mask=mask)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``gelu_tanh(x[..., :N]) * x[..., N:]`` for x [..., 2N] -> [..., N] (Gemma's fused gate/up
    output; torch's ``F.gelu(approximate="tanh")``)."""
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    if x2.shape[0] and n:
        block = min(1024, triton.next_power_of_2(n))
        _gelu_tanh_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](
            x2,
            out,
            x2.stride(0),
            out.stride(0),
            N=n,
            BLOCK=block,
            num_warps=4 if block >= 512 else 1,
        )
    return out.view(*x.shape[:-1], n)


# --------------------------------------------------------------------------------------------
# rotary embedding (HF Llama "rotate_half" layout)


@triton.jit
def _rotate_heads(
    X,
    Out,
    t,
    cos,
    sin,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    hh = tl.arange(0, BLOCK_H)
    j = tl.arange(0, BLOCK_HALF)
    mask = (hh[:, None] < NUM_HEADS) & (j[None, :] < HALF)
    base = X + t * stride_xt + hh[:, None] * stride_xh + j[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    obase = Out + t * stride_ot + hh[:, None] * stride_oh + j[None, :]
    ty = Out.dtype.element_ty
    tl.store(obase, (x1 * cos[None, :] - x2 * sin[None, :]).to(ty), mask=mask)
    tl.store(obase + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(ty), mask=mask)


@triton.jit
def _rotary_kernel(
    Positions,  # [T]
    Q,  # [T, H, D]
    K,  # [T, Hkv, D]
    Q_out,
    K_out,
    Cos_sin,  # [max_pos, D]: cos of the D/2 frequencies, then sin
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cs,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(Positions + t).to(tl.int64)
    j = tl.arange(0, BLOCK_HALF)
    cs = Cos_sin + pos * stride_cs
    cos = tl.load(cs + j, mask=j < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs + HALF + j, mask=j < HALF, other=0.0).to(tl.float32)
    # one program rotates every q and k head of its token: cos/sin are loaded once
    _rotate_heads(
        Q, Q_out, t, cos, sin, stride_qt, stride_qh, stride_qot, stride_qoh,
        NUM_Q_HEADS, HALF, BLOCK_HQ, BLOCK_HALF,
    )  # fmt: skip
    _rotate_heads(
        K, K_out, t, cos, sin, stride_kt, stride_kh, stride_kot, stride_koh,
        NUM_K_HEADS, HALF, BLOCK_HK, BLOCK_HALF,
    )  # fmt: skip


def rotary_embedding(
    positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate ``q`` [T, H, D] and ``k`` [T, Hkv, D] (any row/head strides, contiguous last dim)
    at ``positions`` [T] with ``cos_sin_cache`` [max_pos, D] from
    ``reference.build_cos_sin_cache``. Returns new tensors (the inputs are not modified), in
    the dtype torch gives ``q * cos``."""
    t, h, d = q.shape
    hkv = k.shape[1]
    assert k.shape[2] == d and cos_sin_cache.shape[-1] == d and d % 2 == 0
    assert q.stride(2) == 1 and k.stride(2) == 1 and cos_sin_cache.stride(-1) == 1
    q_out = torch.empty(
        q.shape, dtype=torch.promote_types(q.dtype, cos_sin_cache.dtype), device=q.device
    )
    k_out = torch.empty(
        k.shape, dtype=torch.promote_types(k.dtype, cos_sin_cache.dtype), device=k.device
    )
    if t == 0:
        return q_out, k_out
    half = d // 2
    block_hq = triton.next_power_of_2(h)
    _rotary_kernel[(t,)](
        positions,
        q,
        k,
        q_out,
        k_out,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin_cache.stride(0),
        NUM_Q_HEADS=h,
        NUM_K_HEADS=hkv,
        HALF=half,
        BLOCK_HQ=block_hq,
        BLOCK_HK=triton.next_power_of_2(hkv),
        BLOCK_HALF=triton.next_power_of_2(half),
        num_warps=4 if block_hq * d >= 2048 else 1,
    )
    return q_out, k_out
