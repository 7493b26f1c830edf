"""Linear-layer weights pre-packed for the CPU GEMM path of the worker: in kvflow's own panels
(``PanelWeight``, where the CPU has AVX2 and FMA) or for oneDNN (``PackedWeight``, elsewhere).

``PanelWeight`` keeps the weight as k-major panels of 24 outputs, multiplied by the 4 x 24
register-blocked FMA kernel of csrc/quant_matmul_cpu.c (the one that also serves quantized
weights' long chunks). Each output is one FMA chain over k in order, so a row's bits depend on
nothing else in the call: batch invariant for any row count, with nothing to calibrate, and the
same bits whether a token is decoded or part of a prefill chunk. Measured on this project's
2-core AMD EPYC against oneDNN on SmolLM2's layers: ~2x the rate at 16 rows, the same at 1 row
(where the bytes set the time); docs/benchmarks.md has the figures.

torch's default CPU GEMM is MKL, which re-packs the weight on every call and, on AMD CPUs,
takes slower code paths; oneDNN (also inside torch) keeps the weight in its own blocked layout
and JIT-compiles kernels for the CPU it runs on. Measured on this project's 2-core AMD EPYC
with SmolLM2's cold weights: whole decode steps 10-27 % faster, the 49152-row lm_head 2.5x
faster at small batches (docs/benchmarks.md). Results differ from MKL's in the last bits (a
different summation order), as any two GEMMs do; batch invariance is calibrated against the
GEMM actually used (kernels/batch_invariance.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import cpu_quant

PANEL = 24  # outputs per panel (the kernel's register block)


def onednn_available() -> bool:
    return torch.backends.mkldnn.is_available()


class PackedWeight:
    """A linear weight ``[N, K]`` in oneDNN's layout; ``w(x)`` is ``x @ weight.T`` for a
    contiguous fp32 ``x`` ``[M, K]``, returning a dense ``[M, N]``."""

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dim() != 2 or weight.dtype != torch.float32:
            raise ValueError("PackedWeight takes a 2-D fp32 weight")
        self.packed = weight.contiguous().to_mkldnn()
        self.shape = tuple(weight.shape)

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes held (fp32 in oneDNN's layout)."""
        return self.shape[0] * self.shape[1] * 4

    @property
    def in_features(self) -> int:
        return self.shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), self.packed, None).to_dense()

    def __repr__(self) -> str:
        return f"PackedWeight{self.shape}"


def panel_available() -> bool:
    """Whether the panel kernel runs here (AVX2, FMA and F16C, and a C compiler)."""
    return cpu_quant.panel_available()


class Bf16Weight:
    """A linear weight ``[N, K]`` held in bfloat16 for ``--dtype bfloat16`` on the CPU: ``w(x)``
    rounds ``x`` to bf16 and runs oneDNN's bf16 GEMM (AVX512_BF16 or AMX dot products where the
    CPU has them, fp32 sums), returning fp32 ``[M, N]``. Half the bytes of fp32 and, on this
    project's AMD EPYC (avx512_bf16), 2-3x the fp32 panels' rate from 16 rows on. Not batch
    invariant by construction (the worker calibrates its row layout, kernels/batch_invariance.py);
    a single row goes through as two, since oneDNN's one-row path gives other bits (seen for a
    576 x 1536 weight in 6 % of random inputs, once rounded to bf16) than its GEMMs of 2-64
    rows, which agreed in every trial.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError("Bf16Weight takes a 2-D floating-point weight")
        self.weight = weight.to(torch.bfloat16).contiguous()
        self.shape = tuple(weight.shape)

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        xb = x.to(torch.bfloat16)
        if xb.shape[0] == 1:  # oneDNN's one-row GEMV sums in another order than its GEMMs:
            return F.linear(xb.expand(2, -1).contiguous(), self.weight)[:1].float()  # 2 rows
        return F.linear(xb, self.weight).float()

    def __repr__(self) -> str:
        return f"Bf16Weight{self.shape}"


def bf16_instructions() -> bool:
    """Whether oneDNN has bf16 dot products here (AVX512_BF16 or AMX); elsewhere its bf16
    GEMM converts to fp32 and runs slower than the fp32 panels."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def linear_packing(dtype: torch.dtype) -> tuple[type, str]:
    """How the CPU path holds dense linear weights for a model served in ``dtype``, and its
    name for the log: bf16 -> ``Bf16Weight``; fp32 -> kvflow's panels where the panel kernel
    runs (batch invariant by construction), else oneDNN's fp32 layout."""
    if dtype == torch.bfloat16:
        return Bf16Weight, "oneDNN bf16"
    if dtype != torch.float32:
        raise ValueError(f"the CPU path computes in float32 or bfloat16, not {dtype}")
    return (PanelWeight, "panels") if panel_available() else (PackedWeight, "oneDNN")


class PanelWeight:
    """A linear weight ``[N, K]`` fp32 as panels ``[ceil(N / 24), K, 24]`` (zero past N);
    ``w(x)`` is ``x @ weight.T`` for fp32 ``x`` ``[M, K]``, batch invariant for any M."""

    batch_invariant = True  # kernels/batch_invariance.py: nothing to calibrate

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dim() != 2 or weight.dtype != torch.float32:
            raise ValueError("PanelWeight takes a 2-D fp32 weight")
        n, k = weight.shape
        tiles = -(-n // PANEL)
        padded = torch.zeros(tiles * PANEL, k, dtype=torch.float32)
        padded[:n] = weight
        self.panels = padded.view(tiles, PANEL, k).transpose(1, 2).contiguous()
        self.shape = (n, k)

    @property
    def nbytes(self) -> int:
        """Bytes held (the panels, zero-padded to a multiple of 24 outputs)."""
        return self.panels.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        n, k = self.shape
        if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
            raise ValueError(f"x must be fp32 [M, {k}], got {x.dtype} {tuple(x.shape)}")
        x = x if x.stride(1) == 1 else x.contiguous()
        m = x.shape[0]
        y = torch.empty(m, n, dtype=torch.float32)
        if m == 0:
            return y
        rc = cpu_quant.load().kvf_panel_matmul_f32(
            x.data_ptr(),
            m,
            k,
            x.stride(0),
            self.panels.data_ptr(),
            n,
            y.data_ptr(),
            n,
            torch.get_num_threads(),
        )
        if rc != 0:
            raise ValueError(f"kvf_panel_matmul_f32 refused its arguments ({rc})")
        return y

    def __repr__(self) -> str:
        return f"PanelWeight{self.shape}"
