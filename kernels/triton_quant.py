"""Quantized linear weights on the GPU: the device path's ``--quantization gguf | int8 | gptq |
awq`` (weight-only: 8- or 4-bit integers in groups of 32 with an fp16 scale, activations in the
model's dtype), one Triton kernel that reads the integers where they lie and dequantizes each
tile in registers just before its ``tl.dot``.

The CPU path keeps GGUF's interleaved blocks (kernels/cpu_quant.py ``QuantWeight``); at load
the device path splits each block into planes the kernel can load with plain strided reads
(``DeviceQuantWeight.from_blocks``): the integers (int8 [N, K] for Q8_0, or two nibbles a byte
[N, K / 2] in GGUF's order: byte i of a group holds element i low and element i + 16 high),
the fp16 scale ``d`` [N, K / 32], the integer zero point ``z`` [N, K / 32] (8 for Q4_0, the
group's own for GPTQ/AWQ's Q4_Z) and, for Q4_1, the fp16 offset ``m``. A weight is then
``d * (q - z) + m``, decoded exactly as the CPU kernels decode it (in fp32: at most 19
significant bits), and rounded to the activations' dtype for the dot, as a dense weight of that
dtype would be. Q4 weights move ~0.6 bytes per weight against 2 for bf16: a decode step, which
reads every weight once, reads ~3x fewer bytes.

Without a GPU the kernel runs on CPU tensors in Triton's interpreter (TRITON_INTERPRET=1), which
is how tests/kernels checks it against dequantize-then-matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvflow.kernels.cpu_quant import QK, QuantWeight
from kvflow.kernels.quant_planes import UNIT_TYPES, unit_planes


@triton.jit
def _quant_matmul_kernel(
    X,  # [M, K] activations
    Q,  # int8 [N, K] (BITS 8) or uint8 [N, K / 2] (BITS 4, GGUF nibble order per group)
    D,  # fp16 or fp32 [N, K / GROUP] scales
    Z,  # uint8 [N, K / GROUP] zero points (BITS 4 only)
    Mn,  # fp16 or fp32 [N, K / GROUP] offsets (HAS_MIN only)
    Y,  # [M, N]
    M,
    N,
    K,
    stride_xm,
    stride_q,
    stride_g,
    stride_ym,
    BITS: tl.constexpr,
    GROUP: tl.constexpr,
    HAS_MIN: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(
            X + rm[:, None].to(tl.int64) * stride_xm + rk[None, :],
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        wmask = k_ok[:, None] & n_ok[None, :]
        row = rn[None, :].to(tl.int64)
        group = rk // GROUP
        g_off = row * stride_g + group[:, None]
        d = tl.load(D + g_off, mask=wmask, other=0.0).to(tl.float32)
        if BITS == 8:
            q = tl.load(Q + row * stride_q + rk[:, None], mask=wmask, other=0).to(tl.float32)
            w = d * q
        else:  # nibbles in groups of 32 (GROUP 32)
            j = rk % 32
            byte = tl.load(Q + row * stride_q + (group * 16 + j % 16)[:, None], mask=wmask, other=0)
            nib = (byte.to(tl.int32) >> ((j // 16) * 4)[:, None]) & 15
            z = tl.load(Z + g_off, mask=wmask, other=0).to(tl.int32)
            w = d * (nib - z).to(tl.float32)
        if HAS_MIN:
            w = w + tl.load(Mn + g_off, mask=wmask, other=0.0).to(tl.float32)
        wt = w.to(X.dtype.element_ty)  # [BLOCK_K, BLOCK_N]
        if IEEE:
            acc += tl.dot(x, wt, input_precision="ieee")
        else:
            acc += tl.dot(x, wt)
    tl.store(
        Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :],
        acc.to(Y.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


@dataclass(eq=False)
class DeviceQuantWeight:
    """An [N, K] linear weight as integer planes for ``_quant_matmul_kernel`` (see the module
    docstring); ``w(x) == x @ W.T`` (the ``kernels.reference.Weight`` protocol)."""

    q: torch.Tensor
    d: torch.Tensor
    z: torch.Tensor | None
    m: torch.Tensor | None
    bits: int
    shape: tuple[int, int]
    type_name: str
    group: int = QK  # weights per scale (Q6_K: 16)

    @classmethod
    def from_blocks(cls, w: QuantWeight, device: torch.device | str) -> DeviceQuantWeight:
        """``w``'s blocks split into planes on ``device`` (the values unchanged)."""
        if w.type_name in UNIT_TYPES:
            return cls(*unit_planes(w, device))
        n, k = w.shape
        nb = k // QK
        blk = w.blocks.view(n, nb, -1)
        d = blk[:, :, 0:2].contiguous().view(torch.float16).view(n, nb)
        z = m = None
        kind = w.type_name
        if kind == "Q8_0":
            q, bits = blk[:, :, 2:34].contiguous().view(torch.int8).view(n, k), 8
        else:
            start = 2 if kind == "Q4_0" else 4
            q, bits = blk[:, :, start : start + 16].reshape(n, k // 2), 4
            if kind == "Q4_0":
                z = torch.full((n, nb), 8, dtype=torch.uint8)
            elif kind == "Q4_Z":
                z = blk[:, :, 2].contiguous()
            else:  # Q4_1: d * q + m
                z = torch.zeros(n, nb, dtype=torch.uint8)
                m = blk[:, :, 2:4].contiguous().view(torch.float16).view(n, nb)

        def put(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.contiguous().to(device)

        return cls(put(q), put(d), put(z), put(m), bits, (n, k), kind)

    @staticmethod
    def cat(parts: list[DeviceQuantWeight]) -> DeviceQuantWeight:
        """Outputs stacked (fused QKV or gate/up), when all share one block type and K."""
        first = parts[0]
        if any(p.type_name != first.type_name or p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("only weights of one quantization type and K can be fused")

        def cat(ts: list[torch.Tensor | None]) -> torch.Tensor | None:
            return None if ts[0] is None else torch.cat(ts)

        q = torch.cat([p.q for p in parts])
        return DeviceQuantWeight(
            q,
            torch.cat([p.d for p in parts]),
            cat([p.z for p in parts]),
            cat([p.m for p in parts]),
            first.bits,
            (q.shape[0], first.shape[1]),
            first.type_name,
            first.group,
        )

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in (self.q, self.d, self.z, self.m) if t is not None
        )

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight as ``dtype`` [N, K] (torch ops; for references and tests)."""
        n, k = self.shape
        d = self.d.float().repeat_interleave(self.group, dim=1)
        if self.bits == 8:
            w = d * self.q.float()
        else:
            q = self.q.view(n, k // QK, QK // 2)
            nib = torch.cat([q & 15, q >> 4], dim=2).view(n, k).float()
            w = d * (nib - self.z.float().repeat_interleave(QK, dim=1))
        if self.m is not None:
            w = w + self.m.float().repeat_interleave(self.group, dim=1)
        return w.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.shape
        if x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"x must be [M, {k}], got {tuple(x.shape)}")
        x = x if x.stride(1) == 1 else x.contiguous()
        mrows = x.shape[0]
        y = torch.empty(mrows, n, dtype=x.dtype, device=x.device)
        if mrows == 0:
            return y
        block_m = 16 if mrows <= 16 else 64
        # 4-bit tiles decode nibbles, zero points and scales per element: at 64 x 64 Triton
        # 3.6 spills them on sm_90 (tests/kernels' compile check); 32 deep keeps them in registers
        block_n, block_k = 64, (64 if self.bits == 8 else 32)
        grid = (triton.cdiv(mrows, block_m), triton.cdiv(n, block_n))
        dummy = self.d  # a tensor for the planes a type does not have (never read)
        _quant_matmul_kernel[grid](
            x,
            self.q,
            self.d,
            self.z if self.z is not None else dummy,
            self.m if self.m is not None else dummy,
            y,
            mrows,
            n,
            k,
            x.stride(0),
            self.q.stride(0),
            self.d.stride(0),
            y.stride(0),
            BITS=self.bits,
            GROUP=self.group,
            HAS_MIN=self.m is not None,
            IEEE=x.dtype == torch.float32,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            num_warps=4,
        )
        return y
