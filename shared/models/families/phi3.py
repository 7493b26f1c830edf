"""Phi-3 / Phi-4: Llama with Q/K/V fused in one ``qkv_proj`` and gate/up in one ``gate_up_proj``
(cut into Llama's names at load: the worker fuses them again), an optional sliding window on
every layer, and longrope (``su``) scaling."""

from __future__ import annotations

from typing import Any

from kvflow.shared.models.config import ConfigReader, activation, rope_parameters, rope_spec
from kvflow.shared.models.family import LLAMA_NORMS, Family, Gguf


def read_phi3(r: ConfigReader) -> dict[str, Any]:
    maxpos = int(r.get("max_position_embeddings", 0))
    rope = rope_spec(r, rope_parameters(r), max_positions=maxpos)
    window = int(r.get("sliding_window") or 0)
    n = int(r.require("num_hidden_layers"))
    return {
        "hidden_act": activation(r, "hidden_act"),
        "rope": rope,
        "rope_theta": rope.theta,
        "layer_windows": (window,) * n if window else (),
    }


def split_fused(weights: dict[str, Any], cfg: Any) -> dict[str, Any]:
    """``qkv_proj`` -> q/k/v and ``gate_up_proj`` -> gate/up (rows; quantized weights keep their
    blocks: whole rows move)."""
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out: dict[str, Any] = {}
    for name, w in weights.items():
        if name.endswith("self_attn.qkv_proj.weight"):
            base = name.removesuffix("qkv_proj.weight")
            for part, (a, b) in zip(
                "qkv", ((0, q), (q, q + kv), (q + kv, q + 2 * kv)), strict=True
            ):
                out[f"{base}{part}_proj.weight"] = _rows(w, a, b)
        elif name.endswith("mlp.gate_up_proj.weight"):
            base, i = name.removesuffix("gate_up_proj.weight"), cfg.intermediate_size
            if w.shape[0] != 2 * i:
                raise ValueError(f"{name}: {w.shape[0]} rows, not gate | up ({2 * i})")
            out[f"{base}gate_proj.weight"] = _rows(w, 0, i)
            out[f"{base}up_proj.weight"] = _rows(w, i, 2 * i)
        else:
            out[name] = w
    return out


def _rows(w: Any, a: int, b: int) -> Any:
    import torch

    if isinstance(w, torch.Tensor):
        return w[a:b].contiguous()
    return w.rows(torch.arange(a, b))


FAMILIES = (
    Family(
        "phi3",
        ("Phi3ForCausalLM",),
        ("phi3",),
        read_phi3,
        LLAMA_NORMS,
        gguf=Gguf(("phi3",)),  # its ffn_up holds gate | up, as the HF checkpoint's gate_up_proj
        split=split_fused,
        checkpoint_names=("self_attn.qkv_proj", "mlp.gate_up_proj"),
    ),
)
