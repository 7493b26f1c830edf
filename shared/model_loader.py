"""Read a Llama-family model's config and weights from a GGUF file or a local HF directory.

Weights come back under Hugging Face Llama names in torch layout, so the worker's model and any
HF comparison see the same tensors. GGUF tensors are dequantized by gguf's own code and llama.cpp's
rotary row permutation of Q/K is undone (the inverse of convert_hf_to_gguf.py's ``permute``).
"""

from __future__ import annotations

import functools
import json
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kernels.cpu_quant import BLOCK_BYTES, QuantWeight
from kernels.fp8_linear import Fp8Weight, quantize_fp8
from shared.model_source import ModelSource
from shared.quantized_checkpoints import checkpoint_method, quantization_config, read_layer

log = logging.getLogger("kvflow.model")


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]


# --------------------------------------------------------------------------------------------
# config


def load_config(src: ModelSource) -> ModelConfig:
    """The model's shape and special ids; raises ValueError for what kvflow cannot run."""
    return _gguf_config(src.path) if src.kind == "gguf" else _hf_config(src.path)


_SKIP_FIELDS = {f"tokenizer.ggml.{k}" for k in ("tokens", "merges", "token_type", "scores")}


def _gguf_fields(reader: Any) -> dict[str, Any]:
    """Metadata values, without the big vocab arrays the config does not need."""
    return {k: f.contents() for k, f in reader.fields.items() if k not in _SKIP_FIELDS}


@functools.lru_cache(maxsize=1)
def _gguf_reader(path: Path, mtime_ns: int) -> Any:
    """Parsing a GGUF header takes seconds (the vocab arrays): do it once for config + weights."""
    from gguf import GGUFReader

    return GGUFReader(path)


def _reader(path: Path) -> Any:
    return _gguf_reader(path, path.stat().st_mtime_ns)


def _gguf_config(path: Path) -> ModelConfig:
    reader = _reader(path)
    f = _gguf_fields(reader)
    arch = f.get("general.architecture", "llama")
    if arch != "llama":
        raise ValueError(f"{path.name}: architecture {arch!r} is not supported (llama only)")
    if f.get(f"{arch}.rope.scaling.type", "none") not in ("none", "linear") or any(
        t.name == "rope_freqs.weight" for t in reader.tensors
    ):
        raise ValueError(f"{path.name}: RoPE scaling is not supported")
    names = {t.name for t in reader.tensors}
    emb = next(t for t in reader.tensors if t.name == "token_embd.weight")
    hidden = int(f[f"{arch}.embedding_length"])
    heads = int(f[f"{arch}.attention.head_count"])
    eos = [f.get("tokenizer.ggml.eos_token_id")]
    eos += [f.get(f"tokenizer.ggml.{k}_token_id") for k in ("eot", "eom")]
    return ModelConfig(
        vocab_size=int(f.get(f"{arch}.vocab_size", int(emb.shape[1]))),
        hidden_size=hidden,
        num_layers=int(f[f"{arch}.block_count"]),
        num_heads=heads,
        num_kv_heads=int(f.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=int(f.get(f"{arch}.attention.key_length", hidden // heads)),
        intermediate_size=int(f[f"{arch}.feed_forward_length"]),
        rms_norm_eps=float(f.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(f.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=int(f.get(f"{arch}.context_length", 2048)),
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_opt_int(f.get("tokenizer.ggml.bos_token_id")),
        eos_token_ids=tuple(dict.fromkeys(int(e) for e in eos if e is not None)),
    )


def _opt_int(x: Any) -> int | None:
    return None if x is None else int(x)


def _as_ids(x: Any) -> list[int]:
    if x is None:
        return []
    return [int(i) for i in x] if isinstance(x, list) else [int(x)]


def _hf_config(path: Path) -> ModelConfig:
    c = json.loads((path / "config.json").read_text())
    if c.get("model_type", "llama") != "llama":
        raise ValueError(f"{path}: model_type {c['model_type']!r} is not supported (llama only)")
    rope = c.get("rope_scaling") or c.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise ValueError(f"{path}: RoPE scaling {rope} is not supported")
    eos = _as_ids(c.get("eos_token_id"))
    gen = path / "generation_config.json"
    if gen.is_file():
        eos += _as_ids(json.loads(gen.read_text()).get("eos_token_id"))
    heads = int(c["num_attention_heads"])
    return ModelConfig(
        vocab_size=int(c["vocab_size"]),
        hidden_size=int(c["hidden_size"]),
        num_layers=int(c["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(c.get("num_key_value_heads") or heads),
        head_dim=int(c.get("head_dim") or c["hidden_size"] // heads),
        intermediate_size=int(c["intermediate_size"]),
        rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
        rope_theta=float(c.get("rope_theta", rope.get("rope_theta", 10000.0))),
        max_position_embeddings=int(c.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_token_id=_opt_int(c.get("bos_token_id")),
        eos_token_ids=tuple(dict.fromkeys(eos)),
    )


# --------------------------------------------------------------------------------------------
# weights

_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output_norm.weight":
        return "model.norm.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    return None


def unpermute_rotary(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's ``permute`` of Q/K rows (interleaved rotary pairs -> rotate_half)."""
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def load_weights(
    src: ModelSource, cfg: ModelConfig, dtype: torch.dtype = torch.float32, quantization: str = ""
) -> dict[str, torch.Tensor | QuantWeight | Fp8Weight]:
    """All weights under HF Llama names, as ``dtype`` (``lm_head.weight`` only if untied, or as
    the embedding's quantized copy when quantized). ``quantization``: ``"gguf"`` keeps a GGUF's
    Q8_0/Q4_0/Q4_1 linear weights in their blocks (``kernels.cpu_quant.QuantWeight``);
    ``"int8"`` rounds every linear weight to int8 blocks (``quantize_int8``); ``"fp8"`` rounds
    the layers' linear weights to e4m3 per output channel (kernels/fp8_linear.py); ``"gptq"`` /
    ``"awq"`` keep such a checkpoint's 4-bit groups as Q4_Z blocks (otherwise its packed layers
    are dequantized: shared/quantized_checkpoints.py). The embedding stays dense for lookups."""
    t0 = time.perf_counter()
    if src.kind == "gguf":
        weights = _gguf_weights(src.path, cfg, dtype, quantized=quantization == "gguf")
    else:
        weights = _hf_weights(src.path, dtype)
        method = checkpoint_method(src.path)
        if method:
            weights = _quantized_layers(weights, method, src.path, quantization == method, dtype)
        if cfg.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
    weights = round_weights(weights, quantization)
    expected = 3 + 9 * cfg.num_layers - (1 if cfg.tie_word_embeddings else 0)
    if cfg.tie_word_embeddings and "lm_head.weight" in weights:  # its quantized copy
        expected += 1
    if len(weights) != expected:
        raise ValueError(f"{src.path}: found {len(weights)} weight tensors, expected {expected}")
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


_LINEAR_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def round_weights(weights: dict[str, Any], quantization: str) -> dict[str, Any]:
    """The schemes that round loaded weights (``int8``: ``quantize_int8``; ``fp8``: the layers'
    linear weights as kernels/fp8_linear.py ``Fp8Weight``); any other leaves them as they are."""
    if quantization == "int8":
        return quantize_int8(weights)
    if quantization == "fp8":
        return quantize_fp8(weights, frozenset(_LINEAR_NAMES))
    return weights


def quantize_int8(
    weights: dict[str, torch.Tensor | QuantWeight],
) -> dict[str, torch.Tensor | QuantWeight]:
    """``--quantization int8``: every linear weight (and the lm_head, tied or not) as int8 with
    one fp16 scale per 32 weights of a row, rounded to nearest (GGUF's Q8_0 layout, so the same
    CPU kernel reads it; finer than one scale per output channel). Norms and the embedding
    lookup stay dense; a weight whose K is not a multiple of 32 stays dense too."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    def q8(w: torch.Tensor) -> torch.Tensor | QuantWeight:
        if w.shape[1] % 32:
            log.warning("a weight of shape %s stays dense: K is not a multiple of 32", w.shape)
            return w
        raw = quantize(w.float().numpy(), GGMLQuantizationType.Q8_0)
        return QuantWeight.from_gguf(raw, int(GGMLQuantizationType.Q8_0), tuple(w.shape))

    out = dict(weights)
    for name, w in weights.items():
        if isinstance(w, torch.Tensor) and name.split(".")[-2] in _LINEAR_NAMES:
            out[name] = q8(w)
    head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    if isinstance(head, torch.Tensor):
        out["lm_head.weight"] = q8(head)
    return out


def _gguf_weights(
    path: Path, cfg: ModelConfig, dtype: torch.dtype, quantized: bool = False
) -> dict[str, torch.Tensor | QuantWeight]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    log.info("reading %s", path.name)
    reader = _reader(path)
    tensors = [t for t in reader.tensors if _hf_name(t.name) is not None]
    kinds = sorted({t.tensor_type.name for t in tensors})
    log.info("dequantizing %d tensors (%s)", len(tensors), ", ".join(kinds))
    out: dict[str, torch.Tensor | QuantWeight] = {}
    for i, t in enumerate(tensors):
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dims fastest-first
        name = _hf_name(t.name)
        keep = quantized and int(t.tensor_type) in BLOCK_BYTES and len(shape) == 2
        if keep and name != "model.embed_tokens.weight":
            w: torch.Tensor | QuantWeight = QuantWeight.from_gguf(t.data, int(t.tensor_type), shape)
        else:
            if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
                arr = np.array(t.data, dtype=np.float32)  # a copy: the file is mapped read-only
            else:
                arr = dequantize(t.data, t.tensor_type)
            w = torch.from_numpy(arr.reshape(shape)).to(dtype).contiguous()
            if keep and cfg.tie_word_embeddings:  # the tied lm_head reads the blocks
                out["lm_head.weight"] = QuantWeight.from_gguf(t.data, int(t.tensor_type), shape)
        if ".attn_q." in t.name:
            w = _unpermute(w, cfg.num_heads)
        elif ".attn_k." in t.name:
            w = _unpermute(w, cfg.num_kv_heads)
        out[name] = w
        if (i + 1) % 50 == 0:
            log.info("dequantized %d/%d tensors", i + 1, len(tensors))
    return out


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
