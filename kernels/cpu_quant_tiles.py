"""GGUF blocks multiplied with int8 activations on the CPU, llama.cpp's way (``--quantization
gguf-a8``, and ``w8a8``'s int8 blocks): the blocks of every type kvflow keeps (Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) repacked once at load into tiles of 16 outputs
(``csrc/quant_tiles_cpu.c``), so that one AVX-512 VNNI ``vpdpbusd`` multiplies 4 weights of
each of 16 outputs by 4 of x's values rounded to int8, and the scale work is one vector
operation per 32 weights for 16 outputs. The weights keep their bits (4 to 8 per weight; the
scales of the K-quants widen to fp32 per 32 weights, since ``d * sc`` is not an fp16);
decoding a tile gives exactly what the block decoders give, so the embedding is looked up from
the same tiles its tied head multiplies.

Each row of x is rounded to int8 per 32 values (scale max|x| / 127, as
``kvf_quant_matmul_int8``), each output is one fixed chain of operations over K: a row's result
never depends on the batch, for any number of rows. Where the CPU lacks AVX-512 VNNI the
weights stay ``QuantWeight`` blocks (``pack`` returns them unchanged).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from kvflow.kernels import cpu_native, cpu_quant

_SRC = Path(__file__).parent / "csrc" / "quant_tiles_cpu.c"
# no fused multiply-adds the source does not write: decoding equals the block decoders
_COMPILE_FLAGS = cpu_quant._COMPILE_FLAGS


@cache
def load() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built (no compiler)."""
    lib = cpu_native.load_kernels(_SRC, _COMPILE_FLAGS)
    if lib is None:
        return None
    p, i, lg = ctypes.c_void_p, ctypes.c_int, ctypes.c_long
    lib.kvf_tiles_bytes.restype = lg
    lib.kvf_tiles_bytes.argtypes = [i, i, i]
    lib.kvf_tiles_pack.restype = i
    lib.kvf_tiles_pack.argtypes = [p, i, i, i, p, i]
    lib.kvf_tiles_decode.restype = i
    lib.kvf_tiles_decode.argtypes = [p, i, i, i, p, lg, p, i]
    lib.kvf_tiles_matmul.restype = i
    lib.kvf_tiles_matmul.argtypes = [p, i, i, i, p, i, i, p, i, i]
    lib.kvf_tiles_available.restype = i
    return lib


@cache
def available() -> bool:
    """Whether this CPU multiplies tiles (AVX-512 BW + VNNI, F16C)."""
    lib = load()
    return lib is not None and lib.kvf_tiles_available() == 1


def pack(w: cpu_quant.QuantWeight) -> TiledQuantWeight | cpu_quant.QuantWeight:
    """``w`` as tiles where this CPU multiplies them, else ``w`` itself."""
    if not available() or w.qtype not in TYPES:
        return w
    return TiledQuantWeight.from_blocks(w)


TYPES = tuple(t for t in cpu_quant.BLOCK_BYTES if t != cpu_quant.Q4_Z)


@dataclass(eq=False)
class TiledQuantWeight:
    """An [N, K] linear weight as tiles (``data`` uint8, ``kvf_tiles_bytes`` long) of GGUF block
    type ``qtype``. ``w(x) == x @ W.T`` with x rounded to int8 per 32 values (the
    ``kernels.reference.Weight`` protocol); ``w[ids]`` looks rows up exactly."""

    data: torch.Tensor
    qtype: int
    shape: tuple[int, int]
    batch_invariant = True  # every row one fixed chain, for any number of rows
    int8_activations = True

    @classmethod
    def from_blocks(cls, w: cpu_quant.QuantWeight) -> TiledQuantWeight:
        lib = _lib()
        n, k = w.shape
        size = lib.kvf_tiles_bytes(n, k, w.qtype)
        if size <= 0:
            raise ValueError(f"{w.type_name} [{n}, {k}] cannot be tiled")
        data = torch.empty(size, dtype=torch.uint8)
        rc = lib.kvf_tiles_pack(
            w.blocks.data_ptr(), n, k, w.qtype, data.data_ptr(), torch.get_num_threads()
        )
        if rc != 0:
            raise ValueError(f"kvf_tiles_pack returned {rc}")
        return cls(data, w.qtype, (n, k))

    @property
    def type_name(self) -> str:
        return cpu_quant.TYPE_NAMES[self.qtype]

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    def _decode(self, ids: torch.Tensor) -> torch.Tensor:
        ids = ids.to(torch.long).contiguous()
        out = torch.empty(ids.numel(), self.shape[1], dtype=torch.float32)
        rc = _lib().kvf_tiles_decode(
            self.data.data_ptr(), *self.shape, self.qtype, ids.data_ptr(), ids.numel(),
            out.data_ptr(), torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError(f"ids out of range for {self.shape[0]} rows (kvf_tiles_decode {rc})")
        return out

    def __getitem__(self, ids: torch.Tensor) -> torch.Tensor:
        """An embedding lookup: rows ``ids`` (any shape) decoded to fp32."""
        return self._decode(ids.reshape(-1)).reshape(*ids.shape, self.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The weight as fp32 [N, K]."""
        return self._decode(torch.arange(self.shape[0]))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x, y = cpu_quant.product_operands(x, self.shape)
        (m, n), k = y.shape, self.shape[1]
        if m == 0:
            return y
        rc = _lib().kvf_tiles_matmul(
            x.data_ptr(), m, k, x.stride(0), self.data.data_ptr(), n, self.qtype, y.data_ptr(),
            n, torch.get_num_threads(),
        )  # fmt: skip
        if rc == -2:
            raise MemoryError("the tiled matmul could not allocate its scratch memory")
        if rc != 0:
            raise ValueError(f"kvf_tiles_matmul refused its arguments ({rc})")
        return y


def _lib() -> ctypes.CDLL:
    lib = load()
    if lib is None:
        raise RuntimeError("the tiled int8 kernel could not be built (install gcc; see the log)")
    return lib
