"""A decoder's weights (services/worker/model.py), read from a GGUF file
(services/worker/gguf_weights.py) or a local HF directory's safetensors (GPTQ/AWQ packed layers
read by services/worker/gptq_awq.py), for any family the registry knows (shared/models/
registry.py; its config is read by shared/model_config.py), and rounded or marked as
``--quantization`` asks (``round_weights``).

Weights come back under Hugging Face names in torch layout (the family's own names for norms,
Llama's for the projections: a family with fused or renamed checkpoint tensors has them cut by
its ``split``), so the worker's model and any HF comparison see the same tensors.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch

from kvflow.kernels.cpu_quant import QuantWeight
from kvflow.kernels.fp8_linear import Fp8Weight, quantize_fp8
from kvflow.services.worker.gguf_weights import gguf_weights
from kvflow.services.worker.gptq_awq import read_layers
from kvflow.shared.model_source import ModelSource
from kvflow.shared.models.config import ModelConfig
from kvflow.shared.models.family import LINEARS
from kvflow.shared.models.registry import family
from kvflow.shared.quantized_checkpoints import checkpoint_method

__all__ = ["load_weights", "round_weights"]

log = logging.getLogger("kvflow.model")


def load_weights(
    src: ModelSource, cfg: ModelConfig, dtype: torch.dtype = torch.float32, quantization: str = ""
) -> dict[str, torch.Tensor | QuantWeight | Fp8Weight]:
    """All weights under HF names (see the module docstring), as ``dtype`` (``lm_head.weight``
    only if untied, or as the embedding's quantized copy when quantized). ``quantization``:
    ``"gguf"`` keeps a GGUF's Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K linear weights
    in their blocks (``kernels.cpu_quant.QuantWeight``); ``"int8"`` rounds every linear weight
    to int8 blocks (``quantize_int8``); ``"fp8"`` rounds the layers' linear weights to e4m3 per
    output channel (kernels/fp8_linear.py); ``"gptq"`` / ``"awq"`` keep such a checkpoint's
    4-bit groups as Q4_Z blocks (otherwise its packed layers are dequantized:
    services/worker/gptq_awq.py). ``"gguf-a8"`` keeps them so too, to be multiplied with int8
    activations. The embedding stays dense for lookups, except under ``"gguf"``/``"gguf-a8"``:
    there it stays in its blocks (rows decoded as they are looked up; a tied head reads the
    same blocks). ValueError names a missing or unexpected tensor."""
    t0 = time.perf_counter()
    fam = family(cfg.family)
    if src.kind == "gguf":
        if fam.gguf is None:
            raise ValueError(f"{src.path}: kvflow reads no GGUF of {fam.name}")
        weights = gguf_weights(
            src.path, cfg, fam, dtype, quantized=quantization in ("gguf", "gguf-a8")
        )
    else:
        weights = _hf_weights(src.path, dtype)
        method = checkpoint_method(src.path)
        if method:
            weights = read_layers(weights, method, src.path, quantization == method, dtype)
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


def to_device_weight(
    w: torch.Tensor | QuantWeight | Fp8Weight, device: torch.device, name: str = ""
) -> Any:
    """A loaded weight as the device path computes with it on ``device``: dense tensors moved,
    integer blocks split into the Triton kernel's planes (an embedding's blocks decoded: the
    device looks rows up in a dense table), fp8 weights moved."""
    if isinstance(w, QuantWeight) and name == "model.embed_tokens.weight":
        return w.dequantize().to(device)
    if isinstance(w, QuantWeight):
        from kvflow.kernels.triton_quant import DeviceQuantWeight

        return DeviceQuantWeight.from_blocks(w, device)
    return w.to(device)


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
                # GPTQ/AWQ packed ints and fp16 scales stay as stored (gptq_awq.read_layers)
                keep = not v.is_floating_point() or k.endswith(".scales")
                out[k] = v if keep else v.to(dtype)
    return out
