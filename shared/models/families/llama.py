"""Llama 1/2/3/3.1/3.2/3.3 (rope scaling linear, dynamic, yarn, llama3; attention and MLP
biases), and Mistral, which is Llama with a sliding window (vLLM serves both from one file)."""

from __future__ import annotations

from typing import Any

from kvflow.shared.models.config import ConfigReader, activation, rope_parameters, rope_spec
from kvflow.shared.models.family import LLAMA_NORMS, Family, Gguf, GgufFile


def read_llama(r: ConfigReader) -> dict[str, Any]:
    bias = bool(r.get("attention_bias", False))
    rope = rope_spec(r, rope_parameters(r), max_positions=int(r.get("max_position_embeddings", 0)))
    return {
        "hidden_act": activation(r, "hidden_act"),
        "qkv_bias": bias,
        "o_bias": bias,
        "mlp_bias": bool(r.get("mlp_bias", False)),
        "rope": rope,
        "rope_theta": rope.theta,
    }


def read_mistral(r: ConfigReader) -> dict[str, Any]:
    out = read_llama(r)
    window = int(r.get("sliding_window") or 0)
    if window:
        out["layer_windows"] = (window,) * int(r.require("num_hidden_layers"))
    return out


def gguf_ffn_bias(g: GgufFile, raw: dict[str, Any]) -> dict[str, Any]:
    """llama.cpp loads a Llama's (or Granite's) FFN biases where the file has them."""
    return {"mlp_bias": g.has("blk.0.ffn_down.bias")}


FAMILIES = (
    Family(
        "llama",
        ("LlamaForCausalLM",),
        ("llama",),
        read_llama,
        LLAMA_NORMS,
        gguf=Gguf(("llama",), permute_qk=True, config=gguf_ffn_bias),
    ),
    Family(  # llama.cpp writes Mistral's GGUFs as llama's
        "mistral",
        ("MistralForCausalLM",),
        ("mistral",),
        read_mistral,
        LLAMA_NORMS,
        ignored=frozenset({"layer_types"}),
    ),
)
