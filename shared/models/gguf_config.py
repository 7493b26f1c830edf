"""A GGUF's config: its header's metadata read as the config.json its family reads (llama.cpp's
keys -> Hugging Face's, as transformers' GGUF loader maps them), then the family's own reader
(shared/models/registry.py ``hf_config``). What every family shares is mapped here; what
llama.cpp hardcodes for one family, or writes under keys of its own, is that family's
``Gguf.config`` hook (shared/models/families/). The header is read without its vocabulary
(shared/gguf_header.py), torch-free."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvflow.shared.gguf_header import read_header
from kvflow.shared.models.config import ModelConfig
from kvflow.shared.models.family import GgufFile
from kvflow.shared.models.registry import family_for_gguf, hf_config


def gguf_config(path: Path, strict: bool = False) -> ModelConfig:
    """The config of the GGUF at ``path`` (``strict``: a field its family does not read is
    refused, as for a config.json)."""
    header = read_header(path, keep_strings=frozenset({"tokenizer.ggml.tokens"}))
    f = header.fields
    arch = f.get("general.architecture", "llama")
    fam = family_for_gguf(arch, path.name, int(f.get(f"{arch}.expert_count", 0) or 0))
    assert fam.gguf is not None
    g = GgufFile(header, arch)
    names = set(header.tensors)
    emb = header.tensors["token_embd.weight"]
    hidden = int(g.get("embedding_length"))
    heads = int(g.get("attention.head_count"))
    eos = [f.get("tokenizer.ggml.eos_token_id")]
    eos += [f.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    if fam.gguf.eot_text and f.get("tokenizer.ggml.eot_token_id") is None:
        eos.append(header.token_id(fam.gguf.eot_text))
    raw: dict[str, Any] = {
        "architectures": [fam.architectures[0]],
        "vocab_size": int(g.get("vocab_size", int(emb.shape[1]))),
        "hidden_size": hidden,
        "num_hidden_layers": int(g.get("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": g.first("attention.head_count_kv", heads),
        "head_dim": int(g.get("attention.key_length", hidden // heads)),
        "intermediate_size": g.first("feed_forward_length"),
        "rms_norm_eps": float(g.get("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(g.get("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g.get("context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": [int(e) for e in dict.fromkeys(eos) if e is not None],
        "sliding_window": g.get("attention.sliding_window"),
        "attn_logit_softcapping": g.get("attn_logit_softcapping"),
        "final_logit_softcapping": g.get("final_logit_softcapping"),
        # only where present: Qwen2's q/k/v biases and Phi-3 are read without this field
        "attention_bias": ("blk.0.attn_q.bias" in names and "blk.0.attn_output.bias" in names)
        or None,
    }
    raw |= _rope(g)
    if g.get("attention.scale") is not None:
        raw["attention_multiplier"] = float(g.get("attention.scale"))
    if fam.gguf.config is not None:
        raw |= fam.gguf.config(g, raw)
    raw = {k: v for k, v in raw.items() if v is not None}
    return hf_config(raw, path.name, strict=strict)


def _rope(g: GgufFile) -> dict[str, Any]:
    """The RoPE scaling: llama.cpp's ``rope.scaling.*`` keys, or what it keeps as tensors
    (Llama 3.1's ``rope_freqs``, longrope's short and long factors)."""
    scaling = g.get("rope.scaling.type", "none")
    out: dict[str, Any] = {}
    if scaling not in ("none", None):
        out["rope_scaling"] = {
            "rope_type": scaling,
            "factor": g.get("rope.scaling.factor", 1.0),
            "original_max_position_embeddings": g.get("rope.scaling.original_context_length"),
        }
    header = g.header
    if g.has("rope_freqs.weight"):  # llama 3.1+: per-frequency divisors precomputed
        factors = header.f32_tensor("rope_freqs.weight").tolist()
        out["rope_scaling"] = {"rope_type": "default", "freq_factors": factors}
    if g.has("rope_factors_long.weight"):  # longrope (Phi-3): its factors as tensors
        out["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": header.f32_tensor("rope_factors_short.weight").tolist(),
            "long_factor": header.f32_tensor("rope_factors_long.weight").tolist(),
            "original_max_position_embeddings": g.get("rope.scaling.original_context_length"),
            "attention_factor": g.get("rope.scaling.attn_factor"),
        }
    return out
