"""Linear weights kept in GGUF's quantized blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and the K-quants
Q4_K, Q5_K, Q6_K) on the CPU (``--quantization gguf``), multiplied by
``csrc/quant_matmul_cpu.c`` where they lie.

A decode step reads every weight once, so its time is the bytes read: SmolLM2-135M is ~540 MB
in fp32 and ~96 MB in its GGUF's Q4_1 layers + Q8_0 embedding. ``QuantWeight(x)`` runs the
native rows kernel for up to ``PANEL_ROWS`` rows (decode tiles, short chunks): each row's
result is one fixed-order dot product per output, so it never depends on the batch, and the
weight is read once for all the call's rows (a 64-row decode tile reads it once, not four
times as 16-row tiles did). Longer
chunks (prefill), where compute rather than bytes sets the time, go to the panel kernel: each
tile of 24 outputs is decoded once into an fp32 panel in cache and multiplied by all the rows in
a register-blocked FMA kernel (~130 GFLOP/s on 2 AVX2 cores against ~90 for dequantizing the
whole weight and calling torch's GEMM, with no fp32 copy of the weight in memory). Both decode
exactly (``d * q (+ m)`` needs at most 19 bits); they differ from dequantize-then-matmul only in
the order of the sums. The choice is by the length of the call's own chunk: decode rows come in
tiles of at most ``PANEL_ROWS`` (kernels/batch_invariance.py), so a row's result never depends
on the batch.

``int8_activations`` (``--quantization w8a8``, as vLLM's CPU int8 W8A8 and llama.cpp compute):
each row of x is rounded to int8 per block of 32 (scale max|x| / 127) and multiplied with the
Q8_0/Q4_0 blocks' int8 values in integers (AVX-512 VNNI or AVX-VNNI ``vpdpbusd`` where the CPU
has it, AVX2's maddubs elsewhere, the same bits either way), for every chunk length. A decode
step's products then take ~4x fewer instructions than the fp32 FMAs; x loses ~0.4 % of each
block's largest value, which ``kvflow bench quality`` measures.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np
import torch

from kvflow.kernels import cpu_native

log = logging.getLogger("kvflow.kernels")

_SRC = Path(__file__).parent / "csrc" / "quant_matmul_cpu.c"
# no -ffast-math: the sums keep their written order (see the C file)
# no fused multiply-adds the source does not write (the decoders match gguf-py's rounding)
_COMPILE_FLAGS = [
    "-O3",
    "-march=native",
    "-fPIC",
    "-ffp-contract=off",
    f"-I{cpu_native.CSRC}",
    "-c",
]
QK = 32
Q4_Z = 1000  # kvflow's own block (no GGUF id): fp16 d, uint8 z, pad, 16 nibble bytes;
# w = d * (q - z), what GPTQ and AWQ groups are (shared/quantized_checkpoints.py)
QK_K = 256  # a K-quant's super-block
# GGMLQuantizationType value (or Q4_Z) -> bytes per block (of BLOCK_WEIGHTS weights)
BLOCK_BYTES = {8: 34, 2: 18, 3: 20, Q4_Z: 20, 6: 22, 7: 24, 12: 144, 13: 176, 14: 210}
TYPE_NAMES = {8: "Q8_0", 2: "Q4_0", 3: "Q4_1", Q4_Z: "Q4_Z", 6: "Q5_0", 7: "Q5_1", 12: "Q4_K",
              13: "Q5_K", 14: "Q6_K"}  # fmt: skip
BLOCK_WEIGHTS = {t: QK_K if t in (12, 13, 14) else QK for t in BLOCK_BYTES}
INT8_ACTIVATION_TYPES = (8, 2)  # Q8_0, Q4_0: blocks of int8 values (kvf_quant_matmul_int8)
PANEL_ROWS = 64  # more rows than this: the panel kernel (decode tiles never have more)


@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built (no compiler)."""
    lib = cpu_native.load_kernels(_SRC, _COMPILE_FLAGS)
    if lib is None:
        return None
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.kvf_quant_matmul.restype = i
    lib.kvf_quant_matmul.argtypes = [p, i, i, i, p, i, i, p, i, i]
    lib.kvf_quant_matmul_panel.restype = i
    lib.kvf_quant_matmul_panel.argtypes = [p, i, i, i, p, i, i, p, i, i]
    lib.kvf_panel_matmul_f32.restype = i
    lib.kvf_panel_matmul_f32.argtypes = [p, i, i, i, p, i, p, i, i]
    lib.kvf_dequantize.restype = i
    lib.kvf_quant_matmul_int8.restype = i
    lib.kvf_quant_matmul_int8.argtypes = [p, i, i, i, p, i, i, p, i, i]
    lib.kvf_quantize_rows_int8.restype = i
    lib.kvf_quantize_rows_int8.argtypes = [p, i, i, i, p, p]
    lib.kvf_dequantize.argtypes = [p, i, i, i, p, i]
    return lib


def available() -> bool:
    return load() is not None


def quantize_rows_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] fp32 as ``kvf_quant_matmul_int8`` rounds it: int8 [M, K] and one fp32 scale per
    32 values [M, K / 32] (for tests and inspection)."""
    m, k = x.shape
    x = x.contiguous()
    xq = torch.empty(m, k, dtype=torch.int8)
    xd = torch.empty(m, k // QK, 8, dtype=torch.float32)  # each scale 8 times
    rc = _lib().kvf_quantize_rows_int8(x.data_ptr(), m, k, k, xq.data_ptr(), xd.data_ptr())
    if rc != 0:
        raise ValueError(f"kvf_quantize_rows_int8 returned {rc} (K % 32, or no AVX2)")
    return xq, xd[:, :, 0].contiguous()


def product_operands(x: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """What a native ``x @ W.T`` kernel for an [N, K] ``shape`` takes: ``x`` checked as fp32
    [M, K] (rows with a stride of their own allowed, values contiguous) and an empty fp32
    [M, N] output; ValueError for any other ``x``."""
    n, k = shape
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be fp32 [M, {k}], got {x.dtype} {tuple(x.shape)}")
    x = x if x.stride(1) == 1 else x.contiguous()
    return x, torch.empty(x.shape[0], n, dtype=torch.float32)


@dataclass(eq=False)
class QuantWeight:
    """An [N, K] linear weight as GGUF blocks: ``blocks`` is uint8 [N, K / 32 * block bytes],
    one row of blocks per output feature. ``w(x) == x @ W.T`` (the ``kernels.reference.Weight``
    protocol)."""

    blocks: torch.Tensor
    qtype: int
    shape: tuple[int, int]
    # x rounded to int8 blocks and multiplied in integers (``--quantization w8a8``; Q8_0
    # and Q4_0 only, on AVX2 CPUs: elsewhere the exact fp32 kernels run)
    int8_activations: bool = False
    batch_invariant = True  # calibration has nothing to find (kernels/batch_invariance.py)
    max_invariant_rows = PANEL_ROWS  # ... in decode tiles of up to this many rows

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(
                f"quantization type {self.qtype} has no CPU kernel "
                f"({', '.join(TYPE_NAMES.values())})"
            )
        bw = BLOCK_WEIGHTS[self.qtype]
        if k % bw:
            raise ValueError(f"K = {k} is not a multiple of {self.type_name}'s {bw}")
        want = (n, k // bw * BLOCK_BYTES[self.qtype])
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != want:
            raise ValueError(f"blocks {tuple(self.blocks.shape)} {self.blocks.dtype}, want {want}")
        self.blocks = self.blocks.contiguous()

    @classmethod
    def from_gguf(cls, data: np.ndarray, qtype: int, shape: tuple[int, int]) -> QuantWeight:
        """From a GGUF tensor's raw block bytes (``ReaderTensor.data``), copied out of the map."""
        n, k = shape
        raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(n, -1)
        return cls(torch.from_numpy(raw.copy()), qtype, (n, k))

    @property
    def type_name(self) -> str:
        return TYPE_NAMES[self.qtype]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def rows(self, index: torch.Tensor) -> QuantWeight:
        """The weight of the output rows ``index`` (a row permutation or selection)."""
        return QuantWeight(
            self.blocks[index], self.qtype, (len(index), self.shape[1]), self.int8_activations
        )

    @staticmethod
    def cat(parts: list[QuantWeight]) -> QuantWeight:
        """Outputs stacked (fused QKV or gate/up), when all share one type and K."""
        first = parts[0]
        if any(p.qtype != first.qtype or p.shape[1] != first.shape[1] for p in parts):
            raise ValueError("only weights of one quantization type and K can be fused")
        if any(p.int8_activations != first.int8_activations for p in parts):
            raise ValueError("weights with and without int8 activations cannot be fused")
        blocks = torch.cat([p.blocks for p in parts])
        return QuantWeight(
            blocks, first.qtype, (blocks.shape[0], first.shape[1]), first.int8_activations
        )

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """An embedding lookup: the rows ``ids`` (any shape) decoded to fp32, exactly the dense
        table's rows, without a dense copy of the table."""
        flat = ids.reshape(-1)
        return self.rows(flat).dequantize().reshape(*ids.shape, self.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The weight as fp32 [N, K]."""
        lib = _lib()
        n, k = self.shape
        out = torch.empty(n, k, dtype=torch.float32)
        rc = lib.kvf_dequantize(
            self.blocks.data_ptr(), n, k, self.qtype, out.data_ptr(), torch.get_num_threads()
        )
        if rc != 0:
            raise ValueError("kvf_dequantize refused its arguments")
        return out

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x, y = product_operands(x, self.shape)
        (m, n), k = y.shape, self.shape[1]
        if m == 0:
            return y
        lib = _lib()
        if self.int8_activations and self.qtype in INT8_ACTIVATION_TYPES:
            fn = lib.kvf_quant_matmul_int8  # every chunk length: a token's bits never depend on it
        elif m > PANEL_ROWS and panel_available():
            fn = lib.kvf_quant_matmul_panel
        else:
            fn = lib.kvf_quant_matmul
        rc = fn(
            x.data_ptr(),
            m,
            k,
            x.stride(0),
            self.blocks.data_ptr(),
            n,
            self.qtype,
            y.data_ptr(),
            n,
            torch.get_num_threads(),
        )
        if rc == -3 and fn is lib.kvf_quant_matmul_int8:  # no AVX2: the exact kernels
            return dataclasses.replace(self, int8_activations=False)(x)
        if rc == -2:
            raise MemoryError("the quantized matmul could not allocate its scratch memory")
        if rc != 0:
            raise ValueError("kvf_quant_matmul refused its arguments")
        return y


@cache
def panel_available() -> bool:
    """Whether the panel kernel runs here (it needs AVX2, FMA and F16C; elsewhere long chunks
    use the rows kernel too)."""
    lib = load()
    if lib is None:
        return False
    x, y = torch.zeros(1, QK), torch.zeros(1, 1)
    w = torch.zeros(1, BLOCK_BYTES[8], dtype=torch.uint8)
    return (
        lib.kvf_quant_matmul_panel(x.data_ptr(), 1, QK, QK, w.data_ptr(), 1, 8, y.data_ptr(), 1, 1)
        == 0
    )


def _lib() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError(
            "--quantization gguf needs the native CPU kernel, which could not be built "
            "(install gcc; see the log)"
        )
    return lib
