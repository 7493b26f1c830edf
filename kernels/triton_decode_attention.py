"""Paged decode attention in Triton: one new token per sequence, flash-decoding style.

Same function as ``reference.paged_attention`` with every ``query_len == 1``. Two launches:

1. ``_decode_split_kernel``, grid ``(B, Hkv * head_tiles, num_splits)``: one program takes the
   query heads of one KV head (GQA: the whole group at once, so each K/V tile is loaded once
   and used by ``H / Hkv`` heads through ``tl.dot``) over one contiguous slice of the context,
   walks it in ``BLOCK_N``-token tiles gathered through the block table (token by token, so any
   block size works) and keeps an online softmax. It writes that split's normalised output and
   its log-sum-exp.
2. ``_decode_reduce_kernel``, grid ``(B, H)``: merges the splits of one (sequence, head).

Splitting the context is what keeps the GPU busy at small batch sizes and long contexts (a batch
of 1 with 8 KV heads would otherwise be 8 programs). The number of splits is a launch constant
(CUDA graphs need a fixed grid); each sequence divides its own length by it, and splits that
fall past a short sequence's end are empty and skipped by the reduction.

Sliding-window attention (``window`` > 0) attends keys ``max(0, L - window) .. L - 1`` only: the
splits divide that range, so the keys before it are never loaded. Logit soft-capping
(``softcap`` > 0, Gemma 2) caps each score at ``softcap * tanh(score / softcap)``. Both are
runtime arguments behind ``constexpr`` flags: with them off the kernels compile as without them.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

# log2(e): scores are kept in base 2 so the kernels can use exp2 (one instruction on NVIDIA)
_LOG2E = 1.4426950408889634
# fewest context tokens worth a split of their own when the heuristic picks the split count
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 32


@triton.jit
def _tanh(x):
    """tanh from exp2 (``tl.math`` has no tanh in every Triton version, nor the interpreter
    libdevice's): ``sign(x) * (1 - e) / (1 + e)`` with ``e = exp(-2|x|)`` in (0, 1], no
    overflow for any x."""
    e = tl.exp2(tl.abs(x) * -2.8853900817779268)  # -2 * log2(e)
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _num_keys(seq_len, window, USE_WINDOW: tl.constexpr):
    """How many keys a sequence's new token attends (the last ones of its context): all
    ``seq_len``, or at most ``window``. The split and the reduce kernel both cut this count
    into splits, so they agree on which splits are empty."""
    n = seq_len
    if USE_WINDOW:
        n = tl.minimum(seq_len, window)
    return n


# the block table's row stride is its width, which changes from step to step: left
# unspecialized (Triton would compile a variant for widths of 1 and multiples of 16)
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_split_kernel(
    Q,  # [B, H, D]
    K_cache,  # [num_blocks, block_size, Hkv, D]
    V_cache,
    Block_tables,  # [B, max_blocks] int32
    Seq_lens,  # [B]
    Part_out,  # [B, H, NUM_SPLITS, BLOCK_D] fp32: each split's normalised output
    Part_lse,  # [B, H, NUM_SPLITS] fp32: each split's log2-sum-exp2
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window (read only with USE_WINDOW)
    softcap2,  # softcap * log2(e) (read only with USE_SOFTCAP)
    stride_qb,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_bt,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,  # H // Hkv
    HEAD_TILES: tl.constexpr,  # cdiv(GROUP, BLOCK_H)
    PAGE: tl.constexpr,  # block size of the cache
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1) // HEAD_TILES
    tile = tl.program_id(1) % HEAD_TILES
    split = tl.program_id(2)

    g = tile * BLOCK_H + tl.arange(0, BLOCK_H)  # index within the group
    head_mask = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM

    seq_len = tl.load(Seq_lens + b)
    num_keys = _num_keys(seq_len, window, USE_WINDOW)
    split_len = tl.cdiv(num_keys, NUM_SPLITS)
    if USE_WINDOW:
        start = seq_len - num_keys + split * split_len  # the window's first key onwards
    else:
        start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    if start < end:
        q = tl.load(
            Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
            mask=head_mask[:, None] & d_mask[None, :],
            other=0.0,
        )
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        bt_row = Block_tables + b * stride_bt
        for n0 in range(start, end, BLOCK_N):
            n = n0 + tl.arange(0, BLOCK_N)
            n_mask = n < end
            # int64: block_id * stride overflows int32 on caches of a few GB
            blk = tl.load(bt_row + n // PAGE, mask=n_mask, other=0).to(tl.int64)
            off = n % PAGE
            kv_mask = n_mask[:, None] & d_mask[None, :]
            k = tl.load(
                K_cache
                + blk[:, None] * stride_kb
                + off[:, None] * stride_ks
                + kv_head * stride_kh
                + d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            if USE_SOFTCAP:
                # c * tanh(s_nat / c) in base 2: s = s_nat * log2e, so with c2 = c * log2e
                # the capped base-2 score is c2 * tanh(s / c2)
                s = softcap2 * _tanh(s / softcap2)
            s = tl.where(n_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(
                V_cache
                + blk[:, None] * stride_vb
                + off[:, None] * stride_vs
                + kv_head * stride_vh
                + d[None, :],
                mask=kv_mask,
                other=0.0,
            )
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            m_i = m_new
        # the tile at ``start`` always has a valid key, so l_i > 0 here
        tl.store(
            Part_out + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + d[None, :],
            acc / l_i[:, None],
            mask=head_mask[:, None] & d_mask[None, :],
        )
        tl.store(
            Part_lse + b * stride_lb + heads * stride_lh + split,
            m_i + tl.log2(l_i),
            mask=head_mask,
        )


@triton.jit
def _decode_reduce_kernel(
    Part_out,
    Part_lse,
    Seq_lens,
    Out,  # [B, H, D]
    window,
    stride_pb,
    stride_ph,
    stride_ps,
    stride_lb,
    stride_lh,
    stride_ob,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_WINDOW: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    seq_len = tl.load(Seq_lens + b)
    num_keys = _num_keys(seq_len, window, USE_WINDOW)
    split_len = tl.cdiv(num_keys, NUM_SPLITS)

    m = float("-inf")
    den = 0.0
    acc = tl.zeros([BLOCK_D], tl.float32)
    for split in range(0, NUM_SPLITS):
        # the split kernel's own test for "this split has keys": empty splits wrote nothing
        if split * split_len < num_keys:
            lse = tl.load(Part_lse + b * stride_lb + h * stride_lh + split)
            o = tl.load(
                Part_out + b * stride_pb + h * stride_ph + split * stride_ps + d,
                mask=d_mask,
                other=0.0,
            )
            m_new = tl.maximum(m, lse)
            alpha = tl.exp2(m - m_new)
            w = tl.exp2(lse - m_new)
            den = den * alpha + w
            acc = acc * alpha + w * o
            m = m_new
    # seq_len == 0 (a padded row of a CUDA-graph batch): no split had keys; write zeros
    out = tl.where(den > 0.0, acc / tl.maximum(den, 1e-30), 0.0)
    tl.store(Out + b * stride_ob + h * stride_oh + d, out.to(Out.dtype.element_ty), mask=d_mask)


@functools.lru_cache(maxsize=8)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 16  # the interpreter: any small number will do


def default_num_splits(
    batch: int, num_kv_heads: int, group: int, max_context: int, device: torch.device
) -> int:
    """Splits per sequence so that ``batch * Hkv * head_tiles * splits`` fills about two waves
    of the GPU's SMs, but no split shorter than ``_MIN_TOKENS_PER_SPLIT`` tokens of
    ``max_context``. Host-side arithmetic only (no device sync), so a CUDA-graph capture can
    call it: pass the block table's capacity (``max_blocks * block_size``) as ``max_context``."""
    programs = batch * num_kv_heads * triton.cdiv(group, _block_h(group))
    want = triton.cdiv(2 * _num_sms(device), max(programs, 1))
    cap = triton.cdiv(max(max_context, 1), _MIN_TOKENS_PER_SPLIT)
    return max(1, min(want, cap, _MAX_SPLITS))


def _block_h(group: int) -> int:
    # tl.dot wants every dimension >= 16; a group is padded up to that (masked heads cost a
    # little compute, nothing in memory traffic, which is what decode is bound by)
    return max(16, min(64, triton.next_power_of_2(group)))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context.

    q [B, H, D]; k_cache/v_cache [num_blocks, block_size, Hkv, D] (the new token's K/V already
    written); block_tables [B, max_blocks] int32; seq_lens [B] (context length including the
    new token; 0 gives a row of zeros, for padded CUDA-graph rows). Returns [B, H, D] in q's
    dtype. ``num_splits`` (None: ``default_num_splits``) is how many slices each context is cut
    into; fix it when capturing a CUDA graph. ``window`` > 0: sliding-window attention over the
    last ``window`` keys of each context; ``softcap`` > 0: scores (after ``scale``) become
    ``softcap * tanh(score / softcap)``; 0 turns either off."""
    bsz, h, d = q.shape
    _, page, hkv, dk = k_cache.shape
    assert dk == d and h % hkv == 0, (q.shape, k_cache.shape)
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    assert window >= 0 and softcap >= 0, (window, softcap)
    group = h // hkv
    if num_splits is None:
        max_context = block_tables.shape[1] * page
        if window:  # splits divide the window, not the context
            max_context = min(max_context, window)
        num_splits = default_num_splits(bsz, hkv, group, max_context, q.device)
    block_h = _block_h(group)
    head_tiles = triton.cdiv(group, block_h)
    block_d = max(16, triton.next_power_of_2(d))
    out = torch.empty_like(q)
    if bsz == 0:
        return out
    part_out = torch.empty(bsz, h, num_splits, block_d, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(bsz, h, num_splits, dtype=torch.float32, device=q.device)
    # fp32 on tensor cores would silently be tf32; ask for full precision there
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    # 64-token tiles over 4 warps: 80 registers, 38 KB shared on sm_90 for bf16 head_dim 128
    # (python -m kvflow.kernels.compile_check); head_dim 256 halves the tile to stay alike
    block_n = 64 if block_d <= 128 else 32
    _decode_split_kernel[(bsz, hkv * head_tiles, num_splits)](
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        part_out,
        part_lse,
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
        block_tables.stride(0),
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        GROUP=group,
        HEAD_TILES=head_tiles,
        PAGE=page,
        HEAD_DIM=d,
        NUM_SPLITS=num_splits,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=precision,
        USE_WINDOW=window > 0,
        USE_SOFTCAP=softcap > 0,
        num_warps=4,
        num_stages=2,
    )
    _decode_reduce_kernel[(bsz, h)](
        part_out,
        part_lse,
        seq_lens,
        out,
        window,
        part_out.stride(0),
        part_out.stride(1),
        part_out.stride(2),
        part_lse.stride(0),
        part_lse.stride(1),
        out.stride(0),
        out.stride(1),
        HEAD_DIM=d,
        NUM_SPLITS=num_splits,
        BLOCK_D=block_d,
        USE_WINDOW=window > 0,
        num_warps=1 if block_d <= 64 else 2,
    )
    return out
