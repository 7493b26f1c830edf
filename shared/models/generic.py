"""A causal LM kvflow has no family file for, read through transformers (``--model-impl
transformers``, or ``auto`` for an architecture the registry lacks): only the shape the
scheduler, tokenizer and KV cache need; the worker runs transformers' own modules around
kvflow's paged attention (services/worker/transformers_model.py)."""

from __future__ import annotations

import os
from typing import Any

from shared.models.config import ModelConfig, ModelConfigError


def transformers_config(
    raw: dict[str, Any], where: str = "config.json", eos_extra: list[int] | None = None
) -> ModelConfig:
    """``raw`` parsed by transformers' own config class; ModelConfigError when transformers
    cannot build a causal LM from it."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = raw.get("model_type", "")
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelConfigError(
            f"{where}: model_type {model_type!r} is not a causal language model transformers "
            "can build (AutoModelForCausalLM)"
        )
    fields = {k: v for k, v in raw.items() if k not in ("model_type", "transformers_version")}
    try:
        c = AutoConfig.for_model(model_type, **fields)
    except (ValueError, TypeError) as e:
        raise ModelConfigError(f"{where}: transformers cannot read it: {e}") from e
    c = c.get_text_config()
    heads = int(c.num_attention_heads)
    hidden = int(c.hidden_size)
    eos = getattr(c, "eos_token_id", None)
    eos_ids = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    bos = getattr(c, "bos_token_id", None)
    maxpos = next(
        (
            getattr(c, k)
            for k in ("max_position_embeddings", "n_positions", "seq_length")
            if getattr(c, k, None)
        ),
        2048,
    )
    return ModelConfig(
        vocab_size=int(c.vocab_size),
        hidden_size=hidden,
        num_layers=int(c.num_hidden_layers),
        num_heads=heads,
        num_kv_heads=int(getattr(c, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(c, "head_dim", None) or hidden // heads),
        intermediate_size=int(getattr(c, "intermediate_size", None) or 0),
        rms_norm_eps=float(getattr(c, "rms_norm_eps", None) or getattr(c, "layer_norm_eps", 0.0)),
        rope_theta=10000.0,
        max_position_embeddings=int(maxpos),
        tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
        bos_token_id=None if bos is None else int(bos),
        eos_token_ids=tuple(dict.fromkeys([int(e) for e in eos_ids] + (eos_extra or []))),
        family="transformers",
    )
