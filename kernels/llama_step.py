"""A random-weight Llama forward pass built only from a kernel backend (kernels/ops.py) and
``F.linear``: what benchmarks/kernels.py times end to end, and what the kernel tests run through both
backends to check that the kernels compose (same call sequence as services/worker/model.py).

Not the worker's model: no weight loading, no batch-invariant GEMM tiling, no sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import reference
from kernels.ops import KernelBackend


@dataclass(frozen=True)
class LlamaShape:
    """Dimensions of a Llama decoder (defaults: a 1B-class model, Llama-3.2-1B without its
    128k vocabulary)."""

    vocab: int = 32000
    hidden: int = 2048
    layers: int = 16
    heads: int = 32
    kv_heads: int = 8
    intermediate: int = 8192
    rope_theta: float = 500000.0
    eps: float = 1e-5
    max_position: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def num_params(self) -> int:
        d, kv = self.hidden, self.kv_heads * self.head_dim
        per_layer = d * (d + 2 * kv) + d * d + 3 * d * self.intermediate + 2 * d
        return self.layers * per_layer + 2 * self.vocab * d + d


@dataclass
class LlamaWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[dict[str, torch.Tensor]]  # in_norm, qkv, o, post_norm, gate_up, down
    norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [vocab, hidden]
    cos_sin: torch.Tensor  # [max_position, head_dim]


def random_llama(
    shape: LlamaShape, dtype: torch.dtype, device: torch.device | str, seed: int = 0
) -> LlamaWeights:
    """Weights drawn N(0, 0.02) (norms N(1, 0.1)) so activations stay in range over the layers."""
    g = torch.Generator(device=device).manual_seed(seed)
    d, kv, i = shape.hidden, shape.kv_heads * shape.head_dim, shape.intermediate

    def w(*dims: int, mean: float = 0.0, std: float = 0.02) -> torch.Tensor:
        # drawn on the device itself: a 1B model drawn on the CPU would take longer than the bench
        x = torch.randn(*dims, generator=g, device=device, dtype=torch.float32)
        return (x * std + mean).to(dtype)

    layers = [
        {
            "in_norm": w(d, mean=1.0, std=0.1),
            "qkv": w(d + 2 * kv, d),
            "o": w(d, d),
            "post_norm": w(d, mean=1.0, std=0.1),
            "gate_up": w(2 * i, d),
            "down": w(d, i),
        }
        for _ in range(shape.layers)
    ]
    cos_sin = reference.build_cos_sin_cache(
        shape.head_dim, shape.max_position, shape.rope_theta, dtype
    ).to(device)
    return LlamaWeights(
        w(shape.vocab, d), layers, w(d, mean=1.0, std=0.1), w(shape.vocab, d), cos_sin
    )


def make_kv_caches(
    shape: LlamaShape,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One zero-filled (k, v) pair per layer, each [num_blocks, block_size, Hkv, D]."""
    dims = (num_blocks, block_size, shape.kv_heads, shape.head_dim)
    return [
        (
            torch.zeros(dims, dtype=dtype, device=device),
            torch.zeros(dims, dtype=dtype, device=device),
        )
        for _ in range(shape.layers)
    ]


@dataclass
class StepInputs:
    """Per-step metadata (device tensors) for B sequences and T new tokens.

    ``query_start_loc`` None means a decode step (T == B, one token per sequence, through
    ``decode_attention``); otherwise a varlen extend step through ``extend_attention``."""

    tokens: torch.Tensor  # [T] token ids
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] flat cache slots, -1: do not write
    block_tables: torch.Tensor  # [B, max_blocks] int32
    seq_lens: torch.Tensor  # [B] context lengths including the new tokens
    query_start_loc: torch.Tensor | None = None  # [B + 1] int32
    max_query_len: int = 1
    num_splits: int | None = None  # decode: flash-decoding splits (fix it for CUDA graphs)


def forward(
    ops: KernelBackend,
    shape: LlamaShape,
    weights: LlamaWeights,
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    step: StepInputs,
    last_rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Run one step; returns fp32 logits [R, vocab] for ``last_rows`` (default: every row)."""
    t = step.tokens.shape[0]
    h_dim, q_size = shape.head_dim, shape.heads * shape.head_dim
    kv_size = shape.kv_heads * h_dim
    scale = h_dim**-0.5
    h = weights.embed[step.tokens]
    residual: torch.Tensor | None = None
    for layer, (k_cache, v_cache) in zip(weights.layers, kv_caches, strict=True):
        x, residual = ops.rms_norm(h, layer["in_norm"], shape.eps, residual)
        qkv = F.linear(x, layer["qkv"])
        # strided views into qkv: the kernels take row/head strides, so no copies here
        q = qkv[:, :q_size].view(t, shape.heads, h_dim)
        k = qkv[:, q_size : q_size + kv_size].view(t, shape.kv_heads, h_dim)
        v = qkv[:, q_size + kv_size :].view(t, shape.kv_heads, h_dim)
        q, k = ops.rotary_embedding(step.positions, q, k, weights.cos_sin)
        ops.write_kv_cache(k, v, k_cache, v_cache, step.slot_mapping)
        if step.query_start_loc is None:
            o = ops.decode_attention(
                q, k_cache, v_cache, step.block_tables, step.seq_lens, scale, step.num_splits
            )
        else:
            o = ops.extend_attention(
                q,
                k_cache,
                v_cache,
                step.block_tables,
                step.seq_lens,
                step.query_start_loc,
                step.max_query_len,
                scale,
            )
        h = F.linear(o.reshape(t, q_size), layer["o"])
        x, residual = ops.rms_norm(h, layer["post_norm"], shape.eps, residual)
        h = F.linear(ops.silu_and_mul(F.linear(x, layer["gate_up"])), layer["down"])
    assert residual is not None
    if last_rows is not None:
        h, residual = h[last_rows], residual[last_rows]
    x, _ = ops.rms_norm(h, weights.norm, shape.eps, residual)
    return F.linear(x, weights.lm_head).float()
