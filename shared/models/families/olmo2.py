"""OLMo 2: norms after attention and after the MLP (none before), and RMSNorm over the whole
query and key projections (not per head) before RoPE."""

from __future__ import annotations

from typing import Any

from kvflow.shared.models.config import ConfigReader
from kvflow.shared.models.families.llama import read_llama
from kvflow.shared.models.family import QK_NORMS, Family


def read_olmo2(r: ConfigReader) -> dict[str, Any]:
    out = read_llama(r)
    out |= {"qk_norm": "full", "norm_layout": "post"}
    return out


FAMILIES = (
    Family(
        "olmo2",
        ("Olmo2ForCausalLM",),
        ("olmo2",),
        read_olmo2,
        {
            "attn_out_norm": "post_attention_layernorm",
            "mlp_out_norm": "post_feedforward_layernorm",
        }
        | QK_NORMS,
        gguf_archs=("olmo2",),
    ),
)
