"""StarCoder2: LayerNorm (with biases) instead of RMSNorm, a plain MLP (``c_fc``, GELU-tanh,
``c_proj``: no gate; cut into Llama's ``up_proj`` / ``down_proj`` names at load), biases on every
projection (``use_bias``), and an optional sliding window on every layer."""

from __future__ import annotations

from typing import Any

from kvflow.shared.models.config import ConfigReader, activation, rope_parameters, rope_spec
from kvflow.shared.models.family import LLAMA_NORMS, Family, Gguf, GgufFile


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


def gguf_starcoder2(g: GgufFile, raw: dict[str, Any]) -> dict[str, Any]:
    """LayerNorm's epsilon and the biases under llama.cpp's names; llama.cpp's graph runs
    GELU (tanh)."""
    return {
        "hidden_act": "gelu_pytorch_tanh",
        "norm_epsilon": float(g.get("attention.layer_norm_epsilon", 1e-5)),
        "use_bias": g.has("blk.0.attn_q.bias"),
        "attention_bias": None,  # use_bias says it
    }


FAMILIES = (
    Family(
        "starcoder2",
        ("Starcoder2ForCausalLM",),
        ("starcoder2",),
        read_starcoder2,
        LLAMA_NORMS,
        gguf=Gguf(("starcoder2",), config=gguf_starcoder2),
        split=rename_mlp,
        checkpoint_names=("mlp.c_fc", "mlp.c_proj"),
        ignored=frozenset({"residual_dropout", "embedding_dropout"}),
        no_lora="for models with an ungated MLP",
    ),
)
