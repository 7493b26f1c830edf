"""Linear-layer weights pre-packed for oneDNN, the CPU GEMM path of the worker.

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
    def in_features(self) -> int:
        return self.shape[1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch._C._nn.mkldnn_linear(x.contiguous().to_mkldnn(), self.packed, None).to_dense()

    def __repr__(self) -> str:
        return f"PackedWeight{self.shape}"
