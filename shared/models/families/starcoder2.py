"""StarCoder2: LayerNorm (with biases) instead of RMSNorm, a plain MLP (``c_fc``, GELU-tanh,
``c_proj``: no gate; cut into Llama's ``up_proj`` / ``down_proj`` names at load), biases on every
projection (``use_bias``), and an optional sliding window on every layer."""

from __future__ import annotations

from typing import Any

from kvflow.shared.models.config import ConfigReader, activation, rope_parameters, rope_spec
from kvflow.shared.models.family import LLAMA_NORMS, Family


def read_starcoder2(r: ConfigReader) -> dict[str, Any]:
    rope = rope_spec(r, rope_parameters(r), max_positions=int(r.get("max_position_embeddings", 0)))
    bias = bool(r.get("use_bias", True))
    window = int(r.get("sliding_window") or 0)
    n = int(r.require("num_hidden_layers"))
    return {
        "hidden_act": activation(r, "hidden_act"),
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": bias,
        "rms_norm_eps": float(r.get("norm_epsilon", 1e-5)),
        "norm_kind": "layer",
        "gated_mlp": False,
        "layer_windows": (window,) * n if window else (),
        "rope": rope,
        "rope_theta": rope.theta,
    }


def rename_mlp(weights: dict[str, Any], cfg: Any) -> dict[str, Any]:
    """``mlp.c_fc`` -> ``mlp.up_proj`` and ``mlp.c_proj`` -> ``mlp.down_proj``."""
    out: dict[str, Any] = {}
    for name, w in weights.items():
        name = name.replace(".mlp.c_fc.", ".mlp.up_proj.").replace(
            ".mlp.c_proj.", ".mlp.down_proj."
        )
        out[name] = w
    return out


FAMILIES = (
    Family(
        "starcoder2",
        ("Starcoder2ForCausalLM",),
        ("starcoder2",),
        read_starcoder2,
        LLAMA_NORMS,
        gguf_archs=("starcoder2",),
        split=rename_mlp,
        ignored=frozenset({"residual_dropout", "embedding_dropout"}),
    ),
)
