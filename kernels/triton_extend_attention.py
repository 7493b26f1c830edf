"""Prefill / extend attention in Triton over the paged KV cache, for a varlen batch in one launch.

Same function as ``reference.paged_attention``: sequence i contributes ``query_len_i`` new tokens
(rows ``query_start_loc[i]:query_start_loc[i+1]`` of q), which are the last tokens of its
``seq_lens[i]`` context, their K/V already written to the cache. A plain prefill has
``seq_len == query_len``; a prefix-cache hit or a later chunk of a chunked prefill has a cached
prefix in front (``seq_len > query_len``), and the causal mask is bottom-right aligned: new token
j (0-based) sees keys ``0 .. seq_len - query_len + j``.

Grid ``(cdiv(max_query_len, BLOCK_M), B, H)``: one program holds ``BLOCK_M`` query rows of one
head and streams that sequence's keys ``BLOCK_N`` at a time straight from the paged cache (the
prefix and the new tokens alike; no gather into a contiguous copy), with an online softmax. Keys
past the last row's causal limit are never loaded. Programs whose row tile lies past their
sequence's ``query_len`` exit at once, so ``max_query_len`` only sizes the grid.

Sliding-window attention (``window`` > 0): query position p sees keys ``p - window < j <= p``;
a tile's key loop starts at the ``BLOCK_N`` tile holding its first row's first visible key, so
keys before every row's window are never loaded. Logit soft-capping (``softcap`` > 0, Gemma 2):
scores become ``softcap * tanh(score / softcap)`` before masking. Both are runtime arguments
behind ``constexpr`` flags: with them off the kernel compiles as without them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvflow.kernels.triton_decode_attention import _tanh

_LOG2E = 1.4426950408889634


# the block table's row stride is its width, which changes from step to step: left
# unspecialized (Triton would compile a variant for widths of 1 and multiples of 16)
@triton.jit(do_not_specialize=["stride_bt"])
def _extend_kernel(
    Q,  # [T, H, D]
    K_cache,  # [num_blocks, block_size, Hkv, D]
    V_cache,
    Out,  # [T, H, D]
    Block_tables,  # [B, max_blocks] int32
    Seq_lens,  # [B]
    Query_start_loc,  # [B + 1]
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window (read only with USE_WINDOW)
    softcap2,  # softcap * log2(e) (read only with USE_SOFTCAP)
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_bt,
    GROUP: tl.constexpr,  # H // Hkv
    PAGE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):
    m_tile = tl.program_id(0)
    b = tl.program_id(1)
    h = tl.program_id(2)
    kv_head = h // GROUP

    q_start = tl.load(Query_start_loc + b)
    q_len = tl.load(Query_start_loc + b + 1) - q_start
    if m_tile * BLOCK_M < q_len:
        seq_len = tl.load(Seq_lens + b)
        prefix = seq_len - q_len
        rows = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        q_pos = prefix + rows  # absolute position of each query row
        d = tl.arange(0, BLOCK_D)
        d_mask = d < HEAD_DIM
        tok = (q_start + rows).to(tl.int64)
        q = tl.load(
            Q + tok[:, None] * stride_qt + h * stride_qh + d[None, :],
            mask=row_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        bt_row = Block_tables + b * stride_bt
        # the tile's last row sees keys up to prefix + its index: nothing beyond is loaded
        end = tl.minimum(seq_len, prefix + (m_tile + 1) * BLOCK_M)
        if USE_WINDOW:
            # and the first row sees nothing before its window: neither does any later row
            lo = tl.maximum(prefix + m_tile * BLOCK_M - window + 1, 0) // BLOCK_N * BLOCK_N
        else:
            lo = 0
        for n0 in range(lo, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < end
            blk = tl.load(bt_row + n // PAGE, mask=n_mask, other=0).to(tl.int64)
            off = n % PAGE
            k = tl.load(
                K_cache
                + blk[None, :] * stride_kb
                + off[None, :] * stride_ks
                + kv_head * stride_kh
                + d[:, None],
                mask=n_mask[None, :] & d_mask[:, None],
                other=0.0,
            )  # [BLOCK_D, BLOCK_N]: loaded transposed, ready for q @ k
            s = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
            if USE_SOFTCAP:  # c * tanh(s_nat / c) in base 2, c2 = c * log2(e)
                s = softcap2 * _tanh(s / softcap2)
            causal = (n[None, :] <= q_pos[:, None]) & n_mask[None, :]
            if USE_WINDOW:
                causal = causal & (n[None, :] > q_pos[:, None] - window)
            s = tl.where(causal, s, float("-inf"))
            # rows past q_len may see no key in a tile: keep their max finite so no NaN is
            # made (those rows are never stored, but NaN would be wasted work to reason about)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                V_cache
                + blk[:, None] * stride_vb
                + off[:, None] * stride_vs
                + kv_head * stride_vh
                + d[None, :],
                mask=n_mask[:, None] & d_mask[None, :],
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(
            Out + tok[:, None] * stride_ot + h * stride_oh + d[None, :],
            out.to(Out.dtype.element_ty),
            mask=row_mask[:, None] & d_mask[None, :],
        )


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of a varlen batch of new tokens over a paged KV cache.

    q [T, H, D], the new tokens of B sequences back to back; query_start_loc [B + 1] int32
    (cumulative query lengths, starting at 0); seq_lens [B] (context length including the new
    tokens, >= query length); block_tables [B, max_blocks] int32; k_cache/v_cache
    [num_blocks, block_size, Hkv, D] with the new tokens' K/V already written. ``max_query_len``
    is a host int >= every query length (it sizes the grid; no device sync here). Returns
    [T, H, D] in q's dtype. Works for any mix, including query lengths of 1. ``window`` > 0:
    sliding-window attention (query position p sees keys ``p - window < j <= p``);
    ``softcap`` > 0: scores (after ``scale``) become ``softcap * tanh(score / softcap)``; 0
    turns either off."""
    t, h, d = q.shape
    _, page, hkv, dk = k_cache.shape
    assert dk == d and h % hkv == 0, (q.shape, k_cache.shape)
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert window >= 0 and softcap >= 0, (window, softcap)
    bsz = seq_lens.shape[0]
    out = torch.empty_like(q)
    if t == 0 or bsz == 0 or max_query_len == 0:
        return out
    block_d = max(16, triton.next_power_of_2(d))
    # 128x64 tiles over 8 warps (FlashAttention-2's Triton tiling): 174 registers, 96 KB shared
    # with two pipeline stages on sm_90 for bf16 head_dim 128, no spills (kernels.compile_check).
    # Short queries take a shorter row tile; fp32 (tests; on CUDA not a serving dtype) and
    # head_dim 256 take smaller tiles to limit spilling.
    wide = q.dtype != torch.float32 and block_d <= 128
    block_m = min(128 if wide else 32, max(16, triton.next_power_of_2(max_query_len)))
    block_n = 64 if wide else 32
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (triton.cdiv(max_query_len, block_m), bsz, h)
    _extend_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        scale * _LOG2E,
        window,
        softcap * _LOG2E,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        out.stride(0),
        out.stride(1),
        block_tables.stride(0),
        GROUP=h // hkv,
        PAGE=page,
        HEAD_DIM=d,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=precision,
        USE_WINDOW=window > 0,
        USE_SOFTCAP=softcap > 0,
        num_warps=8 if wide else 4,
        num_stages=2,
    )
    return out
