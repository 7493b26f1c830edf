"""Llama forward pass over a flat, varlen batch of tokens with a paged KV cache.

The step's tokens are one flat [T] batch (no padding between sequences). Q/K/V and gate/up are
fused into one GEMM each, as in vLLM. Logits are computed only for the rows that sample.

Two forward passes over the same weights: ``forward`` is the CPU path (kernels/reference.py,
batch-invariant GEMM rows, native decode attention, oneDNN-packed weights); ``forward_device``
takes a kernel backend (kernels/ops.py, the Triton kernels on CUDA) and a ``DeviceBatch`` of
device tensors, and has no host synchronisation, so a decode step can be captured as a CUDA
graph (services/worker/cuda_graphs.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kernels import cpu_layer_ops
from kernels import reference as K
from kernels.cpu_gemm import PackedWeight, PanelWeight, panel_available
from kernels.cpu_quant import QuantWeight
from kernels.ops import KernelBackend
from services.worker.step_inputs import DeviceBatch
from shared.model_loader import ModelConfig

if TYPE_CHECKING:
    from services.worker.lora import LoRAStep
    from services.worker.tensor_parallel import TPGroup


@dataclass
class ForwardBatch:
    """Everything one forward pass needs besides the token ids and positions."""

    slot_mapping: torch.Tensor  # [T] cache slot of each token (-1: do not write)
    attn: K.AttentionPlan  # gathers for paged attention
    rows: K.RowLayout | None  # how rows go through GEMMs (None: one plain GEMM)
    sample_rows: torch.Tensor  # [S] indices into T whose logits are wanted
    hidden_rows: torch.Tensor | None = None  # [P] rows whose final hidden states are wanted
    lora: LoRAStep | None = None  # the LoRA adapters of the step's rows (services/worker/lora.py)


def _fuse(parts: list, dtype: torch.dtype) -> torch.Tensor | K.Weight:
    """Linear weights stacked by output rows (fused QKV, gate/up); quantized ones stay
    quantized when they are of one kind and type (QuantWeight, DeviceQuantWeight, Fp8Weight:
    each has ``cat``), else all are dequantized to ``dtype``."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    kind = type(parts[0])
    if all(type(p) is kind for p in parts):
        try:
            return kind.cat(parts)
        except ValueError:
            pass
    return torch.cat(
        [p if isinstance(p, torch.Tensor) else p.dequantize().to(dtype) for p in parts]
    )


class LlamaModel(torch.nn.Module):
    """HF-Llama-compatible decoder built from a ``ModelConfig`` and HF-named weights."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor | QuantWeight]) -> None:
        super().__init__()
        self.cfg = cfg
        self.scale = cfg.head_dim**-0.5
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.embed = weights["model.embed_tokens.weight"]
        # tied: the embedding itself, or its quantized copy (--quantization gguf)
        self.lm_head: torch.Tensor | PackedWeight | PanelWeight | QuantWeight = weights.get(
            "lm_head.weight", self.embed
        )
        self.norm = weights["model.norm.weight"]
        self.layers: list[dict[str, torch.Tensor | PackedWeight | PanelWeight]] = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}."
            w = {n: weights[p + n + ".weight"] for n in _LAYER_NAMES}
            self.layers.append(
                {
                    "in_norm": w["input_layernorm"],
                    "post_norm": w["post_attention_layernorm"],
                    "qkv": _fuse(
                        [w["self_attn.q_proj"], w["self_attn.k_proj"], w["self_attn.v_proj"]],
                        self.embed.dtype,
                    ),
                    "o": w["self_attn.o_proj"],
                    "gate_up": _fuse([w["mlp.gate_proj"], w["mlp.up_proj"]], self.embed.dtype),
                    "down": w["mlp.down_proj"],
                }
            )
        self.cos_sin = K.build_cos_sin_cache(
            cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, self.embed.dtype
        ).to(self.embed.device)
        self.native_layer_ops = False  # the CPU path's fused C elementwise ops (use_native_...)
        # tensor parallelism: this rank's collectives (services/worker/tensor_parallel.py);
        # None: the whole model here
        self.tp: TPGroup | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def pack_weights(self) -> str:
        """Hold every dense linear weight pre-packed for the CPU: kvflow's panels where the
        panel kernel runs (kernels/cpu_gemm.py ``PanelWeight``: batch invariant by
        construction), else oneDNN's layout. The embedding stays dense for lookups, so a tied
        lm_head gets a packed copy of its own. Returns which ("panels" or "oneDNN")."""
        pack = PanelWeight if panel_available() else PackedWeight
        for layer in self.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                w = layer[name]
                if isinstance(w, torch.Tensor):
                    layer[name] = pack(w)
        if isinstance(self.lm_head, torch.Tensor):
            self.lm_head = pack(self.lm_head)
        return "panels" if pack is PanelWeight else "oneDNN"

    def use_native_layer_ops(self) -> bool:
        """Run RMSNorm, RoPE with the KV write and SiLU-and-multiply of ``forward`` as one C
        call each (kernels/cpu_layer_ops.py) when they can be built; returns whether they are."""
        self.native_layer_ops = (
            self.dtype == torch.float32 and self.device.type == "cpu" and cpu_layer_ops.available()
        )
        return self.native_layer_ops

    def linear_weights(self) -> list[torch.Tensor | PackedWeight | PanelWeight]:
        """One linear weight of each distinct shape (what batch-invariance calibration tests)."""
        seen: dict[tuple[int, ...], torch.Tensor | PackedWeight | PanelWeight] = {}
        for w in (*(self.layers[0][n] for n in ("qkv", "o", "gate_up", "down")), self.lm_head):
            seen.setdefault(tuple(w.shape), w)
        return list(seen.values())

    def make_kv_caches(
        self, num_blocks: int, block_size: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """One (k, v) pair per layer, each [num_blocks, block_size, Hkv, D], zero filled (so
        padded gathers never meet NaNs)."""
        shape = (num_blocks, block_size, self.cfg.num_kv_heads, self.cfg.head_dim)
        dt, dev = self.dtype, self.device
        return [
            (torch.zeros(shape, dtype=dt, device=dev), torch.zeros(shape, dtype=dt, device=dev))
            for _ in range(self.cfg.num_layers)
        ]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """Run ``input_ids`` [T] at ``positions`` [T]; returns logits [S, vocab] (fp32) for
        ``batch.sample_rows`` only."""
        return self.forward_pooled(input_ids, positions, batch, kv_caches)[0]

    @torch.inference_mode()
    def forward_pooled(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        batch: ForwardBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward``'s logits, and the final hidden states (after the last RMSNorm, fp32)
        [P, hidden] of ``batch.hidden_rows`` (None when there are none): what embedding
        requests pool."""
        cfg, rows = self.cfg, batch.rows
        native = self.native_layer_ops
        norm = cpu_layer_ops.add_rms_norm if native else K.rms_norm
        silu_and_mul = cpu_layer_ops.silu_and_mul if native else K.silu_and_mul
        eps = cfg.rms_norm_eps
        lora, tp = batch.lora, self.tp
        h = self.embed[input_ids] if tp is None else tp.embed(input_ids, self.embed)
        residual: torch.Tensor | None = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = norm(h, layer["in_norm"], eps, residual)
            qkv = K.linear(x, layer["qkv"], rows)
            if lora is not None:
                lora.apply(i, "qkv", x, qkv)
            if native:
                q = cpu_layer_ops.rope_write_kv(
                    qkv,
                    cfg.num_heads,
                    cfg.num_kv_heads,
                    positions,
                    self.cos_sin,
                    k_cache,
                    v_cache,
                    batch.slot_mapping,
                )
            else:
                q = self._rope_write_kv(qkv, positions, k_cache, v_cache, batch.slot_mapping)
            o = K.paged_attention(
                q, k_cache, v_cache, None, None, None, self.scale, plan=batch.attn
            )
            o = o.view(-1, self.q_size)
            h = K.linear(o, layer["o"], rows)
            h = _reduce(tp, _lora(lora, i, "o", o, h))
            x, residual = norm(h, layer["post_norm"], eps, residual)
            gate_up = _lora(lora, i, "gate_up", x, K.linear(x, layer["gate_up"], rows))
            m = silu_and_mul(gate_up)
            h = _reduce(tp, _lora(lora, i, "down", m, K.linear(m, layer["down"], rows)))
        s, p = batch.sample_rows, batch.hidden_rows
        hidden = None if p is None else norm(h[p], self.norm, eps, residual[p])[0].float()
        x, _ = norm(h[s], self.norm, eps, residual[s])
        head_rows = None if rows is None else K.RowLayout(s.numel(), (), rows.tile, rows.pad)
        logits = K.linear(x, self.lm_head, head_rows).float()
        if tp is not None:
            logits = tp.gather_logits(logits, self.cfg.vocab_size)
        return logits, hidden

    def _rope_write_kv(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """The reference kernels' RoPE and KV-cache write (what the native call fuses)."""
        cfg, t = self.cfg, qkv.shape[0]
        q = qkv[:, : self.q_size].view(t, cfg.num_heads, cfg.head_dim)
        k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, self.q_size + self.kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
        q, k = K.rotary_embedding(positions, q, k, self.cos_sin)
        K.write_kv_cache(k, v, k_cache, v_cache, slot_mapping)
        return q

    def forward_device(
        self,
        ops: KernelBackend,
        batch: DeviceBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """``forward_device_pooled`` without hidden rows: fp32 logits [S, vocab]."""
        return self.forward_device_pooled(ops, batch, kv_caches)[0]

    @torch.inference_mode()
    def forward_device_pooled(
        self,
        ops: KernelBackend,
        batch: DeviceBatch,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        hidden_rows: torch.Tensor | None = None,
        lora: LoRAStep | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One step through ``ops``, linear layers through ``K.linear`` (``F.linear``, cuBLAS on CUDA,
        for dense weights; a quantized weight's own kernel otherwise);
        returns fp32 logits [S, vocab] for ``batch.sample_rows`` (every row when None). No
        host synchronisation: safe to capture in a CUDA graph when ``batch`` holds static
        tensors and, for decode, a fixed ``num_splits``. With ``hidden_rows`` (a device
        tensor of row indices) also the final hidden states of those rows (fp32), which
        embedding requests pool."""
        cfg = self.cfg
        t, d = batch.input_ids.shape[0], cfg.head_dim
        tp = self.tp
        h = (
            F.embedding(batch.input_ids, self.embed)
            if tp is None
            else tp.embed(batch.input_ids, self.embed)
        )
        residual: torch.Tensor | None = None
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x, residual = ops.rms_norm(h, layer["in_norm"], cfg.rms_norm_eps, residual)
            qkv = _lora(lora, i, "qkv", x, K.linear(x, layer["qkv"]))
            # strided views into qkv: the kernels take row/head strides, so no copies here
            q = qkv[:, : self.q_size].view(t, cfg.num_heads, d)
            k = qkv[:, self.q_size : self.q_size + self.kv_size].view(t, cfg.num_kv_heads, d)
            v = qkv[:, self.q_size + self.kv_size :].view(t, cfg.num_kv_heads, d)
            q, k = ops.rotary_embedding(batch.positions, q, k, self.cos_sin)
            ops.write_kv_cache(k, v, k_cache, v_cache, batch.slot_mapping)
            if batch.query_start_loc is None:
                o = ops.decode_attention(
                    q,
                    k_cache,
                    v_cache,
                    batch.block_tables,
                    batch.seq_lens,
                    self.scale,
                    batch.num_splits,
                )
            else:
                o = ops.extend_attention(
                    q,
                    k_cache,
                    v_cache,
                    batch.block_tables,
                    batch.seq_lens,
                    batch.query_start_loc,
                    batch.max_query_len,
                    self.scale,
                )
            o = o.reshape(t, self.q_size)
            h = _reduce(tp, _lora(lora, i, "o", o, K.linear(o, layer["o"])))
            x, residual = ops.rms_norm(h, layer["post_norm"], cfg.rms_norm_eps, residual)
            m = ops.silu_and_mul(_lora(lora, i, "gate_up", x, K.linear(x, layer["gate_up"])))
            h = _reduce(tp, _lora(lora, i, "down", m, K.linear(m, layer["down"])))
        assert residual is not None
        hidden = None
        if hidden_rows is not None:  # before the head's norm, which may update in place
            hr = (h.index_select(0, hidden_rows), residual.index_select(0, hidden_rows))
            hidden = ops.rms_norm(hr[0], self.norm, cfg.rms_norm_eps, hr[1])[0].float()
        if batch.sample_rows is not None:
            h = h.index_select(0, batch.sample_rows)
            residual = residual.index_select(0, batch.sample_rows)
        x, _ = ops.rms_norm(h, self.norm, cfg.rms_norm_eps, residual)
        logits = K.linear(x, self.lm_head).float()
        if tp is not None:
            logits = tp.gather_logits(logits, cfg.vocab_size)
        return logits, hidden


def _reduce(tp: TPGroup | None, partial: torch.Tensor) -> torch.Tensor:
    """A row-parallel projection's output: summed over the ranks (as it is without them)."""
    return partial if tp is None else tp.reduce(partial)


def _lora(
    lora: LoRAStep | None, layer: int, group: str, x: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``out`` (a projection of ``x``) plus its rows' LoRA deltas, in place."""
    if lora is not None:
        lora.apply(layer, group, x, out)
    return out


_LAYER_NAMES = (
    "input_layernorm",
    "post_attention_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)
