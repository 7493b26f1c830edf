"""A causal LM kvflow has no family file for, read through transformers (``--model-impl
transformers``, or ``auto`` for an architecture the registry lacks): only the shape the
scheduler, tokenizer and KV cache need; the worker runs transformers' own modules around
kvflow's paged attention (services/worker/transformers_model.py). ``FALLBACK`` is its entry in
the registry: the model kind that runs it and what that does not serve."""

from __future__ import annotations

import os
from typing import Any

from kvflow.shared.models.config import ConfigReader, ModelConfig, ModelConfigError
from kvflow.shared.models.family import Family


def transformers_config(
    raw: dict[str, Any], where: str = "config.json", eos_extra: list[int] | None = None
) -> ModelConfig:
    """``raw`` parsed by transformers' own config class; ModelConfigError when transformers
    cannot build a causal LM from it."""
    values = read_transformers(ConfigReader(raw, where))
    eos = (*values.pop("eos_token_ids"), *(eos_extra or []))
    return ModelConfig(**values, eos_token_ids=tuple(dict.fromkeys(eos)))


def read_transformers(r: ConfigReader) -> dict[str, Any]:
    """Every ``ModelConfig`` field of a config.json, through transformers' config class (whose
    aliases map GPT-2's ``n_embd`` and the like): the fallback's ``read``."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoConfig

    raw, where = r.raw, r.where
    check_supported(raw, where)
    model_type = raw["model_type"]
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
    return {
        "vocab_size": int(c.vocab_size),
        "hidden_size": hidden,
        "num_layers": int(c.num_hidden_layers),
        "num_heads": heads,
        "num_kv_heads": int(getattr(c, "num_key_value_heads", None) or heads),
        "head_dim": int(getattr(c, "head_dim", None) or hidden // heads),
        "intermediate_size": int(getattr(c, "intermediate_size", None) or 0),
        "rms_norm_eps": float(
            getattr(c, "rms_norm_eps", None) or getattr(c, "layer_norm_eps", 0.0)
        ),
        "rope_theta": 10000.0,
        "max_position_embeddings": int(maxpos),
        "tie_word_embeddings": bool(getattr(c, "tie_word_embeddings", False)),
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_ids": tuple(dict.fromkeys(int(e) for e in eos_ids)),
        "family": "transformers",
    }


NEITHER = (
    "through transformers' own modules (--model-impl transformers, or auto for an architecture "
    "kvflow has no family for), which serve neither tensor parallelism nor LoRA adapters: it "
    "needs kvflow's own implementation of the model"
)

FALLBACK = Family(
    "transformers",
    (),
    (),
    read_transformers,
    {},
    kind="transformers",
    no_tensor_parallel=NEITHER,
    no_lora=NEITHER,
)


SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def check_supported(raw: dict[str, Any], where: str) -> None:
    """Refuse (ModelConfigError, a ValueError) what the backend cannot run, from config.json
    alone: model types transformers does not know, encoder-decoders, models with no
    causal-LM class, quantized checkpoints, models with no attention shape (Mamba)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    kind = raw.get("model_type")
    if not kind or kind not in CONFIG_MAPPING:
        raise ModelConfigError(f"{where}: model_type {kind!r} is not one transformers knows")
    c = CONFIG_MAPPING[kind].from_dict(raw)
    if getattr(c, "is_encoder_decoder", False):
        raise ModelConfigError(
            f"{where}: {kind} is an encoder-decoder model; --model-impl transformers runs "
            "decoder-only causal LMs"
        )
    if kind not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ModelConfigError(
            f"{where}: {kind} is not a causal LM (no AutoModelForCausalLM class in "
            "transformers); --model-impl transformers runs causal LMs only"
        )
    if getattr(c, "quantization_config", None):
        raise ModelConfigError(
            f"{where}: a quantized checkpoint ({c.quantization_config}); --model-impl "
            "transformers serves unquantized weights only (use the native implementation)"
        )
    text = c.get_text_config()
    missing = [n for n in SHAPE_FIELDS if getattr(text, n, None) is None]
    if missing:
        raise ModelConfigError(
            f"{where}: {kind} has no {', '.join(missing)}; --model-impl transformers runs "
            "attention-based causal LMs"
        )
