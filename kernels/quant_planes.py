"""GGUF's Q5_0, Q5_1 and K-quant blocks (Q4_K, Q5_K, Q6_K) as the planes the device path's
Triton kernel reads (kernels/triton_quant.py): integers, a scale per group and, where the type
has one, an offset per group, so that ``w = d * q (+ m)`` (4-bit: ``d * (q - z) + m``) is
exactly gguf-py's dequantized value in fp32:

- Q5_0: int8 ``q - 16``, fp16 ``d`` per 32;  Q5_1: int8 ``q``, fp16 ``d`` and ``m`` per 32;
- Q4_K: nibbles (GGUF's 32-group order), fp32 ``d * sc`` and ``-(dmin * m)`` per 32, z = 0;
- Q5_K: int8 ``q``, fp32 ``d * sc`` and ``-(dmin * m)`` per 32;
- Q6_K: int8 ``q - 32``, fp32 ``d * sc`` per 16.

The sub-block scales are decoded once here, at load, in fp32 as gguf-py does (``d * sc`` and
``dmin * m`` are not fp16 numbers, hence fp32 planes); ``a + (-b)`` rounds as ``a - b``.
5- and 6-bit values take a byte each (1 byte per weight against Q5_K's 0.69: still half of
bf16's 2), Q4_K keeps its nibbles."""

from __future__ import annotations

from typing import Any

import torch

from kvflow.kernels.cpu_quant import BLOCK_WEIGHTS, QK, QuantWeight

UNIT_TYPES = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


def _fp16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 from the last axis' 2 bytes, as fp32."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """Bit i of the little-endian bytes ``b`` [..., count / 8] -> [..., count] (0 or 1)."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((b.unsqueeze(-1) >> shifts) & 1).reshape(*b.shape[:-1], count)


def _k4_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 6-bit scales and mins of K-quant super-blocks (12 bytes each, llama.cpp's
    get_scale_min_k4)."""
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc.float(), mn.float()


def _pack_nibbles(v: torch.Tensor) -> torch.Tensor:
    """4-bit values [n, k] -> bytes [n, k / 2] in GGUF's order per 32 (byte i: element i low,
    element i + 16 high)."""
    n, k = v.shape
    g = v.view(n, k // QK, 2, QK // 2)
    return (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, k // 2)


def unit_planes(w: QuantWeight, device: torch.device | str) -> tuple[Any, ...]:
    """``DeviceQuantWeight``'s fields (q, d, z, m, bits, shape, type_name, group) for ``w``."""
    n, k = w.shape
    kind = w.type_name
    nb = k // BLOCK_WEIGHTS[w.qtype]
    blk = w.blocks.view(n, nb, -1)
    z = m = None
    if kind in ("Q5_0", "Q5_1"):
        d = blk[:, :, 0:2].contiguous().view(torch.float16).view(n, nb)
        h = 4 if kind == "Q5_1" else 2
        hi = _bits(blk[:, :, h : h + 4], QK)
        qs = blk[:, :, h + 4 : h + 20]
        q = torch.cat([qs & 0x0F, qs >> 4], dim=-1) | (hi << 4)
        q = q.to(torch.int8) - (16 if kind == "Q5_0" else 0)
        if kind == "Q5_1":
            m = blk[:, :, 2:4].contiguous().view(torch.float16).view(n, nb)
        planes = (q.reshape(n, k), d, z, m, 8, 32)
    elif kind in ("Q4_K", "Q5_K"):
        dd, dmin = _fp16(blk[:, :, 0:2].unsqueeze(-2)), _fp16(blk[:, :, 2:4].unsqueeze(-2))
        sc, mn = _k4_scales(blk[:, :, 4:16])
        d = (dd * sc).reshape(n, nb * 8)  # fp32, as gguf-py
        m = -(dmin * mn).reshape(n, nb * 8)
        qs = blk[:, :, 16:] if kind == "Q4_K" else blk[:, :, 48:]
        g = qs.reshape(n, nb, 4, 32)  # bytes 32 g ..: sub-blocks 2 g (low) and 2 g + 1 (high)
        q = torch.stack([g & 0x0F, g >> 4], dim=3).reshape(n, nb, 8, 32)
        if kind == "Q4_K":
            z = torch.zeros(n, nb * 8, dtype=torch.uint8)
            planes = (_pack_nibbles(q.reshape(n, k)), d, z, m, 4, 32)
        else:
            hi = _bits(blk[:, :, 16:48], 256).view(n, nb, 32, 8).transpose(2, 3)  # bit j of byte i
            q = (q | (hi << 4)).to(torch.int8)
            planes = (q.reshape(n, k), d, z, m, 8, 32)
    elif kind == "Q6_K":
        ql, qh = blk[:, :, 0:128], blk[:, :, 128:192]
        sc = blk[:, :, 192:208].contiguous().view(torch.int8).float()
        dd = _fp16(blk[:, :, 208:210].unsqueeze(-2))
        chunks = []
        for c in range(8):  # 32 weights each: ql half and nibble, qh shift
            h, nib, half, shift = c // 4, (c // 2) % 2, c % 2, 2 * (c % 4)
            lo = (ql[:, :, 64 * h + 32 * half : 64 * h + 32 * half + 32] >> (4 * nib)) & 0x0F
            up = (qh[:, :, 32 * h : 32 * h + 32] >> shift) & 3
            chunks.append((lo | (up << 4)).to(torch.int8) - 32)
        q = torch.stack(chunks, dim=2)
        d = (dd * sc).reshape(n, nb * 16)
        planes = (q.reshape(n, k), d, z, m, 8, 16)
    else:
        raise ValueError(f"{kind} is not a unit type ({', '.join(UNIT_TYPES)})")
    q, d, z, m, bits, group = planes

    def put(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.contiguous().to(device)

    return put(q), put(d), put(z), put(m), bits, (n, k), kind, group
