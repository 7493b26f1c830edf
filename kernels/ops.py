"""One set of kernel functions, two backends: ``"reference"`` (plain PyTorch, kernels/reference.py;
the CPU path, fp32, batch invariant) and ``"triton"`` (the Triton kernels; CUDA, bf16/fp16).

A caller picks a backend once (``select_backend`` from its device and dtype, or by name) and
calls the same functions either way::

    ops = get_backend(select_backend(device, dtype))
    x, residual = ops.rms_norm(h, weight, eps, residual)

The functions (shapes: T tokens, B sequences, H query heads, Hkv KV heads, D head dim, S LoRA
adapter slots, R LoRA rank):

``rms_norm(x [T, N], weight [N], eps, residual [T, N] | None) -> (normed, x + residual)``
    Without ``residual`` the second value is ``x`` itself.
``silu_and_mul(x [..., 2N]) -> [..., N]``
    ``silu(gate) * up`` of a fused gate/up projection.
``gelu_tanh_and_mul(x [..., 2N]) -> [..., N]``
    ``gelu_tanh(gate) * up`` (Gemma; torch's ``F.gelu(approximate="tanh")``).
``rotary_embedding(positions [T], q [T, H, D], k [T, Hkv, D], cos_sin [max_pos, D]) -> (q, k)``
    HF "rotate_half" layout; ``cos_sin`` from ``reference.build_cos_sin_cache``. New tensors.
``write_kv_cache(k [T, Hkv, D], v, k_cache [num_blocks, block_size, Hkv, D], v_cache,
slot_mapping [T]) -> None``
    Stores each row at flat slot ``block_id * block_size + offset``; slot -1 skips the row.
``decode_attention(q [B, H, D], k_cache, v_cache, block_tables [B, max_blocks] int32,
seq_lens [B], scale, num_splits=None, window=0, softcap=0.0) -> [B, H, D]``
    One new token per sequence (its K/V already written); ``seq_lens`` counts it. A row with
    ``seq_len == 0`` (padding) gives zeros. ``num_splits``: flash-decoding splits per context
    (Triton only; None picks one from the shapes without a device sync).
``extend_attention(q [T, H, D], k_cache, v_cache, block_tables [B, max_blocks], seq_lens [B],
query_start_loc [B + 1] int32, max_query_len, scale, window=0, softcap=0.0) -> [T, H, D]``
    Causal attention of B sequences' new tokens (rows ``query_start_loc[i]:[i+1]`` of q, the
    last ones of each ``seq_lens[i]``-token context, K/V already written): prefill, chunked
    prefill and prefix hits (bottom-right aligned mask). ``max_query_len`` is a host int.

Both attentions: ``window`` > 0 is sliding-window attention (Mistral, Qwen2, Gemma; HF's
semantics: the query at position i sees keys ``i - window < j <= i``, so a decode token of a
length-L context sees ``max(0, L - window) .. L - 1``); ``softcap`` > 0 caps each score (after
``scale``) at ``softcap * tanh(score / softcap)`` before masking and softmax (Gemma 2's
``attn_logit_softcapping``). 0 turns either off (the same results as without them).
``lora_shrink(x [T, K], a [S, R, K], slots [T], split_k=None) -> [T, R]``
    Multi-LoRA down projection (Punica-style gather GEMM): row t is ``x[t] @ a[slots[t]].T``,
    zeros where ``slots[t] < 0`` (no adapter). fp32 accumulation, x's dtype. ``slots`` int32 or
    int64. ``split_k``: programs sharing the K reduction (Triton only; None picks one from the
    shapes without a device sync).
``lora_expand(v [T, R], b [S, N, R], slots [T], out [T, N]) -> None``
    Multi-LoRA up projection, in place: ``out[t] += v[t] @ b[slots[t]].T`` for rows with
    ``slots[t] >= 0``; the other rows are not written. fp32 accumulation, the sum rounded to
    out's dtype. ``out`` needs unit column stride; any row stride (a column slice is fine).

Any GQA ratio, any block size. The Triton modules are imported only when the Triton backend
is asked for, so CPU deployments never need a working Triton.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvflow.kernels import reference

BACKENDS = ("reference", "triton")


@dataclass(frozen=True)
class KernelBackend:
    """The kernel functions of one backend (signatures in the module docstring)."""

    name: str
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    gelu_tanh_and_mul: Callable[[torch.Tensor], torch.Tensor]
    rotary_embedding: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    write_kv_cache: Callable[..., None]
    decode_attention: Callable[..., torch.Tensor]
    extend_attention: Callable[..., torch.Tensor]
    lora_shrink: Callable[..., torch.Tensor]
    lora_expand: Callable[..., None]


def select_backend(device: torch.device | str, dtype: torch.dtype) -> str:
    """``"triton"`` for CUDA tensors in bf16/fp16, else ``"reference"`` (CPU, or fp32 where the
    reference's batch invariance and exactness matter more than speed)."""
    if torch.device(device).type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        return "triton"
    return "reference"


def get_backend(name: str) -> KernelBackend:
    """The backend called ``name`` (one of ``BACKENDS``)."""
    if name == "reference":
        return KernelBackend(
            name="reference",
            rms_norm=reference.rms_norm,
            silu_and_mul=reference.silu_and_mul,
            gelu_tanh_and_mul=reference.gelu_tanh_and_mul,
            rotary_embedding=reference.rotary_embedding,
            write_kv_cache=reference.write_kv_cache,
            decode_attention=_reference_decode_attention,
            extend_attention=_reference_extend_attention,
            lora_shrink=_reference_lora_shrink,
            lora_expand=reference.lora_expand,
        )
    if name == "triton":
        try:
            from kvflow.kernels import (
                triton_decode_attention,
                triton_extend_attention,
                triton_kv_cache,
                triton_layers,
                triton_lora,
            )
        except ImportError as e:  # no triton wheel for this platform
            raise RuntimeError(f"the triton backend needs the triton package: {e}") from e
        return KernelBackend(
            name="triton",
            rms_norm=triton_layers.rms_norm,
            silu_and_mul=triton_layers.silu_and_mul,
            gelu_tanh_and_mul=triton_layers.gelu_tanh_and_mul,
            rotary_embedding=triton_layers.rotary_embedding,
            write_kv_cache=triton_kv_cache.write_kv_cache,
            decode_attention=triton_decode_attention.decode_attention,
            extend_attention=triton_extend_attention.extend_attention,
            lora_shrink=triton_lora.lora_shrink,
            lora_expand=triton_lora.lora_expand,
        )
    raise ValueError(f"unknown kernel backend {name!r} (expected one of {BACKENDS})")


# --------------------------------------------------------------------------------------------
# the reference backend's entry points whose signatures differ from kernels/reference.py's


def _reference_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,  # the reference splits by its own fixed key chunks
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    out = torch.zeros_like(q)
    live = (seq_lens > 0).nonzero().view(-1)  # padded rows (seq_len 0) stay zero, as in Triton
    if live.numel():
        out[live] = reference.paged_attention(
            q[live],
            k_cache,
            v_cache,
            block_tables[live],
            seq_lens[live],
            torch.ones(live.numel(), dtype=torch.long),
            scale,
            window=window,
            softcap=softcap,
        )
    return out


def _reference_extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,  # only the Triton grid needs it
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    return reference.paged_attention(
        q,
        k_cache,
        v_cache,
        block_tables,
        seq_lens,
        query_lens,
        scale,
        window=window,
        softcap=softcap,
    )


def _reference_lora_shrink(
    x: torch.Tensor,
    a: torch.Tensor,
    slots: torch.Tensor,
    split_k: int | None = None,  # only the Triton kernel splits K
) -> torch.Tensor:
    return reference.lora_shrink(x, a, slots)
