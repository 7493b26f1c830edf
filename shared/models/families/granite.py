"""Granite (3.x): Llama with four multipliers: embeddings times ``embedding_multiplier``, the
attention softmax scale ``attention_multiplier``, each block's output times
``residual_multiplier`` before the residual add, logits divided by ``logits_scaling``."""

from __future__ import annotations

from typing import Any

from kvflow.shared.models.config import ConfigReader
from kvflow.shared.models.families.llama import read_llama
from kvflow.shared.models.family import LLAMA_NORMS, Family


def read_granite(r: ConfigReader) -> dict[str, Any]:
    out = read_llama(r)
    out |= {
        "embed_scale": float(r.get("embedding_multiplier", 1.0)),
        "attn_scale": float(r.get("attention_multiplier", 1.0)),
        "residual_multiplier": float(r.get("residual_multiplier", 1.0)),
        "logits_divisor": float(r.get("logits_scaling", 1.0)),
    }
    return out


FAMILIES = (
    Family(
        "granite",
        ("GraniteForCausalLM",),
        ("granite",),
        read_granite,
        LLAMA_NORMS,
        gguf_archs=("granite",),
        gguf_permute_qk=True,
    ),
)
