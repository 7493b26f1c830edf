"""KV cache write in Triton: each token's new K/V into its flat slot of the paged cache.

Same function as ``reference.write_kv_cache``. Grid ``(T,)``: one program copies one token's
``[Hkv, D]`` keys and values (one tile each). A slot of -1 marks a padded row (CUDA-graph
batches are padded to a captured size) and that program stores nothing, so the cache rows
behind it are left exactly as they were.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(
    K,  # [T, Hkv, D]
    V,
    K_cache,  # [num_blocks, block_size, Hkv, D]
    V_cache,
    Slot_mapping,  # [T]
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    slot = tl.load(Slot_mapping + t).to(tl.int64)
    if slot >= 0:  # padded rows (slot -1) write nothing
        hh = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        mask = (hh[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
        blk = slot // PAGE
        off = slot % PAGE
        k = tl.load(K + t * stride_kt + hh[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(V + t * stride_vt + hh[:, None] * stride_vh + d[None, :], mask=mask)
        kc = K_cache + blk * stride_kcb + off * stride_kcs + hh[:, None] * stride_kch + d[None, :]
        vc = V_cache + blk * stride_vcb + off * stride_vcs + hh[:, None] * stride_vch + d[None, :]
        tl.store(kc, k.to(K_cache.dtype.element_ty), mask=mask)
        tl.store(vc, v.to(V_cache.dtype.element_ty), mask=mask)


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store ``k``/``v`` [T, Hkv, D] (any row/head strides, contiguous last dim) into caches
    [num_blocks, block_size, Hkv, D] at flat slots ``block_id * block_size + offset``
    (slot_mapping [T], int32 or int64); rows whose slot is -1 are skipped."""
    t, hkv, d = k.shape
    assert v.shape == k.shape and k_cache.shape[2:] == (hkv, d), (k.shape, k_cache.shape)
    assert k.stride(2) == 1 and v.stride(2) == 1
    assert k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    if t == 0:
        return
    block_h = triton.next_power_of_2(hkv)
    block_d = triton.next_power_of_2(d)
    _write_kv_kernel[(t,)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        NUM_KV_HEADS=hkv,
        HEAD_DIM=d,
        PAGE=k_cache.shape[1],
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4 if block_h * block_d >= 1024 else 1,
    )
