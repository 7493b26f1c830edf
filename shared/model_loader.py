"""Read a model's weights from a GGUF file or a local HF directory, for any family the registry
knows (shared/models/registry.py); its config is read by shared/model_config.py.

Weights come back under Hugging Face names in torch layout (the family's own names for norms,
Llama's for the projections: a family with fused checkpoint tensors has them cut by its ``split``),
so the worker's model and any HF comparison see the same tensors. GGUF tensors are named back
through gguf-py's own name tables, dequantized bit for bit as gguf's own code does, llama.cpp's
rotary row permutation of Q/K is undone where its converter made one (the inverse of
convert_hf_to_gguf.py's ``permute``), and norms it stored as ``1 + w`` (Gemma) are given back as
``w``.
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
from typing import Any

import numpy as np
import torch

from kvflow.kernels import cpu_quant
from kvflow.kernels.cpu_quant import BLOCK_BYTES, TYPE_NAMES, QuantWeight
from kvflow.kernels.fp8_linear import Fp8Weight, quantize_fp8
from kvflow.shared.gguf_header import read_header, read_tensors
from kvflow.shared.model_source import ModelSource
from kvflow.shared.models.config import ModelConfig
from kvflow.shared.models.family import LINEARS, Family
from kvflow.shared.models.registry import family
from kvflow.shared.quantized_checkpoints import checkpoint_method, quantization_config, read_layer

__all__ = ["load_weights", "round_weights"]

log = logging.getLogger("kvflow.model")


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
    """A GGUF tensor as fp32 of ``shape``: F32/F16 copied (the file is mapped read-only), a
    block type kvflow's kernels read decoded by them (kernels/cpu_quant.py: bit for bit gguf-py's
    values, tests/unit/test_kernels_cpu_quant.py and test_kernels_kquants.py, on every core:
    SmolLM2's 211 Q4_1/Q8_0 tensors in 0.36 s instead of 2.4 s), any other by gguf-py."""
    from gguf.quants import dequantize

    qtype = int(t.tensor_type)
    if t.tensor_type.name in ("F32", "F16"):
        arr = np.array(t.data, dtype=np.float32)
    elif qtype in BLOCK_BYTES and cpu_quant.available():
        rows = (math.prod(shape[:-1]), shape[-1])
        return QuantWeight.from_gguf(t.data, qtype, rows).dequantize().reshape(shape)
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
