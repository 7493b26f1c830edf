"""Linear-layer weights pre-packed for the CPU GEMM path of the worker: in kvflow's own panels
(``PanelWeight``, where the CPU has AVX2 and FMA) or for oneDNN (``PackedWeight``, elsewhere);
for ``--dtype bfloat16``, in kvflow's bf16 panels (``Bf16PanelWeight``, where the CPU has
AVX-512: AVX512_BF16's instruction, or its products emulated) or for oneDNN's bf16 GEMM
(``Bf16Weight``, elsewhere).

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

import ctypes
from functools import cache
from pathlib import Path

import torch
import torch.nn.functional as F

from kvflow.kernels import cpu_native, cpu_quant

PANEL = 24  # outputs per panel (the kernel's register block)
BF16_PANEL = 32  # outputs per bf16 panel (csrc/bf16_matmul_cpu.c)
_BF16_SRC = Path(__file__).parent / "csrc" / "bf16_matmul_cpu.c"
# the sums keep their written order: no -ffast-math, no contraction the source does not write
_BF16_FLAGS = ["-O3", "-march=native", "-fPIC", "-ffp-contract=off", f"-I{cpu_native.CSRC}", "-c"]


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


def head_packing(dtype: torch.dtype) -> type:
    """How the CPU path holds the lm_head for a model served in ``dtype``: in bf16 panels where
    the linear layers use them (their outputs are fp32 sums, so near ties between the top
    logits stay apart, as vLLM also computes the head in the model's dtype), else for fp32: a
    bf16 GEMM through oneDNN rounds its outputs to 8 significant bits, which turns a near tie
    between the top logits into an exact one."""
    kind = linear_packing(dtype)[0]
    return kind if kind is Bf16PanelWeight else linear_packing(torch.float32)[0]


def panel_available() -> bool:
    """Whether the panel kernel runs here (AVX2, FMA and F16C, and a C compiler)."""
    return cpu_quant.panel_available()


def _panel_product(
    fn: ctypes._CFuncPtr, panels: torch.Tensor, shape: tuple[int, int], x: torch.Tensor
) -> torch.Tensor:
    """``x @ W.T`` for fp32 ``x`` ``[M, K]`` (rows with a stride of their own allowed) through a
    panel kernel ``fn(x, M, K, x_stride, panels, N, y, y_stride, threads)``; fp32 ``[M, N]``."""
    x, y = cpu_quant.product_operands(x, shape)
    (m, n), k = y.shape, shape[1]
    if m == 0:
        return y
    rc = fn(x.data_ptr(), m, k, x.stride(0), panels.data_ptr(), n, y.data_ptr(), n,
            torch.get_num_threads())  # fmt: skip
    if rc != 0:
        raise ValueError(f"{fn.__name__} refused its arguments ({rc})")
    return y


@cache
def _bf16_kernel() -> ctypes.CDLL | None:
    """csrc/bf16_matmul_cpu.c built for this CPU, or None where it cannot be built or the CPU
    has no AVX-512 (the build then has no kernel)."""
    lib = cpu_native.load_kernels(_BF16_SRC, _BF16_FLAGS)
    if lib is None:
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.kvf_bf16_available.restype = i
    lib.kvf_bf16_panel_matmul.restype = i
    lib.kvf_bf16_panel_matmul.argtypes = [p, i, i, i, p, i, p, i, i]
    return lib if lib.kvf_bf16_available() else None


def bf16_panel_native() -> bool:
    """Whether the bf16 panels run on AVX512_BF16's own instruction (not emulated)."""
    lib = _bf16_kernel()
    return lib is not None and lib.kvf_bf16_available() == 2


def bf16_panel_available() -> bool:
    """Whether kvflow's bf16 panel kernel runs here (AVX-512 and a C compiler: AVX512_BF16's
    vdpbf16ps, or the same products emulated with fp32 fmas where the CPU lacks it)."""
    return _bf16_kernel() is not None


def _zero_padded(weight: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``weight`` contiguous and zero-padded to ``[rows, cols]``: itself when it already is
    (the panels' transposing copy is then the only one made; a zero-filled buffer written
    over was a second pass over every weight at start-up)."""
    n, k = weight.shape
    if (n, k) != (rows, cols):
        return F.pad(weight, (0, cols - k, 0, rows - n))
    return weight.contiguous()


class Bf16PanelWeight:
    """A linear weight ``[N, K]`` in bfloat16 panels ``[ceil(N / 32), ceil(K / 2), 32, 2]`` (zero
    past N and K) for ``--dtype bfloat16`` on the CPU: ``w(x)`` rounds fp32 ``x`` ``[M, K]`` to
    bf16 and returns ``x @ weight.T`` with fp32 sums as fp32 ``[M, N]`` (not rounded to bf16).
    AVX512_BF16's ``vdpbf16ps`` takes a pair of k for 16 outputs per instruction, so every output
    is one chain over k pairs in order: batch invariant for any M, nothing to calibrate."""

    batch_invariant = True  # kernels/batch_invariance.py: nothing to calibrate

    def __init__(self, weight: torch.Tensor) -> None:
        if weight.dim() != 2 or not weight.is_floating_point():
            raise ValueError("Bf16PanelWeight takes a 2-D floating-point weight")
        n, k = weight.shape
        tiles, pairs = -(-n // BF16_PANEL), -(-k // 2)
        padded = _zero_padded(weight.to(torch.bfloat16), tiles * BF16_PANEL, pairs * 2)
        self.panels = padded.view(tiles, BF16_PANEL, pairs, 2).transpose(1, 2).contiguous()
        self.shape = (n, k)

    @property
    def nbytes(self) -> int:
        """Bytes held (the panels, zero-padded to 32 outputs and an even K)."""
        return self.panels.numel() * 2

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        lib = _bf16_kernel()
        if lib is None:  # a wrong x is refused as such first, on any CPU
            cpu_quant.product_operands(x, self.shape)
            raise RuntimeError("the bf16 panel kernel is not available on this CPU")
        return _panel_product(lib.kvf_bf16_panel_matmul, self.panels, self.shape, x)

    def __repr__(self) -> str:
        return f"Bf16PanelWeight{self.shape}"


class Bf16Weight:
    """A linear weight ``[N, K]`` held in bfloat16 for ``--dtype bfloat16`` on a CPU without
    AVX-512 (``Bf16PanelWeight`` elsewhere): ``w(x)``
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
    name for the log: bf16 -> kvflow's bf16 panels where the CPU has AVX-512, else
    ``Bf16Weight`` (oneDNN); fp32 -> kvflow's panels where the panel kernel runs (batch
    invariant by construction), else oneDNN's fp32 layout."""
    if dtype == torch.bfloat16:
        if bf16_panel_available():
            return Bf16PanelWeight, "bf16 panels"
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
        padded = _zero_padded(weight, tiles * PANEL, k)
        self.panels = padded.view(tiles, PANEL, k).transpose(1, 2).contiguous()
        self.shape = (n, k)

    @property
    def nbytes(self) -> int:
        """Bytes held (the panels, zero-padded to a multiple of 24 outputs)."""
        return self.panels.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return _panel_product(cpu_quant.load().kvf_panel_matmul_f32, self.panels, self.shape, x)

    def __repr__(self) -> str:
        return f"PanelWeight{self.shape}"
