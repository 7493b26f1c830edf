"""Gemma 2 and Gemma 3 (text): RMSNorm scaling by ``1 + w``, norms before and after attention and
the MLP, embeddings times sqrt(hidden), GELU-tanh, queries scaled by
``query_pre_attn_scalar ** -0.5``, interleaved sliding-window and global layers; Gemma 2 soft-caps
attention scores and logits, Gemma 3 normalises query and key heads and gives its sliding
layers a RoPE base of their own."""

from __future__ import annotations

from typing import Any

from kvflow.shared.models.config import (
    ConfigReader,
    activation,
    layer_type_rope_parameters,
    rope_parameters,
    rope_spec,
)
from kvflow.shared.models.families.qwen import layer_windows
from kvflow.shared.models.family import QK_NORMS, Family, Gguf, GgufFile

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
    keyed = layer_type_rope_parameters(r)
    if keyed is not None:
        full, local = keyed
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


EOT_TEXT = "<end_of_turn>"
"""Gemma's chat turns end with this token, which a GGUF may not name
(``tokenizer.ggml.eot_token_id``; llama.cpp's Gemma converter writes none): llama.cpp finds
the end of turn by its text (llama-vocab.cpp) and stops there, as Gemma's own
generation_config.json lists it beside ``<eos>``."""

_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
"""llama.cpp's 27B model types (by block count): the only Gemma 2/3 whose queries are scaled by
1 / sqrt(hidden / heads) instead of 1 / sqrt(key_length) (llama-model.cpp, after gemma_pytorch;
HF's own configs: query_pre_attn_scalar 144 and 168)."""


def _gguf_gemma(name: str, g: GgufFile, raw: dict[str, Any]) -> dict[str, Any]:
    """What llama.cpp's Gemma 2/3 loaders (src/models/gemma2.cpp, gemma3.cpp) hardcode or
    default instead of reading from the GGUF: GELU-tanh, the query scale, which layers slide
    (``attention.sliding_window_pattern``: every Nth layer global, default 2 and 6, or one flag
    per layer); Gemma 2: a 4096 window and soft-caps 50 / 30 where absent; Gemma 3: the sliding
    layers' RoPE base (``rope.freq_base_swa``, default 10000), no soft-cap, and no sliding layer
    at all when the GGUF names no window."""
    layers, hidden = raw["num_hidden_layers"], raw["hidden_size"]
    big = layers == _27B_LAYERS[name]
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // raw["num_attention_heads"] if big else raw["head_dim"],
    }
    if name == "gemma2":
        out["sliding_window"] = raw.get("sliding_window") or 4096
        for key, default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
            out[key] = default if raw.get(key) is None else raw[key]
    elif raw.get("sliding_window"):
        out["rope_local_base_freq"] = float(g.get("rope.freq_base_swa", 10000.0))
    else:
        out["layer_types"] = ["full_attention"] * layers
        return out
    pattern = g.get("attention.sliding_window_pattern", 2 if name == "gemma2" else 6)
    if isinstance(pattern, list):
        slides = [bool(x) for x in pattern[:layers]]
    else:  # llama_hparams::set_swa_pattern: 0 means every layer slides
        n = int(pattern)
        slides = [n == 0 or i % n < n - 1 for i in range(layers)]
    out["layer_types"] = ["sliding_attention" if x else "full_attention" for x in slides]
    return out


def gguf_gemma2(g: GgufFile, raw: dict[str, Any]) -> dict[str, Any]:
    return _gguf_gemma("gemma2", g, raw)


def gguf_gemma3(g: GgufFile, raw: dict[str, Any]) -> dict[str, Any]:
    return _gguf_gemma("gemma3", g, raw)


FAMILIES = (
    Family(
        "gemma2",
        ("Gemma2ForCausalLM",),
        ("gemma2",),
        read_gemma2,
        GEMMA_NORMS,
        gguf=Gguf(("gemma2",), norm_offset=1.0, eot_text=EOT_TEXT, config=gguf_gemma2),
    ),
    Family(
        "gemma3",
        ("Gemma3ForCausalLM",),
        ("gemma3_text",),
        read_gemma3,
        GEMMA_NORMS | QK_NORMS,
        gguf=Gguf(("gemma3",), norm_offset=1.0, eot_text=EOT_TEXT, config=gguf_gemma3),
    ),
)
