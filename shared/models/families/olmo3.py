"""OLMo 3: OLMo 2's layers (norms after attention and after the MLP, RMSNorm over the whole query
and key projections) with sliding-window attention on the layers ``layer_types`` says (three of
every four by default), which keep an unscaled RoPE: RoPE scaling (YaRN, in the long-context
checkpoints) applies to the full-attention layers only."""

from __future__ import annotations

from typing import Any

from kvflow.shared.models.config import (
    ConfigReader,
    activation,
    layer_type_rope_parameters,
    rope_parameters,
    rope_spec,
)
from kvflow.shared.models.families.olmo2 import OLMO2_NORMS, WHOLE_QK_NORMS
from kvflow.shared.models.families.qwen import layer_windows
from kvflow.shared.models.family import Family


def read_olmo3(r: ConfigReader) -> dict[str, Any]:
    keyed = layer_type_rope_parameters(r)
    if keyed is not None:
        full, local = keyed
    else:  # transformers v4: rope_theta + rope_scaling for the full layers, unscaled elsewhere
        full = rope_parameters(r)
        local = {"rope_type": "default", "rope_theta": full["rope_theta"]}
    maxpos = int(r.get("max_position_embeddings", 0))
    rope = rope_spec(r, full, max_positions=maxpos)
    bias = bool(r.get("attention_bias", False))
    return {
        "hidden_act": activation(r, "hidden_act"),
        "qkv_bias": bias,
        "o_bias": bias,
        "qk_norm": "full",
        "norm_layout": "post",
        "rope": rope,
        "rope_theta": rope.theta,
        "rope_local": rope_spec(r, local, max_positions=maxpos),
        "layer_windows": layer_windows(r, lambda i: (i + 1) % 4 != 0),
    }


FAMILIES = (
    Family(
        "olmo3",
        ("Olmo3ForCausalLM",),
        ("olmo3",),
        read_olmo3,
        OLMO2_NORMS,
        no_tensor_parallel=WHOLE_QK_NORMS,
    ),
)
