"""GPTQ and AWQ 4-bit checkpoints' packed tensors (which method a checkpoint has:
shared/quantized_checkpoints.py), read as vLLM reads them, into the CPU kernel's blocks.

Both formats store, per linear layer ``X``, 4-bit weights ``q`` packed eight to an int32, one
fp16 scale and one 4-bit zero point per group of ``group_size`` input channels and output
feature, and dequantize as ``w = scale * (q - zero)``:

- GPTQ (AutoGPTQ / GPTQModel, ``checkpoint_format`` "gptq"): ``X.qweight`` int32 [K / 8, N],
  packed along the input dimension (input ``k`` in bits ``4 * (k % 8)`` of row ``k // 8``);
  ``X.qzeros`` int32 [G, N / 8], packed along the output dimension, holding ``zero - 1`` (the
  v1 format's offset; "gptq_v2" stores ``zero``); ``X.scales`` fp16 [G, N]; ``X.g_idx`` int32
  [K], the group of each input channel (``k // group_size`` unless quantized with act-order).
- AWQ (AutoAWQ GEMM): ``X.qweight`` int32 [K, N / 8] and ``X.qzeros`` int32 [G, N / 8], both
  packed along the output dimension in AutoAWQ's order (nibble ``i`` of word ``c`` holds output
  ``8 c + (0, 2, 4, 6, 1, 3, 5, 7)[i]``); ``X.scales`` fp16 [G, N].

Each group becomes ``group_size / 32`` blocks of kvflow's ``Q4_Z`` type (fp16 d, uint8 z, 16
nibble bytes: kernels/cpu_quant.py), read in place by the same CPU kernels as GGUF's blocks, so
nothing is rounded again: the kernel's ``d * (q - z)`` is the checkpoint's weight exactly (in
fp32). Layers whose groups cannot be cut into 32-channel blocks (act-order ``g_idx``, a group
size that is not a multiple of 32) are dequantized to fp32 instead, with a log line.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from kvflow.kernels.cpu_quant import Q4_Z, QK, QuantWeight
from kvflow.shared.quantized_checkpoints import quantization_config

log = logging.getLogger("kvflow.model")

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a packed word holds output 8c + order[i]


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R * 8, C]: nibble i of row r becomes row 8 r + i."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    q = (packed.to(torch.int32)[:, None, :] >> shifts[None, :, None]) & 0xF
    return q.reshape(-1, packed.shape[1]).to(torch.uint8)


def _unpack_cols(packed: torch.Tensor, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """int32 [R, C] -> uint8 [R, C * 8]: nibble i of word c becomes column 8 c + order[i]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    q = (packed.to(torch.int32)[:, :, None] >> shifts[None, None, :]) & 0xF  # [R, C, 8]
    if order is not None:
        q = q[:, :, torch.tensor([order.index(j) for j in range(8)])]
    return q.reshape(packed.shape[0], -1).to(torch.uint8)


def unpack(
    method: str, tensors: dict[str, torch.Tensor], qcfg: dict[str, Any]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One layer's ``qweight``/``qzeros``/``scales`` (and GPTQ's ``g_idx``) as ``q`` uint8
    [N, K], ``zeros`` int [G, N], ``scales`` fp16 [G, N] and the group of each input channel
    ``g_idx`` [K]."""
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    if method == "gptq":
        q = _unpack_rows(qweight).t()  # [N, K]
        zeros = _unpack_cols(qzeros).to(torch.int32)
        if str(qcfg.get("checkpoint_format", "gptq")).lower() != "gptq_v2":
            zeros = zeros + 1
    else:
        q = _unpack_cols(qweight, _AWQ_ORDER).t()
        zeros = _unpack_cols(qzeros, _AWQ_ORDER).to(torch.int32)
    n, k = q.shape
    g = scales.shape[0]
    zeros = zeros[:, :n]
    if scales.shape != (g, n) or zeros.shape != (g, n) or k % g:
        raise ValueError(f"qweight {tuple(qweight.shape)} / scales {tuple(scales.shape)} mismatch")
    g_idx = tensors.get("g_idx")
    if g_idx is None:
        g_idx = torch.arange(k) // (k // g)
    return q.contiguous(), zeros, scales.to(torch.float16), g_idx.to(torch.long)


def dequantize(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor
) -> torch.Tensor:
    """The fp32 weight [N, K] = scale * (q - zero), each input channel in its group (exact)."""
    z = zeros.t()[:, g_idx].float()  # [N, K]
    s = scales.t()[:, g_idx].float()
    return s * (q.float() - z)


def to_blocks(
    q: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor
) -> QuantWeight | None:
    """The weight as Q4_Z blocks, or None when a 32-channel block would span two groups."""
    n, k = q.shape
    if k % QK:
        return None
    block_group = g_idx.view(-1, QK)
    if not bool((block_group == block_group[:, :1]).all()):
        return None  # act-order, or groups not a multiple of 32 channels
    grp = block_group[:, 0]  # [K / 32]
    if not bool((zeros >= 0).all() and (zeros <= 255).all()):
        return None
    nb = k // QK
    d = scales.t()[:, grp].contiguous().view(torch.uint8).view(n, nb, 2)  # fp16 bytes
    z = zeros.t()[:, grp].to(torch.uint8).view(n, nb, 1)
    qq = q.view(n, nb, 2, QK // 2)
    nib = qq[:, :, 0] | (qq[:, :, 1] << 4)  # byte i: element i low, element i + 16 high
    blocks = torch.cat([d, z, torch.zeros_like(z), nib], dim=2).reshape(n, nb * 20)
    return QuantWeight(blocks.contiguous(), Q4_Z, (n, k))


def read_layer(
    method: str, tensors: dict[str, torch.Tensor], qcfg: dict[str, Any], keep: bool
) -> torch.Tensor | QuantWeight:
    """One quantized linear layer: Q4_Z blocks when ``keep`` (the CPU kernels serve it) and its
    groups allow, else the dequantized fp32 weight."""
    q, zeros, scales, g_idx = unpack(method, tensors, qcfg)
    if keep:
        w = to_blocks(q, zeros, scales, g_idx)
        if w is not None:
            return w
        log.warning(
            "a %s layer %s has groups that are not whole 32-channel blocks (act-order or group "
            "size %s): dequantized to fp32",
            method,
            tuple(q.shape),
            qcfg.get("group_size"),
        )
    return dequantize(q, zeros, scales, g_idx)


def read_layers(
    weights: dict[str, torch.Tensor], method: str, path: Path, keep: bool, dtype: torch.dtype
) -> dict[str, torch.Tensor | QuantWeight]:
    """A GPTQ/AWQ checkpoint's packed layers as ``X.weight``: Q4_Z blocks when ``keep``
    (``--quantization gptq|awq``, the CPU path), else dequantized to ``dtype``; the other
    tensors as they are."""
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
