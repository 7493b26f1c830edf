"""A GGUF file's weights for the worker (services/worker/model_loader.py): tensors named back to
Hugging Face names through gguf-py's own name tables, dequantized bit for bit as gguf's own code
does (kvflow's kernels where they read the block type) or kept in their blocks
(``--quantization gguf``), llama.cpp's rotary row permutation of Q/K undone where its converter
made one (the inverse of convert_hf_to_gguf.py's ``permute``), norms it stored as ``1 + w``
(Gemma) given back as ``w``, and every expert of a stacked mixture-of-experts tensor cut out."""

from __future__ import annotations

import functools
import logging
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvflow.kernels import cpu_quant
from kvflow.kernels.cpu_quant import BLOCK_BYTES, TYPE_NAMES, QuantWeight
from kvflow.shared.gguf_header import read_header, read_tensors
from kvflow.shared.models.config import ModelConfig
from kvflow.shared.models.family import LINEARS, Family

log = logging.getLogger("kvflow.model")


@functools.cache
def _gguf_names(arch: str, num_layers: int, layer: tuple[str, ...]) -> dict[str, str]:
    """GGUF tensor name -> HF name of the model's tensors and of each layer's ``layer`` tensors
    (the first of these a GGUF name maps to wins), from gguf-py's own tables."""
    from gguf import MODEL_ARCH, MODEL_ARCH_NAMES, get_tensor_name_map

    code = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch and k in MODEL_ARCH)
    table = get_tensor_name_map(code, num_layers)
    hf = ["model.embed_tokens", "model.norm", "lm_head"]
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
    values, tests/unit/kernels/test_kernels_cpu_quant.py and test_kernels_kquants.py, on every core:
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


def gguf_weights(
    path: Path, cfg: ModelConfig, fam: Family, dtype: torch.dtype, quantized: bool = False
) -> dict[str, torch.Tensor | QuantWeight]:
    """A GGUF's tensors under HF names (the family's own where its checkpoints have their own:
    its ``split`` cuts them), dequantized to ``dtype``, or, when ``quantized``, the linear
    weights (and the embedding) kept in the blocks kvflow's kernels read."""
    assert fam.gguf is not None
    log.info("reading %s", path.name)
    header = read_header(path)
    arch = header.fields.get("general.architecture", "llama")
    layer = (*fam.checkpoint_names, *LINEARS, *fam.norms.values())
    names = _gguf_names(arch, cfg.num_layers, layer)
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
        keep = quantized and int(t.tensor_type) in BLOCK_BYTES and len(shape) == 2
        if keep:  # the embedding too: looked up row by row; a tied head reads the same blocks
            w: torch.Tensor | QuantWeight = QuantWeight.from_gguf(t.data, int(t.tensor_type), shape)
        else:
            w = _gguf_dense(t, shape)
            if fam.gguf.norm_offset and name.endswith("norm.weight"):
                w = w - fam.gguf.norm_offset  # stored as offset + w; the model adds it back
            w = w.to(dtype).contiguous()
        # the converter permutes the Q/K biases (attention_bias) as their weights' rows
        if fam.gguf.permute_qk and name.endswith(("self_attn.q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, cfg.num_heads)
        elif fam.gguf.permute_qk and name.endswith(("self_attn.k_proj.weight", "k_proj.bias")):
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
