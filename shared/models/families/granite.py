"""Granite (3.x): Llama with four multipliers: embeddings times ``embedding_multiplier``, the
attention softmax scale ``attention_multiplier``, each block's output times
``residual_multiplier`` before the residual add, logits divided by ``logits_scaling``."""

from __future__ import annotations

from typing import Any

from kvflow.shared.models.config import ConfigReader
from kvflow.shared.models.families.llama import gguf_ffn_bias, read_llama
from kvflow.shared.models.family import LLAMA_NORMS, Family, Gguf, GgufFile


def read_granite(r: ConfigReader) -> dict[str, Any]:
    out = read_llama(r)
    out |= {
        "embed_scale": float(r.get("embedding_multiplier", 1.0)),
        "attn_scale": float(r.get("attention_multiplier", 1.0)),
        "residual_multiplier": float(r.get("residual_multiplier", 1.0)),
        "logits_divisor": float(r.get("logits_scaling", 1.0)),
    }
    return out


_GGUF_MULTIPLIERS = {
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "logit_scale": "logits_scaling",
}
"""llama.cpp's Granite keys -> config.json's (the attention multiplier is the shared
``attention.scale``)."""


def gguf_granite(g: GgufFile, raw: dict[str, Any]) -> dict[str, Any]:
    """Llama's FFN biases, and the multipliers under llama.cpp's names."""
    out = gguf_ffn_bias(g, raw)
    for key, hf in _GGUF_MULTIPLIERS.items():
        if g.get(key) is not None:
            out[hf] = float(g.get(key))
    return out


FAMILIES = (
    Family(
        "granite",
        ("GraniteForCausalLM",),
        ("granite",),
        read_granite,
        LLAMA_NORMS,
        gguf=Gguf(("granite",), permute_qk=True, config=gguf_granite),
    ),
)
