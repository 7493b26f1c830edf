"""OLMo 2: norms after attention and after the MLP (none before), and RMSNorm over the whole
query and key projections (not per head) before RoPE."""

from __future__ import annotations

from typing import Any

from kvflow.shared.models.config import ConfigReader
from kvflow.shared.models.families.llama import read_llama
from kvflow.shared.models.family import QK_NORMS, Family, Gguf

WHOLE_QK_NORMS = (
    "for models whose q/k norms run over all heads together: tensor parallelism would need "
    "one more all-reduce per layer"
)
"""Why OLMo 2, OLMo 3 and OLMoE are refused tensor parallelism (services/worker/
tensor_parallel.py cuts per-head q/k norms only)."""

OLMO2_NORMS = {
    "attn_out_norm": "post_attention_layernorm",
    "mlp_out_norm": "post_feedforward_layernorm",
} | QK_NORMS


def read_olmo2(r: ConfigReader) -> dict[str, Any]:
    if r.get("sliding_window"):  # llama.cpp writes OLMo 3 GGUFs as olmo2 with a window
        raise r.refuse(
            "sliding_window",
            "OLMo 2 has no sliding window: this is OLMo 3 (llama.cpp names it olmo2); serve its "
            "Hugging Face directory (Olmo3ForCausalLM), which kvflow runs natively",
        )
    out = read_llama(r)
    out |= {"qk_norm": "full", "norm_layout": "post"}
    return out


FAMILIES = (
    Family(
        "olmo2",
        ("Olmo2ForCausalLM",),
        ("olmo2",),
        read_olmo2,
        OLMO2_NORMS,
        gguf=Gguf(("olmo2",)),
        no_tensor_parallel=WHOLE_QK_NORMS,
    ),
)
