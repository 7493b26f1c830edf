"""Qwen2/2.5 (biases on q/k/v) and Qwen3 (RMSNorm of each query and key head before RoPE, no
biases unless ``attention_bias``); both may run sliding windows on their upper layers
(``use_sliding_window``, ``max_window_layers``, or transformers v5's ``layer_types``)."""

from __future__ import annotations

from typing import Any

from kvflow.shared.models.config import ConfigReader, activation, rope_parameters, rope_spec
from kvflow.shared.models.family import LLAMA_NORMS, QK_NORMS, Family, Gguf, GgufFile


def layer_windows(r: ConfigReader, sliding_default: Any) -> tuple[int, ...]:
    """Per layer: the sliding window of ``sliding_attention`` layers, 0 for the others, from
    ``layer_types`` or, without it, ``sliding_default(i)``."""
    n = int(r.require("num_hidden_layers"))
    window = int(r.get("sliding_window") or 0)
    types = r.get("layer_types")
    if types is None:
        types = ["sliding_attention" if sliding_default(i) else "full_attention" for i in range(n)]
    if len(types) != n or any(t not in ("sliding_attention", "full_attention") for t in types):
        raise r.refuse("layer_types", f"want {n} of 'sliding_attention' / 'full_attention'")
    if "sliding_attention" in types and not window:
        raise r.refuse("sliding_window", "sliding_attention layers need a window")
    out = tuple(window if t == "sliding_attention" else 0 for t in types)
    return out if any(out) else ()


def read_qwen2(r: ConfigReader, qkv_bias: bool = True) -> dict[str, Any]:
    rope = rope_spec(r, rope_parameters(r), max_positions=int(r.get("max_position_embeddings", 0)))
    use = bool(r.get("use_sliding_window", False))
    first = int(r.get("max_window_layers", 0))
    windows = layer_windows(r, lambda i: use and i >= first)
    if not use and not r.has("layer_types"):
        windows = ()  # transformers ignores sliding_window unless use_sliding_window
    return {
        "hidden_act": activation(r, "hidden_act"),
        "qkv_bias": qkv_bias,
        "layer_windows": windows,
        "rope": rope,
        "rope_theta": rope.theta,
    }


def read_qwen3(r: ConfigReader) -> dict[str, Any]:
    out = read_qwen2(r, qkv_bias=bool(r.get("attention_bias", False)))
    out["o_bias"] = out["qkv_bias"]
    out["qk_norm"] = "head"
    return out


def gguf_qwen2(g: GgufFile, raw: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp runs Qwen2 without the window its GGUF may name."""
    return {"use_sliding_window": False} if raw.get("sliding_window") else {}


FAMILIES = (
    Family(
        "qwen2",
        ("Qwen2ForCausalLM",),
        ("qwen2",),
        read_qwen2,
        LLAMA_NORMS,
        gguf=Gguf(("qwen2",), config=gguf_qwen2),
    ),
    Family(
        "qwen3",
        ("Qwen3ForCausalLM",),
        ("qwen3",),
        read_qwen3,
        LLAMA_NORMS | QK_NORMS,
        gguf=Gguf(("qwen3",)),
    ),
)
