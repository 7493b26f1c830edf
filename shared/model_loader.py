"""Read a model's config and weights from a GGUF file or a local HF directory, for any family the
registry knows (shared/models/registry.py).

Weights come back under Hugging Face names in torch layout (the family's own names for norms,
Llama's for the projections: a family with fused checkpoint tensors has them cut by its
``split``), so the worker's model and any HF comparison see the same tensors. GGUF tensors are
named back through gguf-py's own name tables, dequantized by gguf's own code, llama.cpp's rotary
row permutation of Q/K is undone where its converter made one (the inverse of
convert_hf_to_gguf.py's ``permute``), and norms it stored as ``1 + w`` (Gemma) are given back
as ``w``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from kernels.cpu_quant import BLOCK_BYTES, TYPE_NAMES, QuantWeight
from kernels.fp8_linear import Fp8Weight, quantize_fp8
from shared.gguf_header import read_header, read_tensors
from shared.model_source import ModelSource, resolve_model
from shared.models.config import ModelConfig, ModelConfigError
from shared.models.family import LINEARS, Family
from shared.models.generic import transformers_config
from shared.models.registry import UnsupportedArchitecture, family, family_for_gguf, hf_config
from shared.models.tasks import served_task, st_max_seq_length
from shared.quantized_checkpoints import checkpoint_method, quantization_config, read_layer

if TYPE_CHECKING:
    from shared.config import Settings

__all__ = ["ModelConfig", "ModelConfigError", "load_config", "load_weights", "round_weights"]

log = logging.getLogger("kvflow.model")


# --------------------------------------------------------------------------------------------
# config


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


# --------------------------------------------------------------------------------------------
# weights


def load_weights(
    src: ModelSource, cfg: ModelConfig, dtype: torch.dtype = torch.float32, quantization: str = ""
) -> dict[str, torch.Tensor | QuantWeight | Fp8Weight]:
    """All weights under HF names (see the module docstring), as ``dtype`` (``lm_head.weight``
    only if untied, or as the embedding's quantized copy when quantized). ``quantization``:
    ``"gguf"`` keeps a GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K linear weights
    in their blocks
    (``kernels.cpu_quant.QuantWeight``); ``"int8"`` rounds every linear weight to int8 blocks
    (``quantize_int8``); ``"fp8"`` rounds the layers' linear weights to e4m3 per output channel
    (kernels/fp8_linear.py); ``"gptq"`` / ``"awq"`` keep such a checkpoint's 4-bit groups as
    Q4_Z blocks (otherwise its packed layers are dequantized: shared/quantized_checkpoints.py).
    ``"gguf-a8"`` keeps them so too, to be multiplied with int8 activations.
    The embedding stays dense for lookups, except under ``"gguf"``/``"gguf-a8"``: there it stays in its blocks
    (rows decoded as they are looked up; a tied head reads the same blocks). ValueError names a
    missing or unexpected tensor."""
    t0 = time.perf_counter()
    fam = family(cfg.family)
    if cfg.encoder:  # BERT / RoBERTa: their own names, checked by the encoder model
        if src.kind == "gguf" or quantization:
            raise ValueError(f"{src.path}: encoders load from HF directories, unquantized")
        return encoder_weights(src.path, dtype)
    if src.kind == "gguf":
        weights = _gguf_weights(
            src.path, cfg, fam, dtype, quantized=quantization in ("gguf", "gguf-a8")
        )
    else:
        weights = _hf_weights(src.path, dtype)
        method = checkpoint_method(src.path)
        if method:
            weights = _quantized_layers(weights, method, src.path, quantization == method, dtype)
        if cfg.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
    if fam.split is not None:
        weights = fam.split(weights, cfg)
    weights = round_weights(weights, quantization)
    check_weights(weights, cfg, str(src.path))
    copy = "lm_head.weight" if cfg.tie_word_embeddings else ""  # the tied head's quantized copy
    n = sum(math.prod(w.shape) for name, w in weights.items() if name != copy)
    quant = [w for w in weights.values() if not isinstance(w, torch.Tensor)]
    mib = sum(w.nbytes for w in quant) / 2**20
    log.info(
        "model weights ready: %.1fM parameters in %.1fs%s",
        n / 1e6,
        time.perf_counter() - t0,
        f" ({len(quant)} linear weights quantized, {mib:.0f} MiB)" if quant else "",
    )
    return weights


def expected_names(cfg: ModelConfig) -> set[str]:
    """Every tensor name a model of ``cfg`` needs (the lm_head only when untied)."""
    fam = family(cfg.family)
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if cfg.norm_kind == "layer":
        names.add("model.norm.bias")
    if not cfg.tie_word_embeddings:
        names.add("lm_head.weight")
    for i in range(cfg.num_layers):
        names |= {f"model.layers.{i}.{n}" for n in fam.layer_weight_names(cfg, i)}
    return names


def check_weights(weights: dict[str, Any], cfg: ModelConfig, where: str) -> None:
    """ValueError naming the tensors ``cfg`` needs that are missing, and those left over (a
    tied lm_head's quantized copy is allowed)."""
    want = expected_names(cfg)
    have = set(weights) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    missing, extra = sorted(want - have), sorted(have - want)
    if missing or extra:
        raise ValueError(
            f"{where}: weights do not fit the {cfg.family} config: missing {missing[:6]}"
            f"{'...' if len(missing) > 6 else ''}, unexpected {extra[:6]}"
            f"{'...' if len(extra) > 6 else ''}"
        )


_LINEAR_NAMES = tuple(n.split(".")[-1] for n in LINEARS)


def is_linear_weight(name: str) -> bool:
    """A layer's projection weight (not its bias, not a norm)."""
    parts = name.split(".")
    return parts[-1] == "weight" and len(parts) > 2 and parts[-2] in _LINEAR_NAMES


def round_weights(weights: dict[str, Any], quantization: str) -> dict[str, Any]:
    """The schemes that round loaded weights (``int8``: ``quantize_int8``; ``fp8``: the layers'
    linear weights as kernels/fp8_linear.py ``Fp8Weight``) or mark them for int8 activations
    (``gguf-a8``: a GGUF's blocks as they are); any other leaves them as they are."""
    if quantization in ("int8", "w8a8"):
        return quantize_int8(weights, int8_activations=quantization == "w8a8")
    if quantization == "gguf-a8":  # the file's blocks, multiplied with int8 activations
        return {
            n: dataclasses.replace(w, int8_activations=True) if isinstance(w, QuantWeight) else w
            for n, w in weights.items()
        }
    if quantization == "fp8":
        return quantize_fp8(weights, frozenset(_LINEAR_NAMES))
    return weights


def quantize_int8(
    weights: dict[str, torch.Tensor | QuantWeight], int8_activations: bool = False
) -> dict[str, torch.Tensor | QuantWeight]:
    """``--quantization int8``: every linear weight (and the lm_head, tied or not) as int8 with
    one fp16 scale per 32 weights of a row, rounded to nearest (GGUF's Q8_0 layout, so the same
    CPU kernel reads it; finer than one scale per output channel). ``int8_activations``
    (``--quantization w8a8``): multiplied on the CPU with activations rounded to int8 per 32 as
    well (``QuantWeight.int8_activations``). Norms, biases and the embedding lookup stay dense;
    a weight whose K is not a multiple of 32 stays dense too."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    def q8(w: torch.Tensor) -> torch.Tensor | QuantWeight:
        if w.shape[1] % 32:
            log.warning("a weight of shape %s stays dense: K is not a multiple of 32", w.shape)
            return w
        raw = quantize(w.float().numpy(), GGMLQuantizationType.Q8_0)
        qw = QuantWeight.from_gguf(raw, int(GGMLQuantizationType.Q8_0), tuple(w.shape))
        return dataclasses.replace(qw, int8_activations=int8_activations)

    out = dict(weights)
    for name, w in weights.items():
        if isinstance(w, torch.Tensor) and is_linear_weight(name):
            out[name] = q8(w)
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    if isinstance(head, torch.Tensor):
        out["lm_head.weight"] = q8(head)
    return out


@functools.cache
def _gguf_names(arch: str, num_layers: int) -> dict[str, str]:
    """GGUF tensor name -> HF name for a family's tensors, from gguf-py's own tables."""
    from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, get_tensor_name_map

    code = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch and k in MODEL_ARCH)
    table = get_tensor_name_map(code, num_layers)
    hf = ["model.embed_tokens", "model.norm", "lm_head"]
    layer = [*LINEARS, "self_attn.qkv_proj", "mlp.gate_up_proj", "self_attn.q_norm"]
    layer += ["mlp.c_fc", "mlp.c_proj"]
    layer += ["self_attn.k_norm", "input_layernorm", "post_attention_layernorm"]
    layer += ["pre_feedforward_layernorm", "post_feedforward_layernorm"]
    hf += [f"model.layers.{i}.{n}" for i in range(num_layers) for n in layer]
    out: dict[str, str] = {}
    for name in hf:
        g = table.get_name(name)
        if g is not None:
            for suffix in ("weight", "bias"):
                out.setdefault(f"{g}.{suffix}", f"{name}.{suffix}")
    return out


_GGUF_MOE = re.compile(
    r"blk\.(\d+)\.ffn_(gate_inp|gate_exps|up_exps|down_exps|gate_shexp|up_shexp|down_shexp"
    r"|gate_inp_shexp)\.weight"
)
"""llama.cpp's mixture-of-experts tensors: the router (``ffn_gate_inp``), every expert's
projection stacked in one 3-D tensor (``ffn_*_exps``), a shared expert and its gate."""


def _gguf_dense(t: Any, shape: tuple[int, ...]) -> torch.Tensor:
    """A GGUF tensor as fp32 of ``shape``: F32/F16 copied (the file is mapped read-only), any
    block type dequantized by gguf-py."""
    from gguf.quants import dequantize

    if t.tensor_type.name in ("F32", "F16"):
        arr = np.array(t.data, dtype=np.float32)
    else:
        arr = dequantize(t.data, t.tensor_type)
    return torch.from_numpy(np.ascontiguousarray(arr).reshape(shape))


def _gguf_moe_tensor(
    t: Any, shape: tuple[int, ...], m: re.Match[str], quantized: bool, dtype: torch.dtype
) -> dict[str, torch.Tensor | QuantWeight]:
    """One MoE tensor of a GGUF under HF names: a stacked [E, N, K] tensor cut into each
    expert's [N, K] (each keeping its rows of blocks when ``quantized`` and a kernel reads
    them), the router and the shared expert's gate dense."""
    p, kind = f"model.layers.{m.group(1)}.mlp.", m.group(2)
    keep = (
        quantized
        and int(t.tensor_type) in BLOCK_BYTES
        and kind not in ("gate_inp", "gate_inp_shexp")
    )

    def dense() -> torch.Tensor:
        return _gguf_dense(t, shape).to(dtype)

    if kind == "gate_inp":
        return {p + "gate.weight": dense()}
    if kind == "gate_inp_shexp":
        return {p + "shared_expert_gate.weight": dense().reshape(1, -1)}
    proj = kind.split("_")[0] + "_proj.weight"
    if kind.endswith("_shexp"):
        name = p + "shared_expert." + proj
        return {name: QuantWeight.from_gguf(t.data, int(t.tensor_type), shape) if keep else dense()}
    experts, n, k = shape
    if keep:
        rows = np.ascontiguousarray(t.data, dtype=np.uint8).reshape(experts, n, -1)
        return {
            f"{p}experts.{e}.{proj}": QuantWeight.from_gguf(rows[e], int(t.tensor_type), (n, k))
            for e in range(experts)
        }
    w = dense()
    return {f"{p}experts.{e}.{proj}": w[e].clone() for e in range(experts)}


def _gguf_weights(
    path: Path, cfg: ModelConfig, fam: Family, dtype: torch.dtype, quantized: bool = False
) -> dict[str, torch.Tensor | QuantWeight]:

    log.info("reading %s", path.name)
    header = read_header(path)
    arch = header.fields.get("general.architecture", "llama")
    names = _gguf_names(arch, cfg.num_layers)
    tensors = [t for t in read_tensors(header) if t.name in names or _GGUF_MOE.match(t.name)]
    if quantized:
        _log_kept(path, tensors)
    else:
        kinds = sorted({t.tensor_type.name for t in tensors})
        log.info("dequantizing %d tensors (%s)", len(tensors), ", ".join(kinds))
    out: dict[str, torch.Tensor | QuantWeight] = {}
    for i, t in enumerate(tensors):
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
        moe = _GGUF_MOE.match(t.name)
        if moe:
            out |= _gguf_moe_tensor(t, shape, moe, quantized, dtype)
            continue
        name = names[t.name]
        if name.endswith("mlp.up_proj.weight") and shape[0] == 2 * cfg.intermediate_size:
            name = name.replace("up_proj", "gate_up_proj")  # Phi-3: gate and up in one ffn_up
        keep = quantized and int(t.tensor_type) in BLOCK_BYTES and len(shape) == 2
        if keep:  # the embedding too: looked up row by row; a tied head reads the same blocks
            w: torch.Tensor | QuantWeight = QuantWeight.from_gguf(t.data, int(t.tensor_type), shape)
        else:
            w = _gguf_dense(t, shape)
            if fam.gguf_norm_offset and name.endswith("norm.weight"):
                w = w - fam.gguf_norm_offset  # stored as offset + w; the model adds it back
            w = w.to(dtype).contiguous()
        # the converter permutes the Q/K biases (attention_bias) as their weights' rows
        if fam.gguf_permute_qk and name.endswith(("self_attn.q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, cfg.num_heads)
        elif fam.gguf_permute_qk and name.endswith(("self_attn.k_proj.weight", "k_proj.bias")):
            w = _unpermute(w, cfg.num_kv_heads)
        out[name] = w
        if (i + 1) % 50 == 0:
            log.info("dequantized %d/%d tensors", i + 1, len(tensors))
    return out


def _log_kept(path: Path, tensors: list[Any]) -> None:
    """Which of a GGUF's tensors ``--quantization gguf`` keeps in their blocks and which it
    densifies, and why; ValueError when it would keep none (the flag would change nothing)."""
    from collections import Counter

    dense = {"F32", "F16", "BF16"}

    def keeps(t: Any) -> bool:  # a projection (an expert's among a stacked 3-D tensor's)
        router = "ffn_gate_inp" in t.name
        return int(t.tensor_type) in BLOCK_BYTES and len(t.shape) in (2, 3) and not router

    kept = Counter(t.tensor_type.name for t in tensors if keeps(t))
    other = Counter(
        t.tensor_type.name for t in tensors if not keeps(t) and t.tensor_type.name not in dense
    )
    if not kept:
        raise ValueError(
            f"--quantization gguf: {path.name} has no linear weight in a block type kvflow "
            f"multiplies in place ({', '.join(TYPE_NAMES[t] for t in BLOCK_BYTES if t in TYPE_NAMES and t < 1000)}); "
            f"its {', '.join(sorted(other)) or 'float'} tensors would all be densified: serve "
            "it without --quantization"
        )
    log.info(
        "kept in their blocks: %s (the token embedding looked up from its blocks, a tied "
        "head reading the same); norms, biases and routers in fp32",
        ", ".join(f"{k} x{n}" for k, n in sorted(kept.items())),
    )
    if other:
        log.warning(
            "densified to fp32 (no kvflow kernel reads these blocks in place): %s",
            ", ".join(f"{k} x{n}" for k, n in sorted(other.items())),
        )


def unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of Q/K rows (interleaved rotary pairs -> rotate_half)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _unpermute(w: torch.Tensor | QuantWeight, n_head: int) -> torch.Tensor | QuantWeight:
    if isinstance(w, QuantWeight):  # whole rows of blocks move
        rows = unpermute_rotary(torch.arange(w.shape[0]).unsqueeze(1), n_head).squeeze(1)
        return w.rows(rows)
    return unpermute_rotary(w, n_head).contiguous()


def _hf_weights(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [p.name for p in sorted(path.glob("*.safetensors"))]
    if not files:
        raise ValueError(f"{path}: no safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for i, name in enumerate(files):
        log.info("loading %s (%d/%d)", name, i + 1, len(files))
        for k, v in load_file(str(path / name)).items():
            if k.startswith("model.") or k == "lm_head.weight":
                # GPTQ/AWQ packed ints and fp16 scales stay as stored (_quantized_layers)
                keep = not v.is_floating_point() or k.endswith(".scales")
                out[k] = v if keep else v.to(dtype)
    return out


ENCODER_PREFIXES = ("bert.", "roberta.")


def encoder_weights(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """An encoder's tensors (shared/models/families/bert.py) under BERT's names without the
    base model's prefix; position-id buffers are dropped."""
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{path}: no safetensors weights")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in load_file(str(f)).items():
            for prefix in ENCODER_PREFIXES:
                k = k.removeprefix(prefix)
            if not k.endswith(("position_ids", "token_type_ids")):
                out[k] = v.to(dtype)
    return out


def _quantized_layers(
    weights: dict[str, torch.Tensor], method: str, path: Path, keep: bool, dtype: torch.dtype
) -> dict[str, torch.Tensor | QuantWeight]:
    """A GPTQ/AWQ checkpoint's packed layers as ``X.weight``: Q4_Z blocks when ``keep``
    (``--quantization gptq|awq``, the CPU path), else dequantized to ``dtype``."""
    qcfg = quantization_config(path)
    out: dict[str, torch.Tensor | QuantWeight] = {}
    layers = sorted({k.removesuffix(".qweight") for k in weights if k.endswith(".qweight")})
    parts = ("qweight", "qzeros", "scales", "g_idx")
    for prefix in layers:
        tensors = {p: weights[f"{prefix}.{p}"] for p in parts if f"{prefix}.{p}" in weights}
        w = read_layer(method, tensors, qcfg, keep)
        out[f"{prefix}.weight"] = w if isinstance(w, QuantWeight) else w.to(dtype)
    packed = {f"{prefix}.{p}" for prefix in layers for p in parts}
    out |= {k: v for k, v in weights.items() if k not in packed}
    log.info("%s checkpoint: %d packed 4-bit layers read (%s)", method, len(layers), qcfg)
    return out
