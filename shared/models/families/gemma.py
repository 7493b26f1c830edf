"""Gemma 2 and Gemma 3 (text): RMSNorm scaling by ``1 + w``, norms before and after attention and
the MLP, embeddings times sqrt(hidden), GELU-tanh, queries scaled by
``query_pre_attn_scalar ** -0.5``, interleaved sliding-window and global layers; Gemma 2 soft-caps
attention scores and logits, Gemma 3 normalises query and key heads and gives its sliding
layers a RoPE base of their own."""

from __future__ import annotations

from typing import Any

from kvflow.shared.models.config import ConfigReader, activation, rope_parameters, rope_spec
from kvflow.shared.models.families.qwen import layer_windows
from kvflow.shared.models.family import QK_NORMS, Family

GEMMA_NORMS = {
    "attn_norm": "input_layernorm",
    "attn_out_norm": "post_attention_layernorm",
    "mlp_norm": "pre_feedforward_layernorm",
    "mlp_out_norm": "post_feedforward_layernorm",
}


def _gemma_common(r: ConfigReader) -> dict[str, Any]:
    hidden = int(r.require("hidden_size"))
    if r.get("use_bidirectional_attention"):
        raise r.refuse("use_bidirectional_attention", "bidirectional attention is not served")
    # Gemma 2/3 configs default to GELU-tanh (transformers' Gemma2Config/Gemma3TextConfig); a
    # GGUF names no activation (llama.cpp's gemma graphs hardcode it), so silu is never right
    absent = not r.has("hidden_activation") and not r.has("hidden_act")
    act = "gelu_tanh" if absent else activation(r, "hidden_activation", "hidden_act")
    return {
        "hidden_act": act,
        "qkv_bias": bool(r.get("attention_bias", False)),
        "o_bias": bool(r.get("attention_bias", False)),
        "norm_offset": 1.0,
        "norm_layout": "sandwich",
        "embed_scale": hidden**0.5,
        "attn_scale": float(r.get("query_pre_attn_scalar", 256)) ** -0.5,
        "attn_softcap": float(r.get("attn_logit_softcapping") or 0.0),
        "final_softcap": float(r.get("final_logit_softcapping") or 0.0),
    }


def read_gemma2(r: ConfigReader) -> dict[str, Any]:
    out = _gemma_common(r)
    rope = rope_spec(r, rope_parameters(r), max_positions=int(r.get("max_position_embeddings", 0)))
    out |= {"rope": rope, "rope_theta": rope.theta, "layer_windows": layer_windows(r, _every(2))}
    return out


def _every(n: int) -> Any:
    return lambda i: bool((i + 1) % n)


def read_gemma3(r: ConfigReader) -> dict[str, Any]:
    out = _gemma_common(r)
    maxpos = int(r.get("max_position_embeddings", 0))
    if isinstance(r.get("rope_parameters"), dict) and "full_attention" in r.get("rope_parameters"):
        full = rope_parameters(r, "full_attention")
        local = rope_parameters(r, "sliding_attention")
        local.setdefault("rope_theta", r.get("rope_local_base_freq", 10000.0))
    else:  # transformers v4: rope_theta + rope_scaling global, rope_local_base_freq local
        full = rope_parameters(r)
        if "rope_theta" not in (r.get("rope_parameters") or {}) and not r.has("rope_theta"):
            full["rope_theta"] = 1_000_000.0
        local = {"rope_type": "default", "rope_theta": r.get("rope_local_base_freq", 10000.0)}
    rope = rope_spec(r, full, max_positions=maxpos)
    pattern = int(r.get("sliding_window_pattern", 6))
    out |= {
        "rope": rope,
        "rope_theta": rope.theta,
        "rope_local": rope_spec(r, local, max_positions=maxpos),
        "layer_windows": layer_windows(r, _every(pattern)),
        "qk_norm": "head",
    }
    return out


FAMILIES = (
    Family(
        "gemma2",
        ("Gemma2ForCausalLM",),
        ("gemma2",),
        read_gemma2,
        GEMMA_NORMS,
        gguf_archs=("gemma2",),
        gguf_norm_offset=1.0,
    ),
    Family(
        "gemma3",
        ("Gemma3ForCausalLM",),
        ("gemma3_text",),
        read_gemma3,
        GEMMA_NORMS | QK_NORMS,
        gguf_archs=("gemma3",),
        gguf_norm_offset=1.0,
    ),
)
