"""A model's config, read from its files alone (a GGUF's header, or a Hugging Face directory's
config.json and generation_config.json) for any family the registry knows
(shared/models/registry.py), and checked against what the settings ask for.

Nothing here imports torch: the processes that only need the model's shape (the scheduler, the
tokenizer, the detokenizer, ``kvflow serve``'s checks) start without it. The weights are read by
shared/model_loader.py.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvflow.shared.gguf_header import read_header
from kvflow.shared.model_source import ModelSource, resolve_model
from kvflow.shared.models.config import ModelConfig, ModelConfigError
from kvflow.shared.models.generic import transformers_config
from kvflow.shared.models.registry import UnsupportedArchitecture, family_for_gguf, hf_config
from kvflow.shared.models.tasks import served_task, st_max_seq_length

if TYPE_CHECKING:
    from kvflow.shared.config import Settings

__all__ = ["MODEL_IMPLS", "check_model", "check_settings_model", "load_config"]


MODEL_IMPLS = ("auto", "kvflow", "transformers")
"""vLLM's ``--model-impl``: ``kvflow`` (a native family, shared/models/registry.py), ``transformers``
(transformers' own modules around kvflow's paged attention), ``auto`` (native where the registry
has the architecture, else transformers)."""


def load_config(src: ModelSource, strict: bool = False, model_impl: str = "auto") -> ModelConfig:
    """The model's shape, features and special ids; raises ModelConfigError (a ValueError)
    naming the field and value kvflow cannot run, and what to do instead."""
    if model_impl not in MODEL_IMPLS:
        raise ModelConfigError(f"--model-impl must be one of {', '.join(MODEL_IMPLS)}")
    if src.kind == "gguf":
        if model_impl == "transformers":
            raise ModelConfigError(
                f"{src.path.name}: --model-impl transformers serves Hugging Face directories, "
                "not GGUF files"
            )
        return _gguf_config(src.path, strict)
    cfg = _hf_config(src.path, strict, model_impl)
    cap = st_max_seq_length(src.path)  # sentence-transformers truncates its inputs here
    if 0 < cap < cfg.max_position_embeddings:
        cfg = dataclasses.replace(cfg, max_position_embeddings=cap)
    return cfg


def check_model(
    path: str,
    served_name: str = "",
    model_impl: str = "auto",
    tensor_parallel_size: int = 1,
    enable_lora: bool = False,
    task: str = "auto",
    pooling_type: str = "",
) -> ModelConfig:
    """What ``kvflow serve``, ``kvflow run`` and ``LLM()`` check before anything starts: the
    model is found and its config can be served as asked, ``--task`` included
    (ModelNotFoundError or ModelConfigError, both naming what to change); only config.json (and
    a sentence-transformers directory's own configs) or the GGUF header is read."""
    src = resolve_model(path, served_name)
    cfg = load_config(src, model_impl=model_impl)
    served_task(cfg, src.path if src.kind == "hf" else None, task, pooling_type)
    if cfg.family == "transformers" and (tensor_parallel_size > 1 or enable_lora):
        what = "--tensor-parallel-size > 1" if tensor_parallel_size > 1 else "--enable-lora"
        raise ModelConfigError(
            f"{path}: {what} needs kvflow's own implementation of the model; this one runs "
            f"through transformers (--model-impl {model_impl}), which serves neither"
        )
    if cfg.num_experts and enable_lora:
        raise ModelConfigError(
            f"{path}: --enable-lora is not served yet for mixtures of experts ({cfg.family}): "
            "serve it without adapters"
        )
    if cfg.encoder and (tensor_parallel_size > 1 or enable_lora):
        what = "--tensor-parallel-size > 1" if tensor_parallel_size > 1 else "--enable-lora"
        raise ModelConfigError(
            f"{path}: {what} is not served for encoders ({cfg.family}); they are small: serve "
            "one per worker, and scale workers"
        )
    return cfg


def check_settings_model(settings: Settings) -> ModelConfig:
    """``check_model`` with what the settings ask for."""
    ms = settings.model
    return check_model(
        ms.path,
        ms.served_model_name,
        ms.model_impl,
        settings.worker.tensor_parallel_size,
        ms.enable_lora,
        ms.task,
        ms.pooling_type,
    )


def _hf_config(path: Path, strict: bool = False, model_impl: str = "auto") -> ModelConfig:
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ModelConfigError(f"{path}/config.json cannot be read: {e}") from e
    eos: list[int] = []
    gen = path / "generation_config.json"
    if gen.is_file():
        got = json.loads(gen.read_text()).get("eos_token_id")
        eos = [] if got is None else [int(i) for i in (got if isinstance(got, list) else [got])]
    where = f"{path}/config.json"
    if model_impl == "transformers":
        return transformers_config(raw, where, eos)
    try:
        return hf_config(raw, where, eos, strict)
    except UnsupportedArchitecture as e:
        if model_impl == "kvflow":
            raise ModelConfigError(f"{e}; or serve it with --model-impl transformers") from e
        try:
            return transformers_config(raw, where, eos)
        except ModelConfigError as fallback:
            raise ModelConfigError(f"{e}; and {fallback}") from e
    except ModelConfigError as e:
        raise ModelConfigError(f"{e} (or serve it with --model-impl transformers)") from e


def _gguf_config(path: Path, strict: bool = False) -> ModelConfig:
    """A GGUF's metadata as the config.json its family reads (llama.cpp's keys -> HF's, as
    transformers' GGUF loader maps them), then the family's own reader (``strict``: a field
    it does not read is refused, as for a config.json)."""
    header = read_header(path, keep_strings=frozenset({"tokenizer.ggml.tokens"}))
    f = header.fields
    arch = f.get("general.architecture", "llama")
    fam = family_for_gguf(arch, path.name, int(f.get(f"{arch}.expert_count", 0) or 0))
    names = set(header.tensors)
    emb = header.tensors["token_embd.weight"]
    hidden = int(f[f"{arch}.embedding_length"])
    heads = int(f[f"{arch}.attention.head_count"])
    head_dim = int(f.get(f"{arch}.attention.key_length", hidden // heads))
    eos = [f.get("tokenizer.ggml.eos_token_id")]
    eos += [f.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    if fam.name in _GGUF_EOT_TEXT and f.get("tokenizer.ggml.eot_token_id") is None:
        eos.append(header.token_id(_GGUF_EOT_TEXT[fam.name]))
    raw: dict[str, Any] = {
        "architectures": [fam.architectures[0]],
        "vocab_size": int(f.get(f"{arch}.vocab_size", int(emb.shape[1]))),
        "hidden_size": hidden,
        "num_hidden_layers": int(f[f"{arch}.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": _first(f.get(f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "intermediate_size": _first(f[f"{arch}.feed_forward_length"]),
        "rms_norm_eps": float(f.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": float(f.get(f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(f.get(f"{arch}.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": f.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": [int(e) for e in dict.fromkeys(eos) if e is not None],
        "sliding_window": f.get(f"{arch}.attention.sliding_window"),
        "attn_logit_softcapping": f.get(f"{arch}.attn_logit_softcapping"),
        "final_logit_softcapping": f.get(f"{arch}.final_logit_softcapping"),
        # only where present: Qwen2's q/k/v biases and Phi-3 are read without this field
        "attention_bias": ("blk.0.attn_q.bias" in names and "blk.0.attn_output.bias" in names)
        or None,
    }
    if fam.name in ("llama", "granite"):  # llama.cpp loads their FFN biases where present
        raw["mlp_bias"] = "blk.0.ffn_down.bias" in names
    if fam.name == "starcoder2":  # LayerNorm's epsilon; llama.cpp's graph: GELU (tanh)
        raw |= {
            "hidden_act": "gelu_pytorch_tanh",
            "norm_epsilon": float(f.get(f"{arch}.attention.layer_norm_epsilon", 1e-5)),
            "use_bias": "blk.0.attn_q.bias" in names,
        }
        raw.pop("attention_bias", None)
    if fam.name.startswith("gemma"):
        raw |= _gguf_gemma(fam.name, raw, f, arch)
    if fam.name in _GGUF_MOE_RENORMALIZE:
        raw |= _gguf_moe(fam.name, f, arch)
    if fam.name == "qwen2" and raw["sliding_window"]:
        raw["use_sliding_window"] = False  # llama.cpp runs Qwen2 without its window too
    scaling = f.get(f"{arch}.rope.scaling.type", "none")
    if scaling not in ("none", None):
        raw["rope_scaling"] = {
            "rope_type": scaling,
            "factor": f.get(f"{arch}.rope.scaling.factor", 1.0),
            "original_max_position_embeddings": f.get(
                f"{arch}.rope.scaling.original_context_length"
            ),
        }
    raw |= _gguf_extras(header, f, arch, names)
    raw = {k: v for k, v in raw.items() if v is not None}
    return hf_config(raw, path.name, strict=strict)


def _gguf_extras(header: Any, f: dict[str, Any], arch: str, names: set[str]) -> dict[str, Any]:
    """What a GGUF keeps as tensors or family keys: Llama 3.1's ``rope_freqs``, Phi-3's
    longrope factors, Granite's multipliers, an explicit attention scale."""
    raw: dict[str, Any] = {}
    if "rope_freqs.weight" in names:  # llama 3.1+: per-frequency divisors precomputed
        factors = header.f32_tensor("rope_freqs.weight").tolist()
        raw["rope_scaling"] = {"rope_type": "default", "freq_factors": factors}
    if "rope_factors_long.weight" in names:  # Phi-3's longrope: its factors as tensors
        raw["rope_scaling"] = {
            "rope_type": "longrope",
            "short_factor": header.f32_tensor("rope_factors_short.weight").tolist(),
            "long_factor": header.f32_tensor("rope_factors_long.weight").tolist(),
            "original_max_position_embeddings": f.get(
                f"{arch}.rope.scaling.original_context_length"
            ),
            "attention_factor": f.get(f"{arch}.rope.scaling.attn_factor"),
        }
    for key in ("granite.embedding_scale", "granite.residual_scale", "granite.logit_scale"):
        if key in f:
            hf = {
                "embedding_scale": "embedding_multiplier",
                "residual_scale": "residual_multiplier",
            }
            raw[hf.get(key.split(".")[1], "logits_scaling")] = float(f[key])
    if f"{arch}.attention.scale" in f:
        raw["attention_multiplier"] = float(f[f"{arch}.attention.scale"])
    return raw


_GGUF_MOE_RENORMALIZE = {"mixtral": True, "qwen2_moe": False, "qwen3_moe": True, "olmoe": False}
"""Whether llama.cpp renormalises a family's top-k router weights (``build_moe_ffn``'s
``norm_w`` in src/models/llama.cpp, qwen2moe.cpp, qwen3moe.cpp, olmoe.cpp: hardcoded per
architecture, not in the GGUF)."""


def _gguf_moe(name: str, f: dict[str, Any], arch: str) -> dict[str, Any]:
    """A mixture of experts' fields from llama.cpp's keys: the expert count and top-k, each
    expert's width (``expert_feed_forward_length``, else ``feed_forward_length``), the shared
    expert's (Qwen2-MoE), whether the top-k is renormalised. Every layer is MoE (llama.cpp's
    tensor tables have no dense MLP for these architectures)."""
    out: dict[str, Any] = {
        "num_experts": int(f[f"{arch}.expert_count"]),
        "num_experts_per_tok": int(f[f"{arch}.expert_used_count"]),
    }
    width = f.get(f"{arch}.expert_feed_forward_length")
    if name in ("qwen2_moe", "qwen3_moe"):
        out["moe_intermediate_size"] = int(width or _first(f[f"{arch}.feed_forward_length"]))
        out["norm_topk_prob"] = _GGUF_MOE_RENORMALIZE[name]
    elif name == "olmoe":
        out["norm_topk_prob"] = False
    if name == "qwen2_moe":
        out["shared_expert_intermediate_size"] = int(
            f.get(f"{arch}.expert_shared_feed_forward_length", 0) or 0
        )
    return out


_GGUF_EOT_TEXT = {"gemma2": "<end_of_turn>", "gemma3": "<end_of_turn>"}
"""Families whose chat turns end with a token other than EOS that a GGUF may not name
(``tokenizer.ggml.eot_token_id``; llama.cpp's Gemma converter writes none): llama.cpp finds
the end of turn by this text (llama-vocab.cpp) and stops there, as Gemma's own
generation_config.json lists it beside ``<eos>``."""

_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
"""llama.cpp's 27B model types (by block count): the only Gemma 2/3 whose queries are scaled by
1 / sqrt(hidden / heads) instead of 1 / sqrt(key_length) (llama-model.cpp, after gemma_pytorch;
HF's own configs: query_pre_attn_scalar 144 and 168)."""


def _gguf_gemma(name: str, raw: dict[str, Any], f: dict[str, Any], arch: str) -> dict[str, Any]:
    """What llama.cpp's Gemma 2/3 loaders (src/models/gemma2.cpp, gemma3.cpp) hardcode or
    default instead of reading from the GGUF: GELU-tanh, the query scale, which layers slide
    (``attention.sliding_window_pattern``: every Nth layer global, default 2 and 6, or one flag
    per layer); Gemma 2: a 4096 window and soft-caps 50 / 30 where absent; Gemma 3: the sliding
    layers' RoPE base (``rope.freq_base_swa``, default 10000), no soft-cap, and no sliding layer
    at all when the GGUF names no window."""
    layers, hidden = raw["num_hidden_layers"], raw["hidden_size"]
    big = layers == _GEMMA_27B_LAYERS[name]
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": hidden // raw["num_attention_heads"] if big else raw["head_dim"],
    }
    if name == "gemma2":
        out["sliding_window"] = raw.get("sliding_window") or 4096
        for key, default in (("attn_logit_softcapping", 50.0), ("final_logit_softcapping", 30.0)):
            out[key] = default if raw.get(key) is None else raw[key]
    elif raw.get("sliding_window"):
        out["rope_local_base_freq"] = float(f.get(f"{arch}.rope.freq_base_swa", 10000.0))
    else:
        out["layer_types"] = ["full_attention"] * layers
        return out
    pattern = f.get(f"{arch}.attention.sliding_window_pattern", 2 if name == "gemma2" else 6)
    if isinstance(pattern, list):
        slides = [bool(x) for x in pattern[:layers]]
    else:  # llama_hparams::set_swa_pattern: 0 means every layer slides
        n = int(pattern)
        slides = [n == 0 or i % n < n - 1 for i in range(layers)]
    out["layer_types"] = ["sliding_attention" if x else "full_attention" for x in slides]
    return out


def _first(x: Any) -> int:
    """A per-layer array (some GGUFs list head counts per layer) or a number: the first."""
    return int(x[0]) if isinstance(x, list) else int(x)
